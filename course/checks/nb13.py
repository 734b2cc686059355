"""Checks for notebook 13 (tensor parallelism)."""

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

from course.parallel import tensor_parallel as tp
from course.observe import tracing, wire
from course.classroom.exercises import correct, exercise, wrong
from course.runtime.launcher import launch

IN, OUT, BATCH = 8, 6, 4
# Bytes a backward without communication may still put on the wire (measured with course.observe.wire: 0 B on
# 2 and 3 ranks, 5 backwards each, right after an all-reduce).
WIRE_SLACK = 256


def _row_parallel_run(rank, world_size, forward, backward):
    class RowParallelLinearFn(torch.autograd.Function):
        pass

    RowParallelLinearFn.forward = staticmethod(forward)
    RowParallelLinearFn.backward = staticmethod(backward)

    torch.manual_seed(0)
    full = nn.Linear(IN, OUT, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)  # the same x and upstream gradient on every rank (one layer)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    upstream = torch.randn(BATCH, OUT, generator=g, dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    (full(x_full) * upstream).sum().backward()

    x_local = x.chunk(world_size, 1)[rank].clone().requires_grad_()
    w_local = full.weight.detach().chunk(world_size, 1)[rank].clone().requires_grad_()
    bias = full.bias.detach().clone().requires_grad_()
    groups = tracing.process_groups()  # the default group: the tracer sees nothing on any other
    tracing.clear()
    y = RowParallelLinearFn.apply(x_local, w_local, bias)
    if not isinstance(y, torch.Tensor) or y.shape != (BATCH, OUT):
        return {"bad_output": repr(type(y)) if not isinstance(y, torch.Tensor) else str(tuple(y.shape))}
    forward_ops = [(e.op, e.bytes) for e in tracing.collectives()]
    tracing.clear()
    with wire.measure() if wire.available() else contextlib.nullcontext() as on_wire:
        (y * upstream).sum().backward()
    tracing.wait_all()
    backward_ops = [(e.op, e.bytes) for e in tracing.collectives()]
    if not backward_ops and on_wire is not None and on_wire.sent > WIRE_SLACK:  # bytes the tracer did not see
        backward_ops.append(("communication the tracer did not see", on_wire.sent))
    grads = [x_local.grad, w_local.grad, bias.grad]
    refs = [x_full.grad.chunk(world_size, 1)[rank], full.weight.grad.chunk(world_size, 1)[rank], full.bias.grad]
    return {
        "y": y.detach(),
        "y_ref": full(x).detach(),
        "partial": (x_local @ w_local.T).detach(),
        "bias": full.bias.detach(),
        "grads": [None if g is None else g.detach() for g in grads],
        "refs": refs,
        "forward_ops": forward_ops,
        "backward_ops": backward_ops,
        "new_groups": tracing.process_groups() - groups,
    }


def _close(a, b):
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-9)


@exercise(
    "Exercise 1 (row_parallel)",
    hint="forward: this rank's partial product, summed over the ranks, plus the bias once; "
    "backward: every rank already holds the whole ∂L/∂y, so each gradient is one local matrix product.",
)
def row_parallel(forward, backward):
    """Exercise 1: a row-parallel linear layer as one autograd Function (forward and backward)."""
    for world_size in ROW_PARALLEL_RANKS:
        feedback = _judge_row_parallel(launch(_row_parallel_run, world_size, forward, backward, backend="traced",
                                              show=None, timeout=60), world_size)
        if feedback is not None:
            return feedback
    return correct(f"{' and '.join(map(str, ROW_PARALLEL_RANKS))} ranks: the output and all three gradients equal "
                   "the unsplit layer's, with one all-reduce of the output in forward and no communication in backward.")


ROW_PARALLEL_RANKS = (2, 3)  # 3 ranks: a partner hard-coded as 1 - rank, or halves, fail there


def _judge_row_parallel(results, world_size):
    """The feedback for one world size, or None if every rank got it right."""
    r = results[0]
    if "bad_output" in r:
        return wrong(f"forward must return the layer's output, a ({BATCH}, {OUT}) tensor; it returned {r['bad_output']}.")
    n = world_size
    if not _close(r["y"], r["y_ref"]):
        if all(_close(q["y"], q["partial"]) or _close(q["y"], q["partial"] + q["bias"]) for q in results):
            return wrong("each rank returned only its own partial product: sum the ranks' partial outputs with dist.all_reduce.")
        if _close(r["y"], r["y_ref"] + (n - 1) * r["bias"]):
            return wrong(f"the bias was added on every rank before the all-reduce, so it is counted {n} times: add it once, after the sum.")
        if _close(r["y"], r["y_ref"] - r["bias"]):
            return wrong("the output is missing the bias: add it (once, after the all-reduce).")
        return wrong("the output differs from the unsplit layer's x @ W.T + b.")
    if not all(_close(q["y"], r["y"]) for q in results):
        return wrong("the ranks returned different outputs: after the all-reduce every rank must hold the whole output.")
    names = ["x_local", "w_local", "bias"]
    for q in results:
        for name, grad, ref in zip(names, q["grads"], q["refs"]):
            if grad is None:
                return wrong(f"backward returned None for {name}: return one gradient per input of forward (x_local, w_local, bias).")
            if _close(grad, n * ref):
                return wrong(
                    f"the gradient of {name} is {n}× too large: backward must not all-reduce — "
                    "∂L/∂y is already the same whole tensor on every rank."
                )
            if not _close(grad, ref):
                return wrong(f"the gradient of {name} is wrong; with y = x_local @ w_local.T + b: "
                             "∂L/∂x_local = g @ w_local, ∂L/∂w_local = g.T @ x_local, ∂L/∂b = g summed over the batch.")
    output_bytes = BATCH * OUT * 8  # float64
    if any(q["new_groups"] for q in results):
        return wrong("the values are right, but your Function created another process group (dist.new_group): "
                     "use the default group. Forward needs one all_reduce of the output; backward needs none.")
    for q in results:
        forward_ops, backward_ops = q["forward_ops"], q["backward_ops"]
        if backward_ops:
            ops = ", ".join(op for op, _ in backward_ops)
            return wrong(f"the values are right, but backward communicates ({ops}): ∂L/∂y is already the same whole "
                         "tensor on every rank, so every gradient is local; an all-reduce there only costs time.")
        if forward_ops != [("all_reduce", output_bytes)]:
            ops = ", ".join(f"{op} of {nbytes} B" for op, nbytes in forward_ops) or "nothing"
            return wrong(f"the values are right on {world_size} ranks, but forward communicates {ops}: a row-parallel layer "
                         f"needs exactly one all_reduce, of its output's partial sums ({output_bytes} B here), not the "
                         "input or the weight, and not point-to-point messages to a fixed partner.")
    return None


# ------------------------------------------------------------------ Exercise 2: predict the all-reduces


def _tp_step(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*(tp.ParallelMLP(tp.MLP(8, 32)) for _ in range(2)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)  # data: does not require grad
    tracing.clear()
    tracing.mark("forward")
    loss = nn.functional.mse_loss(model(x), y)
    tracing.mark("backward")
    loss.backward()
    tracing.wait_all()
    return tracing.events()


def traced_tp_step():
    """One training step of two Megatron MLP blocks (8 -> 32 -> 8) on 2 ranks, batch 4,
    traced: {"forward": [bytes of each all_reduce], "backward": [...]} from rank 0's trace."""
    events = launch(_tp_step, 2, backend="traced", show=None, timeout=60)[0]
    phases, phase = {"forward": [], "backward": []}, None
    for e in events:
        if isinstance(e, tracing.Mark):
            phase = e.label
        elif e.op == "all_reduce":
            phases[phase].append(e.bytes)
    return phases


@exercise(
    "Exercise 2 (tp_all_reduces)",
    hint="f (all-reduce in backward) sits at each block's entrance, g (all-reduce in forward) at its exit; "
    "ask which tensors autograd needs a gradient for, and what shape g sums.",
)
def tp_all_reduces(forward_all_reduces, backward_all_reduces, bytes_per_all_reduce):
    """Exercise 2: predict, then compare with a traced run."""
    answers = (forward_all_reduces, backward_all_reduces, bytes_per_all_reduce)
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in answers):
        return wrong("give three whole numbers.")
    traced = traced_tp_step()
    forward, backward = len(traced["forward"]), len(traced["backward"])
    size = traced["forward"][0]
    if forward_all_reduces != forward:
        if forward_all_reduces == 2 * forward:
            return wrong("a column-parallel layer needs no communication in forward: each rank has the whole input. Only g, after the row-parallel layer, all-reduces.")
        return wrong("count the g's: one at the exit of each block.")
    if backward_all_reduces != backward:
        if backward_all_reduces == forward:
            return wrong("the first block's f gets the data as input, and the data does not require grad: autograd never runs a backward it does not need.")
        if backward_all_reduces == 0:
            return wrong("f all-reduces in backward: a block's input gradient is a sum of the ranks' contributions.")
        return wrong("count the f's whose input needs a gradient.")
    if bytes_per_all_reduce != size:
        if bytes_per_all_reduce == 4 * size:
            return wrong("the hidden activation (32 features) never leaves its rank: g sums the row-parallel layer's output, 8 features per sample.")
        if bytes_per_all_reduce == 2 * size:
            return wrong("that is this rank's slice of the hidden activation (batch × 32/2 features): it stays on the rank and "
                         "feeds the row-parallel layer; g sums that layer's output, 8 features per sample.")
        if bytes_per_all_reduce == size // 2:
            return wrong("each rank hands the all-reduce its whole partial output (all 8 features), not half of it.")
        return wrong("g sums the block's output: batch × features × 4 bytes (float32).")
    return correct(f"traced: {forward} all-reduces in forward and {backward} in backward, {size} B each — activations, not weights.")


# ------------------------------------------------------------------ Exercise 3: DTensor attention


SEQ = 5
# (ranks, features, heads): the notebook's 4 heads on 2 ranks, 6 heads on 2 and on 3 ranks, 12 heads on 4 ranks
# (3 per rank), so that neither heads per rank == ranks (n_heads = mesh.size()), nor a count hard-coded for 2 ranks
# (n_heads //= 2, n_heads = 2), nor one hard-coded per world size ({2: 2, 4: 3}[mesh.size()]) passes.
ATTENTION_CASES = [(2, 8, 4), (2, 12, 6), (3, 12, 6), (4, 24, 12)]
PROJECTIONS = ("q", "k", "v", "out")


def _attention_run(rank, world_size, parallelize, dim, heads):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = tp.SelfAttention(dim, heads).double()
    block = parallelize(copy.deepcopy(full), mesh)
    if not isinstance(block, nn.Module):
        return {"not_module": repr(type(block))}
    placements = {}
    for name in PROJECTIONS:
        w = getattr(getattr(block, name, None), "weight", None)
        placements[name] = repr(w.placements[0]) if isinstance(w, DTensor) else "plain"
    decided = [_placements_feedback(placements) is not None]  # rank 0's placements are the ones judged
    dist.broadcast_object_list(decided, src=0)
    if decided[0]:  # the verdict is the plan's: no forward and backward needed (every rank stops)
        return {"placements": placements, "n_heads": getattr(block, "n_heads", None)}
    x = torch.randn(2, SEQ, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    upstream = torch.randn(2, SEQ, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_full, x_part = x.clone().requires_grad_(), x.clone().requires_grad_()
    (full(x_full) * upstream).sum().backward()
    result = {"placements": placements, "n_heads": getattr(block, "n_heads", None)}
    try:
        y = block(x_part)
        if isinstance(y, DTensor):
            y = y.full_tensor()
    except Exception as e:  # a wrong plan often fails inside the block: report it as a hint
        return {**result, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    ok_output = isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, full(x), rtol=1e-9, atol=1e-9)
    # A wrong output with a head count other than heads / N is judged by the count alone: skip the backward
    # (decided alike on every rank: an output wrong on any rank, rank 0's count).
    every_output_ok = torch.tensor([float(ok_output)])
    dist.all_reduce(every_output_ok, op=dist.ReduceOp.MIN)
    rank0_heads = [result["n_heads"]]
    dist.broadcast_object_list(rank0_heads, src=0)
    if not every_output_ok.item() and rank0_heads[0] != heads // world_size:
        return {**result, "ok_output": ok_output}
    try:
        (y * upstream).sum().backward()
    except Exception as e:  # report it as a hint, as above
        return {**result, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    bad_weight_grads = []
    for name in PROJECTIONS:  # column-parallel q, k, v and row-parallel out: compare the whole gradient
        grad = getattr(block, name).weight.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        expected = getattr(full, name).weight.grad
        if not (grad is not None and grad.shape == expected.shape and torch.allclose(grad, expected, rtol=1e-9, atol=1e-9)):
            bad_weight_grads.append(f"{name}.weight")
    return {
        **result,
        "ok_output": ok_output,
        "ok_grad": x_part.grad is not None and torch.allclose(x_part.grad, x_full.grad, rtol=1e-9, atol=1e-9),
        "bad_weight_grads": bad_weight_grads,
    }


def _placements_feedback(p):
    """The feedback on where the plan put the weights (rank 0's), or None if every projection is split right."""
    if any(p[name] == "plain" for name in p):
        plain = [name for name in p if p[name] == "plain"]
        return wrong(f"{', '.join(plain)} still hold whole weights: every projection needs a style in the plan.")
    if any(p[name] != "Shard(dim=0)" for name in ("q", "k", "v")):
        return wrong("q, k and v must split their *output* features (whole heads per rank): ColwiseParallel.")
    if p["out"] != "Shard(dim=1)":
        return wrong("out must combine the heads, which are split across ranks along its *input* features: RowwiseParallel.")
    return None


def _judge_attention(results, world_size, heads):
    """The feedback for one (ranks, features, heads) case, or None if every rank got it right."""
    r = results[0]
    case = f"{heads} heads on {world_size} ranks"
    if "not_module" in r:
        return wrong(f"return the block (parallelize_module returns it); got {r['not_module']}.")
    feedback = _placements_feedback(r["placements"])
    if feedback is not None:
        return feedback
    failed = "error" in r or not all(q["ok_output"] for q in results)
    per_rank = heads // world_size
    if failed and r["n_heads"] == heads:
        return wrong(f"each rank now computes {per_rank} of the {heads} heads, but the block still "
                     f"splits its features into {heads} heads (of 1/{world_size} the size): set block.n_heads.")
    if failed and r["n_heads"] != per_rank:
        return wrong(f"with {case}, each rank holds {per_rank} whole heads, but block.n_heads is {r['n_heads']}: "
                     "compute it from the block's heads and the mesh (the check also runs other head counts and "
                     "numbers of ranks).")
    if "error" in r:
        return wrong(f"with {case}, the block failed: {r['error']}")
    if not all(q["ok_output"] for q in results):
        bad = [rank for rank, q in enumerate(results) if not q["ok_output"]]
        return wrong(f"with {case}, the output on rank(s) {bad} differs from the unsplit block's.")
    if not all(q["ok_grad"] for q in results):
        return wrong(f"with {case}, the output is right but the input gradient is not.")
    bad = sorted({name for q in results for name in q["bad_weight_grads"]})
    if bad:
        return wrong(f"with {case}, the output and the input gradient are right, but the gradients of "
                     f"{', '.join(bad)} are not.")
    return None


def _attention_runs(rank, world_size, plans, dim, heads):
    """_attention_run for each plan, one after the other on the same ranks."""
    return [_attention_run(rank, world_size, plan, dim, heads) for plan in plans]


def attention_verdicts(plans):
    """For each plan, the feedback of the first case of ATTENTION_CASES it gets wrong, or None if it gets every
    case right. One launch per case runs every plan not judged yet (the tests judge many wrong plans at once)."""
    verdicts = [None] * len(plans)
    undecided = list(range(len(plans)))
    for world_size, dim, heads in ATTENTION_CASES:
        if not undecided:
            break
        results = launch(_attention_runs, world_size, [plans[i] for i in undecided], dim, heads, show=None,
                         timeout=60)
        for j, i in enumerate(undecided):
            verdicts[i] = _judge_attention([per_rank[j] for per_rank in results], world_size, heads)
        undecided = [i for i in undecided if verdicts[i] is None]
    return verdicts


@exercise(
    "Exercise 3 (tensor_parallel_attention)",
    hint="give each rank whole heads: q, k and v split their output features, out splits its input features; "
    "then the block must know how many heads it holds now.",
)
def tensor_parallel_attention(parallelize):
    """Exercise 3: split an attention block's heads with parallelize_module."""
    feedback, = attention_verdicts([parallelize])
    if feedback is not None:
        return feedback
    cases = ", ".join(f"{heads} heads on {n} ranks" for n, _, heads in ATTENTION_CASES)
    return correct(f"{cases}: on every rank the output, the input gradient and the gradients of "
                   "q, k, v and out's weights equal the unsplit block's.")
