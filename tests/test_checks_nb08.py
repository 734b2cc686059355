"""Notebook 08's checks accept right answers and reject plausible wrong ones with a useful hint."""

import sys

import pytest

from course.checks import nb08

# ------------------------------------------------------------------ Exercise 1: two-node torchrun commands

C10D = ["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-id=job"]
MODULE = ["-m", "course.training.train"]


def _c10d(head, port):
    return [["torchrun", *C10D, f"--rdzv-endpoint={head}:{port}", *MODULE]] * 2


def _static(head, port):
    return [["torchrun", "--nnodes=2", "--nproc-per-node=4", f"--node-rank={n}", f"--master-addr={head}",
             f"--master-port={port}", "-m", "course.training.train"] for n in (0, 1)]


def _python_m_strings(head, port):  # strings, and python -m torch.distributed.run, are fine too
    line = f"{sys.executable} -m torch.distributed.run " + " ".join(C10D) + f" --rdzv-endpoint={head}:{port} -m course.training.train"
    return [line, line]


def _static_endpoint_one_per_gpu(head, port):  # --rdzv-endpoint in place of --master-addr/--master-port
    return [["torchrun", "--nnodes=2", "--nproc-per-node=gpu", f"--node-rank={n}", f"--rdzv-endpoint={head}:{port}",
             "-m", "course.training.train"] for n in (0, 1)]


@pytest.mark.parametrize("answer", [_c10d, _static, _python_m_strings, _static_endpoint_one_per_gpu])
def test_two_node_commands_accepts_both_rendezvous(answer):
    assert nb08.two_node_commands(answer).status == "correct"


def _swap(option, value):
    def answer(head, port):
        commands = []
        for command in _c10d(head, port):
            command = [a for a in command if not a.startswith(option + "=")]
            commands.append(command[:1] + ([f"{option}={value}"] if value is not None else []) + command[1:])
        return commands
    return answer


def _different_ids(head, port):
    return [["torchrun", *C10D[:3], f"--rdzv-id=job{n}", f"--rdzv-endpoint={head}:{port}", *MODULE] for n in (0, 1)]


def _own_host(head, port):
    return [["torchrun", *C10D, f"--rdzv-endpoint={host}:{port}", *MODULE] for host in (head, "node02")]


def _static_same_rank(head, port):
    return [_static(head, port)[0]] * 2


def _static_ranks_swapped(head, port):  # node 0 would host the store on the machine not named by --master-addr
    return _static(head, port)[::-1]


def _hard_coded(head, port):  # the notebook's example command, whatever head and port are
    return _c10d("node01", 29400)


def _standalone(head, port):
    return [["torchrun", "--standalone", "--nnodes=2", "--nproc-per-node=4", "-m", "course.training.train"]] * 2


@pytest.mark.parametrize("answer, hint", [
    (_swap("--nproc-per-node", 8), "ONE node"),
    (_swap("--nnodes", 1), "number of nodes"),
    (_swap("--rdzv-endpoint", "localhost:29400"), "same address"),
    (_swap("--rdzv-endpoint", "node01:12345"), "port you were given"),
    (_different_ids, "same --rdzv-id"),
    (_own_host, "same address"),
    (_static_same_rank, "is --node-rank=0"),
    (_static_ranks_swapped, "is --node-rank=0"),
    (_hard_coded, "port you were given"),
    (_standalone, "never meet"),
    (lambda head, port: [["torchrun", "--nproc-per-node=4", "train.py"]] * 2, "-m course.training.train"),
    (lambda head, port: [["torchrun", *C10D, *MODULE, f"--rdzv-endpoint={head}:{port}"]] * 2, "go before '-m"),
    (lambda head, port: [["python", "train.py"]] * 2, "start with 'torchrun'"),
    (lambda head, port: [["torchrun", "--no-such-option", "-m", "course.training.train"]] * 2, "cannot read"),
    (lambda head, port: _c10d(head, port)[0], "list of 2 commands"),
])
def test_two_node_commands_rejects_wrong_answers(answer, hint):
    feedback = nb08.two_node_commands(answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 2: the old --local_rank script


@pytest.mark.parametrize("prediction, hint", [
    ({"torch.distributed.launch": [0, 1], "torchrun": [0, 0]}, "unrecognized arguments"),
    ({"torch.distributed.launch": "error", "torchrun": [0, 1]}, "passes no --local_rank argument"),
    ({"torch.distributed.launch": "error", "torchrun": "error"}, "argparse is happy"),
    ({"torch.distributed.launch": "error", "torchrun": 0}, "give \"error\" or the list"),
    ({"torchrun": [0, 0]}, "give a dict with the keys"),
])
def test_old_script_rejects_wrong_predictions(prediction, hint):
    feedback = nb08.old_script(prediction)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_old_script_accepts_tuples():
    assert nb08.old_script({"torch.distributed.launch": "error", "torchrun": (0, 0)}).status == "correct"


def test_old_script_outcome_comes_from_torchs_own_argument_building():
    assert nb08._argv_from("torch.distributed.launch", 1)[0] == "--local-rank=1"
    assert not any("local" in a for a in nb08._argv_from("torchrun", 1))
