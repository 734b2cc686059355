"""A model of memory and communication per GPU, for choosing a parallel configuration (the capstone).

Everything here is a **model**: formulas built from the laws notebooks 10–16 measured, with
their assumptions written down, so they can be checked against small runs before they are
trusted for big ones (the capstone does that on 8 ranks, and :func:`validation` against
published runs of torchtitan and Llama 3).

Assumptions (change them by changing the arguments):

* a decoder-only transformer (:class:`Model`): per layer the attention projections
  (grouped-query: ``kv_heads`` ≤ ``heads``) and an MLP of ``ffn_matrices`` matrices
  (2 for GELU, 3 for SwiGLU); embedding and output layer ``vocab × hidden`` each (untied);
* mixed precision as notebooks 11 and 12 measured it: bf16 parameters and gradients, fp32 master
  weights and Adam's two moments: 2 + 2 + 12 = 16 bytes per parameter before sharding
  (FSDP2 with fp32 gradient reduction holds fp32 sharded weights and gradients: also 16);
* TP splits every layer's matrices (not the norms or the row-parallel biases) and, with
  ``vocab_parallel``, the embedding and the output layer (Megatron's vocabulary-parallel
  layers, torchtitan's plan); with sequence parallelism (``Config.sp``) it also splits the
  activations between the layers. PP gives each stage ``layers / pp`` layers, or, when that
  does not divide, the first and last stages one layer fewer than the others (Llama 3's 126
  layers on 16 stages: 7 + 14 × 8 + 7); the first stage also holds the embedding, the last
  the output layer. ZeRO stage 1/2/3 shards optimizer state / + gradients / + parameters over
  the ``dp × cp`` ranks (torchtitan's FSDP mesh includes the CP dimension);
* activations of one layer for one micro-batch of ``b`` sequences of ``s`` tokens:
  ``c·s·b·h`` bytes, where ``c`` is **measured** (:func:`activation_coefficient`, on the
  target's kernels: CUDA's by default) for each recomputation policy (``Config.recompute``:
  ``"none"``, ``"selective"`` as torchtitan's op policy, ``"full"``), divided by ``tp``
  (with sequence parallelism) and ``cp``. With recomputation one layer's whole activations
  exist again while it is recomputed. How many micro-batches a stage holds depends on the
  schedule (:func:`in_flight`). The last stage also holds the logits, ``10·s·b·vocab`` bytes
  (:data:`LOGIT_BYTES`; divided by ``tp`` with ``vocab_parallel``). ZeRO-3 (FSDP2, gradients
  reduced in fp32 as torchtitan does) holds, beside the activations, whole layers' worth of bf16
  weights in its backward: the layer computing, the next one's prefetched all-gather, the layer's
  own gradients (3), and, from the second layer of backward on, the previous layer's fp32
  reduce-scatter input, which FSDP2 keeps until the next reduce-scatter (2 more: by default
  one buffer in flight, ``set_reduce_scatter_max_input_buffers`` in torch 2.15), while one
  layer's activations are gone: so ``max(3, 5 - a)`` layers, ``a`` one layer's activations of
  one micro-batch in those units (:func:`fsdp_peak_buffers` measures them with torch's
  ``FSDPMemTracker``). The embedding and output layer stay whole (FSDP2's root module is not
  resharded between forward and backward), and so does the output layer's bf16 gradient until
  backward ends. A fraction ``1 - Cluster.usable`` of each GPU is kept free (allocator
  fragmentation, NCCL buffers, the CUDA context: an assumption, not a measurement);
* communication per GPU and step (bytes *sent*, bandwidth-optimal ring collectives):
  TP: 4 all-reduces (or their reduce-scatter + all-gather halves) of ``s·b·h`` activations
  per layer per micro-batch (6 with full recomputation; selective keeps the reduce-scatters'
  outputs), each ``2(tp-1)/tp`` × its size;
  PP: per micro-batch and model chunk, one activation forward and one gradient back, except
  that the first stage sends nothing back and the last nothing forward;
  ``1/tp`` of it with sequence parallelism (each TP rank sends its slice);
  CP: notebook 15's ring attention: per layer and micro-batch ``3cp - 2`` messages of one rank's K/V
  (its ``1/cp`` of the tokens, its ``1/tp`` of the K/V heads): ``cp - 1`` in forward, ``cp - 1`` and
  ``cp`` dK/dV accumulators in backward (``cp - 1`` more with full recomputation). torch 2.15's
  ``context_parallel`` sends the accumulators in fp32 (``convert_to_f32``, read in its source, not
  run): twice these bytes for that part. torch 2.15's ``context_parallel`` also does not use a
  ring by default: it all-gathers K/V (``rotate_method = _RotateMethod.ALL_GATHER``) and moves
  dK/dV by all-to-all; the ring is the model's, not torch's default;
  DP (over ``dp × cp`` ranks, the ranks that hold the same weights), with ``m`` micro-batches
  per step: ZeRO-0/1 all-reduce the accumulated gradients once, ``2(n-1)/n`` × their size;
  ZeRO-2 keeps only a shard of the gradients, so it reduce-scatters every micro-batch's
  (``m·(n-1)/n``) and all-gathers the parameters once; ZeRO-3 (FSDP's default) all-gathers the
  parameters twice and reduce-scatters the gradients for every micro-batch, ``3m(n-1)/n``;
* time: :func:`flops_per_token` at ``mfu`` × the GPU's peak, the slowest pipeline stage setting
  the pace; the pipeline bubble (:func:`bubble`) adds its fraction of that; each collective
  costs its bytes at the link's bandwidth plus ``alpha`` per step of its ring (``2(n-1)``
  steps for an all-reduce, ``n-1`` for a reduce-scatter or all-gather; one per point-to-point
  message). TP, CP and PP communication is not overlapped; DP communication overlaps with what
  runs beside it (ZeRO-0/1: the last micro-batch's backward; ZeRO-2/3: all of forward and
  backward) and what does not fit adds.

Left out, among much else: hybrid sharding (HSDP), overlapped TP communication, expert
parallelism, Float8, torch.compile's fusions, stragglers, the real MFU of each shape, the
gradients of activations that backward makes and frees layer by layer, and, under ZeRO-0/1/2, the
unsharded gradients and reduce-scatter buffers FSDP holds in backward (counted for ZeRO-3 only).
:func:`torchtitan_terms` estimates three terms torchtitan's runs add (the loss's own peak, the output
layer's input, FSDP2's unsharded fp32 gradients under a pipeline), outside the model.

The numbers for a GPU (:class:`Cluster`) are parameters: the defaults are an H100 SXM node
(989 TFLOP/s bf16 dense, 80 GB, NVLink ~450 GB/s per direction, 8 per node) on a 400 Gb/s
network (~50 GB/s per GPU); ring-step latencies of 2 µs inside a node and 8 µs between nodes
are assumptions of the order NCCL's own tuning model uses, not measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
from dataclasses import dataclass

from course.parallel.schedules import bubble_fraction, interleaved_1f1b, simulate, zb_h1

RECOMPUTE = ("none", "selective", "full")
# bytes per logit at the loss's peak in forward: the bf16 logits, their fp32 copy and the fp32 log-softmax
# that cross-entropy saves: torchtitan's loss on bf16 logits (backward's peak: LOSS_PEAK_BYTES, further down)
LOGIT_BYTES = 2 + 4 + 4
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
# The planner's schedules that torch 2.15's torch.distributed.pipelining runs: ScheduleGPipe, Schedule1F1B,
# ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (the paper's ZB1P, ZB-H1 with one stage per rank): the
# search's default. torch 2.15 also runs ScheduleLoopedBFS, ScheduleZBVZeroBubble and ScheduleDualPipeV, which the
# planner has no model of (ZBV and DualPipeV idle less than ZB-H1: notebook 17). It has no ZB-H2, nor the
# post-validation that ZB-H2's zero bubble needs (no all-reduce before the optimizer step).
TORCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    ffn_matrices: int = 3  # SwiGLU: gate, up, down
    bias: bool = False
    norms: bool = True  # two RMSNorm weight vectors per layer, one at the end
    vocab_parallel: bool = True  # TP also splits the embedding and the output layer

    def layer_params(self) -> int:
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        attn = h * h + 2 * h * kv + h * h  # q, k, v, out
        mlp = self.ffn_matrices * h * self.ffn
        bias = (h + 2 * kv + h + (self.ffn_matrices - 1) * self.ffn + h) if self.bias else 0
        return attn + mlp + bias + (2 * h if self.norms else 0)

    def matrices(self) -> list:
        """A layer's weight matrices (inputs, outputs) in the order forward multiplies by them."""
        h, kv, f = self.hidden, self.hidden * self.kv_heads // self.heads, self.ffn
        mlp = [(h, f)] * (self.ffn_matrices - 1) + [(f, h)]
        return [(h, h), (h, kv), (h, kv), (h, h)] + mlp

    def params(self) -> int:
        h = self.hidden
        ends = self.vocab * h + self.vocab * h + (self.vocab if self.bias else 0) + (h if self.norms else 0)
        return self.layers * self.layer_params() + ends


LLAMA3_8B = Model("Llama-3 8B", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
LLAMA3_70B = Model("Llama-3 70B", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)
LLAMA3_405B = Model("Llama-3 405B", layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    per_node: int = 8
    memory: float = 80e9  # bytes per GPU
    flops: float = 989e12  # peak bf16 FLOP/s per GPU
    mfu: float = 0.5  # the fraction of the peak that matmuls reach
    intra_node: float = 450e9  # bytes/s per GPU, each direction (NVLink)
    inter_node: float = 50e9  # bytes/s per GPU, each direction (the network)
    usable: float = 0.9  # the fraction of memory a configuration may fill (an assumption)
    alpha_intra: float = 2e-6  # seconds per ring step or message inside a node (an assumption)
    alpha_inter: float = 8e-6  # seconds per ring step or message between nodes (an assumption)
    kernels: str = "cuda"  # whose kernels' saved tensors the activations are: "cuda" or "cpu"
    activation_scale: float = 1.0  # multiplies the activation coefficient (to see what hangs on it)


@dataclass(frozen=True)
class Config:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1  # 0: none, 1: optimizer state, 2: + gradients, 3: + parameters
    micro_batch: int = 1  # sequences per micro-batch
    recompute: str = "none"  # "none", "selective" (torchtitan's op policy) or "full"; True/False: full/none
    sp: bool = True  # sequence parallelism with TP: activations between layers split too
    schedule: str = "1f1b"  # the pipeline schedule: "gpipe", "1f1b", "interleaved", "zb-h1" or "zb-h2"
    v: int = 1  # model chunks per pipeline rank (interleaved: v >= 2)

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "v"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config: {name} must be a whole number >= 1, not {value!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"Config: zero is a ZeRO stage, 0, 1, 2 or 3, not {self.zero!r}")
        if isinstance(self.recompute, bool):  # the old yes/no: full recomputation or none
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Config: recompute is one of {RECOMPUTE}, not {self.recompute!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Config: schedule is one of {SCHEDULES}, not {self.schedule!r}")
        if (self.schedule == "interleaved") != (self.v > 1):
            raise ValueError(f"Config: the interleaved schedule has v >= 2 chunks per rank, the others v = 1 "
                             f"(schedule={self.schedule!r}, v={self.v})")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def stage_layers(model: Model, pp: int, stage: int) -> int:
    """Layers on pipeline stage ``stage``: ``layers / pp``, or, when ``pp`` does not divide them,
    one fewer on the first and the last stage (as Llama 3 did: 126 layers = 7 + 14 × 8 + 7)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} of {pp}")
    if model.layers % pp == 0:
        return model.layers // pp
    if pp > 2 and (model.layers + 2) % pp == 0:
        return (model.layers + 2) // pp - (stage in (0, pp - 1))
    raise ValueError(f"{model.layers} layers split into neither {pp} equal stages nor {pp} with shorter ends")


def splits(model: Model, pp: int) -> bool:
    """Can ``model``'s layers be cut into ``pp`` stages (equal, or with the ends one layer shorter)?"""
    try:
        stage_layers(model, pp, 0)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=2**12)  # a search asks for the same few many times
def stage_params(model: Model, tp: int, pp: int, stage: int, ends: bool = True) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds under ``tp``-way tensor parallelism (with
    ``ends=False``, those of its layers only: not the embedding, output layer and final norm)."""
    h, per_layer = model.hidden, model.layer_params()
    replicated = (2 * h if model.norms else 0) + (2 * h if model.bias else 0)  # norms, row-parallel biases
    layer = (per_layer - replicated) // tp + replicated
    params = stage_layers(model, pp, stage) * layer
    if not ends:
        return params
    vocab = model.vocab * h // (tp if model.vocab_parallel else 1)
    if stage == 0:
        params += vocab
    if stage == pp - 1:
        params += vocab + (model.vocab if model.bias else 0) + (h if model.norms else 0)
    return params


def block_of(model: Model, seq: int, head_dim: int, device: str, repeat_kv: bool = False, fp32_norm: bool = False,
             sdpa: bool = False):
    """One bf16 block of ``model``'s shape with ``head_dim``-wide heads on ``device``: (forward, its modules,
    input). On a CUDA device attention is the fused flash kernel called directly, unless ``sdpa``:
    ``F.scaled_dot_product_attention``, which picks a kernel by asking the GPU (only on a real one)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, kv = model.heads * head_dim, model.kv_heads * head_dim
    f = round(model.ffn / model.hidden * h)
    make = dict(dtype=torch.bfloat16, device=device)

    class Fp32RMSNorm(nn.RMSNorm):  # written by hand, in fp32 (torchtitan's Llama of 2024, models/norms.py)
        def forward(self, t):
            u = t.float()
            return (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(t) * self.weight

    norm = (lambda: (Fp32RMSNorm if fp32_norm else nn.RMSNorm)(h, **make)) if model.norms else nn.Identity
    linear = functools.partial(nn.Linear, bias=model.bias, **make)
    n1, n2 = norm(), norm()
    q, k, v, o = linear(h, h), linear(h, kv), linear(h, kv), linear(h, h)
    mlp = [linear(h, f) for _ in range(model.ffn_matrices - 1)] + [linear(f, h)]
    x = torch.randn(1, seq, h, requires_grad=True, **make)
    group = model.heads // model.kv_heads

    def heads(t, n):
        t = t.view(1, seq, n, head_dim).transpose(1, 2)
        return t.repeat_interleave(group, dim=1) if repeat_kv and n != model.heads else t

    def attention(q_, k_, v_):
        if device == "cpu" or sdpa:
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=k_.shape[1] != q_.shape[1])
        # the fused kernel SDPA picks on an H100; SDPA itself would ask the (absent) GPU and fall back to the math path
        return torch.ops.aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, True)[0]

    def block(x):
        y = n1(x)
        a = attention(heads(q(y), model.heads), heads(k(y), model.kv_heads), heads(v(y), model.kv_heads))
        x = x + o(a.transpose(1, 2).reshape(1, seq, h))
        y = n2(x)
        hidden = F.silu(mlp[0](y)) * mlp[1](y) if model.ffn_matrices == 3 else F.gelu(mlp[0](y))
        return x + mlp[-1](hidden)

    return block, nn.ModuleList([n1, n2, q, k, v, o, *mlp]), x


def selective_policy():
    """torchtitan's selective (op) recomputation policy (torchtitan/distributed/activation_checkpoint.py):
    keep the outputs of compute-intensive ops (matmuls, fused attention) except every second matmul of a
    block; recompute everything else."""
    import torch
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy

    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            count[mode] += 1
        if func in save and not (func in matmuls and count[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _measured_once(function):
    """``functools.lru_cache`` for a measurement: ``f(m)``, ``f(m, "cuda")`` and ``f(m, kernels="cuda")`` are
    one measurement, made once (``lru_cache`` alone keys the three apart and would trace the block three times)."""
    signature = inspect.signature(function)
    measured = functools.lru_cache(maxsize=None)(function)

    @functools.lru_cache(maxsize=None)  # each way of calling, matched with its measurement once
    @functools.wraps(function)
    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return measured(*bound.args)

    return call


@_measured_once
def activation_coefficient(model: Model, kernels: str = "cuda", recompute: str = "none",
                           repeat_kv: bool = False, seq: int = 64, head_dim: int | None = None,
                           fp32_norm: bool = False):
    """Bytes one layer of ``model`` keeps for backward, per token and per hidden feature (its input
    included), measured on one bf16 block of the model's shape, on ``kernels``:

    * ``"cuda"`` (the planner's default): the block runs under ``FakeTensorMode`` on a fake CUDA
      device: no GPU and no kernel run, but CUDA's autograd formulas decide what is saved. Attention
      calls the fused flash kernel directly (SDPA would ask the absent GPU which kernels it has and
      fall back to the math path, which saves the fp32 attention matrix); RMSNorm is CUDA's fused
      one, which saves its bf16 input and an fp32 rstd per token (``FusedRmsNormBackward0`` keeps
      ``input_``, ``weight_``, ``result1_``: torch/include/torch/csrc/autograd/generated/
      Functions.h, torch 2.15). Heads have their real width (``head_dim=None``): nothing is
      computed.
    * ``"cpu"``: the block really runs on this machine, scaled down to 8-wide heads. CPU's RMSNorm
      in bf16 is a composite that saves fp32 copies of its input: all of the difference (without
      norms both give 37.50). It is the model's code and torch's dispatch, not the device: a
      hand-written RMSNorm that casts to fp32 keeps fp32 copies on CUDA too (``fp32_norm``).
    * ``"gpu"``: the ``"cuda"`` block really run on this machine's CUDA GPU
      (benchmarks/gpu_memory.py compares the two on an H100).

    ``recompute="none"``: ``saved_tensors_hooks`` see every tensor autograd keeps (each storage
    once, weights left out). ``"selective"`` / ``"full"``: the block runs under
    ``torch.utils.checkpoint`` (with :func:`selective_policy` / without a policy), and
    :class:`~course.observe.memory.LiveBytes` counts the storages still alive after forward, less
    the output. ``repeat_kv``: K and V repeated to every head before attention (torchtitan's Llama
    in 2024) instead of grouped-query attention. ``fp32_norm``: RMSNorm written by hand, casting to
    fp32 (torchtitan's Llama in 2024), in place of ``nn.RMSNorm``."""
    import torch
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from course.observe.memory import LiveBytes, saved_activation_bytes

    if kernels not in ("cuda", "cpu", "gpu") or recompute not in RECOMPUTE:
        raise ValueError(f"kernels is 'cuda', 'cpu' or 'gpu', recompute one of {RECOMPUTE}: "
                         f"not {kernels!r}, {recompute!r}")
    if kernels == "gpu" and not torch.cuda.is_available():
        raise ValueError("kernels='gpu' runs the block on this machine's CUDA GPU, "
                         "and it has none: "
                         "use kernels='cuda' (CUDA's formulas traced without a GPU)")
    if kernels == "cpu" and recompute != "none":
        raise ValueError("recomputation is measured on the cuda kernels only")
    head_dim = head_dim or (8 if kernels == "cpu" else model.hidden // model.heads)
    fake = None
    if kernels == "cuda":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode()
        fake.__enter__()
    try:
        device = "cpu" if kernels == "cpu" else "cuda"
        block, modules, x = block_of(model, seq, head_dim, device, repeat_kv, fp32_norm)
        width = seq * model.heads * head_dim
        if recompute == "none":
            saved, _ = saved_activation_bytes(block, modules, x)  # the input: kept by norm 1
            return saved / width
        kwargs = {}
        if recompute == "selective":
            kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(selective_policy())
        with LiveBytes([*modules.parameters(), x]) as live:
            before = live.now()
            out = checkpoint(block, x, use_reentrant=False, **kwargs)
            kept = live.now() - before - out.untyped_storage().nbytes()
        return (kept + x.untyped_storage().nbytes()) / width  # + the input, which checkpoint keeps
    finally:
        if fake is not None:
            fake.__exit__(None, None, None)



# Recorded, not re-measured in CI: the bytes per token per hidden feature a bf16 block of each shape kept for
# backward when it really ran on one NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, 2026-11-27, 2,048 tokens):
# benchmarks/gpu_memory.py's "gpu" column in benchmarks/results/gpu_memory_h100.json (tests/test_planner.py
# checks the two agree). Blocks: "GQA" (activation_coefficient's defaults), "K/V repeated" (repeat_kv),
# "fp32 RMSNorm" (fp32_norm), "selective" and "full" (recompute).
H100_COEFFICIENTS = {
    ("Llama-3 8B", "GQA"): 41.0332,
    ("Llama-3 8B", "K/V repeated"): 44.0332,
    ("Llama-3 8B", "fp32 RMSNorm"): 49.0332,
    ("Llama-3 8B", "selective"): 15.5313,
    ("Llama-3 8B", "full"): 2.0000,
    ("Llama-3 70B", "GQA"): 40.5322,
    ("Llama-3 70B", "K/V repeated"): 44.0322,
    ("Llama-3 70B", "fp32 RMSNorm"): 48.5322,
    ("Llama-3 70B", "selective"): 15.2813,
    ("Llama-3 70B", "full"): 2.0000,
    ("Llama-3 405B", "GQA"): 38.2817,
    ("Llama-3 405B", "K/V repeated"): 42.0317,
    ("Llama-3 405B", "fp32 RMSNorm"): 46.2817,
    ("Llama-3 405B", "selective"): 14.6563,
    ("Llama-3 405B", "full"): 2.0000,
}
# Recorded the same way (benchmarks/gpu_memory.py, results in the same JSON): peak reserved / peak allocated bytes
# of a training step (forward, backward, AdamW) of 4 blocks of 8B's shape x 8,192 tokens and 8 blocks x 4,096,
# with the default caching allocator and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
H100_RESERVED_OVER_ALLOCATED = {"default": (1.0953, 1.0323), "expandable_segments:True": (1.0140, 1.0013)}
# activation_coefficient's arguments for each block above
BLOCKS = {"GQA": {}, "K/V repeated": {"repeat_kv": True}, "fp32 RMSNorm": {"fp32_norm": True},
          "selective": {"recompute": "selective"}, "full": {"recompute": "full"}}


def fsdp_peak_buffers(seq: int, vocab: int = 8, reduce: str = "fp32", backward: bool = True, world: int = 4,
                      layers: int = 4, hidden: int = 64) -> dict:
    """What FSDP2 (``fully_shard`` per block and on the root, default resharding and prefetching, bf16
    weights) holds at its peak, measured by torch's ``FSDPMemTracker`` on the fake process group as one
    rank of ``world``, for a Llama-like model of ``layers`` blocks run on one sequence of ``seq`` tokens:
    {"weights" (unsharded, the root's left out), "all-gather" (its output buffers), "reduce-scatter" (its
    input buffers, in the ``reduce`` dtype), "temporary" (what backward makes: gradients, unsharded
    until reduced, and activations' gradients), "activations"}, each in units of one block's bf16 weights.
    ``backward=False``: the peak of forward alone. On the CPU (FSDP2 on a fake CUDA device asks the absent
    GPU for its current device): the order of allocations is eager's, without a GPU's streams running
    behind the CPU. Makes and destroys the default process group: call it where none exists."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if reduce not in ("fp32", "bf16"):
        raise ValueError(f"reduce is 'fp32' or 'bf16', not {reduce!r}")
    if dist.is_initialized():
        raise RuntimeError("fsdp_peak_buffers makes its own fake process group: call it in a process without one "
                           "(course.launch(..., init_process_group=False))")
    h, f, heads = hidden, 4 * hidden, 4

    class Block(nn.Module):  # RMSNorm, attention, RMSNorm, SwiGLU MLP
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
            self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
            self.gate, self.up, self.down = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

        def forward(self, x):
            y, split = self.n1(x), lambda t: t.unflatten(-1, (heads, h // heads)).transpose(1, 2)
            a = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)), is_causal=True)
            x = x + self.o(a.transpose(1, 2).flatten(2))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(vocab, h), *[Block() for _ in range(layers)], nn.RMSNorm(h),
                              nn.Linear(h, vocab, bias=False))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32 if reduce == "fp32" else torch.bfloat16)
        for block in model[1:-2]:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        layer = 2 * sum(p.numel() for p in model[1].parameters())
        root = 2 * (2 * vocab * h + h)  # embedding, output layer and final norm, bf16
        tracker = FSDPMemTracker(model)
        with tracker:
            loss = model(torch.randint(vocab, (1, seq))).float().logsumexp(-1).mean()
            if backward:
                loss.backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    finally:
        dist.destroy_process_group()
    size = {getattr(kind, "value", kind): n for kind, n in peak.items()}  # keys: torch's categories by name
    return {"weights": (size["Unsharded Param"] - root) / layer, "all-gather": size["All Gather"] / layer,
            "reduce-scatter": size["Reduce Scatter"] / layer, "temporary": size["Temp"] / layer,
            "activations": size["Activation"] / layer}

def loss_peak_bytes(parallel: bool, tp: int = 2, tokens: int = 64, width: int = 1024) -> dict:
    """Bytes per logit of this rank's shard that the loss holds, beside the output layer's input and weight,
    measured with ``LiveBytes`` on CPU as one rank of ``tp`` on the fake process group (nothing is sent):
    {"forward", "peak"} (the peak of forward and backward). The logits are bf16 and the loss is torchtitan's
    ``cross_entropy(pred.float(), labels)`` with ``pred`` deleted before backward; ``parallel``: under
    ``loss_parallel()`` (torchtitan with TP, vocabulary-sharded logits: ``width`` of ``width·tp``), whose
    log-softmax and fused backward are Python composites (torch/distributed/tensor/parallel/loss.py), else
    on the whole logits (``width`` wide). Makes and destroys the default process group: call it where none exists."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course.observe.memory import LiveBytes

    class Local(LiveBytes):  # sees the operations DTensor runs on its local shards, not its fake shape checks
        def follow(self, t):
            if not isinstance(t, (DTensor, FakeTensor)) and t.device.type != "meta":
                super().follow(t)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs it, on local tensors this mode then sees
            return super().__torch_dispatch__(func, types, args, kwargs)

    if dist.is_initialized():
        raise RuntimeError("loss_peak_bytes makes its own fake process group: call it in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        torch.manual_seed(0)
        vocab = width * tp if parallel else width
        hidden = torch.randn(tokens, 64, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(64, width, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(vocab, (tokens,))
        with Local([hidden, weight, labels]) as live:
            before = live.now()
            pred = hidden @ weight  # the output layer: this rank's logits
            if parallel:
                pred = DTensor.from_local(pred, mesh, [Shard(-1)])
            with loss_parallel() if parallel else contextlib.nullcontext():
                loss = F.cross_entropy(pred.float(), labels)
                forward = live.peak
                del pred
                loss.backward()
    finally:
        dist.destroy_process_group()
    return {"forward": (forward - before) / (tokens * width), "peak": (live.peak - before) / (tokens * width)}


def accumulated_gradient_bytes(sync: bool, world: int = 4) -> float:
    """Bytes per parameter that FSDP2 (bf16 weights, gradients reduced in fp32, torchtitan's policy) holds
    in gradients after two backwards, measured with ``LiveBytes`` as one rank of ``world`` on the fake process
    group. ``sync=False``: ``set_requires_gradient_sync(False)``, what torch.distributed.pipelining's
    ``backward_maybe_with_nosync`` sets before every micro-batch's backward, the last included (it
    reduce-scatters once, after the last: ``perform_reduce_grad``): the gradients stay unsharded,
    accumulated in fp32 (4). ``sync=True``: reduce-scattered, an fp32 shard (``4 / world``).
    Makes and destroys the default process group: call it where none exists."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course.observe.memory import LiveBytes

    if dist.is_initialized():
        raise RuntimeError("accumulated_gradient_bytes makes its own fake process group: call it where none exists")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)  # as under PP
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        model.set_requires_gradient_sync(sync)
        with LiveBytes(model.parameters()) as live:
            before = live.now()
            for _ in range(2):  # two micro-batches
                model(torch.randn(8, 64)).sum().backward()
            held = live.now() - before
    finally:
        dist.destroy_process_group()
    return held / sum(p.numel() for p in model.parameters())


def bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The pipeline's idle time as a fraction of its ideal compute time (a model, equal forward,
    input-gradient and weight-gradient times): ``f / (1 - f)`` of the schedules notebook's
    :func:`~course.parallel.schedules.bubble_fraction` ``f``, the idle fraction of the whole step.
    GPipe and 1F1B: ``(p-1)/m`` (Megatron's bubble/ideal ratio), for every ``m``; interleaved with ``v``
    chunks per rank: ``(p-1)/(v·m)`` (Narayanan et al. 2021); ZB-H1 (Qi et al. 2023): a third of 1F1B's,
    ``(p-1)/(3m)``. These two laws hold for ``m >= p``; with fewer micro-batches both idle more, and the
    figure is the simulator's for the schedules notebook's table (the table torch 2.15 builds: a test),
    e.g. ZB-H1 with ``m = 1``: ``2(p-1)/3``, not ``(p-1)/3``. ZB-H2 (the course's
    :func:`~course.parallel.schedules.zb_h2`): what rank 0 idles inside its own step, ``max(0, 2p-1-m)``
    forwards' time per ``3m`` of compute (0 from ``m = 2p-1`` on), on the paper's condition that
    consecutive steps then overlap, the next one starting on rank 0 while the last rank finishes: no
    all-reduce before the optimizer step (post-validation); with one, its step idles as ZB-H1's."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule is one of {SCHEDULES}, not {schedule!r}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp, m and v are >= 1, not {pp}, {m}, {v}")
    if schedule == "zb-h2":
        return max(0, 2 * pp - 1 - m) / (3 * m)
    if schedule in ("interleaved", "zb-h1") and m < pp:  # outside the law's domain
        return _simulated_bubble(schedule, pp, m, v)
    idle = bubble_fraction(schedule, pp, m, v)  # idle / (compute + idle)
    return idle / (1 - idle)


@functools.lru_cache(maxsize=1024)
def _simulated_bubble(schedule: str, pp: int, m: int, v: int) -> float:
    """:func:`bubble` of the schedules notebook's table, played by its simulator in unit time (F = B = W)."""
    table = interleaved_1f1b(pp, m, v) if schedule == "interleaved" else zb_h1(pp, m)
    idle = simulate(table, pp, m, v).bubble
    return idle / (1 - idle)


def in_flight(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> float:
    """Micro-batches whose activations pipeline stage ``stage`` holds at its peak, in units of all its
    layers. GPipe: all ``m`` (every forward before any backward, as the capstone's 8-rank run does);
    1F1B: ``min(p - stage, m)``; ZB-H1: ``min(p, m)`` on every stage (a micro-batch is held from its
    F until its W, and rank ``r`` keeps ``r`` W's for the end); ZB-H2: ``min(2p - 1, m)`` on every
    stage; interleaved (Megatron's warm-up): ``2(p - stage - 1) + (v - 1)p + 1`` chunks of ``1/v`` of
    the stage's layers, at most ``m·v``. Each is the peak the schedules notebook's simulator counts
    (a test). A micro-batch waiting for its W is counted whole, though W needs less than all of it."""
    if schedule == "gpipe":
        return m
    if schedule == "zb-h1":
        return min(pp, m)
    if schedule == "zb-h2":
        return min(2 * pp - 1, m)
    if schedule == "interleaved":
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v) / v
    return min(pp - stage, m)


def micro_batches(config: Config, global_batch: int) -> int:
    """Micro-batches per step on each pipeline (gradient accumulation steps without PP): the global
    batch's sequences over the ``dp`` replicas, ``micro_batch`` at a time."""
    return max(1, global_batch // (config.dp * config.micro_batch))


def memory(model: Model, config: Config, seq: int, global_batch: int, stage=None, kernels: str = "cuda",
           activation_scale: float = 1.0) -> dict:
    """Bytes per GPU of pipeline stage ``stage`` (None: the fullest): {"parameters", "gradients",
    "optimizer", "activations"}."""
    return dict(_memory(model, config, seq, global_batch, stage, kernels, activation_scale))


@functools.lru_cache(maxsize=2**16)
def _memory(model: Model, config: Config, seq: int, global_batch: int, stage, kernels: str,
            activation_scale: float) -> tuple:
    """:func:`memory`'s figures as (name, bytes) pairs, remembered: a search asks for the same ones many times
    (every setting of a sensitivity sweep that leaves the memory alone)."""
    c = config
    if stage is None:  # the fullest is an end stage or the first full-length one
        stages = sorted({0, min(1, c.pp - 1), c.pp - 1})
        fullest = max((memory(model, c, seq, global_batch, s, kernels, activation_scale) for s in stages),
                      key=lambda used: sum(used.values()))
        return tuple(fullest.items())
    params = stage_params(model, c.tp, c.pp, stage)
    m = micro_batches(c, global_batch)
    b, h = c.micro_batch, model.hidden
    split = (c.tp if c.sp else 1) * c.cp  # how many ranks share one sequence's activations
    token_features = seq * b * h / split
    kept = activation_coefficient(model, kernels, c.recompute) * activation_scale
    held = in_flight(c.schedule, c.pp, m, stage, c.v)
    activations = kept * token_features * stage_layers(model, c.pp, stage) * held
    if c.recompute != "none":  # one layer's activations rebuilt while it is recomputed
        activations += (activation_coefficient(model, kernels) * activation_scale - kept) * token_features
    if stage == c.pp - 1:  # the logits: bf16, their fp32 copy and the fp32 log-softmax (LOGIT_BYTES)
        activations += LOGIT_BYTES * seq * b * model.vocab / (c.tp if model.vocab_parallel else 1) / c.cp
    shards = c.dp * c.cp
    parameters = 2 * params / (shards if c.zero >= 3 else 1)
    gradients = 2 * params / (shards if c.zero >= 2 else 1)
    if c.zero >= 3 and shards > 1:  # whole layers in backward (see the assumptions), the root module whole
        ends = params - stage_params(model, c.tp, c.pp, stage, ends=False)
        layer = 2 * model.layer_params() / c.tp  # one layer's bf16 weights on this GPU
        parameters += max(3 * layer, 5 * layer - kept * token_features) + 2 * ends * (1 - 1 / shards)
        if stage == c.pp - 1:  # the output layer's (and final norm's) bf16 gradient, whole until backward ends
            gradients += 2 * (model.vocab * model.hidden / (c.tp if model.vocab_parallel else 1)
                              + (model.hidden if model.norms else 0)) * (1 - 1 / shards)
    return tuple({
        "parameters": parameters,
        "gradients": gradients,
        "optimizer": 12 * params / (shards if c.zero >= 1 else 1),
        "activations": activations,
    }.items())


# Bytes per logit (of this GPU's shard) at the loss's peak, in backward: :func:`loss_peak_bytes` measures them
# (torch 2.15, tests/test_planner.py). Plain cross-entropy on the fp32 copy: its log-softmax, the gradient
# nll_loss makes and the one log-softmax's backward makes (12). Under loss_parallel() (torchtitan with TP):
# the log-softmax, zeros, their exp and its sum in the fused backward (16).
LOSS_PEAK_BYTES = {"plain": 12, "loss parallel": 16}
# FSDP2 without gradient sync keeps unsharded gradients in fp32 (:func:`accumulated_gradient_bytes`)
ACCUMULATED_GRADIENT_BYTES = 4


def torchtitan_terms(model: Model, config: Config, seq: int, global_batch: int, stage=None) -> dict:
    """Estimates of what a torchtitan run (2024-12) holds at its peak and :func:`memory` leaves out, in bytes
    per GPU of ``stage`` (None: the stage where memory plus these terms is largest), each from a measured
    per-element cost times the model's element count, added to the model, not in it:

    * "loss": on the last stage, the loss's peak (at the start of backward, before any layer is recomputed)
      is :data:`LOSS_PEAK_BYTES` per logit (loss parallel under TP), where :func:`memory` counts
      :data:`LOGIT_BYTES` per logit *and* the layer being recomputed, which is not alive then;
    * "output layer's input": on the last stage, the final norm's output, which the output layer saves for
      its weight's gradient: ``2·s·b·h`` bytes, whole (all-gathered from the sequence-parallel shards);
    * "accumulated gradients": with a pipeline, FSDP2 (ZeRO-2 here) gets no gradient sync in any micro-batch's
      backward and reduce-scatters once after the last (torch.distributed.pipelining's
      ``backward_maybe_with_nosync``), so the stage's gradients stay unsharded in fp32
      (:data:`ACCUMULATED_GRADIENT_BYTES` per parameter), where
      :func:`memory` counts a bf16 shard.

    Returns {"stage", "loss", "output layer's input", "accumulated gradients", "model", "estimate"}."""
    c = config
    if stage is None:
        found = [torchtitan_terms(model, c, seq, global_batch, s) for s in sorted({0, min(1, c.pp - 1), c.pp - 1})]
        return max(found, key=lambda terms: terms["estimate"])
    used = memory(model, c, seq, global_batch, stage)
    b = c.micro_batch
    terms = {"stage": stage, "loss": 0.0, "output layer's input": 0.0, "accumulated gradients": 0.0}
    if stage == c.pp - 1:
        logits = seq * b * model.vocab / (c.tp if model.vocab_parallel else 1) / c.cp
        peak = LOSS_PEAK_BYTES["loss parallel" if c.tp > 1 and model.vocab_parallel else "plain"] * logits
        split = (c.tp if c.sp else 1) * c.cp
        kept = activation_coefficient(model, "cuda", c.recompute)
        rebuilt = (activation_coefficient(model, "cuda") - kept) * seq * b * model.hidden / split
        rebuilt = rebuilt if c.recompute != "none" else 0.0
        terms["loss"] = max(peak, rebuilt) - (LOGIT_BYTES * logits + rebuilt)
        terms["output layer's input"] = 2 * seq * b * model.hidden / c.cp
    if c.pp > 1 and c.dp * c.cp > 1 and c.zero >= 2:
        terms["accumulated gradients"] = (ACCUMULATED_GRADIENT_BYTES * stage_params(model, c.tp, c.pp, stage)
                                          - used["gradients"])
    terms["model"] = sum(used.values())
    terms["estimate"] = terms["model"] + terms["loss"] + terms["output layer's input"] + terms["accumulated gradients"]
    return terms


def ring(n: int) -> float:
    """Bytes a rank sends in a bandwidth-optimal all-reduce, per byte of the tensor."""
    return 2 * (n - 1) / n


def dp_factor(zero: int, dp: int, m: int) -> float:
    """Bytes a data-parallel rank sends per step, per byte of its gradients (see the assumptions)."""
    share = (dp - 1) / dp
    return {0: 2 * share, 1: 2 * share, 2: (m + 1) * share, 3: 3 * m * share}[zero]


def _pp_sends(config: Config, stage: int) -> int:
    """Point-to-point sends per micro-batch of stage ``stage``: forward and back for each model chunk,
    except the first chunk's gradient (nothing before it) and the last chunk's activation."""
    c = config
    return 0 if c.pp == 1 else 2 * c.v - (stage == 0) - (stage == c.pp - 1)


def _cp_passes(config: Config) -> int:
    """K/V-sized messages one context-parallel rank sends per layer and micro-batch in notebook 15's ring
    attention: ``cp - 1`` K/V chunks in forward; in backward ``cp - 1`` again, and the dK/dV accumulators
    ``cp`` times (the last pass takes each home); full recomputation runs the forward's ring again."""
    n = config.cp
    return 0 if n == 1 else 3 * n - 2 + (n - 1 if config.recompute == "full" else 0)


def traffic(model: Model, config: Config, seq: int, global_batch: int, dtype_bytes: int = 2, stage=None) -> dict:
    """Bytes one GPU of ``stage`` sends per step, per dimension: {"tp", "pp", "dp", "cp"} (None: each
    dimension's busiest stage)."""
    c = config
    if stage is None:
        per_stage = [traffic(model, c, seq, global_batch, dtype_bytes, s) for s in sorted({0, c.pp // 2, c.pp - 1})]
        return {dim: max(t[dim] for t in per_stage) for dim in per_stage[0]}
    m = micro_batches(config, global_batch)
    activation = seq * c.micro_batch * model.hidden * dtype_bytes / c.cp
    layers = stage_layers(model, c.pp, stage)
    params = stage_params(model, c.tp, c.pp, stage)
    kv = 2 * seq / c.cp * c.micro_batch * model.hidden * model.kv_heads // model.heads * dtype_bytes / c.tp
    return {
        "tp": (6 if c.recompute == "full" else 4) * layers * m * activation * ring(c.tp),
        "pp": _pp_sends(c, stage) * m * activation / (c.tp if c.sp else 1),
        "dp": dp_factor(c.zero, c.dp * c.cp, m) * params * dtype_bytes,
        "cp": _cp_passes(c) * layers * m * kv,  # K/V (and their gradients) around the ring
    }


def ring_steps(model: Model, config: Config, global_batch: int, stage: int) -> dict:
    """Latency-bound steps one GPU of ``stage`` waits through per step, per dimension: each collective's
    ring steps (an all-reduce ``2(n-1)``, a reduce-scatter or all-gather ``n-1``; DP issues one
    collective per layer, as FSDP and DDP's buckets do) and each point-to-point message."""
    c = config
    m, layers = micro_batches(c, global_batch), stage_layers(model, c.pp, stage)
    n = c.dp * c.cp
    per_layer = {0: 2 * (n - 1), 1: 2 * (n - 1), 2: (m + 1) * (n - 1), 3: 3 * m * (n - 1)}[c.zero]
    return {
        "tp": (6 if c.recompute == "full" else 4) * layers * m * 2 * (c.tp - 1),
        "pp": _pp_sends(c, stage) * m,
        "dp": per_layer * layers,
        "cp": _cp_passes(c) * layers * m,
    }


@functools.lru_cache(maxsize=None)
def flops_per_token(model: Model, seq: int, recompute: str = "none") -> float:
    """Training FLOPs per token (a model): ``6`` per parameter of the matrices (the input embedding is
    a lookup) plus causal attention's ``6·L·h·s`` (half of PaLM's ``12·L·h·s``); full recomputation
    runs each layer's forward again (8 and 8); selective recomputation (torchtitan's policy) runs again
    every second matrix of a layer, 2 FLOPs per parameter of those, and keeps attention's output."""
    matmuls = model.params() - model.vocab * model.hidden
    layer_matrices = sum(i * o for i, o in model.matrices())
    extra = {"none": 0, "full": 2 * layer_matrices, "selective": 2 * sum(i * o for i, o in model.matrices()[1::2])}
    attention = 6 * model.layers * model.hidden * seq
    return 6 * matmuls + model.layers * extra[recompute] + attention * (8 / 6 if recompute == "full" else 1)


def step_time(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> dict:
    """Seconds per step: {"compute", "bubble", "tp", "pp", "cp", "dp exposed", "total"} (a model)."""
    return dict(_step_time(model, _without_memory(cluster), config, seq, global_batch))


@functools.lru_cache(maxsize=2**16)
def _step_time(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> tuple:
    """:func:`step_time`'s figures as (name, seconds) pairs, remembered."""
    c = config
    flops = flops_per_token(model, seq, c.recompute) * global_batch * seq / c.gpus
    slowest = max(stage_layers(model, c.pp, s) for s in {0, min(1, c.pp - 1)}) * c.pp / model.layers
    compute = flops / (cluster.flops * cluster.mfu) * slowest  # the pipeline runs at its slowest stage's pace
    m = micro_batches(c, global_batch)
    sent = traffic(model, c, seq, global_batch)
    stage = min(1, c.pp - 1)  # a full-length stage
    steps = ring_steps(model, c, global_batch, stage)

    def link(group_span):  # the slowest link a group of ranks that far apart uses, and its latency
        inside = group_span <= cluster.per_node
        return (cluster.intra_node, cluster.alpha_intra) if inside else (cluster.inter_node, cluster.alpha_inter)

    def seconds(dim, span):
        bandwidth, alpha = link(span)
        return sent[dim] / bandwidth + steps[dim] * alpha

    dp = seconds("dp", c.gpus)
    times = {
        "compute": compute,
        "bubble": compute * bubble(c.schedule, c.pp, m, c.v),
        "tp": seconds("tp", c.tp),
        "cp": seconds("cp", c.tp * c.cp),
        "pp": seconds("pp", c.tp * c.cp * c.pp),
        "dp exposed": max(0.0, dp - compute * (1 if c.zero >= 2 else 2 / 3 / m)),
    }
    times["total"] = sum(times.values())
    return tuple(times.items())


def fits(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> bool:
    """Does the fullest stage stay within the usable part of a GPU's memory?"""
    used = memory(model, config, seq, global_batch, kernels=cluster.kernels, activation_scale=cluster.activation_scale)
    return sum(used.values()) <= cluster.usable * cluster.memory


def valid(model: Model, cluster: Cluster, config: Config, global_batch: int) -> bool:
    """Can this configuration run at all: the GPUs, heads and layers divide, the global batch's sequences
    split evenly over the data-parallel replicas (so ``dp × micro_batch`` is at most the global batch), and
    torch 2.15's schedule takes its ``m`` micro-batches (torch/distributed/pipelining/schedules.py):
    ``Schedule1F1B`` needs ``m >= pp``; ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
    (interleaved, ZB-H1) need equal rounds, ``m`` a multiple of ``max(1, m // pp)`` (so ``m = pp + 1``
    and ``m < pp`` run, ``m = 2pp + 1`` does not). One condition is the course's, not torch's:
    interleaved only with ``m`` a multiple of ``pp``, where :func:`in_flight` counts its warm-up (in
    rounds of ``pp`` micro-batches). tests/test_planner.py builds torch's schedules to check each."""
    c = config
    m = micro_batches(c, global_batch)
    return (
        c.gpus == cluster.gpus
        and model.heads % c.tp == 0
        and model.kv_heads % c.tp == 0
        and splits(model, c.pp)
        and c.pp * c.v <= model.layers
        and global_batch % (c.dp * c.micro_batch) == 0
        and c.tp <= cluster.per_node
        and (c.pp == 1 or c.schedule != "1f1b" or m >= c.pp)  # torch's Schedule1F1B
        and (c.schedule not in ("interleaved", "zb-h1") or m % max(1, m // c.pp) == 0)  # torch's equal rounds
        and (c.schedule != "interleaved" or m % c.pp == 0)  # the course's: in_flight's warm-up
    )


def candidates(model: Model, cluster: Cluster, global_batch: int, seq: int, cp=(1,), schedules=TORCH_SCHEDULES):
    """Every valid configuration (powers of two for dp, tp, pp; context parallelism of each size in
    ``cp`` that cuts the sequence into ``2·cp`` equal chunks, notebook 15's zigzag layout: pass e.g.
    ``cp=(1, 2, 4, 8, 16)`` to let it in; every ZeRO stage; micro-batches of 1, 2 or 4; each
    recomputation policy; with pipelines, those of 1F1B, interleaved with 2 or 4 chunks per rank, ZB-H1
    and ZB-H2 named in ``schedules``: by default :data:`TORCH_SCHEDULES`, the planner's schedules that
    torch 2.15 runs, so not ZB-H2; pass :data:`SCHEDULES` to let it in; never GPipe, which idles as long
    as 1F1B in this model and holds more, so ``schedules=("gpipe",)`` gives layouts without a pipeline
    only, and so not the layouts with fewer micro-batches than stages that torch's GPipe runs and its 1F1B
    refuses): the ones that fit first, fastest first, then the rest, by memory."""
    if isinstance(schedules, str) or not set(schedules) <= set(SCHEDULES):
        raise ValueError(f"schedules: a tuple of some of {SCHEDULES}, not {schedules!r}")
    found = _valid_configs(model, _without_memory(cluster), global_batch, seq, tuple(cp), tuple(schedules))

    def key(c):  # fitting first, then fastest, then the least memory
        total = sum(memory(model, c, seq, global_batch, kernels=cluster.kernels,
                           activation_scale=cluster.activation_scale).values())
        fitting = total <= cluster.usable * cluster.memory  # as fits() says
        return (not fitting, step_time(model, cluster, c, seq, global_batch)["total"] if fitting else 0.0, total)

    return sorted(found, key=key)


@functools.lru_cache(maxsize=256)
def _valid_configs(model: Model, cluster: Cluster, global_batch: int, seq: int, cp: tuple, schedules: tuple) -> tuple:
    """:func:`candidates`' configurations, unsorted, remembered (a sweep searches the same ones again)."""
    powers = [2**i for i in range(20) if 2**i <= cluster.gpus]
    piped = [("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1), ("zb-h2", 1)]
    schedules = {1: [("1f1b", 1)], 0: [(name, v) for name, v in piped if name in schedules]}
    found = []
    for tp, pp, cp_, zero, b, recompute in itertools.product(powers, powers, cp, (0, 1, 2, 3), (1, 2, 4), RECOMPUTE):
        if cluster.gpus % (tp * pp * cp_) or tp > cluster.per_node or pp > model.layers or seq % (2 * cp_):
            continue
        for schedule, v in schedules[pp == 1]:
            config = Config(cluster.gpus // (tp * pp * cp_), tp, pp, cp_, zero, b, recompute, schedule=schedule, v=v)
            if valid(model, cluster, config, global_batch):
                found.append(config)
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _without_memory(cluster: Cluster) -> Cluster:
    """``cluster`` less its memory settings (what a sweep changes), which neither a step's time nor which
    configurations are valid depend on: searches that differ only in those share the remembered answers."""
    return dataclasses.replace(cluster, memory=0.0, usable=1.0, kernels="cuda", activation_scale=1.0)


def best(model: Model, cluster: Cluster, global_batch: int, seq: int, cp=(1,), schedules=TORCH_SCHEDULES) -> Config:
    """The fastest configuration that fits, by this model (``cp``, ``schedules``: see :func:`candidates`)."""
    for config in candidates(model, cluster, global_batch, seq, cp, schedules):
        if fits(model, cluster, config, seq, global_batch):
            return config
    raise ValueError(f"no configuration of {model.name} fits in {cluster.usable:.0%} of {cluster.gpus} GPUs of "
                     f"{cluster.memory / 1e9:.0f} GB")


GiB = 2**30
# Published runs (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md, 96 GB H100s; sequences of 8192
# tokens: seq_len in train_configs/llama3_{8b,70b,405b}.toml at the commit it names, 9dec370): (run, model, GPUs,
# configuration, global batch, GiB per GPU, why the model does not cover it or None). torchtitan reports the
# caching allocator's peak *reserved* bytes (torchtitan/metrics.py:62 at 9dec370, memory_stats()
# "reserved_bytes.all.peak"); the model predicts the tensors' bytes (what max_memory_allocated counts). At
# 9dec370 run_llama_train.sh:22 sets PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" (one node, torchrun);
# multinode_trainer.slurm does not; the benchmark does not say how its 256- and 512-GPU runs were launched.
# FSDP under PP is ZeRO-2 here: torchtitan does not reshard the weights after forward under a pipeline.
# :func:`torchtitan_terms` estimates what these runs hold beyond the model.
PUBLISHED = [
    ("8B FSDP 8, selective AC (T1)", LLAMA3_8B, 8, Config(dp=8, zero=3, micro_batch=2, recompute="selective"),
     16, 82.4, None),
    ("8B FSDP 8 + compile (T1)", LLAMA3_8B, 8, Config(dp=8, zero=3, micro_batch=2, recompute="selective"),
     16, 77.0, "torch.compile: fewer saved tensors"),
    ("8B FSDP 128, selective AC (T3)", LLAMA3_8B, 128, Config(dp=128, zero=3, micro_batch=2, recompute="selective"),
     256, 67.0, None),
    ("70B FSDP 32 x TP 8, full AC (T4)", LLAMA3_70B, 256, Config(dp=32, tp=8, zero=3, micro_batch=16, recompute="full"),
     512, 71.9, "Float8, compile; part unexplained"),
    ("405B 8x8x8 1F1B, full AC (T5)", LLAMA3_405B, 512,
     Config(dp=8, tp=8, pp=8, zero=2, micro_batch=4, recompute="full"), 256, 82.5,
     "Float8, compile; part unexplained"),
    ("405B 8x8x8 interleaved (T5)", LLAMA3_405B, 512,
     Config(dp=8, tp=8, pp=8, zero=2, micro_batch=4, recompute="full", schedule="interleaved", v=2), 256, 72.7,
     "Float8, compile; part unexplained"),
]
WITHIN = 0.15  # how close a covered run's prediction must be


def validation(seq: int = 8192) -> list:
    """The model's memory per GPU for each :data:`PUBLISHED` run: a list of dicts with "run",
    "published" and "predicted" (GiB), "ratio" (predicted / published), "within" (of :data:`WITHIN`),
    "why not" (None where the model covers the run) and "estimate" (GiB: the model plus
    :func:`torchtitan_terms`, estimates outside the model)."""
    rows = []
    for run, model, gpus, config, batch, published, why in PUBLISHED:
        if config.gpus != gpus:
            raise ValueError(f"{run}: {config} uses {config.gpus} GPUs, not {gpus}")
        predicted = sum(memory(model, config, seq, batch).values()) / GiB
        rows.append({"run": run, "published": published, "predicted": predicted, "ratio": predicted / published,
                     "within": abs(predicted / published - 1) <= WITHIN, "why not": why,
                     "estimate": torchtitan_terms(model, config, seq, batch)["estimate"] / GiB})
    return rows


# Llama 3 405B's pre-training (Llama Team, *The Llama 3 Herd of Models*, arXiv:2407.21783, not read here: the
# layout second-hand, as P. Balaji's SC'24 slide lists it, quoted at glennklockwood.com/garden/llama-3.1): 16,384
# H100s, TP 8 x PP 16, 16M tokens (2,048 sequences of 8,192) per step, so DP 128; an interleaved schedule, the
# first and last stages one layer shorter (the paper's section 3.3.2, as reported); FSDP sharding the optimizer state and gradients, not resharding the
# weights after forward (ZeRO-2 here). The paper does not give v; 4 chunks per rank is our assumption.
LLAMA3_405B_RUN = (LLAMA3_405B, Cluster(16384), 2048, 8192,
                   Config(dp=128, tp=8, pp=16, zero=2, micro_batch=1, recompute="selective", schedule="interleaved", v=4))

# Its long-context stage, second-hand: P. Balaji's SC'24 slide (Herding Llamas), as glennklockwood.com/garden/
# llama-3.1 quotes it (the paper's own table not read here): 16,384 GPUs, TP 8, CP 16, PP 16, 16M tokens (128
# sequences of 131,072) per step. The slide has no DP column; DP 8 is what makes 8 x 16 x 16 x DP = 16,384.
# v, recomputation and ZeRO-2 assumed as above.
LLAMA3_405B_LONG_RUN = (LLAMA3_405B, Cluster(16384), 128, 131072,
                        Config(dp=8, tp=8, pp=16, cp=16, zero=2, micro_batch=1, recompute="selective",
                               schedule="interleaved", v=4))

def llama3_405b_check() -> dict:
    """Meta's layout for Llama 3 405B by this model: {"config", "fits", "GB", "seconds", "best", "best seconds",
    "slower" (its step time over the best's)}."""
    model, cluster, batch, seq, config = LLAMA3_405B_RUN
    fastest = best(model, cluster, batch, seq)
    mine, theirs = (step_time(model, cluster, c, seq, batch)["total"] for c in (config, fastest))
    return {"config": config, "fits": fits(model, cluster, config, seq, batch),
            "GB": sum(memory(model, config, seq, batch).values()) / 1e9, "seconds": mine, "best": fastest,
            "best seconds": theirs, "slower": mine / theirs}
