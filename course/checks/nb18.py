"""Checks for the capstone (notebook 18) (putting it together: 3-D parallelism, choosing a configuration)."""

import math
import numbers
import random

from course.classroom import guard
from course.classroom.exercises import correct, exercise, wrong
from course.parallel.parallel3d import mesh_groups as reference_groups
from course.parallel.planner import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, Config, micro_batches, splits, stage_layers

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
    # one more shape, fresh each time: a table of the listed shapes' answers fails it. Every dimension at
    # least 2, so that no made-up fallback (all ranks in one tp group, ...) is right by luck on it.
    while (drawn := (random.randint(2, 4), random.randint(2, 4), random.randint(2, 4))) in SHAPES:
        pass
    for shape in [*SHAPES, drawn]:
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
    return correct(f"the groups of every dimension for {len(SHAPES)} grid shapes,\nfrom 1 x 1 x 1 to 4 x 2 x 1, and one "
                   "drawn at random: the lists DeviceMesh makes on 8 ranks below.")


# ------------------------------------------------------------------ Exercise 2


def _is_number(answer):
    return not isinstance(answer, bool) and isinstance(answer, numbers.Real)


def _state_gb(params, zero, dp):
    """The reference (private; refused as an answer while a check runs: ``finished=``).
    bf16 weights (2 bytes) and gradients (2) and fp32 master weights + Adam (12) per parameter, each
    split over the ``dp`` ranks from the ZeRO stage that shards it on."""
    return (2 / (dp if zero >= 3 else 1) + 2 / (dp if zero >= 2 else 1) + 12 / (dp if zero >= 1 else 1)) * params / 1e9


@exercise(
    "Exercise 2 (where the memory goes)",
    hint="per parameter: bf16 weights (2 bytes), bf16 gradients (2 bytes), fp32 master weights and Adam's two "
    "moments (12 bytes). ZeRO-1 splits the 12 over the dp ranks, ZeRO-2 the gradients too, ZeRO-3 also the weights.",
    finished=("course.parallel.planner.memory", "course.checks.nb18._state_gb"),
)
def state_gb(fn):
    """Exercise 2: ``fn(params, zero, dp)`` -> GB per GPU of weights + gradients + optimizer state."""
    reference_state_gb = guard.original(_state_gb)  # guarded while the check runs: it would pass as an answer
    rng = random.Random()
    cases = [(LLAMA3_8B.params(), 1, 8), (LLAMA3_70B.params(), 3, 64), (1_000_000, 0, 4), (1_000_000, 2, 4)]
    cases += [(rng.randrange(10**6, 10**12), rng.randint(0, 3), rng.randint(2, 4096)) for _ in range(20)]
    for params, zero, dp in cases:
        try:
            answer = fn(params, zero, dp)
        except Exception as e:  # noqa: BLE001 - the student's code: say what it raised
            return wrong(f"state_gb({params}, {zero}, {dp}) raised {type(e).__name__}: {e}")
        if not _is_number(answer) or not math.isfinite(answer):
            return wrong(f"state_gb({params}, {zero}, {dp}) returned {answer!r}: return a number of gigabytes "
                         "(1 GB = 1e9 bytes).")
        expected = reference_state_gb(params, zero, dp)
        if abs(answer - expected) <= 1e-6 * expected:
            continue
        close = lambda value: abs(answer - value) <= 1e-6 * value  # noqa: E731
        where = f"for {params:,} parameters, ZeRO-{zero}, dp = {dp}: {answer:.4g} GB, expected {expected:.4g}. "
        if close(expected * 1e9 / 2**30):
            return wrong(where + "That is in GiB (2**30 bytes): answer in GB, 1e9 bytes.")
        if close(16 * params / dp / 1e9) or close(16 * params / 1e9):
            return wrong(where + "Each ZeRO stage shards a different part: 1 the optimizer state, 2 + the gradients, "
                         "3 + the weights.")
        if close(reference_state_gb(params, zero, dp) + 2 * params / (dp if zero >= 2 else 1) / 1e9):
            return wrong(where + "That counts fp32 gradients: here they are bf16, 2 bytes.")
        if close(reference_state_gb(params, zero, dp) - 4 * params / (dp if zero >= 1 else 1) / 1e9):
            return wrong(where + "The optimizer state also holds fp32 master weights (4 bytes) beside Adam's moments.")
        if close(reference_state_gb(params, min(zero + 1, 3), dp)) or close(reference_state_gb(params, zero - 1, dp)):
            return wrong(where + "That is another ZeRO stage's split: count which of the three parts stage "
                         f"{zero} shards.")
        return wrong(where + "See the hint.")
    return correct(f"{len(cases)} cases, 20 of them drawn at random;\nLlama-3 8B with ZeRO-1 on 8 GPUs: "
                   f"{reference_state_gb(LLAMA3_8B.params(), 1, 8):.1f} GB before a single activation.")


# ------------------------------------------------------------------ Exercise 3


def _activations(model, config, seq, global_batch, stage, c):
    """The reference (private; refused as an answer while a check runs: ``finished=``).
    The layers' activations on pipeline stage ``stage`` under 1F1B, without recomputation."""
    per_layer = c * seq * config.micro_batch * model.hidden / ((config.tp if config.sp else 1) * config.cp)
    held = min(config.pp - stage, micro_batches(config, global_batch))
    return per_layer * stage_layers(model, config.pp, stage) * held


def _random_case(rng):
    model = rng.choice([LLAMA3_8B, LLAMA3_70B, LLAMA3_405B])
    pp = rng.choice([p for p in (1, 2, 4, 8, 16) if splits(model, p)])
    tp, cp, b = rng.choice([1, 2, 4, 8]), rng.choice([1, 2]), rng.choice([1, 2])
    dp = rng.choice([1, 2, 4, 8])
    config = Config(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=b, sp=rng.random() < 0.7)
    global_batch = dp * b * rng.choice([1, 2, 3, pp, 2 * pp, 3 * pp])  # fewer micro-batches than stages, or more
    return model, config, rng.choice([2048, 4096, 8192]), global_batch, rng.randrange(pp), rng.uniform(2, 60)


CASES3 = [  # (model, config, seq, global batch, stage, c): hand cases
    (LLAMA3_8B, Config(dp=8), 8192, 512, 0, 41.0),  # one GPU's 32 layers, one micro-batch
    (LLAMA3_70B, Config(dp=2, tp=4, pp=4), 8192, 512, 0, 41.0),  # the first stage holds 4 micro-batches
    (LLAMA3_70B, Config(dp=2, tp=4, pp=4), 8192, 512, 3, 41.0),  # the last holds 1
    (LLAMA3_70B, Config(dp=4, tp=4, pp=4, sp=False), 8192, 8, 0, 41.0),  # 2 micro-batches in all; no SP
    (LLAMA3_405B, Config(dp=8, tp=8, pp=16, cp=2), 8192, 256, 1, 15.5),  # 126 layers: stage 1 has 8
]


def _mistakes(model, config, seq, global_batch, stage, c):
    """What plausible wrong versions of the activation term give, each with what to say."""
    m, layers = micro_batches(config, global_batch), stage_layers(model, config.pp, stage)
    reference_activations = guard.original(_activations)
    right = reference_activations(model, config, seq, global_batch, stage, c)
    held = min(config.pp - stage, m)
    return [
        (right / config.tp if not config.sp else right * config.tp, "split over tp with sequence parallelism, and "
         "only then."),
        (right * config.cp, "context parallelism gives each rank 1/cp of every sequence's tokens."),
        (right / held * m, "that holds every micro-batch (GPipe); under 1F1B stage p holds pp - p of them."),
        (right / held * (config.pp - stage), "a stage cannot hold more micro-batches than the step has "
         "(micro_batches(config, global_batch))."),
        (right / held * min(config.pp, m), "the later stages start their backwards sooner: stage p holds pp - p "
         "micro-batches."),
        (right / layers * (model.layers // config.pp), "with uneven stages (layers % pp != 0) use "
         "stage_layers(model, pp, stage)."),
        (right / config.micro_batch, "a micro-batch is config.micro_batch sequences: one layer holds "
         "c x seq x micro_batch x hidden bytes of each."),
    ]


@exercise(
    "Exercise 3 (the activation term)",
    hint="one layer, one micro-batch: c x seq x micro_batch x hidden bytes, split over tp only with sequence "
    "parallelism (config.sp) and over cp. A stage holds stage_layers(model, pp, stage) layers; under 1F1B stage p "
    "has started pp - p micro-batches before its first backward, but never more than the step has "
    "(micro_batches(config, global_batch)).",
    finished=("course.parallel.planner.memory", "course.parallel.planner.in_flight", "course.checks.nb18._activations"),
)
def activation_bytes(fn):
    """Exercise 3: ``fn(model, config, seq, global_batch, stage, c)`` -> bytes of the layers' activations that
    pipeline stage ``stage`` holds at its peak under 1F1B, without recomputation (no logits)."""
    reference_activations = guard.original(_activations)  # guarded while the check runs: it would pass as an answer
    rng = random.Random()
    cases = CASES3 + [_random_case(rng) for _ in range(40)]
    answers = []
    for model, config, seq, batch, stage, c in cases:
        try:
            answer = fn(model, config, seq, batch, stage, c)
        except Exception as e:  # noqa: BLE001 - the student's code: say what it raised
            return wrong(f"on {model.name}, {config}, stage {stage}: {type(e).__name__}: {e}")
        if not _is_number(answer) or not math.isfinite(answer):
            return wrong(f"return a number of bytes, not {answer!r}.")
        answers.append(answer)
    same = lambda a, b: abs(a - b) <= 1e-9 * abs(b)  # noqa: E731
    wrong_at = [i for i, (case, a) in enumerate(zip(cases, answers)) if not same(a, reference_activations(*case))]
    if not wrong_at:
        return correct(f"{len(CASES3)} hand cases and 40 drawn at random\n(8B to 405B, uneven stages, SP on and off, "
                       "CP, fewer micro-batches than stages):\nthe memory model's activation term.")
    model, config, seq, batch, stage, c = cases[wrong_at[0]]
    where = (f"{model.name}, dp={config.dp} tp={config.tp} pp={config.pp} cp={config.cp} b={config.micro_batch} "
             f"sp={config.sp}, {batch} sequences of {seq}, stage {stage}, c = {c:.3g}: ")
    for k, (_, why) in enumerate(_mistakes(*cases[wrong_at[0]])):  # the mistake that explains every wrong answer
        if all(same(answers[i], _mistakes(*cases[i])[k][0]) for i in wrong_at):
            return wrong(where + why)
    expected = reference_activations(*cases[wrong_at[0]])
    return wrong(where + f"{answers[wrong_at[0]]:.4g} bytes, expected {expected:.4g}. See the hint.")
