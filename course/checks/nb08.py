"""Checks for notebook 08 (launchers, multi-node, elastic restarts)."""

import contextlib
import io
import os
import shlex

from course.classroom.exercises import correct, exercise, wrong

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


HEADS = [("node01", 29400), ("gpu-a17", 31234)]  # two clusters: the commands must follow head and port


@exercise("Exercise 1 (two_node_commands)", hint="both nodes meet at the head node: --rdzv-backend=c10d with "
          "--rdzv-endpoint=HEAD:PORT on both, or the static rendezvous (--master-addr, --master-port) with "
          "--node-rank 0 on the head node and 1 on the other.")
def two_node_commands(fn):
    """Exercise 1: the torchrun command for each of 2 nodes x 4 GPUs, meeting at the head node."""
    for head, port in HEADS:
        feedback = _judge_two_node_commands(fn, head, port)
        if not feedback:
            return feedback
    return feedback


def _judge_two_node_commands(fn, head, port):
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
        if not (args.module and args.training_script == "course.training.train"):
            return wrong(f"command {node} should run the module course.training.train: end it with '-m course.training.train'.")
        late = [a for a in args.training_script_args if a.startswith(("--nnodes", "--nproc", "--rdzv", "--node", "--master"))]
        if late:
            return wrong(f"torchrun's options go before '-m course.training.train': what follows it ({late[0]}) is "
                               "passed to the training script.")
        if args.standalone:
            return wrong("--standalone makes each agent start its own rendezvous on its own machine: the two "
                               "nodes would never meet. Name the head node instead (--rdzv-endpoint).")
        if args.nproc_per_node not in ("4", "gpu", "auto"):  # "gpu"/"auto": one per GPU, 4 here
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
        from torch.distributed.run import get_rdzv_endpoint  # --rdzv-endpoint, else --master-addr:--master-port

        if {get_rdzv_endpoint(args) for args in parsed} != {f"{head}:{port}"}:
            return wrong(f"with the static rendezvous, both nodes need --master-addr={head} --master-port={port}.")
        if [args.node_rank for args in parsed] != [0, 1]:
            return wrong("with the static rendezvous, the head node (the first command) is --node-rank=0: node 0 "
                         "hosts the store at --master-addr. The other node is 1.")
        return correct("static rendezvous: node 0 hosts the store, --node-rank orders the nodes.")
    return wrong("use the same rendezvous on both nodes: --rdzv-backend=c10d with --rdzv-endpoint, "
                       "or --master-addr/--master-port with --node-rank.")


# ------------------------------------------------------------------ Exercise 2

OLD_SCRIPT_PARSER = """
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)   # written for torch.distributed.launch, torch 1.x
parser.add_argument("--epochs", type=int, default=1)
"""


def _argv_from(launcher, local_rank):
    """The arguments ``launcher`` gives the script of local rank ``local_rank``, as this torch builds them
    (``config_from_args`` is what torchrun and torch.distributed.launch call before starting workers)."""
    from torch.distributed.run import config_from_args, get_args_parser

    options = ["--nproc-per-node=2", "old.py", "--epochs", "3"]
    if launcher == "torch.distributed.launch":
        from torch.distributed import launch as legacy

        args = legacy.parse_args(options)
    else:
        args = get_args_parser().parse_args(options)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = saved or "1"  # else config_from_args sets it, with a warning
    try:
        _, _, command_args = config_from_args(args)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
    script_args = command_args[command_args.index("old.py") + 1:]  # after the interpreter's own options
    return [a.replace("${local_rank}", str(local_rank)) for a in script_args]


def old_script_outcome(launcher):
    """"error" if the old script's argparse refuses what ``launcher`` passes, else [local rank of process 0, of process 1]."""
    namespace = {}
    exec(OLD_SCRIPT_PARSER, namespace)
    parser = namespace["parser"]
    used = []
    for local_rank in (0, 1):
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors):
            try:
                used.append(parser.parse_args(_argv_from(launcher, local_rank)).local_rank)
            except SystemExit:
                return "error"
    return used


LAUNCHERS = ("torch.distributed.launch", "torchrun")


@exercise("Exercise 2 (old_script)", hint="read what each launcher passes: torch.distributed.launch adds --local-rank=N (with a dash) to the script's arguments; torchrun adds nothing and sets LOCAL_RANK.")
def old_script(prediction):
    """Exercise 2: what an old ``--local_rank`` script does under each launcher of this torch."""
    if not isinstance(prediction, dict) or set(prediction) != set(LAUNCHERS):
        return wrong(f"give a dict with the keys {list(LAUNCHERS)}.")
    for launcher in LAUNCHERS:
        got, actual = prediction[launcher], old_script_outcome(launcher)
        if isinstance(got, tuple):
            got = list(got)
        if got == actual:
            continue
        if actual == "error":
            return wrong(f"under {launcher} the script never starts training: the launcher passes "
                         f"{_argv_from(launcher, 1)[0]!r} and argparse only knows '--local_rank' (an underscore): "
                         "'unrecognized arguments'.")
        if got == "error":
            return wrong(f"under {launcher} argparse is happy: nothing unknown reaches it.")
        if got == [0, 1]:
            return wrong(f"{launcher} passes no --local_rank argument (it sets LOCAL_RANK): both processes keep "
                         "the default, 0, and would both use cuda:0.")
        return wrong(f"for {launcher}, give \"error\" or the list [local rank used by process 0, by process 1].")
    return correct("torch.distributed.launch passes --local-rank=N, which the old parser refuses; torchrun passes "
                   "nothing, so both processes use the default 0. Read LOCAL_RANK instead.")
