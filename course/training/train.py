"""One DDP training script for every launcher: torchrun, Slurm, mpirun, or a notebook.

    torchrun --standalone --nproc-per-node=2 -m course.training.train --steps 40
    srun python -m course.training.train --steps 40               # in an sbatch job: scripts/train.sbatch
    mpirun -n 2 python -m course.training.train --steps 40
    course.launch(lambda rank, world_size: course.training.train.main(["--steps", "40"]), 2)

The script never asks *who* started it. :func:`course.runtime.distenv.discover` reads the
launcher's environment variables (each launcher has its own names for rank, world
size and local rank), and :meth:`DistEnv.export` writes them back under torchrun's
names, so that one ``init_process_group(init_method="env://")`` serves them all.
Where the process group already exists (``course.launch`` makes one) it is used as it is.

What it trains: the CIFAR-10 CNN of notebook 03 on ``course.training.data.cifar10`` (the
synthetic stand-in when the real data is absent), a ``DistributedSampler``, SGD with
momentum. Everything else is what makes a job survive the real world:

* **Device.** NCCL on ``cuda:LOCAL_RANK`` when this node has a GPU for every local
  rank, gloo on the CPU otherwise. Nothing else in the script changes, except that
  on a GPU it asks for deterministic kernels (or resumed runs would not be exact).
* **Resume.** With ``--checkpoint PATH`` it saves every ``--save-every`` steps (rank 0,
  atomically: ``course.training.checkpoint``, notebook 07) and, if the file exists at start,
  resumes from it exactly. A job restarted by ``torchrun --max-restarts`` or
  resubmitted to Slurm continues where its last checkpoint left it.
* **Failures.** ``@record`` writes a failing rank's traceback where torchrun's
  error summary finds it. ``--crash-at STEP`` makes one rank fail on purpose (only
  in a job's first attempt), to watch a restart.
* **Clean exit.** Delete the DDP model and destroy the process group before the
  interpreter shuts down (otherwise gloo's threads can abort the exit: "terminate
  called without an active exception").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course.training import data
from course.training.checkpoint import load_checkpoint, restore_training_state, save_checkpoint, training_state, unwrap
from course.runtime.distenv import DistEnv, NoLauncherError, discover


class Net(nn.Module):
    """The CNN of notebook 03 (PyTorch's CIFAR-10 tutorial): 62,006 parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m course.training.train", description="Train the CIFAR-10 CNN with DDP.")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total (default 60)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and sampler shuffle (default 0)")
    p.add_argument("--checkpoint", help="resume from this file if it exists; save to it every --save-every steps")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--out", help="rank 0 writes the final weights here")
    p.add_argument("--log-every", type=int, default=20, help="steps between loss lines (default 20)")
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait (default 120)")
    p.add_argument("--crash-at", type=int, help="for the failure demo: fail after this step (first attempt only)")
    p.add_argument("--crash-rank", type=int, default=1, help="which rank fails with --crash-at (default 1)")
    p.add_argument("--crash-how", choices=("raise", "kill"), default="raise",
                   help="raise an exception (traceback via @record), or die by SIGKILL (default raise)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "save_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def say(text, stream=None):
    """Print one line with a single write: the ranks share one terminal (or log file), and with
    unbuffered output (PYTHONUNBUFFERED=1) print() writes the text and the newline separately,
    so two ranks' lines could interleave."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


# ------------------------------------------------------------------------ setup


def choose_device(local_rank: int, local_world_size: int) -> tuple[str, torch.device]:
    """NCCL and this rank's own GPU when the node has one GPU per local rank; else gloo on CPU."""
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def setup(timeout: float = 120, environ=None) -> tuple[DistEnv, torch.device]:
    """Join the job: find the launcher, create the process group, pick the device.

    ``environ``: the launcher's variables (default ``os.environ``). Raises
    :class:`course.runtime.distenv.NoLauncherError`, saying how to start the script, when no
    launcher's variables are found."""
    env = discover(environ)
    if dist.is_initialized():  # e.g. course.launch made it: use it as it is
        on_gpu = dist.get_backend() == "nccl"
        return env, torch.device("cuda", env.local_rank) if on_gpu else torch.device("cpu")
    backend, device = choose_device(env.local_rank, env.local_world_size)
    env.export()  # RANK, WORLD_SIZE, MASTER_ADDR, ... whatever the launcher called them
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # Exact resume needs deterministic kernels on a GPU: without them, two uninterrupted runs
        # of this script already differ by ~5e-6 after 24 steps (measured: one H100, torch 2.11).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True)
    _warn_about_shared_store(env)
    dist.init_process_group(
        backend,
        init_method="env://",
        timeout=datetime.timedelta(seconds=timeout),  # the default is 30 minutes of silence
        device_id=device if device.type == "cuda" else None,
    )
    return env, device


def _warn_about_shared_store(env):
    """torchrun >= 2.5 lets the workers use its own TCPStore, across restarts. A restarted
    worker can then read the address a dead worker of the previous attempt left there
    and fail to connect (7 of 10 restarts here on torch 2.15; pytorch issue 135712)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if env.rank == 0 and restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        say("warning: torchrun --max-restarts shares its store with the workers, and a restart can then "
            "hang or fail while connecting; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun.", sys.stderr)


# ------------------------------------------------------------------------ training


def first_attempt() -> bool:
    """torchrun counts restarts in TORCHELASTIC_RESTART_COUNT; other launchers never restart."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def crash(args, rank, step):
    if args.crash_at == step and rank == args.crash_rank and first_attempt():
        say(f"rank {rank}: crashing after step {step} ({args.crash_how})")
        if args.crash_how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: like a lost machine
        raise RuntimeError(f"simulated failure on rank {rank} after step {step}")


def train(args, device: torch.device) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    transform = _transform()
    with data.rank0_first():  # rank 0 makes the synthetic files if needed, the others wait
        dataset = data.cifar10(train=True, transform=transform)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator())  # its own generator: keeps the global RNG for exact resume

    torch.manual_seed(args.seed)
    model = Net().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)

    step, epoch, done = 0, 0, 0  # done: batches of this epoch already trained on
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = load_checkpoint(args.checkpoint)
        step, epoch = restore_training_state(state, ddp_model, optimizer)
        done = state["batches_done"]
        if rank == 0:
            say(f"resumed from step {step} (epoch {epoch}, {done} batches of it done)")

    losses = []
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(loader):
            if i < done:
                continue  # trained on before the restart
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(loss.detach())
            if step % args.log_every == 0:  # the mean loss since the last line, over all ranks
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean)
                if rank == 0:
                    say(f"step {step:>4}/{args.steps}  loss {mean.item() / world_size:.4f}")
                losses = []
            if args.checkpoint and step % args.save_every == 0:
                state = training_state(ddp_model, optimizer, step=step, epoch=epoch, batches_done=i + 1)
                if rank == 0:
                    save_checkpoint(state, args.checkpoint)
                dist.barrier()  # nobody goes on (or reads the file) before it is complete
            crash(args, rank, step)
            if step == args.steps:
                break
        epoch, done = epoch + 1, 0

    weights = {k: v.detach().cpu() for k, v in unwrap(ddp_model).state_dict().items()}
    if args.out and rank == 0:
        save_checkpoint({"model": weights, "step": step}, args.out)
    del ddp_model, model, optimizer  # DDP's reducer holds the process group: free it first
    gc.collect()
    return weights


def _transform():
    import torchvision.transforms as T

    return T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])


@record  # under torchrun: this rank's traceback goes to the error file, and into torchrun's summary
def main(argv=None) -> dict:
    """Parse the arguments, join the job, train; return the final weights (CPU tensors)."""
    args = parse_args(argv)
    owns_group = not dist.is_initialized()  # else whoever made the process group ends it
    try:
        env, device = setup(args.timeout)
    except NoLauncherError as e:
        sys.exit(f"error: {e}")
    try:
        if dist.get_rank() == 0:
            say(f"{env.launcher}: {env.world_size} ranks, {dist.get_backend()} on {device.type}")
        say(f"rank {env.rank}: local rank {env.local_rank}, node {env.node_rank}")
        return train(args, device)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
