"""course.parallel.pipeline (notebook 14): hand-written GPipe and 1F1B compute one process's gradients,
torch.distributed.pipelining runs the same schedules with the same gradients, and the bubble
falls as the number of micro-batches grows."""

import functools
import inspect

import nbformat
import pytest
import torch
from torch import nn

# Imported here (it imports torch._dynamo and torch._inductor) so that forked ranks inherit it.
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

from course.parallel import pipeline as cp
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.runtime.launcher import launch
from course.classroom.notebooks import SOLUTIONS

# Measured on torch 2.8: these fail there (the library's schedules and tracer changed since); the
# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
needs_part_ii_torch = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
)


NOTEBOOK = SOLUTIONS / "14_pipeline_parallel.ipynb"
TOL = dict(rtol=1e-12, atol=1e-12)  # float64: only the order of additions differs


def _orders(schedule, p, m):
    if schedule == "gpipe":
        return [cp.gpipe_order(m)] * p
    return [cp.one_f_one_b_order(s, p, m) for s in range(p)]


def _reference():
    model = cp.make_model().double()
    x, y = cp.make_batch()
    nn.functional.mse_loss(model(x.double()), y.double()).backward()
    return [p.grad for p in model.parameters()]


def _hand_written(rank, world_size, orders, device_time=0.0):
    x, y = (t.double() for t in cp.make_batch())
    m = 1 + max(i for _, i in orders[rank])
    stage = cp.split(cp.make_model().double(), world_size)[rank]
    log, peak = cp.run_stage(stage, orders[rank], list(x.chunk(m)), list(y.chunk(m)), device_time)
    return {"grads": [p.grad for p in stage.parameters()], "log": log, "peak": peak}


def _all_grads(results):
    return [g for r in results for g in r["grads"]]


def _close(grads, expected):
    return len(grads) == len(expected) and all(torch.allclose(g, e, **TOL) for g, e in zip(grads, expected))


def test_the_notebook_derives_the_package_code():
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    for fn in (cp.gpipe_order, cp.run_stage):
        source = inspect.getsource(fn).rstrip()
        assert any(cell == source or cell.startswith(source + "\n\n\n") for cell in cells), (
            f"notebook 14's {fn.__name__} differs from course/parallel/pipeline.py"
        )


SCHEDULES = [("gpipe", 2, 1), ("gpipe", 2, 4), ("gpipe", 4, 8), ("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 4, 2)]


def _every_schedule(rank, world_size):
    """_hand_written for each schedule of SCHEDULES on world_size stages, one after the other in the same ranks."""
    return {(schedule, m): _hand_written(rank, world_size, _orders(schedule, world_size, m))
            for schedule, p, m in SCHEDULES if p == world_size}


@functools.cache
def _schedules_on(p):
    """Every schedule of SCHEDULES on p stages: one launch for all of them."""
    per_rank = launch(_every_schedule, p, show=None, timeout=60)
    return {key: [results[key] for results in per_rank] for key in per_rank[0]}


@pytest.mark.parametrize("schedule, p, m", SCHEDULES)
def test_hand_written_schedules_give_one_process_gradients(schedule, p, m):
    orders = _orders(schedule, p, m)
    results = _schedules_on(p)[(schedule, m)]
    assert _close(_all_grads(results), _reference())
    assert [[(k, i) for k, i, _, _ in r["log"]] for r in results] == orders  # ran in the order given
    expected_peaks = [m] * p if schedule == "gpipe" else [min(p - s, m) for s in range(p)]
    assert [r["peak"] for r in results] == expected_peaks == [cp.peak_activations(o) for o in orders]


def test_a_schedule_that_skips_a_backward_gives_different_gradients():
    """The comparison above can fail: drop the last micro-batch's backward and it does."""
    orders = [cp.gpipe_order(4)[:-1]] * 2
    results = launch(_hand_written, 2, orders, show=None, timeout=60)
    assert not _close(_all_grads(results), _reference())


def _record_order(module):
    order = []

    def on_forward(module, args, output):
        i = sum(kind == "F" for kind, _ in order)
        order.append(("F", i))
        output.register_hook(lambda grad: order.append(("B", i)))

    module.register_forward_hook(on_forward)
    return order


def _library(rank, world_size, schedule_class, m, pipe=None):
    x, y = (t.double() for t in cp.make_batch())
    if pipe is None:
        stage_module = cp.split(cp.make_model().double(), world_size)[rank]
        stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    else:
        stage = pipe.build_stage(rank, torch.device("cpu"))
        stage_module = stage.submod
    schedule = schedule_class(stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    order = _record_order(stage_module)
    counts = []
    for _ in range(2):  # the first step also runs a shape-inference probe (without pipe)
        order.clear()
        stage_module.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        counts.append(tuple(sum(kind == k for kind, _ in order) for k in "FB"))
    return {"grads": [p.grad for p in stage_module.parameters()], "order": order, "counts": counts}


@needs_part_ii_torch
@pytest.mark.parametrize("schedule_class, schedule", [(ScheduleGPipe, "gpipe"), (Schedule1F1B, "1f1b")])
def test_library_schedules_equal_the_hand_written_ones(schedule_class, schedule):
    p, m = 4, 8
    library = launch(_library, p, schedule_class, m, show=None, timeout=60)
    ours = launch(_hand_written, p, _orders(schedule, p, m), show=None, timeout=60)
    assert [r["order"] for r in library] == _orders(schedule, p, m)
    assert _close(_all_grads(library), _all_grads(ours))
    assert _close(_all_grads(library), _reference())
    # Without example shapes, PipelineStage's first step runs the first micro-batch once more:
    # forward on every stage, backward on every stage that sends gradients.
    assert [r["counts"] for r in library] == [[(m + 1, m), (m, m)]] + [[(m + 1, m + 1), (m, m)]] * (p - 1)


@needs_part_ii_torch
def test_the_pipeline_tracer_splits_where_told_and_equals_the_hand_written_pipeline():
    m = 4
    x, _ = cp.make_batch()
    pipe = pipeline(cp.make_model().double(), mb_args=(x.double().chunk(m)[0],), split_spec={"2": SplitPoint.BEGINNING})
    assert [sum(p.numel() for p in sub.parameters()) for sub in pipe.split_gm.children()] == [2112, 2112]
    traced = launch(_library, 2, Schedule1F1B, m, pipe, show=None, timeout=60)
    ours = launch(_hand_written, 2, _orders("1f1b", 2, m), show=None, timeout=60)
    assert [r["order"] for r in traced] == _orders("1f1b", 2, m)
    assert all(r["counts"] == [(m, m), (m, m)] for r in traced)  # the traced stages know their shapes: no probe
    assert _close(_all_grads(traced), _all_grads(ours))


@pytest.mark.parametrize("forward, backward", [(1, 1), (1, 2), (2, 3)])
def test_simulated_bubble_is_the_formula_for_gpipe_and_1f1b(forward, backward):
    for p in range(1, 6):
        for m in range(1, 13):
            formula = (p - 1) / (m + p - 1)
            for schedule in ("gpipe", "1f1b"):
                logs = cp.simulate(_orders(schedule, p, m), forward, backward)
                assert abs(cp.bubble(logs) - formula) < 1e-12, (schedule, p, m)
                assert max(end for log in logs for *_, end in log) == (m + p - 1) * (forward + backward)


def test_simulate_finds_a_deadlock():
    # Stage 0 waits for B0's gradient, which stage 1 sends only after F1, which stage 0 sends only after B0.
    orders = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    with pytest.raises(cp.Deadlock, match="stage 0 waits at B0, stage 1 waits at F1"):
        cp.simulate(orders)
    with pytest.raises(cp.Deadlock):  # a backward before its own forward
        cp.simulate([[("B", 0), ("F", 0)]])


def test_measured_bubble_falls_as_m_grows():
    # Scheduling delays add idle time to every action, more so on a loaded machine (2 busy loops and the
    # other pytest worker beside the ranks: m = 8 measured 0.31 with device_time 0.02); 0.05 makes them a
    # smaller share.
    p, device_time = 2, 0.05
    logical, wall = {}, {}
    for m in (1, 4, 8):
        results = launch(_hand_written, p, _orders("gpipe", p, m), device_time, show=None, timeout=60)
        logical[m] = cp.bubble(cp.simulate([[(k, i) for k, i, _, _ in r["log"]] for r in results]))
        wall[m] = cp.bubble([r["log"] for r in results])
        formula = (p - 1) / (m + p - 1)
        assert abs(logical[m] - formula) < 1e-12
        assert wall[m] > formula - 0.05, (m, wall[m])  # overheads only add idle time
    assert logical[1] > logical[4] > logical[8]
    assert wall[1] > wall[8] + 0.15, wall  # formula: 0.50 vs 0.11; stages that did not overlap: ~0.5 for every m


def test_peak_activations_and_split():
    assert cp.peak_activations(cp.gpipe_order(5)) == 5
    assert [cp.peak_activations(cp.one_f_one_b_order(s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]
    assert [len(stage) for stage in cp.split(cp.make_model(), 4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="do not split into 3 equal stages"):
        cp.split(cp.make_model(), 3)
