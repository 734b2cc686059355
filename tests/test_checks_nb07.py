"""Notebook 07's checks reject plausible wrong answers with a useful hint."""

import os
import shutil
import tempfile

import pytest
import torch

from course.checks import nb07

# ------------------------------------------------------------------ Exercise 1


def _replace_everywhere(state_dict):
    return {k.replace("module.", ""): v for k, v in state_dict.items()}


def _slice_every_key(state_dict):
    return {k[len("module."):]: v for k, v in state_dict.items()}


def _in_place(state_dict):
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, "module.")


def _zeroed(state_dict):
    return {k.removeprefix("module."): torch.zeros_like(v) for k, v in state_dict.items()}


def _typo(state_dict):
    return {k.removeprefix("modul."): v for k, v in state_dict.items()}


def _crashes(state_dict):
    raise KeyError("oops")


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_replace_everywhere, "leading"),
        (_slice_every_key, "must stay as they are"),
        (_in_place, "return the new state_dict"),
        (_zeroed, "keep each value"),
        (_typo, "expected the keys"),
        (_crashes, "raised KeyError"),
        (lambda sd: list(sd.items()), "return a dict"),
    ],
)
def test_strip_module_prefix_rejects_wrong_answers(answer, hint):
    feedback = nb07.strip_module_prefix(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_strip_module_prefix_accepts_alternatives():
    def with_removeprefix(state_dict):
        return {(k.removeprefix("module.")): v for k, v in state_dict.items()}

    def copy_then_consume(state_dict):
        state_dict = dict(state_dict)
        torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, "module.")
        return state_dict

    assert nb07.strip_module_prefix(with_removeprefix).status == "correct"
    assert nb07.strip_module_prefix(copy_then_consume).status == "correct"


# ------------------------------------------------------------------ Exercise 2


def _straight_into_path(obj, path):
    torch.save(obj, path)


def _temporary_in_tmp(obj, path):
    fd, tmp = tempfile.mkstemp(suffix=".tmp")  # in the system's temporary folder, not next to path
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_not_rename(obj, path):
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.copyfile(tmp, path)


def _no_fsync(obj, path):
    tmp = str(path) + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _pickle_instead(obj, path):
    import pickle

    with open(path, "wb") as f:
        pickle.dump(obj, f)


def _fsync_after_the_rename(obj, path):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.replace(tmp, path)  # the name can reach the disk before the data
        os.fsync(f.fileno())


def _no_cleanup(obj, path):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:  # a failing torch.save leaves the temporary file behind
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _swallows_the_error(obj, path):
    try:
        _no_cleanup(obj, path)
    except Exception:
        pass


def _forgets_the_rename(obj, path):
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_the_folder(folder):
    folder_fd = os.open(folder, os.O_RDONLY)
    os.fsync(folder_fd)
    os.close(folder_fd)


def _folder_fsync_instead_of_the_files(before_rename):  # fsyncs the folder (the rename), not the file's data
    def save(obj, path):
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
            if before_rename:
                _fsync_the_folder(folder)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        if not before_rename:
            _fsync_the_folder(folder)

    return save


def _file_and_folder(obj, path):  # the full recipe: fsync the file, rename, fsync the folder
    _no_cleanup(obj, path)
    _fsync_the_folder(os.path.dirname(os.path.abspath(path)))


@pytest.mark.parametrize(
    "answer, hint",
    [
        (_folder_fsync_instead_of_the_files(before_rename=False), "you fsync the folder, not the temporary file"),
        (_folder_fsync_instead_of_the_files(before_rename=True), "you fsync the folder, not the temporary file"),
        (_straight_into_path, "half-written"),
        (_temporary_in_tmp, "same folder"),
        (_copy_not_rename, "os.replace"),
        (_no_fsync, "fsync"),
        (_fsync_after_the_rename, "os.fsync ran after the rename"),
        (_no_cleanup, "delete the temporary file when saving fails"),
        (_swallows_the_error, "returned without an error"),
        (_pickle_instead, "torch.load(path, weights_only=True) failed"),
        (_forgets_the_rename, "torch.load(path, weights_only=True) failed"),
        (lambda obj, path: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_atomic_save_rejects_wrong_answers(answer, hint):
    feedback = nb07.atomic_save(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_atomic_save_accepts_a_fixed_temporary_name_next_to_the_file():
    def fixed_name(obj, path):
        tmp = str(path) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    assert nb07.atomic_save(fixed_name).status == "correct"


def test_atomic_save_check_restores_what_it_patched():
    originals = (torch.save, os.fsync, os.fdatasync, os.replace, os.rename)
    nb07.atomic_save(_no_fsync)
    nb07.atomic_save(lambda obj, path: 1 / 0)
    assert (torch.save, os.fsync, os.fdatasync, os.replace, os.rename) == originals


def _fsync_before_flush(obj, path):
    # the loophole: fsync writes to disk what the OS has; Python's buffer is flushed only afterwards
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        os.fsync(f.fileno())
        f.flush()
    os.replace(tmp, path)


def _fsync_without_flush(obj, path):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        os.fsync(f.fileno())  # the close() after it flushes, too late for the fsync
    os.replace(tmp, path)


@pytest.mark.parametrize("answer", [_fsync_before_flush, _fsync_without_flush])
def test_atomic_save_rejects_fsync_before_flush(answer):
    feedback = nb07.atomic_save(answer)
    assert feedback.status == "wrong" and "f.flush() first" in feedback.message, feedback


def test_atomic_save_check_lets_the_folder_fsync_pass_where_it_belongs():
    # Failing saves of _file_and_folder leave the temporary file (it has no cleanup), so only the order of
    # fsyncs is judged here: the hint must not be about the folder's fsync.
    feedback = nb07.atomic_save(_file_and_folder)
    assert "fsync the folder" not in feedback.message and "fsync ran" not in feedback.message, feedback


def _atomic_save_syncing_with(sync):
    def save(obj, path):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)
                f.flush()
                sync(f, path)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    return save


def _fsyncs_the_old_checkpoint(first_save_too):
    # The old and new checkpoints have the same size: only the inode tells the fsynced file from the renamed one.
    def sync(f, path):
        if os.path.exists(path):
            with open(path, "rb") as old:
                os.fsync(old.fileno())
        elif first_save_too:
            os.fsync(f.fileno())  # the first save syncs the right file

    return _atomic_save_syncing_with(sync)


@pytest.mark.parametrize("first_save_too", [True, False])
def test_atomic_save_rejects_an_fsync_of_the_old_checkpoint(first_save_too):
    feedback = nb07.atomic_save(_fsyncs_the_old_checkpoint(first_save_too))
    assert feedback.status == "wrong" and "not preceded by an fsync of the file renamed" in feedback.message, feedback


@pytest.mark.parametrize(
    "sync",
    [
        lambda f, path: os.fsync(f),  # os.fsync takes anything with a fileno()
        lambda f, path: os.fdatasync(f.fileno()),  # enough for a new file's data on Linux
        lambda f, path: os.fdatasync(f),
    ],
    ids=["fsync-file-object", "fdatasync", "fdatasync-file-object"],
)
def test_atomic_save_accepts_other_ways_to_sync_the_file(sync):
    feedback = nb07.atomic_save(_atomic_save_syncing_with(sync))
    assert feedback.status == "correct", feedback
