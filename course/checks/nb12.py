"""Checks for notebook 12 (FSDP2: bytes per rank, activation checkpointing)."""

import functools
import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course.classroom import guard
from course.classroom.exercises import correct, exercise, wrong
from course.observe.memory import bytes_per_rank as measure_bytes
from course.observe.memory import saved_activation_bytes
from course.parallel.zero import zero1_setup, zero1_step as reference_zero1_step
from course.runtime.launcher import launch

# ------------------------------------------------------------------ Exercise 1

STAGES = (0, 1, 3)
KINDS = ("parameters", "gradients", "optimizer")


def _bytes_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 30), nn.ReLU(), nn.Linear(30, 11))  # P = 3,371: not a multiple of 4


def _measure_stages(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(rank))
    ddp_model = DDP(_bytes_model())
    ddp_optimizer = torch.optim.Adam(ddp_model.parameters())
    ddp_model(x).square().mean().backward()
    ddp_optimizer.step()

    zero_model = _bytes_model()
    shard, zero_optimizer = zero1_setup(zero_model, torch.optim.Adam)
    zero_model(x).square().mean().backward()
    guard.original(reference_zero1_step)(zero_model, shard, zero_optimizer)

    fsdp = _bytes_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (fsdp[0], fsdp[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_optimizer = torch.optim.Adam(fsdp.parameters())
    fsdp(x).square().mean().backward()
    fsdp_optimizer.step()
    return {
        0: measure_bytes(ddp_model, ddp_optimizer),
        1: measure_bytes(zero_model, zero_optimizer),
        3: measure_bytes(fsdp, fsdp_optimizer),
    }


@functools.lru_cache(maxsize=1)
def measured_bytes(world_size=4):
    """Rank 0's bytes for stages 0, 1 and 3, measured on a real run (cached: it takes a launch)."""
    return launch(_measure_stages, world_size, show=None, timeout=120)[0]


def _plausible_mistakes(world_size=4):
    """{description: (stage, kind, wrong value, hint)} for the mistakes we expect."""
    model = _bytes_model()
    P = sum(p.numel() for p in model.parameters())
    T = len(list(model.parameters()))
    rows_padded = sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) for p in model.parameters())
    last_rank = sum(max(p.shape[0] - (world_size - 1) * math.ceil(p.shape[0] / world_size), 0)
                    * (p.numel() // p.shape[0]) for p in model.parameters())  # the last rank's rows, the short ones
    return [
        (0, "optimizer", 4 * P + 4 * T, "Adam keeps *two* tensors per parameter (exp_avg and exp_avg_sq)."),
        (1, "optimizer", 4 * math.ceil(P / world_size) + 4, "Adam keeps *two* tensors per parameter (exp_avg and exp_avg_sq)."),
        (3, "optimizer", 4 * rows_padded + 4 * T, "Adam keeps *two* tensors per parameter (exp_avg and exp_avg_sq)."),
        (0, "optimizer", 8 * P, "count Adam's `step` too: a 4-byte tensor for every parameter tensor it updates."),
        (1, "optimizer", 8 * math.ceil(P / world_size), "count Adam's `step` too: one 4-byte tensor (ZeRO-1's optimizer sees one flat slice)."),
        (3, "optimizer", 8 * rows_padded, "count Adam's `step` too: a 4-byte tensor for every parameter tensor it updates."),
        (1, "optimizer", 8 * math.ceil(P / world_size) + 4 * T, "ZeRO-1's optimizer updates a single tensor (the flat slice): one step counter."),
        (1, "parameters", 4 * P // world_size, "ZeRO-1 shards only the optimizer state: every rank still holds all parameters."),
        (1, "parameters", 4 * math.ceil(P / world_size), "ZeRO-1 shards only the optimizer state: every rank still holds all parameters."),
        (1, "gradients", 4 * math.ceil(P / world_size), "ZeRO-1 keeps the full gradients (sharding them is ZeRO-2)."),
        (1, "gradients", 4 * P // world_size, "ZeRO-1 keeps the full gradients (sharding them is ZeRO-2)."),
        (1, "optimizer", 8 * P // world_size + 4, "the flat vector is padded to a multiple of the world size before it is cut."),
        (1, "optimizer", 8 * (P // world_size) + 4, "the flat vector is padded to a multiple of the world size before it "
         "is cut: 3,371 values on 4 ranks are 843 per rank, not 842."),
        (0, "parameters", 4 * P // world_size, "DDP replicates everything: each rank holds all of it."),
        (0, "optimizer", (8 * P + 4 * T) // world_size, "DDP replicates everything: each rank holds all of it."),
        (3, "parameters", 4 * P // world_size, "FSDP2 cuts each tensor by rows and gives every rank as many rows as the "
         "first (30 rows on 4 ranks: 8, 8, 8, 6 padded to 8): round up per tensor, not P / N."),
        (3, "gradients", 4 * P // world_size, "FSDP2 cuts each tensor by rows and gives every rank as many rows as the "
         "first (30 rows on 4 ranks: 8, 8, 8, 6 padded to 8): round up per tensor, not P / N."),
        (3, "optimizer", 8 * P // world_size + 4 * T, "FSDP2 cuts each tensor by rows and gives every rank as many rows "
         "as the first: round up per tensor, not P / N."),
        (3, "optimizer", 8 * last_rank + 4 * T, f"that is the last rank's {8 * last_rank + 4 * T:,} B, whose shards "
         "are the short ones (6 of 30 rows, 2 of 11); rank 0's shards are full (8 rows and 3): count those."),
        (3, "parameters", 4 * P, "FSDP2 (ZeRO-3) shards the parameters too: each rank keeps only its rows between steps."),
        (3, "gradients", 4 * P, "FSDP2 reduce-scatters the gradients: each rank keeps only its rows' gradient."),
    ]


@exercise(
    "Exercise 1 (bytes_per_rank)",
    hint="P = 3,371 values in 4 tensors, 4 bytes each; Adam: 2 values per parameter value + a 4-byte step per "
    "tensor it updates. ZeRO-1 shards only Adam's state (over a flat, padded vector); FSDP2 shards each tensor by rows.",
)
def bytes_per_rank(stage0, stage1, stage3):
    """Exercise 1: rank 0's bytes of parameters, gradients and optimizer state for stages 0, 1 and 3."""
    predicted = {0: stage0, 1: stage1, 3: stage3}
    for stage in STAGES:
        entry = predicted[stage]
        if not isinstance(entry, dict) or sorted(entry) != sorted(KINDS):
            return wrong(f"stage{stage} must be a dict with the keys {list(KINDS)}.")
        if not all(isinstance(entry[k], (int, float)) and not isinstance(entry[k], bool) for k in KINDS):
            return wrong(f"stage{stage} must hold numbers of bytes.")
    truth = measured_bytes()
    off = [(stage, kind) for stage in STAGES for kind in KINDS if predicted[stage][kind] != truth[stage][kind]]
    if not off:
        return correct("rank 0's bytes for DDP, ZeRO-1 and FSDP2 on 4 ranks,\nall nine as measured.")
    for stage, kind, value, hint in _plausible_mistakes():
        if (stage, kind) in off and predicted[stage][kind] == value:
            return wrong(f"stage {stage}, {kind}: {hint}")
    if any(abs(predicted[s][k] - truth[s][k]) < 1 for s, k in off):
        return wrong("bytes are whole numbers: compute them exactly.")
    if all(abs(predicted[s][k] * 1024 - truth[s][k]) < 1024 for s, k in off):
        return wrong("give bytes, not KiB.")
    stage, kind = off[0]
    return wrong(f"{len(off)} of the 9 numbers are off, the first: stage {stage}, {kind}.")


# ------------------------------------------------------------------ Exercise 2


def _blocks(n=4, d=128, h=512):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, h, bias=False), nn.GELU(), nn.Linear(h, d, bias=False))
                           for _ in range(n)])


@functools.lru_cache(maxsize=1)
def checkpoint_sequential_counts(segments=3, batch=32):
    """(forward calls per block, KiB of saved activations) for checkpoint_sequential on 4 blocks."""
    from torch.utils.checkpoint import checkpoint_sequential

    model = _blocks()
    calls = [0] * len(model)
    for i, b in enumerate(model):
        b.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(0))
    saved, out = saved_activation_bytes(lambda x: checkpoint_sequential(model, segments, x, use_reentrant=False), model, x)
    out.square().mean().backward()
    return calls, saved / 1024


@exercise(
    "Exercise 2 (checkpoint_sequential)",
    hint="segment size = len(model) // segments; all segments but the last are checkpointed; "
    "the last runs normally, whatever its length. Per normal block: input 16 KiB, GELU input 64, GELU output 64.",
)
def checkpoint_sequential(forward_calls, saved_kib):
    """Exercise 2: what checkpoint_sequential(model, 3, x) runs and keeps for 4 blocks."""
    calls, kib = checkpoint_sequential_counts()
    try:
        if isinstance(saved_kib, (str, bytes)) or any(isinstance(c, (str, bytes)) for c in forward_calls):
            return wrong("forward_calls: a list of 4 whole numbers, saved_kib: a number (numbers, not strings).")
        whole = all(not isinstance(c, bool) and float(c) == int(c) for c in forward_calls)
        forward_calls = [int(c) for c in forward_calls]
        saved_kib = float(saved_kib)
    except (TypeError, ValueError, OverflowError):
        return wrong("forward_calls: a list of 4 whole numbers, saved_kib: a number.")
    if not whole:
        return wrong("forward_calls: a block's forward runs a whole number of times; give 4 whole numbers.")
    if len(forward_calls) != 4:
        return wrong("forward_calls has one number per block: 4 of them.")
    if forward_calls != calls:
        if forward_calls == [2, 2, 2, 2]:
            return wrong("the last segment is never checkpointed: checkpoint_sequential runs it normally.")
        if forward_calls == [2, 2, 2, 1]:
            return wrong("segment size is len(model) // segments = 1, so segments are [0], [1] and the rest [2, 3]; "
                         "the last one runs normally.")
        if forward_calls == [1, 1, 1, 1]:
            return wrong("a checkpointed block runs its forward again during backward.")
        return wrong("segment size = len(model) // segments; all segments but the last are checkpointed.")
    if saved_kib != kib:
        if saved_kib == 4 * 144:
            return wrong("that is without any checkpointing: a checkpointed block saves only its input.")
        if saved_kib == 4 * 16:
            return wrong("only the checkpointed blocks keep just their input; the last segment saves everything.")
        if saved_kib == kib * 1024:
            return wrong("give saved_kib in KiB, not bytes.")
        if saved_kib == 16 + 16 + 16 + 144:
            return wrong("the last segment has two blocks, each saving 144 KiB (its input, the GELU's input and output).")
        return wrong("count per block: checkpointed, its input (32 x 128 floats); normal, also the GELU's input and "
                     "output (32 x 512 floats each). Tensors shared between blocks count once.")
    return correct(f"blocks 0 and 1 ran twice, 2 and 3 once;\n{kib:.0f} KiB saved instead of {4 * 144} KiB.")
