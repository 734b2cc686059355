"""Checks for notebook 15 (context parallelism: ring attention)."""

import contextlib
import random
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from course.parallel import context_parallel as cp
from course.classroom.exercises import Feedback, correct, exercise, replaced, wrong
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
            result = _merged(fn, args, out, lse, f"{name}{order}")
            if isinstance(result, Feedback):
                return result
            got_out, got_lse = result
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
    feedback = _fold_backwards(fn, seed) or _far_apart_and_empty(fn, seed)
    if feedback is not None:
        return feedback
    return correct("equals attention over all keys, with large scores and empty partials.")


def _fold_backwards(fn, seed):
    """A causal fold of three chunks in the order 2, 1, 0: queries 0-2 see no key of chunks 2 and 1, so
    the first merge gets two partials with lse -inf. Merging is associative only if that gives (0, -inf)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, DIM, generator=g) for n in (5, 9, 9))
    q_pos, k_pos = torch.arange(5), torch.arange(9)
    whole_out, whole_lse = cp.attend(q, k, v, q_pos, k_pos, True)
    chunks = [slice(6, 9), slice(3, 6), slice(0, 3)]
    try:
        out, lse = cp.attend(q, k[:, chunks[0]], v[:, chunks[0]], q_pos, k_pos[chunks[0]], True)
        for c in chunks[1:]:
            result = _as_pair(fn(out.clone(), lse.clone(), *cp.attend(q, k[:, c], v[:, c], q_pos, k_pos[c], True)))
            if result is None:
                return wrong("return a pair (out, lse) of tensors: the merged output and the merged log-sum-exp.")
            out, lse = result
    except Exception as e:  # noqa: BLE001 - reported as the feedback
        return wrong(f"folding causal chunks from the last one back, your merge raised {type(e).__name__}: {e}")
    if not (torch.isfinite(out).all() and torch.allclose(out, whole_out, rtol=1e-5, atol=1e-5)
            and torch.allclose(lse, whole_lse, rtol=1e-5, atol=1e-5)):
        return wrong("folding causal chunks from the last one back (keys 6-8, then 3-5, then 0-2), queries 0-2 "
                     "first meet two partials that both saw no key (lse -inf): -inf - (-inf) is nan, and the nan "
                     "stays. Merging two empty partials must give out 0 and lse -inf.")
    return None


def _merged(fn, args, want_out, want_lse, where):
    """The student's merge of ``args`` (copies) as (out, lse) of the expected shapes, or the feedback
    that says why not (it raised, returned no pair, or the wrong shapes)."""
    try:
        result = _as_pair(fn(*(t.clone() for t in args)))
    except Exception as e:  # noqa: BLE001 - reported as the feedback
        return wrong(f"with {where} your merge raised {type(e).__name__}: {e}")
    if result is None:
        return wrong("return a pair (out, lse) of tensors: the merged output and the merged log-sum-exp.")
    out, lse = result
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return wrong(f"out should have shape {tuple(want_out.shape)} and lse {tuple(want_lse.shape)}; got "
                     f"{tuple(out.shape)} and {tuple(lse.shape)}.")
    return out, lse


def _far_apart_and_empty(fn, seed):
    """Rows whose two lse are 200 apart, each way round (e^200 overflows float32, so a merge that rescales
    by either lse but the larger one gives inf), and rows where both partials saw no key (lse -inf, out 0)."""
    g = torch.Generator().manual_seed(seed)
    out1, out2 = torch.randn(2, 6, DIM, generator=g), torch.randn(2, 6, DIM, generator=g)
    inf = float("inf")
    lse1 = torch.tensor([[0.0, 200.0, -inf, 0.0, 200.0, -inf]] * 2)
    lse2 = torch.tensor([[200.0, 0.0, -inf, 200.0, 0.0, -inf]] * 2)
    empty = torch.isneginf(lse1)
    out1[empty], out2[empty] = 0.0, 0.0
    want_out = torch.where((lse1 > lse2)[..., None], out1, out2).masked_fill(empty[..., None], 0.0)
    want_lse = torch.maximum(lse1, lse2)  # e^-200 is 0 in float32: the smaller partial adds nothing
    result = _merged(fn, (out1, lse1, out2, lse2), want_out, want_lse, "partials whose lse are 0 and 200")
    if isinstance(result, Feedback):
        return result
    out, lse = result
    far = ~empty
    if not (torch.isfinite(out[far]).all() and torch.isfinite(lse[far]).all()):
        return wrong("with partials whose lse are 0 and 200 (either way round) an exp overflowed to inf: "
                     "e^200 is beyond float32. Subtract the larger of the two lse, not the first one.")
    if not (torch.allclose(out[far], want_out[far], rtol=1e-5, atol=1e-5)
            and torch.allclose(lse[far], want_lse[far], rtol=1e-5, atol=1e-5)):
        return wrong("with partials whose lse are 0 and 200 the merge should return the second partial "
                     "(and lse 200) nearly unchanged: e^-200 is 0 in float32.")
    if not (torch.isneginf(lse[empty]).all() and torch.equal(out[empty], torch.zeros_like(out[empty]))):
        return wrong("merging two partials that both saw no key (lse -inf) must give out 0 and lse exactly "
                     "-inf, not a large negative number: that is what attention over no keys gives.")
    return None


# ------------------------------------------------------------------ Exercise 2: ring attention's forward

# (ranks, tokens, causal, layout, scale of q): uneven chunks (10 and 13 tokens), 2, 3 and 4 ranks, both
# layouts; q x 60 makes scores of hundreds, beyond exp's float32 range, so a merge must rescale by the max
RING_CASES = [
    (2, 10, False, "contiguous", 60.0),
    (3, 13, True, "contiguous", 1.0),
    (4, 10, True, "contiguous", 1.0),
    (4, 16, True, "zigzag", 1.0),
    (4, 13, False, "contiguous", 1.0),
]
LAYOUTS = {"contiguous": cp.contiguous_layout, "zigzag": cp.zigzag_layout}
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_reduce",
               "all_to_all", "all_to_all_single", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor")
BLOCKING = ("send", "recv")  # batch_isend_irecv is not blocking: it calls isend/irecv, which the check logs
MOST_KV_HELD = 3  # chunks: the one computed on, the one arriving, and attend's copy of its visible K, V


class _Watch(TorchDispatchMode):
    """Logs the ops a rank runs. A matrix product with a chunk's keys or values among its operands is
    the attention's work ("compute"; a product of other tensors, or of a few rows of K, is not). At each one it measures how many
    chunks' worth of K/V values the tensors created so far and still alive hold (whatever made them:
    a receive buffer, a stack, a clone), and it keeps the largest number of tokens any (..., tokens, DIM)
    tensor held. K/V values are recognised by value: the inputs are random floats, and a copy keeps them."""

    def __init__(self, log, kv_values, chunk_values, smallest_k, receiving):
        super().__init__()
        self.log, self.kv_values, self.chunk_values = log, kv_values, chunk_values
        self.smallest_k = smallest_k
        self.created, self.receiving, self.most_tokens, self.most_held = [], receiving, 0, 0

    def _kv_count(self, tensor):
        storage = tensor.untyped_storage()
        if tensor.dtype != torch.float32 or storage.nbytes() % 4:
            return storage.data_ptr(), 0
        values = torch.empty(0).set_(storage).tolist()
        return storage.data_ptr(), sum(x in self.kv_values for x in values)

    def _kv_in(self, tensor):
        """How many K/V values the tensor itself holds (not its storage: a one-row view of K
        has K's storage but one row's values)."""
        if tensor.dtype != torch.float32:
            return 0
        return sum(x in self.kv_values for x in tensor.detach().flatten().tolist())

    def _held(self):
        alive = [t for ref in self.created + self.receiving if (t := ref()) is not None]
        counts = dict(self._kv_count(t) for t in alive)
        return sum(counts.values()) / self.chunk_values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if ("mm" in name or "scaled_dot_product" in name) and any(
                isinstance(a, torch.Tensor) and self._kv_count(a)[1] >= a.numel() // 2 > 0
                and self._kv_in(a) >= self.smallest_k for a in args):
            self.log.append(("compute",))
            self.most_held = max(self.most_held, self._held())
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.created.append(weakref.ref(t))
                if t.dim() >= 2 and t.shape[-1] == DIM:
                    self.most_tokens = max(self.most_tokens, t.shape[-2])
        self.created = [ref for ref in self.created if ref() is not None]
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


def _ring_run(rank, world_size, forward, seed, seq_len, causal, layout_name, scale, transfers):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, seq_len, DIM, generator=g) for _ in range(3))
    q = q * scale
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    expected_lse = (q @ k.transpose(-2, -1) * DIM**-0.5).masked_fill(
        causal & torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    layout = LAYOUTS[layout_name](seq_len, world_size)
    mine = layout[rank]

    log, peers, used = [], set(), []
    receiving = []  # a weak reference to every irecv's buffer
    record = open(f"{transfers}/{rank}", "a", buffering=1)  # each isend/irecv's shape, read if a rank dies

    def watched(name, original):
        def call(tensor, *args, **kwargs):  # also as batch_isend_irecv calls it: peer as group_dst/group_src
            peer = args[0] if args else next((kwargs[key] for key in ("dst", "src", "group_dst", "group_src")
                                              if kwargs.get(key) is not None), None)
            peers.add((name, peer))
            key = len(log)
            if name == "irecv":
                receiving.append(weakref.ref(tensor))
            record.write(f"{name} {peer} {'x'.join(map(str, tensor.shape))} {tensor.numel()}\n")
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
    kv_values = set(torch.cat([k.flatten(), v.flatten()]).tolist())
    chunk_values = 2 * k[..., :1, :].numel() * max(len(p) for p in layout)  # one rank's K and V at most
    smallest_k = k[..., :1, :].numel() * min(len(p) for p in layout)  # the K of the smallest chunk
    watch = _Watch(log, kv_values, chunk_values, smallest_k, receiving)
    local = [t[..., mine, :].clone() for t in (q, k, v)]
    with contextlib.ExitStack() as stack:  # an exception stops every rank (a WorkerError), none waits for it
        for name, replacement in patches:  # torch.distributed's names, the answer's, and distributed_c10d's
            stack.enter_context(replaced(dist, name, replacement, forward))
            if getattr(c10d, name, None) is not replacement and hasattr(c10d, name):
                stack.enter_context(replaced(c10d, name, replacement))
        with watch:
            result = forward(*local, layout, causal)
    result = _as_pair(result)
    report = {"used": used, "peers": sorted(peers), "most_tokens": watch.most_tokens, "log": log,
              "most_held": watch.most_held if scale == 1 else 0,  # with q x 60 an output row can equal a V row
              "largest_chunk": max(len(p) for p in layout)}
    if result is None:
        return {**report, "bad_result": True}
    out, lse = result
    report["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
    # 1e-4: with q x 60 the lse are hundreds, float32 keeps them to ~3e-5, and the merge's weights e^(lse_i - lse)
    # carry that error into the output: a right ring that merges in another order (arrival order) differs by
    # a few 1e-5 (seen: a 1e-5 tolerance failed such answers now and then on a busy machine)
    report["ok_out"] = out.shape == expected[..., mine, :].shape and torch.allclose(out, expected[..., mine, :],
                                                                                   rtol=1e-4, atol=1e-4)
    report["ok_lse"] = lse.shape == expected_lse[..., mine].shape and torch.allclose(lse, expected_lse[..., mine],
                                                                                    rtol=1e-4, atol=1e-4)
    report["uncausal"] = causal and out.shape == expected[..., mine, :].shape and torch.allclose(
        out, F.scaled_dot_product_attention(q, k, v)[..., mine, :], atol=1e-5)
    return report


def _mismatched_transfer(transfers, world_size):
    """The first receive whose buffer differs in size from what its sender sent (each rank's k-th isend
    to a peer meets that peer's k-th irecv from it), as a sentence; None if none differs."""
    calls = {}
    for rank in range(world_size):
        with contextlib.suppress(FileNotFoundError), open(f"{transfers}/{rank}") as f:
            calls[rank] = [line.split() for line in f]
    for rank, lines in calls.items():
        received = [line for line in lines if line[0] == "irecv"]
        for peer in {line[1] for line in received}:
            mine = [line for line in received if line[1] == peer]
            sent = [line for line in calls.get(int(peer), []) if line[0] == "isend" and line[1] == str(rank)]
            for i, (got, theirs) in enumerate(zip(mine, sent)):
                if got[3] != theirs[3]:
                    return (f"rank {rank}'s receive buffer number {i + 1} from rank {peer} has shape ({got[2]}), "
                            f"{got[3]} numbers, but rank {peer} sent a tensor of shape ({theirs[2]}), {theirs[3]} "
                            "numbers: a receive buffer must be exactly as big as what arrives in it (the chunk "
                            "arriving while you compute on rank src's is rank src - 1's). If the shape is the "
                            "one you meant, the sender is not: compute the neighbours from the rank and the world "
                            "size (the check runs 2, 3 and 4 ranks).")
    return None


def _overlapped(log):
    """Every receive was in flight while attention ran: between posting each irecv and waiting for
    it, the rank ran a matrix product on a chunk's keys or values. Only meaningful without
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


def _judge_ring(results, world_size, seq_len, causal, layout_name, scale):
    case = f"{world_size} ranks, {seq_len} tokens, causal={causal}, {layout_name} layout"
    if scale != 1:
        case += f", q x {scale:g}"
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
        if held > MOST_KV_HELD:
            return wrong(f"with {case}, rank {rank}'s tensors still alive during a product held {held:.1f} chunks' "
                         "K and V at once (receive buffers, stacks, clones: any copy): a ring rank keeps the chunk "
                         "it computes on and the one arriving, no more (attend's copy of the visible keys and "
                         f"values makes {MOST_KV_HELD}). Attend to each chunk while the next one travels, then "
                         "let it go.")
        if r["most_tokens"] > r["largest_chunk"]:
            return wrong(f"with {case}, rank {rank} built a tensor of {r['most_tokens']} tokens, more than a "
                         f"chunk ({r['largest_chunk']}): a ring rank holds one K/V chunk at a time (and the next "
                         "one arriving), never the whole sequence.")
    for rank, r in enumerate(results):
        if world_size > 1 and not any(event[0] == "irecv" for event in r["log"]):
            return wrong(f"with {case}, rank {rank} received nothing with dist.irecv (no isend/irecv seen): pass "
                         "the K/V chunks to the next rank with dist.isend / dist.irecv (start_pass).")
    if not all(r["finite"] for r in results):
        return wrong(f"with {case} the output or lse has inf or nan: with scores of hundreds e^score overflows "
                     "float32 (e^89 already does). Merge with the running max subtracted (Exercise 1's merge).")
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
                     "irecv and waiting for it the check saw no matrix product on a chunk's keys or values "
                     "(a product on a few rows of K is not attention). Post the isend/irecv of the next "
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
    for world_size, seq_len, causal, layout_name, scale in RING_CASES:
        with tempfile.TemporaryDirectory() as transfers:
            try:
                results = launch(_ring_run, world_size, forward, seed, seq_len, causal, layout_name, scale,
                                 transfers, show=None, timeout=TIMEOUT)
            except WorkerTimeoutError:
                return wrong(f"with {world_size} ranks the ranks waited for each other until the timeout: every "
                             "isend to rank r+1 needs an irecv on rank r+1 from rank r (the check also runs 3 and "
                             "4 ranks).")
            except WorkerError as e:
                mismatch = _mismatched_transfer(transfers, world_size)
                if mismatch is not None:  # gloo aborts the receiving rank's process (SIGABRT)
                    return wrong(f"with {world_size} ranks, {seq_len} tokens, causal={causal}: {mismatch}")
                reason = e.failed.get(e.rank, str(e))
                advice = (" The check runs 2, 3 and 4 ranks: compute the neighbours from the rank and the world "
                          "size." if "signal" in reason else "")
                return wrong(f"with {world_size} ranks, {seq_len} tokens, causal={causal}, rank {e.rank} failed: "
                             f"{reason}.{advice}")
        feedback = _judge_ring(results, world_size, seq_len, causal, layout_name, scale)
        if feedback is not None:
            return feedback
    return correct("full attention on 2-4 ranks; neighbours only, overlapped, <= 3 chunks.")


# ------------------------------------------------------------------ Exercise 3: the zig-zag layout

UNEVEN_CASES = [(2, 13), (3, 26)]  # lengths that 2N does not divide: slices differ by one token
UNEVEN_TOLERANCE = 1.25  # the course's layout: slowest / fastest rank 1.12 (13 on 2) and 1.10 (26 on 3)


def _flops(rank, world_size, layouts):
    """This rank's flops in ring attention over each of the layouts (one launch per world size)."""
    flops = []
    for layout in layouts:
        q, k, v = (torch.randn(1, len(layout[rank]), DIM) for _ in range(3))
        with FlopCounterMode(display=False) as counter:
            cp.ring_attention(q, k, v, layout, True)
        flops.append(counter.get_total_flops())
    return flops


def _runs(positions):
    """How many runs of consecutive positions."""
    return 1 + sum(1 for a, b in zip(positions, positions[1:]) if b != a + 1)


def _zigzag_layout_of(fn, world_size, seq_len):
    """(fn's layout as tensors, None), or (None, the feedback) where it is wrong without measuring."""
    even = seq_len % (2 * world_size) == 0
    case = f"{seq_len} tokens on {world_size} ranks"
    try:
        layout = fn(seq_len, world_size)
    except Exception as e:  # noqa: BLE001 - reported as the feedback
        advice = "" if even else " (2N does not divide the length: slices then differ by one token)"
        return None, wrong(f"with {case} your function raised {type(e).__name__}: {e}{advice}")
    try:
        layout = [torch.as_tensor(p, dtype=torch.long).flatten() for p in layout]
    except (TypeError, ValueError):
        return None, wrong("return a list with one 1-D tensor of token positions per rank.")
    if len(layout) != world_size:
        return None, wrong(f"with {case} the layout has {len(layout)} entries: one per rank (the check also runs "
                           "3 and 4 ranks).")
    if sorted(torch.cat(layout).tolist()) != list(range(seq_len)):
        return None, wrong(f"with {case} the ranks do not hold every token exactly once"
                           + ("." if even else ": when 2N does not divide the length, cut with torch.tensor_split, "
                              "whose slices differ by one token, so that none is dropped."))
    if any(_runs(p.tolist()) > 2 for p in layout):
        return None, wrong(f"with {case} a rank holds more than two slices of consecutive tokens: the zig-zag layout "
                           "gives each rank two slices (two runs of neighbouring tokens).")
    low, high = 2 * (seq_len // (2 * world_size)), 2 * -(-seq_len // (2 * world_size))
    if any(not low <= len(p) <= high for p in layout):
        return None, wrong(f"with {case} the ranks hold {[len(p) for p in layout]} tokens: each should hold two of "
                           f"2N slices that differ by at most one token, {low} to {high} tokens.")
    return layout, None


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
    layouts, feedback = [], None  # the layouts, in order, up to the first that is wrong by itself
    for world_size, seq_len in cases:
        layout, feedback = _zigzag_layout_of(fn, world_size, seq_len)
        if feedback is not None:
            break
        layouts.append((world_size, seq_len, layout))
    flops = {}  # (ranks, tokens) -> flops per rank: one launch per world size, for all its layouts at once
    for world_size, seq_len, _ in layouts:  # in the order of the cases, as if each had been measured in turn
        if (world_size, seq_len) not in flops:
            mine = [(tokens, layout) for n, tokens, layout in layouts if n == world_size]
            per_rank = launch(_flops, world_size, [layout for _, layout in mine], show=None, timeout=60)
            flops.update({(world_size, tokens): [f[i] for f in per_rank] for i, (tokens, _) in enumerate(mine)})
        even, measured = seq_len % (2 * world_size) == 0, flops[world_size, seq_len]
        if (len(set(measured)) > 1) if even else max(measured) > UNEVEN_TOLERANCE * min(measured):
            return wrong(f"with {seq_len} tokens on {world_size} ranks the ranks' work is not balanced: measured "
                         f"flops per rank {measured}. Pair the slices so that each rank's two costs add up to the "
                         "same total.")
    if feedback is not None:
        return feedback
    return correct("every token once, two slices per rank, equal flops on 2-4 ranks.")
