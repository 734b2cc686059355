"""course.training.data: the synthetic CIFAR-10 round-trips through torchvision's loader, is
deterministic, and damaged or missing files give clear errors without anything being rewritten."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import CIFAR10

import course
from course.training import data
from course.training.data import FOLDER, MANIFEST, SyntheticCIFAR10, make_synthetic_cifar10

SMALL = {"n_train": 50, "n_test": 20}
FILES = [*data.TRAIN_FILES, data.TEST_FILE, data.META_FILE]


@pytest.fixture
def small(tmp_path):
    """A small synthetic CIFAR-10 in a fresh folder; returns its root."""
    assert make_synthetic_cifar10(tmp_path, **SMALL) is True
    return tmp_path


def _contents(root):
    return {p.name: p.read_bytes() for p in sorted((root / FOLDER).iterdir())}


# ------------------------------------------------------------------ format and round-trip


def test_files_have_cifar10s_names_and_layout(small):
    folder = small / FOLDER
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES + [MANIFEST])
    assert folder.stat().st_mode & 0o755 == 0o755  # readable by others, like a normal folder
    with open(folder / "data_batch_2", "rb") as f:
        batch = pickle.load(f, encoding="latin1")  # as torchvision reads it
    assert set(batch) == {"batch_label", "labels", "data", "filenames"}
    assert batch["data"].dtype == np.uint8 and batch["data"].shape == (10, 3072)
    assert len(batch["labels"]) == 10 and all(0 <= y < 10 for y in batch["labels"])
    with open(folder / "batches.meta", "rb") as f:
        meta = pickle.load(f, encoding="latin1")
    assert meta["label_names"] == list(data.CLASSES)


def test_torchvision_loader_reads_back_exactly_the_images_that_were_made(small):
    images, labels = data.synthetic_images(SMALL["n_train"] + SMALL["n_test"], seed=data.SEED)
    train, test = SyntheticCIFAR10(small), SyntheticCIFAR10(small, train=False)
    assert isinstance(train, CIFAR10)
    assert (len(train), len(test)) == (50, 20)
    assert np.array_equal(train.data, images[:50]) and train.targets == labels[:50]
    assert np.array_equal(test.data, images[50:]) and test.targets == labels[50:]
    assert train.classes == list(data.CLASSES) and train.class_to_idx["truck"] == 9
    image, label = train[7]  # CIFAR10.__getitem__: a PIL image and an int
    assert isinstance(image, Image.Image) and image.size == (32, 32) and image.mode == "RGB"
    assert np.array_equal(np.asarray(image), images[7]) and label == labels[7]


def test_transform_gives_tensors_for_a_dataloader(small):
    from torchvision.transforms import ToTensor

    loader = torch.utils.data.DataLoader(SyntheticCIFAR10(small, transform=ToTensor()), batch_size=16)
    x, y = next(iter(loader))
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert y.shape == (16,) and y.dtype == torch.int64


def test_classes_are_balanced_and_learnable_features_differ_by_class():
    images, labels = data.synthetic_images(1000)
    assert np.bincount(labels).tolist() == [100] * 10
    # The shape's colour shows in the mean colour of a class: classes are told apart by more than noise.
    means = np.stack([images[np.array(labels) == c].reshape(-1, 3).mean(0) for c in range(10)])
    assert np.ptp(means, axis=0).max() > 20


# ------------------------------------------------------------------ determinism


def test_same_arguments_give_the_same_bytes(tmp_path):
    make_synthetic_cifar10(tmp_path / "a", **SMALL)
    make_synthetic_cifar10(tmp_path / "b", **SMALL)
    make_synthetic_cifar10(tmp_path / "c", seed=1, **SMALL)
    a, b, c = _contents(tmp_path / "a"), _contents(tmp_path / "b"), _contents(tmp_path / "c")
    assert a == b
    assert a["data_batch_1"] != c["data_batch_1"] and a["batches.meta"] == c["batches.meta"]


def test_second_call_keeps_the_files(small):
    before = {p.name: p.stat().st_mtime_ns for p in (small / FOLDER).iterdir()}
    assert make_synthetic_cifar10(small, **SMALL) is False
    assert {p.name: p.stat().st_mtime_ns for p in (small / FOLDER).iterdir()} == before


# ------------------------------------------------------------------ bad files: clear errors, nothing rewritten


def test_the_stock_loader_rejects_synthetic_files_and_stays_unpatched(small):
    real_md5s = [md5 for _, md5 in CIFAR10.train_list + CIFAR10.test_list]
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(small)
    SyntheticCIFAR10(small)
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        CIFAR10(small)  # still: the subclass changed nothing in torchvision's class
    assert [md5 for _, md5 in CIFAR10.train_list + CIFAR10.test_list] == real_md5s


@pytest.mark.parametrize("damage", ["truncate", "flip a byte"])
def test_corrupt_file_is_named_and_not_rewritten(small, damage):
    path = small / FOLDER / "data_batch_3"
    content = bytearray(path.read_bytes())
    if damage == "truncate":
        content = content[:-100]
    else:
        content[5000] ^= 0xFF
    path.write_bytes(bytes(content))
    with pytest.raises(RuntimeError, match=r"data_batch_3 does not match its md5.*Nothing was changed"):
        SyntheticCIFAR10(small)
    assert make_synthetic_cifar10(small, **SMALL) is False  # does not "repair" by overwriting
    assert path.read_bytes() == bytes(content)
    with pytest.raises(RuntimeError, match="data_batch_3"):
        SyntheticCIFAR10(small, train=False)  # any split: the whole dataset is checked


def test_missing_file_is_named(small):
    (small / FOLDER / "test_batch").unlink()
    with pytest.raises(RuntimeError, match="test_batch is missing"):
        SyntheticCIFAR10(small)
    assert make_synthetic_cifar10(small, **SMALL) is False
    assert not (small / FOLDER / "test_batch").exists()


def test_missing_or_damaged_manifest(small, tmp_path):
    with pytest.raises(FileNotFoundError, match="make_synthetic_cifar10"):
        SyntheticCIFAR10(tmp_path / "empty")
    (small / FOLDER / MANIFEST).write_text("{not json")
    with pytest.raises(RuntimeError, match=f"{MANIFEST} is damaged"):
        SyntheticCIFAR10(small)
    with pytest.raises(RuntimeError, match="not a synthetic CIFAR-10 made by the course"):
        make_synthetic_cifar10(small, **SMALL)


def test_existing_folder_is_never_replaced(tmp_path):
    other = tmp_path / FOLDER
    other.mkdir()
    (other / "data_batch_1").write_bytes(b"someone else's data")
    with pytest.raises(RuntimeError, match="Nothing was changed"):
        make_synthetic_cifar10(tmp_path, **SMALL)
    assert (other / "data_batch_1").read_bytes() == b"someone else's data"


def test_a_different_recipe_in_the_same_folder_is_an_error(small):
    before = _contents(small)
    with pytest.raises(ValueError, match="made with .*'n_train': 50.*Nothing was changed"):
        make_synthetic_cifar10(small, n_train=100, n_test=20)
    assert _contents(small) == before


@pytest.mark.parametrize("kwargs", [{"n_train": 52}, {"n_train": 5}, {"n_test": 2.5}, {"n_train": True}])
def test_bad_sizes_are_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        make_synthetic_cifar10(tmp_path, **{**SMALL, **kwargs})
    assert not (tmp_path / FOLDER).exists()


def test_synthetic_data_cannot_be_downloaded(small):
    with pytest.raises(RuntimeError, match="made, not downloaded"):
        SyntheticCIFAR10(small).download()


# ------------------------------------------------------------------ choosing real or synthetic


def test_cifar10_makes_the_synthetic_set_when_the_real_one_is_absent(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_CIFAR10", raising=False)
    monkeypatch.setattr(data, "N_TRAIN", 50)  # keep the test fast: a smaller dataset
    monkeypatch.setattr(data, "N_TEST", 20)
    train = data.cifar10(root=tmp_path)
    assert type(train) is SyntheticCIFAR10 and len(train) == 50
    assert (tmp_path / data.SYNTHETIC / FOLDER / "data_batch_1").is_file()
    assert not (tmp_path / FOLDER).exists()  # the real dataset's place stays free
    assert len(data.cifar10(train=False, root=tmp_path, source="synthetic")) == 20


def test_real_cifar10_is_used_when_present(tmp_path, monkeypatch):
    # Pretend files made here are the real CIFAR-10 by giving the CIFAR10 class their
    # checksums, for this test only (monkeypatch restores the class afterwards).
    make_synthetic_cifar10(tmp_path, **SMALL)  # into tmp_path/cifar-10-batches-py, the real one's place
    md5 = SyntheticCIFAR10(tmp_path).train_list + SyntheticCIFAR10(tmp_path).test_list
    meta = SyntheticCIFAR10(tmp_path).meta
    monkeypatch.setattr(CIFAR10, "train_list", md5[:5])
    monkeypatch.setattr(CIFAR10, "test_list", md5[5:])
    monkeypatch.setattr(CIFAR10, "meta", meta)
    monkeypatch.delenv("COURSE_CIFAR10", raising=False)
    assert data.real_cifar10_present(tmp_path)
    assert type(data.cifar10(root=tmp_path)) is CIFAR10
    assert type(data.cifar10(root=tmp_path, source="real")) is CIFAR10
    monkeypatch.setenv("COURSE_CIFAR10", "synthetic")
    monkeypatch.setattr(data, "N_TRAIN", 50)
    monkeypatch.setattr(data, "N_TEST", 20)
    assert type(data.cifar10(root=tmp_path)) is SyntheticCIFAR10


def test_asking_for_the_real_one_without_it_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r"not in .*download=True"):
        data.cifar10(root=tmp_path, source="real")
    monkeypatch.setenv("COURSE_CIFAR10", "real")
    with pytest.raises(RuntimeError, match="download=True"):
        data.cifar10(root=tmp_path)
    monkeypatch.setenv("COURSE_CIFAR10", "imagenet")
    with pytest.raises(ValueError, match="COURSE_CIFAR10"):
        data.cifar10(root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    monkeypatch.delenv("COURSE_DATA")
    assert data.data_dir() == Path(data.__file__).resolve().parents[2] / "data"  # a checkout: git-ignored data/


# ------------------------------------------------------------------ several ranks


def _prepare(rank, world_size, root):
    with data.rank0_first():
        others_waited = not any(Path(root).glob("rank-*"))  # nobody else got here before rank 0
        Path(root, f"rank-{rank}").touch()
        made = make_synthetic_cifar10(root, **SMALL)
    return {"made": made, "first": others_waited, "n": len(SyntheticCIFAR10(root))}


def test_rank0_first_lets_rank_0_make_the_files_while_the_others_wait(tmp_path):
    results = course.launch(_prepare, 3, str(tmp_path), show=None, timeout=60)
    assert [r["made"] for r in results] == [True, False, False]
    assert results[0]["first"] and not any(r["first"] for r in results[1:])
    assert all(r["n"] == 50 for r in results)


def _race(rank, world_size, root):
    made = make_synthetic_cifar10(root, **SMALL)  # no barrier: all ranks at once
    return made, len(SyntheticCIFAR10(root))


def test_ranks_racing_without_a_barrier_still_get_one_intact_dataset(tmp_path):
    results = course.launch(_race, 3, str(tmp_path), show=None, timeout=60)
    assert sum(made for made, _ in results) >= 1 and all(n == 50 for _, n in results)
    assert sorted(p.name for p in tmp_path.iterdir()) == [FOLDER]  # no temporary folders left


def test_rank0_first_without_a_process_group_just_runs():
    ran = []
    with data.rank0_first():
        ran.append(True)
    assert ran == [True]
