"""CIFAR-10 without a network: the real dataset when you have it, a synthetic one otherwise.

    >>> train = course.training.data.cifar10(train=True, transform=ToTensor())
    >>> type(train).__name__, len(train)
    ('SyntheticCIFAR10', 2400)

The notebooks read CIFAR-10 through ``torchvision.datasets.CIFAR10``, the loader you
would use for the real thing. Where the real dataset cannot be downloaded (a classroom
without network, CI), :func:`make_synthetic_cifar10` writes a small stand-in **in
CIFAR-10's own on-disk format**: the pickled batches ``data_batch_1`` ... ``data_batch_5``,
``test_batch`` and ``batches.meta`` in a folder ``cifar-10-batches-py``. Each image shows
its class's shape (bar, disk, ring, cross, ...) in its class's colour, at a random place,
size and tint, on a random background, plus noise: a small CNN can learn it, but not
in one step. Same arguments, same bytes.

How torchvision checks the files, and why there is a subclass. ``CIFAR10.__init__``
computes the md5 of every batch file and compares it with the checksums of the *real*
dataset, written in the class (``train_list``, ``test_list``, ``meta``). Synthetic files
cannot match them, so :class:`SyntheticCIFAR10` is ``CIFAR10`` with those three
attributes set, on the instance, to the checksums recorded in ``synthetic.json`` when
the files were made. Everything else (the integrity check itself, unpickling, decoding
the images) is torchvision's own code; torchvision is not patched. A damaged or missing
file fails that check, and you get an error that names the file; nothing is rewritten.

Where the data lives: ``$COURSE_DATA`` if set; else ``data/`` in a checkout of the course
(git-ignored); else ``~/.cache/ddp-course``. The real CIFAR-10 goes where torchvision
puts it, ``<data dir>/cifar-10-batches-py``; the synthetic one in
``<data dir>/synthetic-cifar10-v1/cifar-10-batches-py``, so one never overwrites the other.

Which one :func:`cifar10` returns: the real CIFAR-10 if it is in the data folder (intact),
otherwise the synthetic one. Force a choice with ``source="real"`` or ``"synthetic"``, or
the environment variable ``COURSE_CIFAR10=real`` / ``synthetic``. To get the real one,
on a machine with network: ``course.training.data.cifar10(source="real", download=True)``.

In a distributed job only one process should write files: wrap the call in
:func:`rank0_first` (rank 0 prepares, the other ranks wait at a barrier, then read).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import calculate_md5, check_integrity

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FOLDER = "cifar-10-batches-py"  # the folder name torchvision expects under ``root``
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
MANIFEST = "synthetic.json"  # our addition: checksums and how the files were made
VERSION = 1  # of the image recipe: change it whenever synthetic_images() draws different pixels
SYNTHETIC = f"synthetic-cifar10-v{VERSION}"  # sub-folder of the data folder for the synthetic dataset
SOURCES = ("auto", "real", "synthetic")
N_TRAIN, N_TEST, SEED = 2400, 500, 0

_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """The folder for datasets: ``$COURSE_DATA``, else ``data/`` in the course's checkout,
    else ``~/.cache/ddp-course`` (for an installed course, e.g. on Colab)."""
    if os.environ.get("COURSE_DATA"):
        return Path(os.environ["COURSE_DATA"]).expanduser()
    if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "course").is_dir():
        return _ROOT / "data"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ddp-course"


# ------------------------------------------------------------------ making the images

# Class c is drawn as shape c, in (about) colour c. dy, dx: offsets from the centre; r: size.
_SHAPES = (
    lambda dy, dx, r: (abs(dy) <= r // 3) & (abs(dx) <= r),  # airplane: horizontal bar
    lambda dy, dx, r: (abs(dy) <= r - 2) & (abs(dx) <= r - 2),  # automobile: square
    lambda dy, dx, r: dy * dy + dx * dx <= r * r,  # bird: disk
    lambda dy, dx, r: ((r - 3) ** 2 < dy * dy + dx * dx) & (dy * dy + dx * dx <= r * r),  # cat: ring
    lambda dy, dx, r: (abs(dx) <= r // 3) & (abs(dy) <= r),  # deer: vertical bar
    lambda dy, dx, r: ((abs(dy) <= 1) & (abs(dx) <= r)) | ((abs(dx) <= 1) & (abs(dy) <= r)),  # dog: plus
    lambda dy, dx, r: (abs(dy - dx) <= 1) & (abs(dx) <= r),  # frog: diagonal
    lambda dy, dx, r: ((abs(dy - dx) <= 1) | (abs(dy + dx) <= 1)) & (abs(dx) <= r),  # horse: X
    lambda dy, dx, r: (abs(dy) <= r) & (2 * abs(dx) <= dy + r),  # ship: triangle
    lambda dy, dx, r: (np.maximum(abs(dy), abs(dx)) <= r) & (np.maximum(abs(dy), abs(dx)) >= r - 2),  # truck: frame
)
_COLOURS = np.array(
    [[230, 60, 60], [60, 200, 60], [70, 90, 230], [230, 210, 50], [200, 60, 210],
     [50, 210, 210], [240, 140, 40], [140, 80, 40], [240, 240, 240], [120, 120, 120]]
)


def synthetic_images(n: int, seed: int = SEED):
    """``n`` images as uint8 ``(n, 32, 32, 3)`` (height, width, RGB) and their labels
    (a list of ints, each class ``n // 10`` or ``n // 10 + 1`` times, shuffled).

    Uses numpy's ``RandomState``, whose stream numpy keeps the same across versions,
    and integer geometry, so the same ``(n, seed)`` gives the same pixels everywhere."""
    rng = np.random.RandomState(seed)
    labels = rng.permutation(np.arange(n) % len(CLASSES))
    yy, xx = np.mgrid[0:32, 0:32]
    images = np.empty((n, 32, 32, 3), dtype=np.uint8)
    for i, label in enumerate(labels):
        cy, cx = rng.randint(9, 23, size=2)
        size = rng.randint(5, 10)
        mask = _SHAPES[label](yy - cy, xx - cx, size)[..., None]
        colour = _COLOURS[label] + rng.randint(-50, 51, size=3)
        background = rng.randint(0, 256, size=3)
        noise = rng.normal(0.0, 30.0, size=(32, 32, 3))
        images[i] = np.clip(np.rint(np.where(mask, colour, background) + noise), 0, 255)
    return images, [int(label) for label in labels]


def _batch(images, labels, name, first):
    """One batch file's content, laid out like CIFAR-10's: each row is 3072 bytes, the
    1024 red values (row by row), then green, then blue."""
    return {
        "batch_label": name,
        "labels": list(labels),
        "data": np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3072)),
        "filenames": [f"synthetic_{first + i:05d}_{CLASSES[y]}.png" for i, y in enumerate(labels)],
    }


def make_synthetic_cifar10(root=None, n_train: int = N_TRAIN, n_test: int = N_TEST, seed: int = SEED) -> bool:
    """Write a synthetic CIFAR-10 to ``root/cifar-10-batches-py`` (``root`` defaults to
    ``data_dir()/synthetic-cifar10-v1``). Returns True if it wrote the files, False if
    they were already there (made with the same arguments).

    Never overwrites: the files are written to a temporary folder which is then renamed
    into place in one step, so a reader never sees half a dataset, and two processes
    racing to make it cannot clobber each other (the second one's rename fails and it
    keeps the first one's files). An existing folder that is not a dataset made with
    these arguments is an error, never replaced.
    """
    root = Path(root) if root is not None else data_dir() / SYNTHETIC
    for name, value in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 10:
            raise ValueError(f"{name} must be a whole number >= 10, got {value!r}.")
    if n_train % len(TRAIN_FILES):
        raise ValueError(f"n_train must be a multiple of 5 (CIFAR-10 has 5 training batch files), got {n_train}.")
    wanted = {"version": VERSION, "n_train": n_train, "n_test": n_test, "seed": seed}
    folder = root / FOLDER
    if folder.exists():
        _check_same_recipe(folder, wanted)
        return False

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}.tmp-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the dataset folder should be readable like any other
        images, labels = synthetic_images(n_train + n_test, seed)
        per_file = n_train // len(TRAIN_FILES)
        batches = {
            name: _batch(images[i * per_file : (i + 1) * per_file], labels[i * per_file : (i + 1) * per_file],
                         f"training batch {i + 1} of 5", i * per_file)
            for i, name in enumerate(TRAIN_FILES)
        }
        batches[TEST_FILE] = _batch(images[n_train:], labels[n_train:], "testing batch 1 of 1", n_train)
        batches[META_FILE] = {"num_cases_per_batch": per_file, "label_names": list(CLASSES), "num_vis": 3072}
        for name, content in batches.items():
            with open(tmp / name, "wb") as f:
                pickle.dump(content, f, protocol=4)
        manifest = dict(wanted, md5={name: calculate_md5(tmp / name) for name in batches})
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(tmp, folder)  # atomic; fails if ``folder`` appeared meanwhile
        except OSError:
            if not folder.exists():
                raise
            _check_same_recipe(folder, wanted)  # someone else made it first: keep theirs
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_same_recipe(folder: Path, wanted: dict):
    try:
        made = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        raise RuntimeError(
            f"{folder} exists but is not a synthetic CIFAR-10 made by the course ({MANIFEST} is missing or "
            f"unreadable). Nothing was changed. Delete that folder to make the data again, or pass another root."
        ) from None
    recipe = {k: made.get(k) for k in wanted}
    if recipe != wanted:
        raise ValueError(
            f"{folder} holds a synthetic CIFAR-10 made with {recipe}, not {wanted}. Nothing was changed. "
            "Pass another root, or delete that folder to make it again."
        )


# ------------------------------------------------------------------ reading it back


class SyntheticCIFAR10(CIFAR10):
    """``torchvision.datasets.CIFAR10``, checking the files against the checksums recorded
    when they were made (``synthetic.json``) instead of the real dataset's.

    ``root`` is the folder that contains ``cifar-10-batches-py``, as for ``CIFAR10``.
    Items are ``(PIL image, label)`` unless you pass a ``transform``.
    """

    def __init__(self, root, train: bool = True, transform=None, target_transform=None):
        folder = Path(root) / self.base_folder
        try:
            made = json.loads((folder / MANIFEST).read_text())
            md5 = made["md5"]
            files = [*TRAIN_FILES, TEST_FILE, META_FILE]
            checksums = {name: md5[name] for name in files}
        except FileNotFoundError:
            raise FileNotFoundError(
                f"No synthetic CIFAR-10 in {folder} ({MANIFEST} not found). "
                f"Make it with course.training.data.make_synthetic_cifar10({str(root)!r})."
            ) from None
        except (OSError, ValueError, KeyError, TypeError):
            raise RuntimeError(
                f"{folder / MANIFEST} is damaged, so the files cannot be checked. Nothing was changed. "
                "Delete the folder and make the data again (course.training.data.make_synthetic_cifar10)."
            ) from None

        missing = [name for name in files if not (folder / name).is_file()]
        damaged = [name for name in files if name not in missing and not check_integrity(folder / name, checksums[name])]
        if missing or damaged:
            problems = [f"{name} is missing" for name in missing] + [f"{name} does not match its md5" for name in damaged]
            raise RuntimeError(
                f"Synthetic CIFAR-10 in {folder} is damaged: {'; '.join(problems)}. Nothing was changed. "
                "Delete the folder and make the data again (course.training.data.make_synthetic_cifar10)."
            )
        # The only difference from CIFAR10: the checksums it verifies (instance attributes,
        # so the CIFAR10 class itself is untouched).
        self.train_list = [[name, checksums[name]] for name in TRAIN_FILES]
        self.test_list = [[TEST_FILE, checksums[TEST_FILE]]]
        self.meta = {"filename": META_FILE, "key": "label_names", "md5": checksums[META_FILE]}
        super().__init__(root, train=train, transform=transform, target_transform=target_transform, download=False)

    def download(self):
        raise RuntimeError("Synthetic data is made, not downloaded: use course.training.data.make_synthetic_cifar10().")


def real_cifar10_present(root=None) -> bool:
    """True if ``root/cifar-10-batches-py`` holds the real CIFAR-10, intact (torchvision's
    own check: every file's md5 equals the real dataset's)."""
    folder = Path(root if root is not None else data_dir()) / CIFAR10.base_folder
    files = CIFAR10.train_list + CIFAR10.test_list + [[CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]
    return all(check_integrity(folder / name, md5) for name, md5 in files)


def cifar10(train: bool = True, transform=None, root=None, source: str | None = None, download: bool = False):
    """CIFAR-10's training (or test) set, as a ``torchvision.datasets.CIFAR10``.

    ``source``: ``"real"``, ``"synthetic"`` or ``"auto"`` (the default, or the value of
    ``$COURSE_CIFAR10``): the real CIFAR-10 if it is in ``root`` (default
    :func:`data_dir`), else the synthetic one, made on first use in
    ``root/synthetic-cifar10-v1``. ``download=True`` lets torchvision download the real one
    (about 170 MB, needs network) when ``source="real"``.
    """
    source = source or os.environ.get("COURSE_CIFAR10") or "auto"
    if source not in SOURCES:
        raise ValueError(f"source (or $COURSE_CIFAR10) must be one of {SOURCES}, got {source!r}.")
    root = Path(root) if root is not None else data_dir()
    real_is_there = source != "synthetic" and real_cifar10_present(root)
    if source == "real" or real_is_there:
        if not (real_is_there or download):
            raise RuntimeError(
                f"The real CIFAR-10 is not in {root / FOLDER} (or is damaged). Download it with "
                "course.training.data.cifar10(source='real', download=True) on a machine with network, "
                "or use the synthetic data (source='synthetic', or unset COURSE_CIFAR10)."
            )
        return CIFAR10(root, train=train, transform=transform, download=download)
    make_synthetic_cifar10(root / SYNTHETIC, N_TRAIN, N_TEST, SEED)
    return SyntheticCIFAR10(root / SYNTHETIC, train=train, transform=transform)


@contextmanager
def rank0_first():
    """Run a block on rank 0 first, then on the other ranks.

        with rank0_first():
            train_set = cifar10()     # rank 0 makes or downloads; the others then just read

    The other ranks wait at a ``dist.barrier()`` until rank 0 has finished the block, so
    only one process ever writes the files. Outside a process group it just runs the block.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if distributed and rank != 0:
        dist.barrier()  # wait for rank 0 ...
    yield
    if distributed and rank == 0:
        dist.barrier()  # ... which lets the others go once it is done
