"""Checks for notebook 14 (context parallelism: ring attention)."""

import contextlib
import random
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from course.parallel import context_parallel as cp
from course.classroom.exercises import correct, exercise, replaced, wrong
from course.runtime.launcher import WorkerError, WorkerTimeoutError, launch

DIM = 8
TIMEOUT = 30  # seconds; a ring whose sends and receives do not match hangs until then

# ------------------------------------------------------------------ Exercise 1: merge two partial results


def _partials(seed, scale, causal, first_query=4, lead=(2,)):
    """Full attention of 5 queries (positions first_query, ...) over 9 keys, and the partial results
    over keys 0-3 and 4-8. With a causal mask and first_query 0, queries 0-3 see none of keys 4-8
    (their partial result there: out 0, lse -inf)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*lead, n, DIM, generator=g) for n in (5, 9, 9))
    q = q * scale
    q_pos, k_pos = torch.arange(first_query, first_query + 5), torch.arange(9)
    whole = cp.attend(q, k, v, q_pos, k_pos, causal)
    first = cp.attend(q, k[..., :4, :], v[..., :4, :], q_pos, k_pos[:4], causal)
    second = cp.attend(q, k[..., 4:, :], v[..., 4:, :], q_pos, k_pos[4:], causal)
    return whole, first, second


def _as_pair(result):
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        return None
    return result


@exercise(
    "Exercise 1 (merge)",
    hint="the merged log-sum-exp is log(e^lse1 + e^lse2); each output is weighted by e^(lse_i - lse). "
    "Subtract the larger lse before any exp, so that nothing overflows.",
    finished=("course.parallel.context_parallel.merge",),
)
def merge(fn):
    """Exercise 1: merge two partial attention results (out, lse) into the result over both key sets."""
    seed = random.randrange(1 << 30)  # fresh inputs each time: no answer can be hard-coded
    cases = [  # (name, scale, causal, first query's position, leading dims)
        ("small scores", 1.0, False, 4, (2,)),
        ("a causal mask", 1.0, True, 4, (2,)),
        ("queries that see none of one chunk (lse -inf)", 1.0, True, 0, (2,)),
        ("large scores", 60.0, False, 4, (2,)),
        ("4-D (batch, heads, tokens, dim) tensors", 1.0, True, 0, (2, 3)),
    ]
    for name, scale, causal, first_query, lead in cases:
        (out, lse), (out1, lse1), (out2, lse2) = _partials(seed, scale, causal, first_query, lead)
        for args, order in (((out1, lse1, out2, lse2), ""), ((out2, lse2, out1, lse1), " (partials given in the other order)")):
            try:
                result = _as_pair(fn(*(t.clone() for t in args)))
            except Exception as e:  # noqa: BLE001 - reported as the feedback
                return wrong(f"with {name}{order} your merge raised {type(e).__name__}: {e}")
            if result is None:
                return wrong("return a pair (out, lse) of tensors: the merged output and the merged log-sum-exp.")
            got_out, got_lse = result
            if got_out.shape != out.shape or got_lse.shape != lse.shape:
                return wrong(f"out should have shape {tuple(out.shape)} and lse {tuple(lse.shape)}; got "
                             f"{tuple(got_out.shape)} and {tuple(got_lse.shape)}.")
            if not (torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()):
                if name == "large scores":
                    return wrong("with large scores (lse ≈ hundreds) an exp overflowed to inf: e^89 is already "
                                 "beyond float32. Subtract the larger of the two lse before exponentiating.")
                return wrong(f"with {name}{order} the result has inf or nan. Some queries see none of one "
                             "chunk's keys (lse -inf, out 0): such a chunk must get weight 0.")
            if not torch.allclose(got_lse, lse, rtol=1e-5, atol=1e-5):
                if torch.allclose(got_lse, torch.maximum(lse1, lse2), rtol=1e-5, atol=1e-5):
                    return wrong("the merged lse is not the larger of the two: it is log(e^lse1 + e^lse2).")
                return wrong(f"with {name}{order} the merged lse differs from the log-sum-exp over all keys.")
            if not torch.allclose(got_out, out, rtol=1e-5, atol=1e-5):
                if torch.allclose(got_out, (out1 + out2) / 2, rtol=1e-5, atol=1e-5):
                    return wrong("the plain average weighs both chunks equally; weigh each by its share of the "
                                 "softmax's denominator, e^(lse_i - lse).")
                return wrong(f"with {name}{order} the merged output differs from attention over all keys.")
    return correct("small and large scores, a causal mask, queries that see none of a chunk, 3-D and 4-D "
                   "tensors, both orders: the merge equals attention over all keys.")


# ------------------------------------------------------------------ Exercise 2: ring attention's forward

# (ranks, tokens, causal, layout): uneven chunks (10 and 13 tokens), 2, 3 and 4 ranks, both layouts
RING_CASES = [
    (2, 10, False, "contiguous"),
    (3, 13, True, "contiguous"),
    (4, 10, True, "contiguous"),
    (4, 16, True, "zigzag"),
    (4, 13, False, "contiguous"),
]
LAYOUTS = {"contiguous": cp.contiguous_layout, "zigzag": cp.zigzag_layout}
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_reduce",
               "all_to_all", "all_to_all_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor")
BLOCKING = ("send", "recv")  # batch_isend_irecv is not blocking: it calls isend/irecv, which the check logs


class _Watch(TorchDispatchMode):
    """Logs the ops a rank runs: matrix products (the attention's work), how many chunks of K/V the
    receive buffers alive during a product held at most, and the largest number of tokens any
    (..., tokens, DIM) tensor held."""

    def __init__(self, log, held):
        super().__init__()
        self.log, self.most_tokens, self.held, self.most_held = log, 0, held, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "mm" in name or "scaled_dot_product" in name:
            self.log.append(("compute",))
            self.most_held = max(self.most_held, self.held())
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == DIM:
                self.most_tokens = max(self.most_tokens, t.shape[-2])
        return out


class _Request:
    """An isend/irecv request that logs its wait. A second wait is logged, not passed on: on gloo
    (torch 2.8 and 2.15) a second ``wait()`` of a finished isend or irecv never returns."""

    def __init__(self, request, log, key):
        self.request, self.log, self.key, self.waited = request, log, key, False

    def wait(self, *args, **kwargs):
        if self.waited:
            self.log.append(("waited twice", self.key))
            return True
        self.waited = True
        self.log.append(("wait", self.key))
        return self.request.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.request, name)


def _ring_run(rank, world_size, forward, seed, seq_len, causal, layout_name):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, seq_len, DIM, generator=g) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected_lse = (q @ k.transpose(-2, -1) * DIM**-0.5).masked_fill(
        causal & torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    layout = LAYOUTS[layout_name](seq_len, world_size)
    mine = layout[rank]

    log, peers, used = [], set(), []
    receiving = []  # a weak reference to every irecv's buffer
    kv_bytes = 2 * q[..., :1, :].nbytes * max(len(p) for p in layout)  # one rank's K and V at most

    def watched(name, original):
        def call(tensor, *args, **kwargs):  # also as batch_isend_irecv calls it: peer as group_dst/group_src
            peer = args[0] if args else next((kwargs[key] for key in ("dst", "src", "group_dst", "group_src")
                                              if kwargs.get(key) is not None), None)
            peers.add((name, peer))
            key = len(log)
            if name == "irecv":  # the earlier receive buffers still alive now, besides this one
                receiving.append(weakref.ref(tensor))
            log.append((name, key))
            return _Request(original(tensor, *args, **kwargs), log, key)
        return call

    def collective(name, original):
        def call(*args, **kwargs):
            used.append(name)
            return original(*args, **kwargs)
        return call

    patches = [("isend", watched("isend", dist.isend)), ("irecv", watched("irecv", dist.irecv))]
    patches += [(name, collective(name, getattr(dist, name))) for name in COLLECTIVES + BLOCKING if hasattr(dist, name)]
    def held():  # chunks' worth of K/V in the receive buffers still alive
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for r in receiving if (t := r()) is not None}
        return sum(alive.values()) / kv_bytes

    watch = _Watch(log, held)
    local = [t[..., mine, :].clone() for t in (q, k, v)]
    with contextlib.ExitStack() as stack:  # an exception stops every rank (a WorkerError), none waits for it
        for name, replacement in patches:  # torch.distributed's names, the answer's, and distributed_c10d's
            stack.enter_context(replaced(dist, name, replacement, forward))
            if getattr(c10d, name, None) is not replacement and hasattr(c10d, name):
                stack.enter_context(replaced(c10d, name, replacement))
        with watch:
            result = forward(*local, layout, causal)
    result = _as_pair(result)
    report = {"used": used, "peers": sorted(peers), "most_tokens": watch.most_tokens, "log": log, "most_held": watch.most_held,
              "largest_chunk": max(len(p) for p in layout)}
    if result is None:
        return {**report, "bad_result": True}
    out, lse = result
    report["ok_out"] = out.shape == expected[..., mine, :].shape and torch.allclose(out, expected[..., mine, :], atol=1e-5)
    report["ok_lse"] = lse.shape == expected_lse[..., mine].shape and torch.allclose(lse, expected_lse[..., mine], atol=1e-5)
    report["uncausal"] = causal and out.shape == expected[..., mine, :].shape and torch.allclose(
        out, F.scaled_dot_product_attention(q, k, v)[..., mine, :], atol=1e-5)
    return report


def _overlapped(log):
    """Every receive was in flight while a matrix product ran: between posting each irecv and
    waiting for it, the rank computed (attention on the chunk it holds). Only meaningful without
    a causal mask: with one, a chunk that no query of this rank sees costs no product at all."""
    posted, computed = set(), set()
    for event in log:
        if event[0] == "irecv":
            posted.add(event[1])
        elif event[0] == "compute":
            computed |= posted
        elif event[0] == "wait" and event[1] in posted and event[1] not in computed:
            return False
    return True


def _judge_ring(results, world_size, seq_len, causal, layout_name):
    case = f"{world_size} ranks, {seq_len} tokens, causal={causal}, {layout_name} layout"
    for rank, r in enumerate(results):
        if any(name in BLOCKING for name in r.get("used", [])):
            return wrong(f"rank {rank} called dist.{r['used'][0]}: use start_pass (dist.isend / dist.irecv), which "
                         "returns at once, so that the next chunk travels while attend computes on this one.")
        if r.get("used"):
            return wrong(f"rank {rank} called dist.{r['used'][0]}: with a collective every rank ends up holding "
                         "all of K and V (section 6's all-gather variant). Pass one chunk at a time to the next "
                         "rank with dist.isend / dist.irecv.")
        if r.get("bad_result"):
            return wrong("return a pair (out, lse): this rank's attention output and its log-sum-exp.")
    for rank, r in enumerate(results):
        if any(event[0] == "waited twice" for event in r["log"]):
            return wrong(f"with {case}, rank {rank} waited twice for the same request: wait for each one once "
                         "(on gloo a second wait() of a finished isend or irecv never returns; the check skipped it).")
    for rank, r in enumerate(results):
        neighbours = {("isend", (rank + 1) % world_size), ("irecv", (rank - 1) % world_size),
                      ("isend", (rank - 1) % world_size), ("irecv", (rank + 1) % world_size)}
        strangers = [peer for kind, peer in r["peers"] if (kind, peer) not in neighbours]
        if strangers:
            return wrong(f"with {case}, rank {rank} talked to rank {strangers[0]}, which is not its neighbour: "
                         "in a ring each rank receives from one neighbour and sends to the other.")
        held = r["most_held"]
        if held > 2:
            return wrong(f"with {case}, rank {rank}'s receive buffers still alive held {held:.1f} chunks' K and V "
                         "at once: a ring rank keeps the chunk it computes on and the one arriving, no more. "
                         "Attend to each chunk while the next one travels, then let it go.")
        if r["most_tokens"] > r["largest_chunk"]:
            return wrong(f"with {case}, rank {rank} built a tensor of {r['most_tokens']} tokens, more than a "
                         f"chunk ({r['largest_chunk']}): a ring rank holds one K/V chunk at a time (and the next "
                         "one arriving), never the whole sequence.")
    for rank, r in enumerate(results):
        if world_size > 1 and not any(event[0] == "irecv" for event in r["log"]):
            return wrong(f"with {case}, rank {rank} received nothing with dist.irecv (no isend/irecv seen): pass "
                         "the K/V chunks to the next rank with dist.isend / dist.irecv (start_pass).")
    if not all(r["ok_out"] for r in results):
        if causal and all(r["uncausal"] for r in results):
            return wrong(f"with {case} the output is attention *without* the causal mask: pass causal on to attend.")
        bad = [rank for rank, r in enumerate(results) if not r["ok_out"]]
        return wrong(f"with {case} the output on rank(s) {bad} differs from full attention. At step s rank r "
                     "holds the chunk of rank (r - s) % N, whose positions are layout[(r - s) % N]; each "
                     "chunk must be seen exactly once.")
    if not all(r["ok_lse"] for r in results):
        return wrong(f"with {case} the output is right but lse is not: return the merged log-sum-exp.")
    if not causal and not all(_overlapped(r["log"]) for r in results):
        return wrong("the result is right, but a chunk arrived while nothing was computed: between posting each "
                     "irecv and waiting for it the check saw no matrix product. Post the isend/irecv of the next "
                     "chunk *before* calling attend on the current one, and wait after.")
    return None


@exercise(
    "Exercise 2 (ring_forward)",
    hint="at each of the N steps: start passing the K/V chunk you hold to rank r+1 (start_pass), attend "
    "to it (its positions: layout[(rank - step) % N]), merge, then wait and take the chunk that arrived. "
    "No pass after the last step.",
    finished=("course.parallel.context_parallel.ring_forward",),
)
def ring_forward(forward):
    """Exercise 2: ring attention's forward, checked against full attention on 2, 3 and 4 ranks."""
    seed = random.randrange(1 << 30)
    for world_size, seq_len, causal, layout_name in RING_CASES:
        try:
            results = launch(_ring_run, world_size, forward, seed, seq_len, causal, layout_name,
                             show=None, timeout=TIMEOUT)
        except WorkerTimeoutError:
            return wrong(f"with {world_size} ranks the ranks waited for each other until the timeout: every isend "
                         "to rank r+1 needs an irecv on rank r+1 from rank r (the check also runs 3 and 4 ranks).")
        except WorkerError as e:
            reason = e.failed.get(e.rank, str(e))
            advice = (" The check runs 2, 3 and 4 ranks: compute the neighbours from the rank and the world size."
                      if "signal" in reason else "")
            return wrong(f"with {world_size} ranks, {seq_len} tokens, causal={causal}, rank {e.rank} failed: {reason}.{advice}")
        feedback = _judge_ring(results, world_size, seq_len, causal, layout_name)
        if feedback is not None:
            return feedback
    return correct("2, 3 and 4 ranks, uneven chunks, causal or not, both layouts: the output and lse equal "
                   "full attention, chunks go only to neighbours, and the next one travels during attend.")


# ------------------------------------------------------------------ Exercise 3: the zig-zag layout

UNEVEN_CASES = [(2, 13), (3, 26)]  # lengths that 2N does not divide: slices differ by one token
UNEVEN_TOLERANCE = 1.25  # the course's layout: slowest / fastest rank 1.12 (13 on 2) and 1.10 (26 on 3)


def _flops(rank, world_size, layout):
    q, k, v = (torch.randn(1, len(layout[rank]), DIM) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        cp.ring_attention(q, k, v, layout, True)
    return counter.get_total_flops()


def _runs(positions):
    """How many runs of consecutive positions."""
    return 1 + sum(1 for a, b in zip(positions, positions[1:]) if b != a + 1)


@exercise(
    "Exercise 3 (zigzag_layout)",
    hint="cut the sequence into 2N slices with torch.tensor_split (equal when 2N divides the length, else "
    "differing by one token); under a causal mask slice i costs about i + 1/2 blocks of work, "
    "so give each rank two slices whose costs add up to the same total: an early one and a late one.",
    finished=("course.parallel.context_parallel.zigzag_layout",),
)
def zigzag_layout(fn):
    """Exercise 3: a layout (two slices per rank) that balances causal attention's work."""
    size = random.randint(2, 5)  # tokens per slice, fresh each time: no layout can be hard-coded
    cases = [(n, 2 * n * size) for n in (2, 3, 4)] + UNEVEN_CASES
    for world_size, seq_len in cases:
        even = seq_len % (2 * world_size) == 0
        case = f"{seq_len} tokens on {world_size} ranks"
        try:
            layout = fn(seq_len, world_size)
        except Exception as e:  # noqa: BLE001 - reported as the feedback
            advice = "" if even else " (2N does not divide the length: slices then differ by one token)"
            return wrong(f"with {case} your function raised {type(e).__name__}: {e}{advice}")
        try:
            layout = [torch.as_tensor(p, dtype=torch.long).flatten() for p in layout]
        except (TypeError, ValueError):
            return wrong("return a list with one 1-D tensor of token positions per rank.")
        if len(layout) != world_size:
            return wrong(f"with {case} the layout has {len(layout)} entries: one per rank (the check also runs "
                         "3 and 4 ranks).")
        if sorted(torch.cat(layout).tolist()) != list(range(seq_len)):
            return wrong(f"with {case} the ranks do not hold every token exactly once"
                         + ("." if even else ": when 2N does not divide the length, cut with torch.tensor_split, "
                            "whose slices differ by one token, so that none is dropped."))
        if any(_runs(p.tolist()) > 2 for p in layout):
            return wrong(f"with {case} a rank holds more than two slices of consecutive tokens: the zig-zag layout "
                         "gives each rank two slices (two runs of neighbouring tokens).")
        low, high = 2 * (seq_len // (2 * world_size)), 2 * -(-seq_len // (2 * world_size))
        if any(not low <= len(p) <= high for p in layout):
            return wrong(f"with {case} the ranks hold {[len(p) for p in layout]} tokens: each should hold two of "
                         f"2N slices that differ by at most one token, {low} to {high} tokens.")
        flops = launch(_flops, world_size, layout, show=None, timeout=60)
        if (len(set(flops)) > 1) if even else max(flops) > UNEVEN_TOLERANCE * min(flops):
            return wrong(f"with {case} the ranks' work is not balanced: measured flops per rank {flops}. "
                         "Pair the slices so that each rank's two costs add up to the same total.")
    return correct("2, 3 and 4 ranks, random lengths: every token once, two slices per rank, and the same measured "
                   "flops on every rank; for lengths 2N does not divide, within 25%.")
