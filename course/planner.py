"""A model of memory and communication per GPU, for choosing a parallel configuration (notebook 16).

Everything here is a **model**: formulas built from the laws notebooks 10–15 measured, with
their assumptions written down, so they can be checked against small runs before they are
trusted for big ones (notebook 16 does that on 8 ranks).

Assumptions (change them by changing the arguments):

* a decoder-only transformer (:class:`Model`): per layer the attention projections
  (grouped-query: ``kv_heads`` ≤ ``heads``) and an MLP of ``ffn_matrices`` matrices
  (2 for GELU, 3 for SwiGLU); embedding and output layer ``vocab × hidden`` each (untied);
* mixed precision as notebook 11 measured it: bf16 parameters and gradients, fp32 master
  weights and Adam's two moments: 2 + 2 + 12 = 16 bytes per parameter before sharding;
* TP splits every layer's matrices (not the embedding or output layer, not the row-parallel
  biases) and, with sequence parallelism, the layer's activations; PP gives each stage
  ``layers / pp`` layers, the first stage also the embedding, the last the output layer;
  ZeRO stage 1/2/3 shards optimizer state / + gradients / + parameters over the ``dp`` ranks;
* activations of one layer for one micro-batch of ``b`` sequences of ``s`` tokens:
  ``34·s·b·h`` bytes in bf16 (Korthikanti et al. 2022, with FlashAttention, so no s² term),
  divided by ``tp`` (sequence parallelism) and ``cp``; with full recomputation only the
  layer's input, ``2·s·b·h``. Under 1F1B the first stage holds ``min(pp, m)`` micro-batches;
* communication per GPU and step (bytes *sent*, bandwidth-optimal ring collectives):
  TP: 4 all-reduces (or their reduce-scatter + all-gather halves) of ``s·b·h`` activations
  per layer per micro-batch (6 with recomputation), each ``2(tp-1)/tp`` × its size;
  PP: one activation forward and one gradient back per micro-batch per cut (a middle stage;
  Megatron's scatter/gather optimisation, which sends 1/tp of it, is left out);
  DP, with ``m`` micro-batches per step: ZeRO-0/1 all-reduce the accumulated gradients once,
  ``2(dp-1)/dp`` × their size; ZeRO-2 keeps only a shard of the gradients, so it
  reduce-scatters every micro-batch's (``m·(dp-1)/dp``) and all-gathers the parameters once;
  ZeRO-3 (FSDP's default) all-gathers the parameters twice and reduce-scatters the gradients
  for every micro-batch, ``3m(dp-1)/dp``, and holds two layers unsharded at a time (the one
  computing and the one prefetched);
* time: ``6·P·tokens`` FLOPs (8 with full recomputation) at ``mfu`` × the GPU's peak, times
  ``1 + (pp-1)/m`` for the pipeline bubble (Megatron's bubble/ideal ratio), plus TP and PP
  communication at the link's bandwidth (not overlapped), plus whatever DP communication
  does not fit under the compute it overlaps with (the backward pass for ZeRO-0/1, all of
  forward and backward for ZeRO-2/3, which communicate every micro-batch).

The numbers for a GPU (:class:`Cluster`) are parameters: the defaults are an H100 SXM node
(989 TFLOP/s bf16 dense, 80 GB, NVLink ~450 GB/s per direction, 8 per node) on a 400 Gb/s
network (~50 GB/s per GPU).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Config:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 1  # 0: none, 1: optimizer state, 2: + gradients, 3: + parameters
    micro_batch: int = 1  # sequences per micro-batch
    recompute: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def stage_params(model: Model, tp: int, pp: int, stage: int) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds under ``tp``-way tensor parallelism."""
    h, per_layer = model.hidden, model.layer_params()
    replicated = (2 * h if model.norms else 0) + (2 * h if model.bias else 0)  # norms, row-parallel biases
    layer = (per_layer - replicated) // tp + replicated
    params = model.layers // pp * layer
    if stage == 0:
        params += model.vocab * h
    if stage == pp - 1:
        params += model.vocab * h + (model.vocab if model.bias else 0) + (h if model.norms else 0)
    return params


def fullest(model: Model, config: Config, stage=None) -> int:
    """Parameters per GPU of pipeline stage ``stage`` (None: the stage that holds the most)."""
    stages = range(config.pp) if stage is None else [stage]
    return max(stage_params(model, config.tp, config.pp, s) for s in stages)


def memory(model: Model, config: Config, seq: int, global_batch: int, stage=None) -> dict:
    """Bytes per GPU of ``stage`` (None: the fullest): {"parameters", "gradients", "optimizer", "activations"}."""
    c = config
    params = fullest(model, config, stage)
    m = micro_batches(config, global_batch)
    b, h = c.micro_batch, model.hidden
    per_layer = (2 if c.recompute else 34) * seq * b * h / (c.tp * c.cp)
    gathered = 2 * 2 * model.layer_params() / c.tp if c.zero >= 3 and c.dp > 1 else 0  # two layers, whole
    return {
        "parameters": 2 * params / (c.dp if c.zero >= 3 else 1) + gathered,
        "gradients": 2 * params / (c.dp if c.zero >= 2 else 1),
        "optimizer": 12 * params / (c.dp if c.zero >= 1 else 1),
        "activations": per_layer * (model.layers // c.pp) * min(c.pp, m),
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
    params = fullest(model, config, stage)
    kv = 2 * seq / c.cp * c.micro_batch * model.hidden * model.kv_heads // model.heads * dtype_bytes / c.tp
    return {
        "tp": (6 if c.recompute else 4) * layers * m * activation * ring(c.tp),
        "pp": (2 if c.pp > 2 else 1) * m * activation if c.pp > 1 else 0.0,
        "dp": dp_factor(c.zero, c.dp, m) * params * dtype_bytes,
        "cp": 3 * layers * m * kv * (c.cp - 1) if c.cp > 1 else 0.0,  # K/V around the ring, forward + backward
    }


def step_time(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> dict:
    """Seconds per step: {"compute", "bubble", "tp", "pp", "cp", "dp exposed", "total"} (a model)."""
    c = config
    tokens = global_batch * seq
    flops = (8 if c.recompute else 6) * model.params() * tokens / c.gpus
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
        "dp exposed": max(0.0, sent["dp"] / link(c.gpus) - compute * (1 if c.zero >= 2 else 2 / 3)),
    }
    times["total"] = sum(times.values())
    return times


def fits(model: Model, cluster: Cluster, config: Config, seq: int, global_batch: int) -> bool:
    return sum(memory(model, config, seq, global_batch).values()) <= cluster.memory


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
    """Every valid configuration (powers of two), the ones that fit first, fastest first."""
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
        return (total > cluster.memory, step_time(model, cluster, c, seq, global_batch)["total"], total)

    return sorted(found, key=key)


def best(model: Model, cluster: Cluster, global_batch: int, seq: int, cp=(1,)) -> Config:
    """The fastest configuration that fits, by this model."""
    for config in candidates(model, cluster, global_batch, seq, cp):
        if fits(model, cluster, config, seq, global_batch):
            return config
    raise ValueError(f"no configuration of {model.name} fits on {cluster.gpus} GPUs of {cluster.memory / 1e9:.0f} GB")
