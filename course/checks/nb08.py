"""Checks for notebook 08 (launchers, multi-node, elastic restarts, failures)."""

import contextlib
import io
import os
import shlex
import sys

import torch
import torch.distributed as dist
from torch import nn

from course.exercises import correct, exercise, wrong
from course.launcher import WorkerTimeoutError, launch

# ------------------------------------------------------------------ Exercise 1


def _torchrun_arguments(command):
    """The arguments after ``torchrun`` (or ``python -m torch.distributed.run``), or None."""
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, (list, tuple)) or not command:
        return None
    command = [str(a) for a in command]
    if os.path.basename(command[0]) == "torchrun":
        return command[1:]
    if len(command) >= 3 and command[1:3] == ["-m", "torch.distributed.run"]:
        return command[3:]
    return None


def _parse(arguments):
    from torch.distributed.run import get_args_parser

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            return get_args_parser().parse_args(arguments), None
        except SystemExit:
            return None, errors.getvalue().strip().splitlines()[-1]


@exercise("Exercise 1 (two_node_commands)", hint="with the static rendezvous, each node needs its own --node-rank: 0 and 1.")
def two_node_commands(fn):
    """Exercise 1: the torchrun command for each of 2 nodes x 4 GPUs, meeting at the head node."""
    head, port = "node01", 29400
    try:
        commands = fn(head, port)
    except Exception as e:
        return wrong(f"your function raised {type(e).__name__}: {e}")
    if not isinstance(commands, (list, tuple)) or len(commands) != 2:
        return wrong("return a list of 2 commands, one for each node (each a list of arguments).")
    parsed = []
    for node, command in enumerate(commands):
        arguments = _torchrun_arguments(command)
        if arguments is None:
            return wrong(f"command {node} should start with 'torchrun' (or python -m torch.distributed.run).")
        args, error = _parse(arguments)
        if args is None:
            return wrong(f"torchrun cannot read command {node}: {error}")
        parsed.append(args)
    for node, args in enumerate(parsed):
        if not (args.module and args.training_script == "course.train"):
            return wrong(f"command {node} should run the module course.train: end it with '-m course.train'.")
        late = [a for a in args.training_script_args if a.startswith(("--nnodes", "--nproc", "--rdzv", "--node", "--master"))]
        if late:
            return wrong(f"torchrun's options go before '-m course.train': what follows it ({late[0]}) is "
                               "passed to the training script.")
        if args.standalone:
            return wrong("--standalone makes each agent start its own rendezvous on its own machine: the two "
                               "nodes would never meet. Name the head node instead (--rdzv-endpoint).")
        if args.nproc_per_node != "4":
            return wrong(f"--nproc-per-node is the number of processes on ONE node (one per GPU): 4, "
                               f"not {args.nproc_per_node}.")
        if args.nnodes not in ("2", "2:2"):
            return wrong(f"--nnodes is the number of nodes (agents) that must join: 2, not {args.nnodes}.")
    backends = {args.rdzv_backend for args in parsed}
    if backends == {"c10d"}:
        endpoints = [args.rdzv_endpoint for args in parsed]
        if any(e.split(":")[0] in ("localhost", "127.0.0.1", "") for e in endpoints) or len(set(endpoints)) != 1:
            return wrong(f"both agents must meet at the same address, the head node's: "
                               f"--rdzv-endpoint={head}:{port} on both (got {endpoints}).")
        if endpoints[0] != f"{head}:{port}":
            return wrong(f"meet at the head node and port you were given: --rdzv-endpoint={head}:{port}.")
        if parsed[0].rdzv_id != parsed[1].rdzv_id:
            return wrong("the same --rdzv-id on every node: it names the job the agents are joining.")
        return correct("two agents, one rendezvous at the head node; it hands out the node ranks.")
    if backends == {"static"}:
        if {args.master_addr for args in parsed} != {head} or {args.master_port for args in parsed} != {port}:
            return wrong(f"with the static rendezvous, both nodes need --master-addr={head} --master-port={port}.")
        if sorted(args.node_rank for args in parsed) != [0, 1]:
            return wrong("with the static rendezvous, each node needs its own --node-rank: 0 and 1.")
        return correct("static rendezvous: node 0 hosts the store, --node-rank orders the nodes.")
    return wrong("use the same rendezvous on both nodes: --rdzv-backend=c10d with --rdzv-endpoint, "
                       "or --master-addr/--master-port with --node-rank.")


# ------------------------------------------------------------------ Exercise 2


@exercise("Exercise 2 (skipped collective)", hint="collectives are matched by order: pair rank 1's first all_reduce with rank 0's first.")
def skipped_collective(answer):
    """Exercise 2: what rank 1's ``b`` holds when rank 1 skipped the all_reduce of ``a``."""
    try:
        value = float(torch.as_tensor(answer).item())
    except (TypeError, ValueError, RuntimeError):
        return wrong("give one number.")
    if value == 21.0:
        return correct("rank 1's first all_reduce met rank 0's first one, the one of `a`: 1 + 20.")
    if value == 30.0:
        return wrong("that is what a correct program gives. Collectives are not matched by variable "
                           "name, but by order: rank 1's first all_reduce meets rank 0's first all_reduce.")
    if value == 20.0:
        return wrong("rank 1's all_reduce did complete, so it added something from rank 0: "
                           "which of rank 0's two calls came first?")
    return wrong("collectives are matched by order: pair rank 1's first all_reduce with rank 0's first.")


# ------------------------------------------------------------------ Exercise 3

SIZES = (5, 3)  # batches on rank 0 and on rank 1
LR = 0.1


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(SIZES[rank])]


def _uneven_job(rank, world_size, fn):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = fn(model, optimizer, _batches(rank))
    return steps, {k: v.detach() for k, v in model.module.state_dict().items()}


def expected_weights():
    """One process, by hand: while both ranks have batches, the mean of their gradients; once
    rank 1 has joined, Join's shadow all_reduce adds zeros for it and DDP still divides by 2."""
    model = _model()
    batches = [_batches(r) for r in range(2)]
    for step in range(max(SIZES)):
        grads = []
        for rank in range(2):
            model.zero_grad()
            if step < SIZES[rank]:
                x, y = batches[rank][step]
                nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            else:
                grads.append([torch.zeros_like(p) for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * (grads[0][i] + grads[1][i]) / 2
    return model.state_dict()


@exercise("Exercise 3 (train_with_join)", hint="wrap the training loop in `with Join([model]):` so that a rank that ran out of batches shadows the others' all_reduces.")
def train_with_join(fn):
    """Exercise 3: a training loop that survives ranks with different numbers of batches."""
    try:
        results = launch(_uneven_job, 2, fn, show=None, timeout=10)
    except WorkerTimeoutError as e:
        return wrong(f"rank(s) {e.ranks} waited for the other rank in an all_reduce it never joined: put the "
                           "loop inside `with Join([model]):` (from torch.distributed.algorithms.join).")
    steps = [r[0] for r in results]
    if steps != list(SIZES):
        return wrong(f"each rank should train on all of its batches and return how many steps it took: "
                           f"expected {list(SIZES)}, got {steps}.")
    weights = [r[1] for r in results]
    if not all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]):
        return wrong("the ranks ended with different weights: let DDP synchronise every step (Join does it "
                           "for the ranks that ran out of batches).")
    expected = expected_weights()
    if not all(torch.allclose(weights[0][k], expected[k], atol=1e-6) for k in expected):
        return wrong("the weights differ from what the same steps give: per batch, zero_grad, "
                           "mse_loss(model(x), y).backward(), optimizer.step().")
    return correct("rank 0 took 5 steps, rank 1 took 3, nobody hung, and the weights agree.")
