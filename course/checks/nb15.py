"""Checks for notebook 15 (expert parallelism)."""

import copy
import numbers

import torch
import torch.distributed as dist

from course import expert_parallel as ep
from course import tracing, wire
from course.exercises import correct, exercise, wrong
from course.launcher import WorkerError, launch

DIM, HIDDEN = 8, 16
ALL_TO_ALL = {"all_to_all", "all_to_all_single"}


# ------------------------------------------------------------------ Exercise 1: dispatch and combine

# (ranks, experts, k, capacity factor, router skew, tokens per rank): several world sizes, so that a
# solution written for 2 ranks fails; uneven counts everywhere; dropped tokens; and ranks that receive
# no token at all (the skewed router sends every token to expert 0).
LAYER_CASES = [
    (2, 4, 2, None, 0.0, (12, 12)),
    (3, 6, 2, 1.0, 0.0, (5, 12, 0)),  # rank 2 has no tokens of its own
    (4, 4, 1, None, 6.0, (6, 6, 6, 6)),
]


def _case_name(world_size, n_experts, k, capacity_factor, skew, tokens):
    name = f"{world_size} ranks, {n_experts} experts, top-{k}, tokens per rank {list(tokens)}"
    if capacity_factor is not None:
        name += f", capacity factor {capacity_factor}"
    return name + (", every token routed to expert 0" if skew else "")


def make_moe(n_experts, k, capacity_factor, skew=0.0):
    """The float64 MoE the checks compare with; ``skew`` raises expert 0's router row."""
    torch.manual_seed(0)
    moe = ep.MoE(DIM, HIDDEN, n_experts, k, capacity_factor).double()
    with torch.no_grad():
        moe.router.weight[0] += skew
    return moe


def make_tokens(rank, count, positive=False):
    """Rank ``rank``'s tokens and the upstream gradient of its output (positive tokens with a skewed
    router all choose expert 0 first)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(count, DIM, generator=g, dtype=torch.float64)
    return (x.abs() if positive else x), torch.randn(count, DIM, generator=g, dtype=torch.float64)


def _layer_run(rank, world_size, dispatch, combine, n_experts, k, capacity_factor, skew, tokens):
    full = make_moe(n_experts, k, capacity_factor, skew)
    reference = copy.deepcopy(full)
    loss = 0
    inputs = []
    for r in range(world_size):  # the single-process layer on every rank's tokens
        x, upstream = make_tokens(r, tokens[r], positive=skew > 0)
        x.requires_grad_()
        y, aux = reference(x)
        loss = loss + (y * upstream).sum() + aux
        inputs.append((x, y.detach()))
    loss.backward()

    ep.dispatch, ep.combine = dispatch, combine  # the layer calls the answer's functions (in this rank only)
    layer = ep.ExpertParallelMoE(full)
    x, upstream = make_tokens(rank, tokens[rank], positive=skew > 0)
    x.requires_grad_()
    tracing.clear()
    y, aux = layer(x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"bad_shape": True}
    ((y * upstream).sum() + aux).backward()
    tracing.wait_all()
    per_rank = n_experts // world_size
    expert_grads_ok = all(
        torch.allclose(p.grad if p.grad is not None else torch.zeros_like(p),
                       q.grad if q.grad is not None else torch.zeros_like(q), rtol=1e-9, atol=1e-9)
        for local, expert in enumerate(layer.experts)
        for p, q in zip(expert.parameters(), reference.experts[rank * per_rank + local].parameters())
    )
    return {
        "ops": sorted({c.op for c in tracing.collectives()}),
        "output_ok": torch.allclose(y, inputs[rank][1], rtol=1e-9, atol=1e-9),
        "input_grad_ok": x.grad is not None and torch.allclose(x.grad, inputs[rank][0].grad, rtol=1e-9, atol=1e-9),
        "expert_grads_ok": expert_grads_ok,
    }


def _judge_layer(results, case):
    if any("bad_shape" in r for r in results):
        return wrong(f"with {case}, the layer's output does not have its input's shape: combine must return one row "
                     "per row of x_sorted, in x_sorted's order.")
    ops = sorted({op for r in results for op in r["ops"]})
    if set(ops) - ALL_TO_ALL:
        return wrong(f"the answer ran {', '.join(op for op in ops if op not in ALL_TO_ALL)}: every token went to every rank. "
                     "Send each rank only the tokens of its experts, with all_to_all_single and the split sizes.")
    if not ops:
        return wrong("the answer ran no collective: the tokens must travel to the ranks of their experts.")
    if not all(r["output_ok"] for r in results):
        bad = [rank for rank, r in enumerate(results) if not r["output_ok"]]
        return wrong(f"with {case}, the output on rank(s) {bad} differs from the single-process layer's: are the tokens "
                     "received grouped by source rank, then by expert, and do the results come back in x_sorted's order?")
    if not all(r["input_grad_ok"] for r in results):
        return wrong(f"with {case}, the output is right but the input gradient is not: the gradient must travel back "
                     "through both exchanges — use the differentiable AllToAll, not dist.all_to_all_single directly.")
    if not all(r["expert_grads_ok"] for r in results):
        return wrong(f"with {case}, the output is right but the experts' gradients are not.")
    return None


@exercise(
    "Exercise 1 (dispatch and combine)",
    hint="dispatch: first an all-to-all of the counts (each rank sends each rank the counts of that rank's experts), "
    "then rows per rank = counts summed per rank, and AllToAll.apply(x_sorted, rows to receive, rows to send, group); "
    "combine: the same exchange backwards, split sizes swapped.",
)
def dispatch_combine(dispatch, combine):
    """Exercise 1: the expert-parallel layer with the answer's dispatch and combine equals the
    single-process layer (output, input and expert gradients) on 2, 3 and 4 ranks."""
    for case in LAYER_CASES:
        name = _case_name(*case)
        try:
            results = launch(_layer_run, case[0], dispatch, combine, *case[1:], backend="traced", show=None, timeout=60)
        except WorkerError as e:
            return wrong(f"with {name}, a rank failed: {e.failed.get(e.rank, e)}. Do both sides of every "
                         "exchange agree on how many rows go where, on any number of ranks?")
        feedback = _judge_layer(results, name)
        if feedback is not None:
            return feedback
    cases = "; ".join(_case_name(*case) for case in LAYER_CASES)
    return correct(f"{cases}: outputs, input gradients and expert gradients equal the single-process layer's, "
                   "with all-to-alls only.")


# ------------------------------------------------------------------ Exercise 2: predict the bytes

BYTES_DIM = 128  # 512 B per token: far more than gloo's few headers, so each wrong count shows
HEADER_SLACK = 200  # bytes per peer gloo may add (measured: 144 B per peer per all_to_all_single, torch 2.15)


def random_send_counts(world_size, seed):
    """A (N, N) matrix: row i = how many tokens rank i sends to each rank; at least 2 to itself."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (world_size, world_size), generator=g)
    counts.diagonal().add_(2)
    return counts


def _bytes_run(rank, world_size, send_counts):
    send = send_counts[rank].tolist()
    receive = send_counts[:, rank].tolist()
    x = torch.randn(sum(send), BYTES_DIM)
    out = torch.empty(sum(receive), BYTES_DIM)
    with wire.measure() as m:
        dist.all_to_all_single(out, x, receive, send)
    return m.sent


@exercise(
    "Exercise 2 (bytes sent)",
    hint="row `rank` of send_counts says how many tokens this rank sends to each rank; each token is dim float32 "
    "values; and one of those chunks never leaves the process.",
)
def bytes_sent(predict):
    """Exercise 2: predict the bytes a rank sends in one all-to-all, then compare with the wire."""
    for world_size, seed in ((2, 0), (3, 1), (4, 2)):
        counts = random_send_counts(world_size, seed)
        measured = launch(_bytes_run, world_size, counts, show=None, timeout=60)
        for rank in range(world_size):
            guess = predict(counts.clone(), rank, BYTES_DIM)
            if not isinstance(guess, numbers.Real) or isinstance(guess, bool):
                return wrong(f"return a number of bytes; got {guess!r}.")
            payload = (int(counts[rank].sum()) - int(counts[rank, rank])) * BYTES_DIM * 4
            if measured[rank] - HEADER_SLACK * (world_size - 1) <= guess <= measured[rank]:
                continue
            if guess == payload + int(counts[rank, rank]) * BYTES_DIM * 4:
                return wrong("a rank's own chunk is copied in memory: the wire never sees it (measured).")
            if guess == (int(counts[:, rank].sum()) - int(counts[rank, rank])) * BYTES_DIM * 4:
                return wrong("that is what the rank receives (its column of send_counts); it sends its row.")
            if guess * 4 == payload:
                return wrong("count bytes: a float32 value is 4 bytes.")
            return wrong(f"on {world_size} ranks, with send_counts = {counts.tolist()}, rank {rank} sent "
                         f"{measured[rank]:,} B (gloo adds ~{144 * (world_size - 1)} B of headers); you predicted {guess:,}.")
    return correct("2, 3 and 4 ranks, 9 ranks' worth of uneven counts: every prediction is what the wire measured, "
                   "less gloo's headers.")


# ------------------------------------------------------------------ Exercise 3: the EP x DP gradient sync

SYNC_MESHES = [(4, 2), (2, 2), (4, 1)]  # (ranks, dp): 2x2, then pure DP, then pure EP
STEPS, LR = 1, 0.1  # one step: a wrong expert update does not yet change the router's gradient


def _mean_loss(layer_output, target):
    y, aux = layer_output
    return ((y - target) ** 2).mean() + 0.01 * aux


def train_ep_dp(rank, world_size, dp, sync):
    """One SGD step of the expert-parallel layer on a (dp, ep) mesh, gradients synced by ``sync(layer, dp_group)``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, world_size // dp), mesh_dim_names=("dp", "ep"))
    layer = ep.ExpertParallelMoE(make_moe(4, 2, 1.0), mesh.get_group("ep"))
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, target = make_tokens(10 * step + rank, 8)
        _mean_loss(layer(x), target).backward()
        sync(layer, mesh.get_group("dp"))
        optimizer.step()
    per_rank = 4 // mesh.size(1)
    first = mesh.get_local_rank("ep") * per_rank
    return {"router": layer.router.weight.detach(),
            "experts": {first + i: [p.detach() for p in e.parameters()] for i, e in enumerate(layer.experts)}}


def train_one_process(world_size):
    """The same steps in one process: the mean of the ranks' losses."""
    moe = make_moe(4, 2, 1.0)
    optimizer = torch.optim.SGD(moe.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [_mean_loss(moe(x), target) for x, target in (make_tokens(10 * step + r, 8) for r in range(world_size))]
        (sum(losses) / world_size).backward()
        optimizer.step()
    return moe


def compare_training(results, moe):
    """(router equal on every rank, experts equal on every rank) against one process."""
    router = all(torch.allclose(r["router"], moe.router.weight, rtol=1e-9, atol=1e-12) for r in results)
    experts = all(torch.allclose(p, q, rtol=1e-9, atol=1e-12)
                  for r in results for e, params in r["experts"].items() for p, q in zip(params, moe.experts[e].parameters()))
    return router, experts


@exercise(
    "Exercise 3 (EP x DP gradient sync)",
    hint="after backward, an expert's gradient already holds every token of its expert-parallel group; "
    "the router's holds only this rank's. Each rank's loss counts 1/(all ranks) in the mean.",
)
def ep_dp_sync(sync):
    """Exercise 3: fix the gradient sync; trained on 2x2, 1x2 and 1x4 meshes (dp x ep) it must match one process."""
    for world_size, dp in SYNC_MESHES:
        results = launch(train_ep_dp, world_size, dp, sync, show=None, timeout=60)
        router, experts = compare_training(results, train_one_process(world_size))
        mesh = f"{dp} x {world_size // dp} mesh (dp x ep)"
        if not router and not experts:
            return wrong(f"on a {mesh}, neither the router nor the experts train like one process.")
        if not router:
            return wrong(f"on a {mesh}, the experts are right but the router is not: it is replicated on every rank, "
                         "and each rank's router gradient holds only its own tokens.")
        if not experts:
            return wrong(f"on a {mesh}, the router is right but the experts are not: which ranks hold the same experts, "
                         "and by what must their sum be divided?")
    return correct("on 2x2, 2x1 and 1x4 meshes (dp x ep), one SGD step: the router and every expert equal one process's.")
