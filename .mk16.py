"""Writes solutions/16_putting_it_together.ipynb from the cells below (run once; the notebook is the source after)."""
import inspect

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

import course.parallel3d as p3

cells = []
md = lambda s: cells.append(new_markdown_cell(s.strip("\n")))  # noqa: E731
code = lambda s: cells.append(new_code_cell(s.strip("\n")))  # noqa: E731
src = lambda f: inspect.getsource(f).rstrip()  # noqa: E731

md(r"""
# 16 · Putting it together: 3-D parallelism, and choosing a configuration for a real cluster

Each notebook since 10 taught one way to split training: data parallelism and ZeRO/FSDP (10, 11), tensor
parallelism (12), pipeline parallelism (13), context parallelism (14), expert parallelism (15). Large runs
combine them: every GPU belongs to one group per dimension at once, and each dimension's traffic takes the
links it suits. PyTorch's own training stack (torchtitan) composes FSDP, TP, PP, CP and EP this way.

This notebook puts three of them together and then leaves the 2-core machine behind:

1. **The grid.** 8 ranks as data × pipeline × tensor = 2 × 2 × 2: which ranks talk along which dimension
   (Exercise 1), and the groups torch's `DeviceMesh` makes.
2. **A language model on the grid.** A small transformer trained on the 8 ranks, equal to one process, and
   the bytes each rank sends along each dimension, measured on its sockets.
3. **A model of memory and communication per GPU**, built from the laws of notebooks 10–15, that must
   predict those measured bytes and memory *exactly* before we trust it for anything bigger.
4. **Choosing a configuration** for Llama-3 8B and 70B on 8 to 512 GPUs (Exercises 2 and 3), and one rank of
   a large configuration run for real, without the other 63, on torch's fake process group.

The course ends with a table of every technique, what it shards and what it sends.
""")

code(r"""
from course.doctor import PART_II_TORCH, require_torch

require_torch(PART_II_TORCH, "Notebook 16")  # DeviceMesh, FSDP2 and the fake process group, as tested on torch 2.15

import inspect

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import course
from course import wire
from course.tensor_parallel import ParallelMLP, ParallelSelfAttention
""")

md(r"""
## 1 · The grid

With $N = d_p \cdot p_p \cdot t_p$ ranks (here $d_p = p_p = t_p = 2$, so 8), each rank gets three
coordinates: which copy of the model it helps (data, $d$), which pipeline stage it holds ($p$), and which
slice of that stage's layers ($t$). The convention used by Megatron-LM and by `init_device_mesh` numbers
the ranks with the **last dimension varying fastest**:

$$\text{rank} = (d \cdot p_p + p) \cdot t_p + t .$$

Putting tensor parallelism last is a choice about hardware, not arithmetic: TP communicates in every layer,
on the critical path (notebook 12), so its groups should be neighbouring ranks, which a launcher places on
the same node, behind the fastest links (NVLink). Pipeline stages exchange one activation per micro-batch,
and data-parallel ranks exchange gradients once per step, overlapped with backward: they can cross nodes.

A **group** of one dimension is a set of ranks whose *other two* coordinates are equal: they hold the same
slice of the same stage (a data-parallel group, which averages its gradients), or the same data and the
same slice of different stages (a pipeline), or the same data and stage (a tensor-parallel group).

### ✏️ Exercise 1 — the groups of a grid

Write `mesh_groups(dp, pp, tp)`: return a dict with the keys `"dp"`, `"pp"` and `"tp"`, each a list of
groups, each group a list of ranks. For $2 \times 2 \times 2$, rank 0's tensor-parallel group is `[0, 1]`. The
check tries grids from $1 \times 1 \times 1$ to $4 \times 2 \times 1$, and $3 \times 1 \times 2$.
""")

code(r"""
def mesh_groups(dp, pp, tp):
    # BEGIN SOLUTION
""" + "\n".join(src(p3.mesh_groups).splitlines()[1:]) + r"""
    # END SOLUTION
""")

code(r"""
from course.checks import nb16 as check

check.mesh_groups(mesh_groups)
""")

md(r"""
`init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))` creates, on every rank, one process
group per dimension (and every rank takes part in creating all of them, as `new_group` requires), and
`mesh["tp"].get_group()` is the rank's own group of that dimension. Below, each of 8 ranks builds the mesh
and reports its three groups; the cell asserts that they are the lists the course's `mesh_groups` makes
(the same as the exercise's solution).
""")

code(r"""
from torch.distributed.device_mesh import init_device_mesh

from course.parallel3d import coordinates, mesh_groups

SHAPE = (2, 2, 2)  # dp, pp, tp


def torch_groups(rank, world_size, shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
    return {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("dp", "pp", "tp")}


made = course.launch(torch_groups, 8, SHAPE, show=None)
expected = mesh_groups(*SHAPE)
print("rank  (d, p, t)   dp group  pp group  tp group")
for rank, mine in enumerate(made):
    assert all(mine[dim] in expected[dim] for dim in mine)
    print(f"{rank:>4}  {coordinates(rank, *SHAPE)}   {mine['dp']}    {mine['pp']}    {mine['tp']}")
""")

md(r"""
Each rank talks to one peer per dimension: its TP peer differs from it by 1, its pipeline peer by 2, its
data-parallel peer by 4. On a cluster of 8-GPU nodes with $t_p = 8$, every TP group would be one node.

## 2 · A language model on the grid

The model is a small causal language model: an embedding of a 32-token vocabulary into 16 dimensions, two
transformer blocks (self-attention with 4 heads, then an MLP, each with a residual connection; no
normalisation, to keep it short), and an output layer back to the vocabulary. It is built from notebook 12's
attention and MLP blocks, so each block can be split with notebook 12's Megatron layers.
""")

code(r"""
from course.parallel3d import BATCH, DIM, SEQ, VOCAB, Block, TinyLM, make_batch

print(inspect.getsource(Block))
print(inspect.getsource(TinyLM))
model = TinyLM()
x, y = make_batch()
print(f"{sum(p.numel() for p in model.parameters())} parameters; a batch of {BATCH} sequences of {SEQ} tokens")
""")

md(r"""
Each rank holds one **stage** (here one block: 2 blocks over $p_p = 2$ stages), with the first stage also
holding the embedding and the last the output layer, as in notebook 13; and inside the stage, its **slice**
of each block: its heads of the attention and its hidden features of the MLP, as in notebook 12. The
embedding and the output layer are not split: every rank of a TP group holds them whole and computes the
same thing, so their gradients come out equal on every rank of the group without any communication.
""")

code(src(p3.shard_like))

md(r"""
**The step.** Each pipeline (the ranks with the same $d$) takes its slice of the batch, $8 / d_p = 4$
sequences, cut into $m = 2$ micro-batches that flow GPipe's way: activations forward with `isend`,
gradients back (notebook 13's executor, written for one stage of a grid: the neighbouring stages are
given as global ranks, `rank ± tp`). Inside each stage, every block's Megatron layers all-reduce over the TP
group. After backward, the **data-parallel** group averages the gradients, in one all-reduce of all of them
laid end to end (one bucket, as DDP would with a large enough `bucket_cap_mb`). Then every rank steps its own
parameters: no rank ever holds the whole model.
""")

code(src(p3.pipeline_step))

code(src(p3.average_gradients) + "\n\n\n" + src(p3.make_groups))

md(r"""
`train` runs two SGD steps this way on every rank, measures what each rank sends (§3), and then trains one
process on the whole batch for the same two steps, cuts *its* model with the same `shard_like`, and
compares: each rank returns the largest difference between its parameters and the same slice of one
process's. (SGD, not Adam: Adam's first step moves every weight by about the learning rate whatever the
size of its gradient, so a gradient that is zero in exact arithmetic and $10^{-9}$ after rounding moves a
weight by a visible amount; the comparison should show the parallelism, not that.)
""")

code(src(p3.train))

code(r"""
runs = {shape: course.launch(train, 8, *shape, show=None) for shape in [(2, 2, 2), (1, 2, 4)]}
for shape, results in runs.items():
    worst = max(r["diff"] for r in results)
    assert worst < 1e-6
    print(f"dp x pp x tp = {shape[0]} x {shape[1]} x {shape[2]}: every rank's weights after 2 steps equal one "
          f"process's to < 1e-6")
""")

md(r"""
Equal to float32 rounding, not bit for bit: the row-parallel layers add partial products across ranks, the
micro-batches sum their losses in two parts, and data parallelism averages two halves of the batch, each a
different order of the same float32 additions (the largest difference here is around $10^{-8}$).

## 3 · What each rank sends, per dimension

`course.wire` reads how many bytes each of a rank's TCP sockets has sent (notebook 10), and
`wire.sent_per_peer` tells which rank is at the other end of each socket: the ranks swap their sockets'
addresses, and a socket whose remote address is another rank's local one leads to that rank. In a
$2 \times 2 \times 2$ grid every peer differs from the rank in exactly one coordinate, so each byte belongs
to one dimension. `train` above added them up per dimension:
""")

code(r"""
print("rank  (d, p, t)   bytes sent over 2 steps:     tp       pp       dp")
for rank, r in enumerate(runs[SHAPE]):
    sent = r["sent"]
    assert set(sent) == {"dp", "pp", "tp"}  # no byte went to a rank outside the rank's three groups
    print(f"{rank:>4}  {coordinates(rank, *SHAPE)}                         {sent['tp']:>6}   {sent['pp']:>6}   {sent['dp']:>6}")
""")

md(r"""
TP sends the most, though it holds the fewest weights: it communicates activations in every block, for
every micro-batch, in forward and backward. To *predict* these numbers we need one more measurement: gloo
adds a header to every message. The cell below measures it on 4 ranks, for 1 KB and for 64 KB: an
all-reduce over all 4, one over a pair of ranks, and one `send` / `recv`.
""")

code(r"""
def header_bytes(rank, world_size, sizes=(1024, 65536)):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    found = []
    for n in sizes:
        t = torch.ones(n // 4)
        dist.barrier()
        with wire.measure() as four:
            dist.all_reduce(t)
        dist.barrier()
        with wire.measure() as two:
            dist.all_reduce(t, group=pairs[rank // 2])
        dist.barrier()
        with wire.measure() as p2p:
            if rank == 0:
                dist.send(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
        found.append((four.sent - 2 * 3 / 4 * n, two.sent - n, p2p.sent - (n if rank == 0 else 0)))
    assert found[0] == found[1]  # the same for 1 KB and 64 KB: a fixed cost per message
    return found[0]


(four, two, SEND_HEADER), (_, _, RECV_NOTICE) = course.launch(header_bytes, 4, show=None)[:2]
MESSAGE_HEADER = two / 2
assert four == 2 * (4 - 1) * MESSAGE_HEADER  # a ring's 2(N-1) messages, each with the same header
print(f"an all-reduce on 2 ranks sends the ring's bytes + {two:.0f}, on 4 ranks + {four:.0f}: "
      f"2(N-1) messages of {MESSAGE_HEADER:.0f} header bytes each")
print(f"a send: its tensor + {SEND_HEADER:.0f} bytes; the receiving rank sends {RECV_NOTICE:.0f} bytes per recv")
""")

md(r"""
(2(N−1) messages per all-reduce is the ring's count from notebook 10: one per step of the reduce-scatter and
one per step of the all-gather. On a GPU cluster the same count costs *time*: each step waits for one
message's latency, so all-reduces of small tensors over many ranks are latency-bound. The receiver of a
`recv` tells the sender where to put the data, hence its few bytes.)

Now the model. `course.planner` holds a model of memory and communication per GPU, written for GPU clusters
from the laws of notebooks 10–15; its assumptions are listed at the top of `course/planner.py` and in §4.
Per step, per GPU, it says a rank sends: for **TP**, 4 all-reduces of one micro-batch's activation per
block per micro-batch (two in forward, notebook 12's $g$, two in backward, its $f$), each $2(t_p-1)/t_p$
times its size; for **PP**, one activation (forward) or one gradient (backward) per micro-batch; for **DP**,
its stage's gradients, $2(d_p - 1)/d_p$ times their size. Our run is float32 (4 bytes), and each message
carries the header just measured (a $t_p$-rank all-reduce: $2(t_p-1)$ of them). The prediction must equal every rank's measurement, to the byte:
""")

code(r"""
from course.planner import Config, Model, micro_batches, stage_params, traffic

TINY = Model("TinyLM", layers=2, hidden=16, ffn=64, heads=4, kv_heads=4, vocab=32, ffn_matrices=2, bias=True, norms=False)
assert TINY.params() == sum(p.numel() for p in TinyLM().parameters())


def predicted(dp, pp, tp, stage, steps=2, m=2):
    config = Config(dp=dp, pp=pp, tp=tp, zero=0, micro_batch=BATCH // (dp * m))  # train's 2 micro-batches
    law = traffic(TINY, config, seq=SEQ, global_batch=BATCH, dtype_bytes=4, stage=stage)
    assert micro_batches(config, BATCH) == m
    blocks = TINY.layers // pp
    headers = {  # per step: the messages of each dimension
        "tp": 4 * blocks * m * 2 * (tp - 1) * MESSAGE_HEADER,
        "pp": m * (SEND_HEADER + RECV_NOTICE) if pp > 1 else 0,
        "dp": 2 * (dp - 1) * MESSAGE_HEADER,
    }
    return {dim: steps * (law[dim] + headers[dim]) for dim in headers}


for shape, results in runs.items():
    for rank, r in enumerate(results):
        d, p, t = coordinates(rank, *shape)
        assert {dim: n for dim, n in r["sent"].items() if n} == {dim: n for dim, n in predicted(*shape, p).items() if n}
        assert r["param_bytes"] == 4 * stage_params(TINY, shape[2], shape[1], p)
print("bytes sent per dimension and parameter bytes, every rank of both grids: as the model predicts, to the byte")
law = {dim: int(2 * traffic(TINY, Config(2, 2, 2, zero=0, micro_batch=2), SEQ, BATCH, 4, stage=0)[dim]) for dim in ("tp", "pp", "dp")}
print(f"rank 0 of the 2 x 2 x 2 grid, over 2 steps: the law alone {law}; with gloo's headers "
      f"{ {dim: int(n) for dim, n in predicted(2, 2, 2, 0).items()} }")
""")

md(r"""
The same formulas at a real scale are a different story: the headers vanish next to megabytes, and the
sizes that matter are the model's. That is what the rest of the notebook does with them.

## 4 · Choosing a configuration for a real cluster

From here on everything is a **model**: `course.planner`'s formulas, with its assumptions stated, applied to
real model sizes. Its assumptions, in short (the module's docstring has them all):

* mixed precision as notebook 11 measured it: bf16 weights and gradients, fp32 master weights and Adam's two
  moments, **16 bytes per parameter**; ZeRO-1/2/3 shard the 12 / + the gradients / + the weights over $d_p$;
* **activations** per layer and micro-batch of $b$ sequences of $s$ tokens: $34\,s\,b\,h$ bytes (Korthikanti et
  al., *Reducing Activation Recomputation in Large Transformer Models*, 2022, with FlashAttention so no
  $s^2$ term), divided by $t_p$ (with sequence parallelism); $2\,s\,b\,h$ with full recomputation; under 1F1B
  the first stage holds $\min(p_p, m)$ micro-batches;
* **time**: $6\,P$ FLOPs per token (8 with recomputation) at half of an H100's 989 TFLOP/s, the pipeline's
  bubble as $(p_p-1)/m$ of that (notebook 13's bubble/ideal ratio), TP and PP traffic not overlapped (TP at
  NVLink's ~450 GB/s inside a node), DP traffic overlapped with compute except what does not fit under it
  (at ~50 GB/s per GPU between nodes).

First, the parameter count of the two models the formulas describe, against the published ones (Llama-3 8B:
8,030,261,248; 70B: 70,553,706,496, from their configurations: 32 / 80 layers, hidden 4096 / 8192, MLP
14336 / 28672, 32 / 64 heads with 8 K/V heads, vocabulary 128,256, untied embeddings):
""")

code(r"""
from course.planner import LLAMA3_8B, LLAMA3_70B, Cluster, memory, step_time

assert LLAMA3_8B.params() == 8_030_261_248 and LLAMA3_70B.params() == 70_553_706_496
for m in (LLAMA3_8B, LLAMA3_70B):
    print(f"{m.name}: {m.params():,} parameters, {16 * m.params() / 1e9:,.0f} GB of weights, gradients and Adam state")
""")

md(r"""
### ✏️ Exercise 2 — where the memory goes

Llama-3 8B on one node of 8 GPUs with plain data parallelism and ZeRO-1 (`Config(dp=8, zero=1)`): how many
GB (1 GB = $10^9$ bytes) of weights, gradients and optimizer state does each GPU hold? Activations not
included.
""")

code(r"""
state_gb = (2 + 2 + 12 / 8) * LLAMA3_8B.params() / 1e9  # SOLUTION
""")

code(r"""
check.state_gb(state_gb)
""")

md(r"""
What the model says each GPU holds, for a few configurations of Llama-3 8B on 8 GPUs, 512 sequences of 8192
tokens per step (the dashed line is 80 GB):
""")

code(r"""
SEQ_LEN, GLOBAL_BATCH = 8192, 512
configs = {
    "DDP": Config(dp=8, zero=0),
    "ZeRO-1": Config(dp=8, zero=1),
    "ZeRO-3": Config(dp=8, zero=3),
    "ZeRO-3 + recompute": Config(dp=8, zero=3, recompute=True),
    "TP 8 (SP)": Config(dp=1, tp=8, zero=0),
    "TP 2 x PP 2 x DP 2": Config(dp=2, tp=2, pp=2, zero=1),
}
parts = ("parameters", "gradients", "optimizer", "activations")
table = {name: memory(LLAMA3_8B, c, SEQ_LEN, GLOBAL_BATCH) for name, c in configs.items()}
print(f"{'GB per GPU (a model)':<22}" + "".join(f"{p:>13}" for p in parts) + "        total")
for name, used in table.items():
    print(f"{name:<22}" + "".join(f"{used[p] / 1e9:>13.1f}" for p in parts) + f"{sum(used.values()) / 1e9:>13.1f}")

fig, ax = plt.subplots(figsize=(9, 3.2))
bottom = [0.0] * len(table)
for part in parts:
    heights = [used[part] / 1e9 for used in table.values()]
    ax.bar(list(table), heights, bottom=bottom, label=part)
    bottom = [b + h for b, h in zip(bottom, heights)]
ax.axhline(80, color="black", linestyle="--", linewidth=1)
ax.set_ylabel("GB per GPU (model)")
ax.set_title("Llama-3 8B on 8 GPUs, 512 x 8192 tokens per step")
ax.legend(fontsize=8)
plt.xticks(fontsize=8)
plt.tight_layout()
plt.show()
""")

md(r"""
Plain DDP does not fit: 16 bytes per parameter is 128 GB before a single activation. ZeRO removes the
redundant state; what is left is the **activations**, which no amount of data parallelism shrinks (each
GPU processes whole sequences). They are what recomputation, tensor/sequence parallelism, pipeline
parallelism (fewer layers per GPU) and context parallelism (shorter sequences per GPU, notebook 14) are for.

### ✏️ Exercise 3 — a configuration for Llama-3 70B on 64 GPUs

Eight nodes of 8 H100s (80 GB each), 512 sequences of 8192 tokens per step. Choose `config_70b =
Config(dp=..., tp=..., pp=..., zero=..., micro_batch=..., recompute=...)`. The check accepts a configuration
that uses all 64 GPUs, keeps TP inside a node, splits the heads, layers and batch evenly, fits in 80 GB by
the model, and whose step time by the model is within 5% of the fastest configuration that fits. Use
`memory(LLAMA3_70B, config, 8192, 512)` and `step_time(LLAMA3_70B, Cluster(64), config, 8192, 512)` to try
yours.
""")

code(r"""
config_70b = Config(dp=4, tp=4, pp=4, zero=2, micro_batch=1, recompute=False)  # SOLUTION
""")

code(r"""
check.configuration(config_70b)
""")

md(r"""
The fastest configuration the model finds that fits, for four jobs (`course.planner.best` tries every
combination of powers of two, ZeRO stage, micro-batch size and recomputation):
""")

code(r"""
from course.planner import best

jobs = [(LLAMA3_8B, 8), (LLAMA3_8B, 64), (LLAMA3_70B, 64), (LLAMA3_70B, 512)]
chosen = {}
print(f"{'model':<12} GPUs   dp  tp  pp  ZeRO  b  recompute   GB/GPU   s/step   (compute, bubble, TP, PP, exposed DP)")
for model_, gpus in jobs:
    c = chosen[model_.name, gpus] = best(model_, Cluster(gpus), GLOBAL_BATCH, SEQ_LEN)
    t = step_time(model_, Cluster(gpus), c, SEQ_LEN, GLOBAL_BATCH)
    gb = sum(memory(model_, c, SEQ_LEN, GLOBAL_BATCH).values()) / 1e9
    assert gb <= 80 and c.tp <= 8
    parts_ = ", ".join(f"{t[k]:.1f}" for k in ("compute", "bubble", "tp", "pp", "dp exposed"))
    print(f"{model_.name[8:]:<12} {gpus:>4}  {c.dp:>3} {c.tp:>3} {c.pp:>3} {c.zero:>5} {c.micro_batch:>2}  {str(c.recompute):>9}"
          f"   {gb:>6.1f}   {t['total']:>6.1f}   ({parts_})")

# what the text below says of these choices
assert all(chosen[LLAMA3_8B.name, g].tp == chosen[LLAMA3_8B.name, g].pp == 1 for g in (8, 64))
assert chosen[LLAMA3_70B.name, 64].tp > 1 and chosen[LLAMA3_70B.name, 64].pp > 1
assert (chosen[LLAMA3_70B.name, 512].tp, chosen[LLAMA3_70B.name, 512].pp) == (8, 1)
fsdp_only = Config(dp=64, zero=3)
assert sum(memory(LLAMA3_70B, fsdp_only, SEQ_LEN, GLOBAL_BATCH).values()) > 80e9
recomputed = Config(dp=64, zero=3, recompute=True)
slower = step_time(LLAMA3_70B, Cluster(64), recomputed, SEQ_LEN, GLOBAL_BATCH)["total"] / step_time(
    LLAMA3_70B, Cluster(64), chosen[LLAMA3_70B.name, 64], SEQ_LEN, GLOBAL_BATCH)["total"]
assert sum(memory(LLAMA3_70B, recomputed, SEQ_LEN, GLOBAL_BATCH).values()) < 80e9 and slower > 1.1
print(f"70B on 64 GPUs with ZeRO-3 alone: fits only with recomputation, and is then {slower:.2f}x slower by the model")
""")

md(r"""
What the model says, and why:

* **8B** fits on one node with data parallelism alone once ZeRO shards the state, and on 64 GPUs too: adding
  TP or PP only adds communication or a bubble that a model this small does not need.
* **70B on 64 GPUs**: ZeRO-3 over all 64 GPUs shards the state to ~20 GB per GPU, but the activations of 80
  layers of 8192 tokens do not fit beside it unless every layer is recomputed, which costs a third more
  compute. Cutting each layer with TP inside the node (which also splits the activations, with sequence
  parallelism) and the stack into a few pipeline stages is cheaper, and the rest is data parallelism.
* **70B on 512 GPUs**: with more data-parallel ranks the sharded state shrinks, TP 8 fills each node, and
  the pipeline is no longer needed.

These are the shapes real runs take. The model leaves out much that matters at scale (overlap of TP
communication with compute, stragglers, memory fragmentation, the real MFU of each shape), so treat its
ranking as a first cut to try on the cluster, not an answer.

## 5 · One rank of a big configuration, without the others

Can we check the model at a real size on this machine? Not by running 64 ranks. But torch has a **fake
process group** (`torch.testing._internal.distributed.fake_pg`, a testing utility, not a public API): every
collective returns at once without sending anything, so *one* rank can run as if it were rank 5 of 64. With
`FakeTensorMode` the tensors have shapes but no memory, so the layers can have their real sizes. Below, one
rank of 64 applies FSDP2 (`fully_shard`, ZeRO-3) to two layers of Llama-3 8B's MLP (two of its three
matrices each, about 117 million parameters per layer), runs forward and backward on one micro-batch,
and records each collective torch issues and its size.
""")

code(r"""
from torch.utils._python_dispatch import TorchDispatchMode


class RecordCollectives(TorchDispatchMode):
    # Sees every operator torch runs, collectives included; keeps the collectives and their tensors' sizes.
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
            self.ops.append((func.__name__.split(".")[0], sizes))
        return func(*args, **(kwargs or {}))


def one_rank_of_64(rank, world_size, fake_rank=5, fake_world=64):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=fake_world)
    mesh = init_device_mesh("cpu", (fake_world,))
    h, f = LLAMA3_8B.hidden, LLAMA3_8B.ffn
    with FakeTensorMode():
        model = nn.Sequential(*[nn.Sequential(nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)) for _ in range(2)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
        with RecordCollectives() as record:
            model(torch.randn(1, 16, h)).sum().backward()
    dist.destroy_process_group()
    return {"parameters": sum(p.numel() for p in model.parameters()), "local": local, "ops": record.ops}


big = course.launch(one_rank_of_64, 1, init_process_group=False, show=None)[0]
for op, sizes in big["ops"]:
    print(f"{op:<22} tensors of {sizes[0]:>11,} and {sizes[1]:>11,} elements")
""")

md(r"""
Two all-gathers per layer (before its forward, and again before its backward: FSDP freed the whole weights
after forward) and one reduce-scatter per layer, each between the rank's shard (1/64 of the layer) and the
whole layer: the pattern notebook 11 built by hand, at full size. The model's assumptions for ZeRO-3 are
this: $3(d_p-1)/d_p$ times the weights' bytes per micro-batch, and $1/d_p$ of the weights held at rest.
""")

code(r"""
from course.planner import dp_factor

layer = big["parameters"] // 2
kinds = [op for op, _ in big["ops"]]
assert kinds.count("_allgather_base_") == 4 and kinds.count("_reduce_scatter_base_") == 2
assert all(max(sizes) == layer and min(sizes) == layer // 64 for _, sizes in big["ops"])
assert big["local"] == big["parameters"] // 64
ring_bytes = sum(63 / 64 * max(sizes) * 4 for _, sizes in big["ops"])  # what a ring sends for these sizes, fp32
modelled = dp_factor(3, 64, 1) * big["parameters"] * 4
assert abs(ring_bytes - modelled) < 1e-6 * modelled
print(f"rank 5 of 64 holds {big['local']:,} of {big['parameters']:,} parameters (1/64); its collectives would "
      f"send {ring_bytes / 1e9:.2f} GB on a ring, the model's 3(N-1)/N x weights")
""")

md(r"""
(The fake group sends nothing, so these bytes are the ring law applied to the recorded sizes, not a
measurement; what was measured is which collectives FSDP2 issues, how many, and of what size, and how much
of the model one rank holds.)

## 6 · The course in one table

| technique | what each GPU holds of the model | what it sends, per step | use it when | notebook |
|---|---|---|---|---|
| DDP | everything | all-reduce of the gradients, $2(N-1)/N \times$ their bytes (ring), overlapped with backward | the model's state and activations fit on one GPU | 02–10 |
| ZeRO-1 / ZeRO-2 | + 1/N of the optimizer state (/ + of the gradients) | reduce-scatter of gradients + all-gather of parameters: a ring's all-reduce bytes (gloo sends more: measured in 11) | the optimizer state is what does not fit | 11 |
| ZeRO-3 / FSDP | + 1/N of the parameters | + the parameters all-gathered again for backward: $1.5\times$ DDP's bytes per micro-batch | the state does not fit; cheap bandwidth between the ranks | 11 |
| TP (+ SP) | 1/t of each layer's matrices (+ of the activations) | 4 all-reduces (or all-gather + reduce-scatter) of the activations per layer per micro-batch, on the critical path | a layer is too big, inside a node | 12 |
| PP | 1/p of the layers | one activation forward and one gradient back per micro-batch, point to point | very deep models, across nodes; costs a bubble of $(p-1)/m$ | 13 |
| CP | 1/c of the sequence's activations | K/V chunks around a ring, overlapped with attention | long sequences, whose activations do not fit | 14 |
| EP | 1/e of the experts | two all-to-alls of the routed tokens per MoE layer | mixture-of-experts models | 15 |

Every row was built by hand in its notebook, checked against PyTorch's own implementation, and its bytes
measured on the ranks' sockets; this notebook put three of them on one grid and showed that the same laws,
plus what gloo adds to each message, predict every byte.
""")

nb = new_notebook(cells=cells)
nb.metadata = nbformat.read("solutions/13_pipeline_parallel.ipynb", as_version=4).metadata
nbformat.write(nb, "solutions/16_putting_it_together.ipynb")
print(len(cells), "cells")
