"""Checkpoints for a DDP job: save once, load everywhere, resume exactly, never corrupt.

    >>> state = training_state(ddp_model, optimizer, scheduler, step=step, epoch=epoch)
    >>> if dist.get_rank() == 0:
    ...     save_checkpoint(state, "ckpt.pt")       # atomic: old file or new file, never half
    >>> dist.barrier()                              # nobody reads before the file is complete
    ...
    >>> state = load_checkpoint("ckpt.pt")          # weights_only=True, clear errors
    >>> step, epoch = restore_training_state(state, ddp_model, optimizer, scheduler)
    >>> sampler.set_epoch(epoch)                    # and skip the batches already done

Why each piece (notebook 07 demonstrates every point):

* **Rank 0 saves.** After every DDP step the replicas hold the same parameters and
  optimizer state, so one copy is enough; the ``barrier`` keeps the other ranks from
  reading a file that is not written yet.
* **Random state is per rank.** Each rank draws its own dropout masks, so
  :func:`training_state` gathers every rank's RNG states (it is a collective: call it on
  every rank) and :func:`restore_training_state` gives each rank its own back.
* **Atomic write.** :func:`save_checkpoint` calls :func:`atomic_save` (notebook 07's
  Exercise 2: a test asserts it is the same code), which writes a temporary file in the
  same folder, flushes it to disk (``fsync``), and renames it over the old checkpoint
  with ``os.replace``. A rename within one file system is atomic: a process killed at
  any moment leaves either the old checkpoint or the new one, never a half-written
  file. Then :func:`fsync_folder` puts the rename itself on disk.
* **Safe loading.** A checkpoint is a pickle, and unpickling can run arbitrary code.
  :func:`load_checkpoint` uses ``torch.load(..., weights_only=True)``, which only
  rebuilds tensors and plain containers. So everything saved here is plain data: the
  NumPy RNG state, for example, is stored as a tensor, not as a NumPy array (which
  ``weights_only`` would refuse without ``torch.serialization.add_safe_globals``).
"""

from __future__ import annotations

import os
import random
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT = "ddp-course-checkpoint/1"  # stored in every checkpoint; tells ours from foreign files


class CheckpointError(RuntimeError):
    """A file that cannot be used as a checkpoint: truncated, not a checkpoint, or unsafe."""


# ----------------------------------------------------------------------------- files


def save_checkpoint(state: dict, path) -> Path:
    """Write ``state`` (a dict of tensors and plain data) to ``path`` atomically.

    Readers see the previous file or the new one, never a partial one, even if this
    process is killed mid-write. A killed write can leave a temporary file
    ``.<name>.*.tmp`` next to the checkpoint; it is never read and can be deleted.
    """
    if not isinstance(state, dict):
        raise TypeError(f"save_checkpoint() saves a dict (e.g. from training_state()), "
                        f"got {type(state).__name__}.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({**state, "format": FORMAT}, path)
    fsync_folder(path.parent)  # make the rename itself survive a power cut
    return path


def atomic_save(obj, path):
    """torch.save(obj, path), but a crash leaves the old file or the new one, never a partial file."""
    folder, name = os.path.split(os.path.abspath(path))
    # In the same folder: os.replace is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()  # Python's buffer -> the operating system
            os.fsync(f.fileno())  # the operating system's cache -> the disk
        os.replace(tmp, path)  # atomic: the old file until here, the new one after
    except BaseException:  # a failed save (even Ctrl-C) leaves no temporary file behind
        os.unlink(tmp)
        raise


def fsync_folder(folder):
    """Make the renames in ``folder`` survive a power cut: fsync the folder itself (POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder
        pass
    finally:
        os.close(fd)


def load_checkpoint(path, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`, safely.

    ``map_location`` says where the tensors go: ``"cpu"`` (the default: load, then
    ``load_state_dict`` copies into the model wherever it lives) or e.g. ``f"cuda:{local_rank}"``.
    Without it, tensors return to the device they were saved from: every rank's
    copy of a checkpoint saved by rank 0 would land on ``cuda:0``.

    Raises :class:`CheckpointError` if the file is truncated, is not a checkpoint,
    or holds Python objects that ``weights_only=True`` refuses to build.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint at {path}. Check the path, or start training from scratch.")
    try:
        with warnings.catch_warnings():  # a foreign pickle also triggers a protocol warning: the error says enough
            warnings.filterwarnings("ignore", "Detected pickle protocol")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise _explain(path, e) from e
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        if isinstance(state, dict):
            what = f"a dict with keys {sorted(map(str, state))[:5]}"
        else:
            what = f"a {type(state).__name__}"
        raise CheckpointError(
            f"{path} is not a checkpoint written by save_checkpoint(): it holds {what}. "
            "For a bare state_dict use torch.load(path, weights_only=True) and model.load_state_dict()."
        )
    return state


def _explain(path, error) -> CheckpointError:
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text)
    if "Weights only load failed" in text and found:  # torch.load's weights_only refusal
        return CheckpointError(
            f"{path} contains Python objects ({found.group(1)}) that torch.load(weights_only=True) refuses to "
            "build: loading them could run arbitrary code. Only if you trust the file, allow the types it "
            "needs with torch.serialization.add_safe_globals([...]); better, save plain data (tensors, "
            "numbers, strings, lists, dicts)."
        )
    if "Weights only load failed" in text:
        detail = "its pickle data is unreadable"
    else:
        detail = f"{type(error).__name__}: {text.splitlines()[0][:80]}" if text else type(error).__name__
    size = path.stat().st_size if path.exists() else 0
    return CheckpointError(
        f"{path} ({size} bytes) is truncated or not a PyTorch checkpoint ({detail}). "
        "A crash while writing it without an atomic save leaves such a file; "
        "load an older checkpoint, or save with save_checkpoint() which never leaves one."
    )


# ----------------------------------------------------------------------------- state


def unwrap(model):
    """The model inside ``DistributedDataParallel`` (or ``DataParallel``); the model itself otherwise.

    Its ``state_dict()`` has the plain keys (``"0.weight"``), not DDP's ``"module.0.weight"``,
    so it loads into a model with or without DDP."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, wrappers) else model


def rng_state() -> dict:
    """This process's random number generator states, as plain data (``weights_only``-safe)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:  # torch imports NumPy when it is installed
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per rank
    return state


def set_rng_state(state: dict):
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def training_state(model, optimizer, scheduler=None, *, step: int, epoch: int, **extra) -> dict:
    """Everything needed to resume training exactly, as one dict for :func:`save_checkpoint`.

    ``step``: optimizer steps taken so far. ``epoch``: the epoch in progress, i.e. what
    you passed to ``sampler.set_epoch``. ``extra``: any other plain values you need.

    In a distributed job this is a **collective** (it gathers every rank's RNG states):
    call it on every rank, then let rank 0 save the result.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rngs = [rng_state()]
    if world_size > 1:
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng_state())
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "step": int(step),
        "epoch": int(epoch),
        "world_size": world_size,
        "rng": rngs,
        **extra,
    }


def restore_training_state(state: dict, model, optimizer, scheduler=None, *, rng: bool = True):
    """Put ``state`` back into the model, optimizer and scheduler, and (``rng=True``) give
    this rank back its RNG states. Call it on every rank. Returns ``(step, epoch)``.

    Call it right before training continues: anything that draws random numbers in
    between (a ``DataLoader`` without its own ``generator=`` draws one per ``iter()``)
    shifts every later dropout mask, and the resumed run no longer matches.
    """
    if rng:
        _check_world_size(state)  # before changing anything
    if scheduler is not None and state.get("scheduler") is None:
        raise CheckpointError("This checkpoint has no scheduler state: pass scheduler=None, or save one.")
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if rng:
        restore_rng(state)
    return state["step"], state["epoch"]


def restore_rng(state: dict):
    """Give this rank back the RNG states it had when :func:`training_state` captured them."""
    rank = _check_world_size(state)
    set_rng_state(state["rng"][rank])


def _check_world_size(state):
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"The checkpoint holds RNG states for {state['world_size']} rank(s), this job has {world_size}. "
            "An exact resume needs the same world size; to resume anyway, pass rng=False (and reseed)."
        )
    return rank
