"""Checks for notebook 07 (checkpointing a DDP job)."""

import io
import os
import stat
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from course.training.crash import die_halfway
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import WorkerError, launch


class _Wrapper(nn.Module):
    """A model with a child that is itself called ``module`` (EMA and wrapper classes do this)."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(3, 2)
        self.head = nn.Linear(2, 1)


# A state_dict saved without DDP: nothing to strip, although "module" appears in the keys.
_NO_PREFIX = {"0.weight": torch.zeros(2), "block.module.weight": torch.ones(2), "modules.0.bias": torch.ones(1)}


@exercise("Exercise 1 (strip_module_prefix)", hint="keys that do not start with 'module.' (a state_dict saved without DDP) must stay as they are.")
def strip_module_prefix(fn):
    """Exercise 1: turn a state_dict saved from ``DDP(model)`` into one for ``model``."""
    torch.manual_seed(0)
    model = _Wrapper()
    plain = model.state_dict()
    from_ddp = {"module." + k: v.clone() for k, v in plain.items()}  # what DDP(model).state_dict() holds
    try:
        got = fn(dict(from_ddp))
        unchanged = fn(dict(_NO_PREFIX))
    except Exception as e:
        return wrong(f"your function raised {type(e).__name__}: {e}")
    if got is None:
        return wrong("return the new state_dict (a dict), do not only change it in place.")
    if not isinstance(got, dict):
        return wrong(f"return a dict of key -> tensor, not a {type(got).__name__}.")
    if sorted(got) == sorted(k.replace("module.", "") for k in from_ddp) and sorted(got) != sorted(plain):
        return wrong("remove only the *leading* 'module.': a key like 'module.module.weight' has a "
                           "submodule that is really called 'module'. Use key.startswith and slicing.")
    if sorted(got) != sorted(plain):
        return wrong(f"expected the keys {sorted(plain)}, got {sorted(got)}.")
    if not all(torch.equal(got[k], plain[k]) for k in plain):
        return wrong("the keys are right but the tensors changed: keep each value as it is.")
    if not isinstance(unchanged, dict) or sorted(unchanged) != sorted(_NO_PREFIX):
        return wrong("keys that do not start with 'module.' (a state_dict saved without DDP) must stay as they are.")
    fresh = _Wrapper()
    fresh.load_state_dict(got)  # strict: every key matches
    return correct("the checkpoint from DDP loads into the plain model (strict=True).")


# ------------------------------------------------------------------ Exercise 2


def _save_and_die(rank, world_size, fn, obj, path):
    torch.save = die_halfway(torch.save)  # only in this process
    fn(obj, path)
    return "returned"


def _target(f):
    """Where torch.save was asked to write: a path, or a file object's name."""
    name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
    return None if name is None or isinstance(name, int) else Path(name).resolve()


def _load_step(path):
    with warnings.catch_warnings():  # a plain pickle.dump file also warns about its protocol
        warnings.simplefilter("ignore")
        return torch.load(path, weights_only=True)["step"]


def _folder_fsync_instead_of_file(events):
    """True if some rename was preceded (since the previous rename) by fsyncs of folders only."""
    since_rename = []
    for kind, size, _, _ in events:
        if kind == "save":
            continue
        if kind == "fsync":
            since_rename.append(size)
            continue
        if since_rename and all(size == "folder" for size in since_rename):
            return True
        since_rename = []
    return False


def _descriptor(f):
    """The file descriptor os.fsync was given: an int, or anything with a fileno() (a file object)."""
    if isinstance(f, int):
        return f
    try:
        return f.fileno()
    except Exception:
        return None


def _rename_problem(events):
    """What is wrong with the fsyncs before each rename, or None. An fsync counts for a rename only if it
    synced the very file renamed (same inode) with all its bytes (same size): the old checkpoint at `path`
    has the same size as the new one, so only the inode tells them apart."""
    for i, (kind, size, inode, _) in enumerate(events):
        if kind != "rename" or inode is None:
            continue
        before, after = [], []
        for j in range(i - 1, -1, -1):  # back to the previous rename (or the start of this save)
            if events[j][0] in ("rename", "save"):
                break
            before.append(events[j])
        for event in events[i + 1:]:  # on to the next rename (or the end of this save)
            if event[0] in ("rename", "save"):
                break
            after.append(event)
        synced = [s for _, s, ino, _ in before if ino == inode]
        if size in synced:
            continue
        if synced:
            return "flush"
        if any(ino == inode for _, _, ino, _ in after):
            return "after"
        return "other file"
    return None


@exercise("Exercise 2 (atomic_save)", hint="write to a temporary file in the same folder, flush and fsync it, then os.replace it onto the final "
          "name; if saving fails, delete the temporary file and re-raise.",
          finished=("course.training.checkpoint.atomic_save",))
def atomic_save(fn):
    """Exercise 2: save so that a crash at any moment leaves the old file or the new one."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "checkpoint.pt").resolve()
        targets = []
        # ("fsync", bytes the OS had, (device, inode), args) and ("rename", bytes of the file renamed, its
        # (device, inode), args), as they happen
        order = []
        real = {"save": torch.save, "fsync": os.fsync, "fdatasync": os.fdatasync, "replace": os.replace, "rename": os.rename}

        def recording_save(obj, f, *args, **kwargs):
            # Writes like any buffered writer: into the file object, without flushing it (torch.save
            # happens to flush; code that relies on that breaks with the next writer).
            targets.append(_target(f))
            if isinstance(f, (str, os.PathLike)):
                return real["save"](obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real["save"](obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue())

        def recording(kind):
            def call(*args, **kwargs):
                if kind in ("fsync", "fdatasync"):  # what reached the OS when it ran ("folder": a folder's fsync)
                    fd = _descriptor(args[0]) if args else None
                    info = None if fd is None else os.fstat(fd)
                    size = None if info is None else "folder" if stat.S_ISDIR(info.st_mode) else info.st_size
                    order.append(("fsync", size, None if info is None else (info.st_dev, info.st_ino), args))
                else:
                    info = os.stat(args[0]) if args and os.path.isfile(args[0]) else None
                    order.append(("rename", None if info is None else info.st_size,
                                  None if info is None else (info.st_dev, info.st_ino), args))
                return real[kind](*args, **kwargs)

            return call

        torch.save = recording_save
        os.fsync, os.fdatasync = recording("fsync"), recording("fdatasync")  # fdatasync is enough for a new file's data
        os.replace, os.rename = recording("replace"), recording("rename")
        try:
            for step in (1, 2):
                order.append(("save", None, None, None))
                fn({"step": step, "weight": torch.full((3,), float(step))}, str(path))
            good_saves = list(order)  # the failing save below must not blur them
            leftovers = sorted(p.name for p in path.parent.iterdir() if p != path)
            try:
                step = _load_step(path)
            except Exception as e:
                step = e
            try:
                fn({"step": 3, "not picklable": lambda: 0}, str(path))  # a save that fails
                failed_save = None
            except Exception as e:
                failed_save = e
        except Exception as e:
            return wrong(f"saving raised {type(e).__name__}: {e}")
        finally:
            torch.save, os.fsync, os.fdatasync = real["save"], real["fsync"], real["fdatasync"]
            os.replace, os.rename = real["replace"], real["rename"]
        if isinstance(step, Exception):
            return wrong(f"torch.load(path, weights_only=True) failed after two saves ({type(step).__name__}); "
                               "save the object with torch.save and end with the file at `path`.")
        if step != 2:
            return wrong("after saving step 1 and then step 2, the file at `path` should hold step 2.")
        if not targets:
            return wrong("write the checkpoint with torch.save (into a temporary file).")
        if any(t == path for t in targets):
            return wrong("torch.save writes straight into `path`: a crash halfway leaves a half-written "
                               "checkpoint. Write to a temporary file first, then rename it onto `path`.")
        renames = [args for kind, _, _, args in good_saves if kind == "rename"]
        sources = [Path(args[0]).resolve() for args in renames if len(args) >= 2]
        if any(t is not None and t.parent != path.parent for t in targets) or any(
            src.parent != path.parent for src in sources
        ):
            return wrong("create the temporary file in the same folder as `path` (tempfile.mkstemp(dir=...)): "
                               "os.replace is only atomic within one file system, and /tmp is often another one.")
        if not renames:
            return wrong("finish with os.replace(temporary_file, path): a rename is atomic, a copy is not.")
        if leftovers:
            return wrong(f"files were left next to the checkpoint ({leftovers}): rename the temporary "
                               "file onto `path` with os.replace instead of copying it.")
        fsyncs = [size for kind, size, _, _ in good_saves if kind == "fsync" and size != "folder"]
        synced_only_the_folder = [size for kind, size, _, _ in good_saves if kind == "fsync"] and not fsyncs
        if synced_only_the_folder or _folder_fsync_instead_of_file(good_saves):
            return wrong("you fsync the folder, not the temporary file: the file's bytes must reach the disk before "
                         "the rename (f.flush(), then os.fsync(f.fileno())). Fsyncing the folder *after* os.replace is "
                         "a good extra step (it makes the rename itself durable), not a replacement.")
        if not fsyncs:
            return wrong("call f.flush() and os.fsync(f.fileno()) on the temporary file before renaming it: "
                               "otherwise after a power cut the new name can point at a file whose data never reached the disk.")
        problem = _rename_problem(good_saves)
        if problem == "after":
            return wrong("os.fsync ran after the rename: the new name can then reach the disk before the data does. "
                         "fsync the temporary file, then os.replace it onto `path`.")
        if problem == "other file":
            return wrong("a rename was not preceded by an fsync of the file renamed: fsync the temporary file itself "
                         "(os.fsync(f.fileno())) before os.replace, not the old checkpoint at `path` or another file.")
        if problem == "flush":
            return wrong("os.fsync ran before all the bytes had left Python's buffer: f.flush() first (Python -> OS), "
                         "then os.fsync(f.fileno()) (OS -> disk). fsync only writes what the OS already has.")
        if failed_save is None:
            return wrong("saving an object that cannot be pickled returned without an error: let the exception "
                         "through, or the caller believes the checkpoint was saved.")
        left_by_failure = sorted(p.name for p in path.parent.iterdir() if p != path)
        if left_by_failure:
            return wrong(f"a save that failed (an object that cannot be pickled) left {left_by_failure} next to the "
                         "checkpoint: delete the temporary file when saving fails, then re-raise (try/except).")
        try:
            unchanged = _load_step(path) == 2
        except Exception:
            unchanged = False
        if not unchanged:
            return wrong("a save that failed changed the file at `path`: it must still hold the previous checkpoint.")
        try:
            launch(_save_and_die, 1, fn, {"step": 3, "weight": torch.zeros(100_000)}, str(path), show=None, timeout=30)
        except WorkerError as e:
            if "SIGKILL" not in e.failed.get(0, ""):
                return wrong(f"saving failed in an unexpected way: {e.failed.get(0, e)}")
        else:
            return wrong("save the object with torch.save (the check makes torch.save crash halfway).")
        try:
            step = _load_step(path)
        except Exception:
            return wrong("a crash in the middle of torch.save left a broken file at `path`: write to a "
                               "temporary file and os.replace it onto `path` only when it is complete.")
        if step != 2:
            return wrong(f"after the crash `path` holds step {step}, expected the previous checkpoint (step 2).")
    return correct("killed halfway through a save, the previous checkpoint still loads.")
