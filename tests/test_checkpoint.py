"""course.training.checkpoint: exact resume of a DDP job, atomic saves that survive a kill,
safe loading with clear errors for bad files."""

import io
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course.training.crash import die_halfway  # torch.save that dies halfway
from course.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    restore_rng,
    restore_training_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
    training_state,
    unwrap,
)
from course.runtime.launcher import WorkerError, launch
from course.classroom.notebooks import definitions


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def _parts(lr=0.05):
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    x, y = torch.randn(4, 6), torch.randn(4, 1)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


def _draws():
    return torch.rand(3), random.random(), np.random.rand()


# ------------------------------------------------------------------ save / load / restore


def test_round_trip_restores_model_optimizer_scheduler_and_every_rng(tmp_path):
    model, optimizer, scheduler = _parts()
    for _ in range(4):
        _step(model, optimizer, scheduler)
    state = training_state(model, optimizer, scheduler, step=4, epoch=1, batches_done=2)
    save_checkpoint(state, tmp_path / "ckpt.pt")
    expected = _draws()  # what the random generators give right after the capture

    fresh, fresh_optimizer, fresh_scheduler = _parts(lr=1.0)
    torch.manual_seed(999), random.seed(999), np.random.seed(999)  # another process, other states
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    assert restore_training_state(loaded, fresh, fresh_optimizer, fresh_scheduler) == (4, 1)
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert loaded["batches_done"] == 2 and loaded["world_size"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(m, fresh_optimizer.state[p]["momentum_buffer"]) for m, p in zip(momentum, fresh.parameters()))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 0.025


def test_restored_training_continues_identically(tmp_path):
    model, optimizer, scheduler = _parts()
    for _ in range(3):
        _step(model, optimizer, scheduler)
    save_checkpoint(training_state(model, optimizer, scheduler, step=3, epoch=0), tmp_path / "c.pt")
    for _ in range(3):
        _step(model, optimizer, scheduler)  # data and dropout both come from the global RNG

    fresh, fresh_optimizer, fresh_scheduler = _parts(lr=1.0)
    torch.manual_seed(12345)  # a fresh process: some other random state
    restore_training_state(load_checkpoint(tmp_path / "c.pt"), fresh, fresh_optimizer, fresh_scheduler)
    for _ in range(3):
        _step(fresh, fresh_optimizer, fresh_scheduler)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_rng_state_is_plain_data_that_loads_with_weights_only():
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) >= {"torch", "python", "numpy"}
    expected = _draws()
    set_rng_state(state)
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_save_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "sub" / "ckpt.pt"  # the folder is created
    save_checkpoint({"step": 1}, path)
    save_checkpoint({"step": 2}, path)
    assert load_checkpoint(path)["step"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_save_rejects_what_is_not_a_dict(tmp_path):
    with pytest.raises(TypeError, match="saves a dict"):
        save_checkpoint([1, 2], tmp_path / "c.pt")


def test_a_save_that_raises_keeps_the_old_file_and_removes_its_temporary_file(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception):
        save_checkpoint({"step": 2, "oops": lambda: 0}, path)  # lambdas cannot be pickled
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_unwrap():
    model = nn.Linear(2, 2)
    assert unwrap(model) is model
    assert unwrap(nn.DataParallel(model)) is model


# ------------------------------------------------------------------ killed while saving


def _save_and_get_killed(rank, world_size, path, atomic):
    torch.save = die_halfway(torch.save)  # in this process only
    state = {"step": 2, "weights": torch.full((500_000,), 2.0)}
    if atomic:
        save_checkpoint(state, path)
    else:
        torch.save(state, path)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("atomic", [True, False])
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, atomic):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"step": 1, "weights": torch.ones(500_000)}, path)
    with pytest.raises(WorkerError) as info:
        launch(_save_and_get_killed, 1, str(path), atomic, show=None, timeout=60)
    assert "SIGKILL" in info.value.failed[0]
    if atomic:
        state = load_checkpoint(path)
        assert state["step"] == 1 and torch.equal(state["weights"], torch.ones(500_000))
        strays = [p for p in tmp_path.iterdir() if p != path]
        assert len(strays) == 1 and strays[0].name.startswith(".ckpt.pt.") and strays[0].name.endswith(".tmp")
        assert 0 < strays[0].stat().st_size < path.stat().st_size  # the half-written new one, aside
    else:  # the contrast: without the atomic write the crash destroyed the good checkpoint
        with pytest.raises(CheckpointError, match="truncated"):
            load_checkpoint(path)


def _save_forever(folder):
    """Alternate between two checkpoints as fast as possible, until killed."""
    torch.set_num_threads(1)  # first torch call in a forked child: OpenMP hangs otherwise (see launcher.py)
    path = Path(folder, "ckpt.pt")
    states = [{"step": s, "weights": torch.full((2_000_000,), float(s))} for s in (1, 2)]
    save_checkpoint(states[0], path)
    Path(folder, "ready").touch()
    i = 0
    while True:
        i += 1
        save_checkpoint(states[i % 2], path)


@pytest.mark.skipif(sys.platform != "linux", reason="fork-based")
def test_killed_at_random_moments_the_checkpoint_is_always_old_or_new(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    for attempt in range(6):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        proc = ctx.Process(target=_save_forever, args=(str(folder),), daemon=True)
        proc.start()
        deadline = time.monotonic() + 30
        while not (folder / "ready").exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (folder / "ready").exists(), "the saving process did not start"
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        state = load_checkpoint(folder / "ckpt.pt")
        assert state["step"] in (1, 2)
        assert torch.equal(state["weights"], torch.full((2_000_000,), float(state["step"])))


# ------------------------------------------------------------------ bad files


@pytest.fixture
def good_checkpoint(tmp_path):
    path = tmp_path / "good.pt"
    save_checkpoint({"step": 3, "model": nn.Linear(50, 50).state_dict()}, path)
    return path


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.3, 0.5, 0.99])
def test_a_truncated_file_gives_a_clear_error(tmp_path, good_checkpoint, keep):
    data = good_checkpoint.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"bad\.pt .*truncated or not a PyTorch checkpoint.*older checkpoint"):
        load_checkpoint(bad)


@pytest.mark.parametrize("content", [b"this is not a checkpoint\n", bytes(range(256)) * 10])
def test_a_file_that_is_not_a_checkpoint_gives_a_clear_error(tmp_path, content):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match="truncated or not a PyTorch checkpoint"):
        load_checkpoint(bad)


def test_a_bare_state_dict_is_not_taken_for_a_checkpoint(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(nn.Linear(2, 2).state_dict(), path)
    with pytest.raises(CheckpointError, match=r"not a checkpoint written by save_checkpoint.*'bias', 'weight'"):
        load_checkpoint(path)
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="it holds a list"):
        load_checkpoint(path)


class _Payload:
    """Unpickling this calls os.mkdir: a stand-in for any code an attacker wants to run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_loading_refuses_to_run_code_from_the_file(tmp_path):
    path, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"format": "ddp-course-checkpoint/1", "x": _Payload(str(marker))}, path)
    with pytest.raises(CheckpointError, match=r"weights_only=True.*add_safe_globals"):
        load_checkpoint(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what load_checkpoint protects against: the payload runs
    assert marker.exists()


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        load_checkpoint(tmp_path / "nope.pt")


def test_restore_rng_needs_the_same_world_size():
    state = {"world_size": 2, "rng": [rng_state(), rng_state()]}
    with pytest.raises(CheckpointError, match="2 rank"):
        restore_rng(state)


# ------------------------------------------------------------------ a real DDP job: exact resume

STEPS, SAVE_EVERY = 14, 4  # 36 samples / (2 ranks x 3) = 6 steps per epoch


def _dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(36, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(36, 1, generator=g))


def _train(rank, world_size, save_to, resume_from=None, crash_at=None, rng=True, epoch_shift=0):
    torch.manual_seed(0)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    data = _dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=3, sampler=sampler, generator=torch.Generator())
    torch.manual_seed(100 + rank)  # every rank its own dropout masks
    step, epoch, done = 0, 0, 0
    if resume_from:
        state = load_checkpoint(resume_from)
        step, epoch = restore_training_state(state, model, optimizer, scheduler, rng=rng)
        epoch, done = epoch + epoch_shift, state["batches_done"]
    while step < STEPS:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < done:
                continue
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % SAVE_EVERY == 0:
                state = training_state(model, optimizer, scheduler, step=step, epoch=epoch, batches_done=i + 1)
                if rank == 0:
                    save_checkpoint(state, save_to)
                dist.barrier()
            if step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)  # every rank dies after this step
            if step == STEPS:
                break
        epoch, done = epoch + 1, 0
    return {"model": unwrap(model).state_dict(), "rng": torch.get_rng_state()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("uninterrupted")
    return launch(_train, 2, str(folder / "c.pt"), show=None)


def _equal(a, b):
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("crash_at, saved_at", [(10, 8), (13, 12)])  # mid-epoch, and at an epoch's end
def test_ddp_job_crashed_and_resumed_equals_the_uninterrupted_run(tmp_path, uninterrupted, crash_at, saved_at):
    path = str(tmp_path / "c.pt")
    with pytest.raises(WorkerError) as info:
        launch(_train, 2, path, None, crash_at, show=None)
    assert "SIGKILL" in info.value.failed[info.value.rank]
    state = load_checkpoint(path)
    assert state["step"] == saved_at and state["world_size"] == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])  # per-rank generators

    # One launch resumes three times: as saved; without the saved randomness; with the wrong sampler epoch.
    resumed, no_rng, wrong_epoch = zip(*launch(_resume_three_ways, 2, str(tmp_path), path, show=None))
    assert _equal(uninterrupted[0], uninterrupted[1])
    for rank in range(2):
        assert _equal(resumed[rank], uninterrupted[0])  # bit for bit
        assert torch.equal(resumed[rank]["rng"], uninterrupted[rank]["rng"])

    # The job really depends on the saved randomness and sampler epoch: without them it differs.
    assert not _equal(no_rng[0], uninterrupted[0])
    assert not _equal(wrong_epoch[0], uninterrupted[0])


def _resume_three_ways(rank, world_size, folder, path):
    """_train resumed from ``path`` as saved, without its randomness, and one epoch off; each run seeds
    and restores all it uses itself, so running them one after the other changes none of them."""
    return (_train(rank, world_size, os.path.join(folder, "after.pt"), path),
            _train(rank, world_size, os.path.join(folder, "x.pt"), path, None, False),
            _train(rank, world_size, os.path.join(folder, "y.pt"), path, None, True, -1))


def _capture(rank, world_size):
    torch.manual_seed(0)
    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)
    return training_state(model, optimizer, step=0, epoch=0)


def test_training_state_gathers_every_ranks_rng_and_drops_the_module_prefix():
    states = launch(_capture, 2, show=None)
    for state in states:
        assert not any(k.startswith("module.") for k in state["model"])
        assert len(state["rng"]) == 2 and state["scheduler"] is None
        assert torch.equal(state["rng"][0]["torch"], states[0]["rng"][0]["torch"])
    torch.manual_seed(101)
    assert torch.equal(states[0]["rng"][1]["torch"], torch.get_rng_state())  # rank 1's own state


NOTEBOOK = Path(__file__).parent.parent / "solutions" / "07_checkpointing.ipynb"


@pytest.mark.parametrize("name", ["atomic_save", "fsync_folder"])
def test_notebook_derives_the_packages_atomic_save(name):
    """Notebook 07 derives atomic_save (Exercise 2) and fsync_folder; the course holds the same code."""
    import inspect

    import course.training.checkpoint
    from course.classroom.exercises import solutions

    assert definitions(NOTEBOOK)[name] == inspect.getsource(getattr(course.training.checkpoint, name)).rstrip()
    if name == "atomic_save":  # what check.atomic_save.solution() shows is that code too
        assert inspect.getsource(course.training.checkpoint.atomic_save).rstrip() in solutions()["07"]["atomic_save"]


def test_save_checkpoint_is_atomic_save_then_fsync_folder(tmp_path, monkeypatch):
    """save_checkpoint adds only a type check and a format tag to the notebook's two functions."""
    import course.training.checkpoint

    calls = []
    monkeypatch.setattr(course.training.checkpoint, "atomic_save", lambda obj, path: calls.append(("atomic_save", obj, path)))
    monkeypatch.setattr(course.training.checkpoint, "fsync_folder", lambda folder: calls.append(("fsync_folder", folder)))
    path = tmp_path / "sub" / "c.pt"
    assert course.training.checkpoint.save_checkpoint({"step": 1}, str(path)) == path
    assert calls == [("atomic_save", {"step": 1, "format": course.training.checkpoint.FORMAT}, path), ("fsync_folder", path.parent)]


def test_fsync_folder_fsyncs_the_folder_and_tolerates_what_cannot(tmp_path, monkeypatch):
    import stat

    from course.training.checkpoint import fsync_folder

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    fsync_folder(tmp_path)
    assert synced == [True]

    def refuse(fd):
        raise OSError(22, "Invalid argument")  # what some file systems answer for a folder

    monkeypatch.setattr(os, "fsync", refuse)
    fsync_folder(tmp_path)  # no error
    fsync_folder(tmp_path / "missing")  # cannot be opened (as on Windows): no error


def test_die_halfway_leaves_half_a_file(tmp_path):
    """The crash stand-in notebook 07 and its check use: half the bytes, then SIGKILL."""
    import io

    from course import WorkerError, launch
    from course.training.crash import die_halfway

    def job(rank, world_size, path):
        torch.save = die_halfway(torch.save)
        torch.save({"w": torch.ones(10_000)}, path)

    full = io.BytesIO()
    torch.save({"w": torch.ones(10_000)}, full)
    with pytest.raises(WorkerError, match="SIGKILL"):
        launch(job, 1, str(tmp_path / "x.pt"), show=None, timeout=60)
    assert (tmp_path / "x.pt").stat().st_size == len(full.getvalue()) // 2
