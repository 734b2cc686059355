"""Checks for notebook 17 (putting it together: 3-D parallelism, choosing a configuration)."""

import numbers

import math

from course.classroom import guard
from course.classroom.exercises import correct, exercise, wrong
from course.parallel.parallel3d import mesh_groups as reference_groups
from course.parallel.planner import LLAMA3_8B, LLAMA3_70B, Cluster, Config, candidates, fits, memory, step_time, valid

# ------------------------------------------------------------------ Exercise 1

# Shapes (dp, pp, tp) the answer must get right: a 2 x 2 x 2 answer written out by hand fails the others,
# and the uneven ones tell the dimensions apart.
SHAPES = [(2, 2, 2), (1, 2, 4), (4, 2, 1), (3, 1, 2), (2, 3, 2), (1, 1, 1)]


def _canonical(answer):
    return {dim: sorted(sorted(g) for g in answer.get(dim, [])) for dim in ("dp", "pp", "tp")}


@exercise(
    "Exercise 1 (mesh_groups)",
    hint="a rank's coordinates are d = rank // (pp * tp), p = rank // tp % pp, t = rank % tp. A group of one "
    "dimension is the ranks whose *other two* coordinates are equal: loop over the other two, vary this one.",
    finished=("course.parallel.parallel3d.mesh_groups",),
)
def mesh_groups(fn):
    """Exercise 1: ``fn(dp, pp, tp)`` -> {"dp": [[ranks], ...], "pp": ..., "tp": ...}."""
    for shape in SHAPES:
        try:
            answer = fn(*shape)
        except Exception as e:  # noqa: BLE001 - the student's code: say what it raised
            return wrong(f"mesh_groups{shape} raised {type(e).__name__}: {e}")
        if not isinstance(answer, dict) or set(answer) != {"dp", "pp", "tp"}:
            return wrong('return a dict with the keys "dp", "pp" and "tp", each a list of lists of ranks.')
        got, expected = _canonical(answer), _canonical(guard.original(reference_groups)(*shape))
        if got == expected:
            continue
        dp, pp, tp = shape
        for dim in ("dp", "pp", "tp"):
            if got[dim] != expected[dim]:
                size = {"dp": dp, "pp": pp, "tp": tp}[dim]
                groups = got[dim]
                if sorted(r for g in groups for r in g) != list(range(dp * pp * tp)):
                    return wrong(f"for (dp, pp, tp) = {shape} the {dim} groups must cover every rank exactly once: "
                                 f"you gave {groups}.")
                if any(len(g) != size for g in groups):
                    return wrong(f"for (dp, pp, tp) = {shape} each {dim} group has {size} ranks (one per {dim} "
                                 f"coordinate); you gave {groups}.")
                if got["tp"] == expected["dp"] or got["dp"] == expected["tp"]:
                    return wrong("your tp groups are the dp groups: tp varies fastest (neighbouring ranks, one node), "
                                 "dp slowest.")
                return wrong(f"for (dp, pp, tp) = {shape} the {dim} groups should be {expected[dim]}, not {groups}.")
    return correct(f"the groups of every dimension for {len(SHAPES)} grid shapes, from 1 x 1 x 1 to 4 x 2 x 1: "
                   "the same lists DeviceMesh made on 8 ranks above.")


# ------------------------------------------------------------------ Exercise 3

MODEL2, CLUSTER2, BATCH2, SEQ2 = LLAMA3_70B, Cluster(64), 512, 8192
WITHIN = 1.05  # the answer's step time may be 5% above the best configuration's


@exercise(
    "Exercise 3 (a configuration for Llama-3 70B on 64 GPUs)",
    hint="start from what must fit: 16 bytes per parameter is 1.1 TB, so the state must be split at least 16 "
    "ways (tp x pp, and ZeRO over dp); then the activations of 80 layers of 8192 tokens, which only TP (with "
    "sequence parallelism), PP or recomputation shrink. Keep TP inside a node (<= 8), and look at "
    "memory(...) and step_time(...) of your candidates.",
)
def configuration(config):
    """Exercise 3: a Config for Llama-3 70B on 64 H100s (8 per node), 512 sequences of 8192 tokens per step."""
    if not isinstance(config, Config):  # Config itself refuses sizes < 1 and ZeRO stages other than 0-3
        return wrong("answer with a Config(dp=..., tp=..., pp=..., zero=..., micro_batch=..., recompute=...).")
    if config.gpus != CLUSTER2.gpus:
        return wrong(f"dp x tp x pp x cp = {config.gpus}: it must use all {CLUSTER2.gpus} GPUs.")
    if config.tp > CLUSTER2.per_node:
        return wrong(f"tp = {config.tp} spans nodes: TP talks in every layer and needs NVLink, {CLUSTER2.per_node} "
                     "GPUs per node.")
    if not valid(MODEL2, CLUSTER2, config, BATCH2):
        return wrong(f"{MODEL2.heads} heads ({MODEL2.kv_heads} K/V heads) must split over tp, {MODEL2.layers} layers "
                     f"over pp, and the {BATCH2} sequences over dp x micro_batch.")
    used = memory(MODEL2, config, SEQ2, BATCH2)
    if not fits(MODEL2, CLUSTER2, config, SEQ2, BATCH2):
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in used.items())
        return wrong(f"it needs {sum(used.values()) / 1e9:.0f} GB per GPU ({parts} GB): more than the "
                     f"{CLUSTER2.usable * CLUSTER2.memory / 1e9:.0f} GB of 80 the model lets a configuration fill.")
    best = candidates(MODEL2, CLUSTER2, BATCH2, SEQ2)[0]
    time, best_time = (step_time(MODEL2, CLUSTER2, c, SEQ2, BATCH2) for c in (config, best))
    if time["total"] > WITHIN * best_time["total"]:
        slow = max((k for k in time if k != "total"), key=lambda k: time[k] - best_time[k])
        return wrong(f"it fits ({sum(used.values()) / 1e9:.0f} GB), but the model gives {time['total']:.1f} s per step "
                     f"where the best configuration takes {best_time['total']:.1f} s; most of the extra time is "
                     f"'{slow}' ({time[slow]:.1f} s vs {best_time[slow]:.1f} s).")
    return correct(f"{sum(used.values()) / 1e9:.0f} GB per GPU and {time['total']:.1f} s per step by the model, within "
                   f"{100 * (WITHIN - 1):.0f}% of the best it finds ({best_time['total']:.1f} s).")


# ------------------------------------------------------------------ Exercise 2

CONFIG3 = Config(dp=8, zero=1)


def _is_number(answer):
    return not isinstance(answer, bool) and isinstance(answer, numbers.Real)


@exercise(
    "Exercise 2 (where the memory goes)",
    hint="per parameter: bf16 weights (2 bytes) and bf16 gradients (2 bytes) on every rank, fp32 master weights "
    "and Adam's two moments (12 bytes) split over the 8 data-parallel ranks by ZeRO-1.",
)
def state_gb(answer):
    """Exercise 2: GB per GPU of parameters + gradients + optimizer state, Llama-3 8B, Config(dp=8, zero=1)."""
    if not _is_number(answer) or not math.isfinite(answer):
        return wrong("answer with a number of gigabytes (1 GB = 1e9 bytes).")
    p = LLAMA3_8B.params()
    parts = memory(LLAMA3_8B, CONFIG3, 8192, 512)
    expected = (parts["parameters"] + parts["gradients"] + parts["optimizer"]) / 1e9
    close = lambda value: abs(answer - value) <= 0.01 * value  # noqa: E731
    if close(expected):
        return correct(f"(2 + 2 + 12/8) bytes x {p / 1e9:.2f}e9 parameters = {expected:.1f} GB: the activations "
                       "must fit in what is left.")
    if close(16 * p / 8 / 1e9):
        return wrong("that splits everything over the 8 ranks (ZeRO-3). ZeRO-1 splits only the optimizer state.")
    if close(16 * p / 1e9):
        return wrong("that is one whole copy of everything: ZeRO-1 splits the optimizer state over the 8 ranks.")
    if close((2 + 12 / 8) * p / 1e9) or close((2 + 2) * p / 1e9):
        return wrong("count both the bf16 weights and the bf16 gradients, and the sharded fp32 master weights + Adam.")
    if close((2 + 4 + 12 / 8) * p / 1e9):
        return wrong("that counts fp32 gradients (as frameworks that accumulate in fp32 do): here the gradients "
                     "are bf16, 2 bytes, as the exercise says.")
    if close((2 + 2 + 8 / 8) * p / 1e9):
        return wrong("the optimizer state also holds fp32 master weights (4 bytes), beside Adam's two moments (8).")
    if abs(answer - expected * 1e9 / 2**30) <= 0.01 * answer:
        return wrong("that is in GiB (2**30 bytes): answer in GB, 1e9 bytes.")
    return wrong("not the bytes of ZeRO-1 state per GPU: see the hint.")
