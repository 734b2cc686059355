"""Notebook 13's checks reject plausible wrong answers with a specific hint."""

import pytest
import torch
import torch.distributed as dist

from course.checks import nb13
from course.classroom.notebooks import solution_paths

SOLUTION, = solution_paths(["13_tensor_parallel"])

# ------------------------------------------------------------------ Exercise 1: row-parallel Function


def _forward(ctx, x_local, w_local, bias):
    ctx.save_for_backward(x_local, w_local)
    y = x_local @ w_local.T
    dist.all_reduce(y)
    return y + bias


def _backward(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0)


def _forward_no_all_reduce(ctx, x_local, w_local, bias):
    ctx.save_for_backward(x_local, w_local)
    return x_local @ w_local.T + bias


def _forward_bias_on_every_rank(ctx, x_local, w_local, bias):
    ctx.save_for_backward(x_local, w_local)
    y = x_local @ w_local.T + bias
    dist.all_reduce(y)
    return y


def _forward_no_bias(ctx, x_local, w_local, bias):
    ctx.save_for_backward(x_local, w_local)
    y = x_local @ w_local.T
    dist.all_reduce(y)
    return y


def _forward_returns_nothing(ctx, x_local, w_local, bias):
    ctx.save_for_backward(x_local, w_local)
    dist.all_reduce(x_local @ w_local.T)


def _backward_all_reduces(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    grad_y = grad_y.clone()
    dist.all_reduce(grad_y)
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0)


def _backward_no_bias_grad(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    return grad_y @ w_local, grad_y.T @ x_local, None


def _backward_bias_grad_shared_out(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0) / dist.get_world_size()


def _backward_transposed_weight_grad(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    return grad_y @ w_local, x_local.T @ grad_y, grad_y.sum(0)


def _backward_wrong_input_grad(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    return grad_y @ w_local * 0.5, grad_y.T @ x_local, grad_y.sum(0)


def _backward_all_reduces_then_averages(ctx, grad_y):  # the right values, and a needless all-reduce
    x_local, w_local = ctx.saved_tensors
    grad_y = grad_y.clone()
    dist.all_reduce(grad_y)
    grad_y /= dist.get_world_size()
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0)


def _forward_gathers_x_and_w(ctx, x_local, w_local, bias):  # the whole layer on every rank: right, but not split
    ctx.save_for_backward(x_local, w_local)
    n = dist.get_world_size()
    xs = [torch.empty_like(x_local) for _ in range(n)]
    ws = [torch.empty_like(w_local) for _ in range(n)]
    dist.all_gather(xs, x_local.contiguous())
    dist.all_gather(ws, w_local.contiguous())
    return torch.cat(xs, 1) @ torch.cat(ws, 1).T + bias


def _forward_partner(ctx, x_local, w_local, bias):  # the other rank is 1 - rank: 2 ranks only
    ctx.save_for_backward(x_local, w_local)
    y = x_local @ w_local.T
    theirs = torch.empty_like(y)
    work = dist.isend(y, 1 - dist.get_rank())
    dist.recv(theirs, 1 - dist.get_rank())
    work.wait()
    return y + theirs + bias


@pytest.mark.parametrize(
    "forward, backward, hint",
    [
        (_forward, _backward_all_reduces_then_averages, "backward communicates (all_reduce)"),
        (_forward_gathers_x_and_w, _backward, "forward communicates all_gather"),
        (_forward_partner, _backward, "forward communicates send"),
        (_forward_no_all_reduce, _backward, "only its own partial product"),
        (_forward_bias_on_every_rank, _backward, "counted 2 times"),
        (_forward_no_bias, _backward, "missing the bias"),
        (_forward_returns_nothing, _backward, "it returned <class 'NoneType'>"),
        (_forward, _backward_all_reduces, "backward must not all-reduce"),
        (_forward, _backward_no_bias_grad, "returned None for bias"),
        (_forward, _backward_bias_grad_shared_out, "gradient of bias is wrong"),
        (_forward, _backward_transposed_weight_grad, "a rank failed"),
        (_forward, _backward_wrong_input_grad, "gradient of x_local is wrong"),
    ],
)
def test_row_parallel_rejects_wrong_answers(forward, backward, hint):
    feedback = nb13.row_parallel(forward, backward)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


def test_row_parallel_accepts_the_reference_on_2_and_3_ranks():
    assert nb13.ROW_PARALLEL_RANKS == (2, 3)
    assert nb13.row_parallel(_forward, _backward).status == "correct"


# ------------------------------------------------------------------ Exercise 2: predict the all-reduces


TRACED_STEP = {"forward": [128, 128], "backward": [128]}


def test_the_traced_step_is_what_exercise_2_expects():
    assert nb13.traced_tp_step() == TRACED_STEP


@pytest.mark.parametrize(
    "answer, hint",
    [
        ((4, 1, 128), "no communication in forward"),
        ((1, 1, 128), "one at the exit of each block"),
        ((2, 2, 128), "does not require grad"),
        ((2, 0, 128), "f all-reduces in backward"),
        ((2, 1, 512), "never leaves its rank"),
        ((2, 1, 256), "this rank's slice of the hidden activation"),  # batch x hidden/N x 4 B
        ((2, 1, 64), "not half of it"),
        ((2, 1, 2240), "batch × features"),
        ((2, 1, 128.0), "three whole numbers"),
    ],
)
def test_tp_all_reduces_rejects_wrong_answers(answer, hint, monkeypatch):
    # The verdict compares the answer with the traced step, which the test above traces: no launch per answer.
    monkeypatch.setattr(nb13, "traced_tp_step", lambda: TRACED_STEP)
    feedback = nb13.tp_all_reduces(*answer)
    assert feedback.status == "wrong" and hint in feedback.message, feedback


# ------------------------------------------------------------------ Exercise 3: DTensor attention


def _plan(q, k, v, out, set_heads=lambda block, mesh: setattr(block, "n_heads", block.n_heads // mesh.size()),
          returns=True, after=None):
    def parallelize(block, mesh):
        from torch.distributed.tensor.parallel import parallelize_module

        plan = {name: style() for name, style in zip(("q", "k", "v", "out"), (q, k, v, out)) if style}
        parallelize_module(block, mesh, plan)
        if set_heads:
            set_heads(block, mesh)
        if after:
            after(block)
        return block if returns else None

    return parallelize


def _styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def _heads_per_rank_is_the_world_size(block, mesh):
    block.n_heads = mesh.size()


def _heads_halved(block, mesh):  # right for 2 ranks only
    block.n_heads //= 2


def _two_heads(block, mesh):  # 4 heads / 2 ranks, hard-coded
    block.n_heads = 2


def _heads_by_world_size(block, mesh):  # the notebook's 4 heads on 2 ranks, 12 heads on 4: hard-coded per world size
    block.n_heads = {2: 2, 4: 3}[mesh.size()]


def _freeze_v(block):  # only v's weight gradient is wrong (missing): the check compares k and v too
    block.v.weight.requires_grad_(False)


def test_tensor_parallel_attention_rejects_wrong_answers():
    col, row = _styles()
    cases = [
        (_plan(col, col, col, row, set_heads=None), "set block.n_heads"),
        (_plan(col, col, col, row, set_heads=_heads_per_rank_is_the_world_size), "6 heads on 2 ranks, each rank holds 3 whole heads, but block.n_heads is 2"),
        (_plan(col, col, col, row, set_heads=_heads_halved), "6 heads on 3 ranks, each rank holds 2 whole heads, but block.n_heads is 3"),
        (_plan(col, col, col, row, set_heads=_two_heads), "block.n_heads is 2"),
        (_plan(col, col, col, row, set_heads=_heads_by_world_size), "6 heads on 2 ranks, each rank holds 3 whole heads, but block.n_heads is 2"),
        (_plan(col, col, col, row, after=_freeze_v), "gradients of v.weight are not"),
        (_plan(col, col, col, col), "RowwiseParallel"),
        (_plan(row, row, row, row), "ColwiseParallel"),
        (_plan(col, col, col, None), "out still hold whole weights"),
        (_plan(col, None, col, row), "k still hold"),
        (_plan(col, col, col, row, returns=False), "return the block"),
    ]
    answers, hints = zip(*cases)
    for feedback, hint in zip(nb13.attention_verdicts(answers), hints):  # one launch per case for all the answers
        assert feedback is not None and feedback.status == "wrong" and hint in feedback.message, (hint, feedback)
    feedback = nb13.tensor_parallel_attention(cases[0][0])  # the exercise's own verdict is attention_verdicts'
    assert feedback.status == "wrong" and cases[0][1] in feedback.message, feedback


def test_tensor_parallel_attention_tries_2_3_and_4_ranks():
    # two head counts on 2 ranks (no count per world size passes), 3 heads per rank on 4 ranks (!= ranks, != 4 // 2)
    assert nb13.ATTENTION_CASES == [(2, 8, 4), (2, 12, 6), (3, 12, 6), (4, 24, 12)]


@pytest.mark.repeats_solution_notebook  # the notebook's Exercise 3 answer is this very plan
@pytest.mark.parametrize("path", [SOLUTION], ids=lambda p: p.stem)
def test_tensor_parallel_attention_accepts_a_correct_plan_on_2_3_and_4_ranks(path):
    col, row = _styles()
    feedback = nb13.tensor_parallel_attention(_plan(col, col, col, row))
    assert feedback.status == "correct", feedback


# ------------------------------------------------------------------ Exercise 1: communication on another group


def _backward_all_reduces_on_a_new_group(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    grad_y = grad_y.clone()
    dist.all_reduce(grad_y, group=dist.new_group())  # the tracer records the default group only
    grad_y /= dist.get_world_size()  # right values, wasted communication
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0)


def _backward_all_reduces_on_a_gloo_group(ctx, grad_y):
    x_local, w_local = ctx.saved_tensors
    grad_y = grad_y.clone()
    dist.all_reduce(grad_y, group=dist.new_group(backend="gloo"))
    grad_y /= dist.get_world_size()
    return grad_y @ w_local, grad_y.T @ x_local, grad_y.sum(0)


@pytest.mark.parametrize("backward", [_backward_all_reduces_on_a_new_group, _backward_all_reduces_on_a_gloo_group])
def test_row_parallel_rejects_communication_on_another_group(backward):
    feedback = nb13.row_parallel(_forward, backward)
    assert feedback.status == "wrong" and "created another process group" in feedback.message, feedback


def test_row_parallel_measures_backward_on_the_wire(monkeypatch, forked_ranks):
    """Even if the new group went unseen, course.observe.wire sees its bytes; a right backward sends none."""
    if not nb13.wire.available():
        pytest.skip("course.observe.wire cannot read the sockets here")
    monkeypatch.setattr(nb13.tracing, "process_groups", lambda: 1)
    feedback = nb13.row_parallel(_forward, _backward_all_reduces_on_a_new_group)
    assert feedback.status == "wrong" and "the tracer did not see" in feedback.message, feedback
    assert nb13.row_parallel(_forward, _backward).status == "correct"
