"""A model of memory and communication per GPU, for choosing a parallel configuration (notebook 17).

Everything here is a **model**: formulas built from the laws notebooks 10–15 measured, with
their assumptions written down, so they can be checked against small runs before they are
trusted for big ones (notebook 17 does that on 8 ranks).

Assumptions (change them by changing the arguments):

* a decoder-only transformer (:class:`Model`): per layer the attention projections
  (grouped-query: ``kv_heads`` ≤ ``heads``) and an MLP of ``ffn_matrices`` matrices
  (2 for GELU, 3 for SwiGLU); embedding and output layer ``vocab × hidden`` each (untied);
* mixed precision as notebook 11 measured it: bf16 parameters and gradients, fp32 master
  weights and Adam's two moments: 2 + 2 + 12 = 16 bytes per parameter before sharding
  (frameworks that accumulate or reduce gradients in fp32 hold 2 bytes more per parameter);
* TP splits every layer's matrices (not the norms or the row-parallel biases) and, with
  ``vocab_parallel``, the embedding and the output layer (Megatron's vocabulary-parallel
  layers, torchtitan's plan); with sequence parallelism (``Config.sp``) it also splits the
  activations between the layers. PP gives each stage ``layers / pp`` layers, the first stage
  also the embedding, the last the output layer; ZeRO stage 1/2/3 shards optimizer state /
  + gradients / + parameters over the ``dp`` ranks;
* activations of one layer for one micro-batch of ``b`` sequences of ``s`` tokens:
  ``c·s·b·h`` bytes, where ``c`` is **measured** (:func:`activation_coefficient`: the bytes
  autograd saves for backward in one bf16 block of the model's shape, scaled down, on this
  machine's kernels; 34 for Korthikanti et al.'s GPT block with dropout, about 53 for a
  Llama block on CPU kernels), divided by ``tp`` (with sequence parallelism) and ``cp``. With
  full recomputation a layer keeps only its input, ``2·s·b·h``, and one layer's whole
  activations exist during its recomputation. Under 1F1B stage ``p`` holds
  ``min(pp - p, m)`` micro-batches. The last stage also holds the logits and their gradient
  in fp32, ``2·4·s·b·vocab`` bytes (divided by ``tp`` with ``vocab_parallel``). A fraction
  ``1 - Cluster.usable`` of each GPU is kept free (allocator fragmentation, NCCL buffers,
  the CUDA context: an assumption, not a measurement);
* communication per GPU and step (bytes *sent*, bandwidth-optimal ring collectives):
  TP: 4 all-reduces (or their reduce-scatter + all-gather halves) of ``s·b·h`` activations
  per layer per micro-batch (6 with recomputation), each ``2(tp-1)/tp`` × its size;
  PP: one activation forward and one gradient back per micro-batch per cut (a middle stage),
  ``1/tp`` of it with sequence parallelism (each TP rank sends its slice);
  DP, with ``m`` micro-batches per step: ZeRO-0/1 all-reduce the accumulated gradients once,
  ``2(dp-1)/dp`` × their size; ZeRO-2 keeps only a shard of the gradients, so it
  reduce-scatters every micro-batch's (``m·(dp-1)/dp``) and all-gathers the parameters once;
  ZeRO-3 (FSDP's default) all-gathers the parameters twice and reduce-scatters the gradients
  for every micro-batch, ``3m(dp-1)/dp``, and holds two layers unsharded at a time (the one
  computing and the one prefetched);
* time: per token, ``6`` FLOPs per parameter of the matrices (the input embedding is a
  lookup, not a matmul; 8 with full recomputation) plus causal attention's ``6·L·h·s``
  (half of PaLM's ``12·L·h·s``), at ``mfu`` × the GPU's peak; the pipeline bubble adds
  ``(pp-1)/m`` of that (Megatron's bubble/ideal ratio); TP and PP communication at the
  link's bandwidth, not overlapped; DP communication overlaps with what runs beside it
  (ZeRO-0/1: the last micro-batch's backward, when the all-reduce runs; ZeRO-2/3, which
  communicate every micro-batch: all of forward and backward) and what does not fit adds.

Left out, among much else: selective recomputation, interleaved and zero-bubble pipeline
schedules, hybrid sharding (HSDP), overlapped TP communication, expert parallelism.

The numbers for a GPU (:class:`Cluster`) are parameters: the defaults are an H100 SXM node
(989 TFLOP/s bf16 dense, 80 GB, NVLink ~450 GB/s per direction, 8 per node) on a 400 Gb/s
network (~50 GB/s per GPU).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass


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

    def params(self) -> int:
        h = self.hidden
        ends = self.vocab * h + self.vocab * h + (self.vocab if self.bias else 0) + (h if self.norms else 0)
        return self.layers * self.layer_params() + ends


LLAMA3_8B = Model("Llama-3 8B", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
LLAMA3_70B = Model("Llama-3 70B", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256)


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


@dataclass(frozen=True)
class Config:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1  # 0: none, 1: optimizer state, 2: + gradients, 3: + parameters
    micro_batch: int = 1  # sequences per micro-batch
    recompute: bool = False
    sp: bool = True  # sequence parallelism with TP: activations between layers split too

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Config: {name} must be a whole number >= 1, not {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Config: zero is a ZeRO stage, 0, 1, 2 or 3, not {self.zero!r}")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def stage_params(model: Model, tp: int, pp: int, stage: int) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds under ``tp``-way tensor parallelism."""
    h, per_layer = model.hidden, model.layer_params()
    replicated = (2 * h if model.norms else 0) + (2 * h if model.bias else 0)  # norms, row-parallel biases
    layer = (per_layer - replicated) // tp + replicated
    params = model.layers // pp * layer
    vocab = model.vocab * h // (tp if model.vocab_parallel else 1)
    if stage == 0:
        params += vocab
    if stage == pp - 1:
        params += vocab + (model.vocab if model.bias else 0) + (h if model.norms else 0)
    return params


@functools.lru_cache(maxsize=None)
def activation_coefficient(model: Model, seq: int = 64, head_dim: int = 8) -> float:
    """Bytes autograd saves for backward in one layer of ``model``, per token and per hidden
    feature, measured on a bf16 block of the same shape scaled down (``head_dim``-wide heads,
    the same heads, K/V heads and MLP ratio): ``saved_tensors_hooks`` see every tensor a
    layer keeps, and each storage is counted once. On this machine's (CPU) kernels; a GPU's
    attention kernel saves the same tensors (inputs, output, log-sum-exp)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from course.observe.memory import saved_activation_bytes

    h, kv = model.heads * head_dim, model.kv_heads * head_dim
    f = round(model.ffn / model.hidden * h)
    norm = (lambda: nn.RMSNorm(h)) if model.norms else nn.Identity
    linear = functools.partial(nn.Linear, bias=model.bias, dtype=torch.bfloat16)
    n1, n2 = norm().to(torch.bfloat16), norm().to(torch.bfloat16)
    q, k, v, o = linear(h, h), linear(h, kv), linear(h, kv), linear(h, h)
    mlp = [linear(h, f) for _ in range(model.ffn_matrices - 1)] + [linear(f, h)]
    x = torch.randn(1, seq, h, dtype=torch.bfloat16, requires_grad=True)

    def heads(t, n):
        return t.view(1, seq, n, head_dim).transpose(1, 2)

    def block(x):
        y = n1(x)
        a = F.scaled_dot_product_attention(heads(q(y), model.heads), heads(k(y), model.kv_heads),
                                           heads(v(y), model.kv_heads), is_causal=True,
                                           enable_gqa=model.kv_heads != model.heads)
        x = x + o(a.transpose(1, 2).reshape(1, seq, h))
        y = n2(x)
        hidden = F.silu(mlp[0](y)) * mlp[1](y) if model.ffn_matrices == 3 else F.gelu(mlp[0](y))
        return x + mlp[-1](hidden)

    saved, _ = saved_activation_bytes(block, nn.ModuleList([n1, n2, q, k, v, o, *mlp]), x)  # weights excluded
    return saved / (seq * h)


def memory(model: Model, config: Config, seq: int, global_batch: int, stage=None) -> dict:
    """Bytes per GPU of pipeline stage ``stage`` (None: the fullest): {"parameters", "gradients",
    "optimizer", "activations"}."""
    if stage is None:
        return max((memory(model, config, seq, global_batch, s) for s in range(config.pp)), key=lambda m: sum(m.values()))
    c = config
    params = stage_params(model, c.tp, c.pp, stage)
    m = micro_batches(config, global_batch)
    b, h = c.micro_batch, model.hidden
    split = (c.tp if c.sp else 1) * c.cp  # how many ranks share one sequence's activations
    layer = activation_coefficient(model) * seq * b * h / split
    held = min(c.pp - stage, m)  # micro-batches in flight on this stage (1F1B)
    layers = model.layers // c.pp
    activations = (2 * seq * b * h / split * layers * held + layer) if c.recompute else layer * layers * held
    if stage == c.pp - 1:  # the logits and their gradient, fp32
        activations += 2 * 4 * seq * b * model.vocab / (c.tp if model.vocab_parallel else 1) / c.cp
    gathered = 2 * 2 * model.layer_params() / c.tp if c.zero >= 3 and c.dp > 1 else 0  # two layers, whole
    return {
        "parameters": 2 * params / (c.dp if c.zero >= 3 else 1) + gathered,
        "gradients": 2 * params / (c.dp if c.zero >= 2 else 1),
        "optimizer": 12 * params / (c.dp if c.zero >= 1 else 1),
        "activations": activations,
    }


def micro_batches(config: Config, global_batch: int) -> int:
    """Micro-batches per step on each pipeline (gradient accumulation steps without PP)."""
    return max(1, global_batch // (config.dp * config.micro_batch))


def ring(n: int) -> float:
    """Bytes a rank sends in a bandwidth-optimal all-reduce, per byte of the tensor."""
    return 2 * (n - 1) / n


def dp_factor(zero: int, dp: int, m: int) -> float:
    """Bytes a data-parallel rank sends per step, per byte of its gradients (see the assumptions)."""
    share = (dp - 1) / dp
    return {0: 2 * share, 1: 2 * share, 2: (m + 1) * share, 3: 3 * m * share}[zero]


def traffic(model: Model, config: Config, seq: int, global_batch: int, dtype_bytes: int = 2, stage=None) -> dict:
    """Bytes one GPU of ``stage`` (None: the fullest) sends per step, per dimension: {"tp", "pp", "dp", "cp"}."""
    c = config
    m = micro_batches(config, global_batch)
    activation = seq * c.micro_batch * model.hidden * dtype_bytes / c.cp
    layers = model.layers // c.pp
    params = max(stage_params(model, c.tp, c.pp, s) for s in (range(c.pp) if stage is None else [stage]))
    kv = 2 * seq / c.cp * c.micro_batch * model.hidden * model.kv_heads // model.heads * dtype_bytes / c.tp
    return {
        "tp": (6 if c.recompute else 4) * layers * m * activation * ring(c.tp),
        "pp": (2 if c.pp > 2 else 1) * m * activation / (c.tp if c.sp else 1) if c.pp > 1 else 0.0,
        "dp": dp_factor(c.zero, c.dp, m) * params * dtype_bytes,
        "cp": 3 * layers * m * kv * (c.cp - 1) if c.cp > 1 else 0.0,  # K/V around the ring, forward + backward
    }


def step_time(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> dict:
    """Seconds per step: {"compute", "bubble", "tp", "pp", "cp", "dp exposed", "total"} (a model)."""
    c = config
    tokens = global_batch * seq
    matmul_params = model.params() - model.vocab * model.hidden  # the input embedding is a lookup
    flops = ((8 if c.recompute else 6) * matmul_params + 6 * model.layers * model.hidden * seq) * tokens / c.gpus
    compute = flops / (cluster.flops * cluster.mfu)
    m = micro_batches(config, global_batch)
    bubble = compute * (c.pp - 1) / m
    sent = traffic(model, config, seq, global_batch)

    def link(group_span):  # the slowest link a group of ranks that far apart uses
        return cluster.intra_node if group_span <= cluster.per_node else cluster.inter_node

    times = {
        "compute": compute,
        "bubble": bubble,
        "tp": sent["tp"] / link(c.tp),
        "cp": sent["cp"] / link(c.tp * c.cp),
        "pp": sent["pp"] / link(c.tp * c.cp * c.pp),
        "dp exposed": max(0.0, sent["dp"] / link(c.gpus) - compute * (1 if c.zero >= 2 else 2 / 3 / m)),
    }
    times["total"] = sum(times.values())
    return times


def fits(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> bool:
    """Does the fullest stage stay within the usable part of a GPU's memory?"""
    return sum(memory(model, config, seq, global_batch).values()) <= cluster.usable * cluster.memory


def valid(model: Model, cluster: Cluster, config: Config, global_batch: int) -> bool:
    """Can this configuration run at all: the GPUs, heads, layers and batch divide evenly."""
    c = config
    return (
        c.gpus == cluster.gpus
        and model.heads % c.tp == 0
        and model.kv_heads % c.tp == 0
        and model.layers % c.pp == 0
        and global_batch % (c.dp * c.micro_batch) == 0
        and c.tp <= cluster.per_node
    )


def candidates(model: Model, cluster: Cluster, global_batch: int, seq: int, cp=(1,)):
    """Every valid configuration (powers of two for dp, tp, pp; ``cp`` from ``cp``; every ZeRO
    stage; micro-batches of 1, 2 or 4; with and without recomputation), the ones that fit
    first, fastest first."""
    powers = [2**i for i in range(12) if 2**i <= cluster.gpus]
    found = []
    for tp, pp, cp_, zero, b, recompute in itertools.product(powers, powers, cp, (0, 1, 2, 3), (1, 2, 4), (False, True)):
        if cluster.gpus % (tp * pp * cp_):
            continue
        config = Config(cluster.gpus // (tp * pp * cp_), tp, pp, cp_, zero, b, recompute)
        if valid(model, cluster, config, global_batch):
            found.append(config)
    def key(c):  # fitting first, then fastest, then the least memory
        total = sum(memory(model, c, seq, global_batch).values())
        return (not fits(model, cluster, c, seq, global_batch), step_time(model, cluster, c, seq, global_batch)["total"], total)

    return sorted(found, key=key)


def best(model: Model, cluster: Cluster, global_batch: int, seq: int, cp=(1,)) -> Config:
    """The fastest configuration that fits, by this model."""
    for config in candidates(model, cluster, global_batch, seq, cp):
        if fits(model, cluster, config, seq, global_batch):
            return config
    raise ValueError(f"no configuration of {model.name} fits in {cluster.usable:.0%} of {cluster.gpus} GPUs of "
                     f"{cluster.memory / 1e9:.0f} GB")
