"""course.parallel.schedules (notebook 17): the simulator checks and times tables, the generators meet
their laws, run_schedule gives one process's gradients, torch's tables read the same, and notebook 17
shows the package's generators."""

import inspect
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.classroom.notebooks import SOLUTIONS, definitions
from course.parallel import schedules as cs
from course.parallel.pipeline import Deadlock, make_batch, make_model, split
from course.runtime.launcher import launch

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
)
NOTEBOOK = SOLUTIONS / "17_pipeline_schedules.ipynb"


def test_the_notebook_derives_the_package_generators():
    derived = definitions(NOTEBOOK)
    for fn in (cs.interleaved_1f1b, cs.zb_h1):
        assert derived[fn.__name__] == inspect.getsource(fn).rstrip(), fn.__name__


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (2, 5), (3, 3), (3, 7), (4, 8), (5, 6), (6, 13)])
def test_every_generator_meets_its_law_in_the_simulator(p, m):
    for name, make in cs.SCHEDULES.items():
        for v in ((1, 2, 3) if name == "interleaved" else (1,)):
            table = make(p, m, v) if name == "interleaved" else make(p, m)
            timeline = cs.simulate(table, p, m, v)
            assert timeline.bubble == pytest.approx(cs.bubble_fraction(name, p, m, v), abs=1e-12), (name, v)


@pytest.mark.parametrize("p, m", [(2, 1), (4, 2), (4, 3)])
def test_with_fewer_micro_batches_than_stages_the_tables_still_run(p, m):
    for v in (1, 2):
        assert cs.simulate(cs.interleaved_1f1b(p, m, v), p, m, v).peak[0] <= m * v
    assert max(cs.simulate(cs.zb_h1(p, m), p, m, 1).peak) <= m


@pytest.mark.parametrize("p, m", [(1, 3), (2, 3), (3, 5), (4, 8), (5, 9), (6, 13), (4, 4), (4, 2)])
def test_zb_h2_holds_2p_minus_1_and_with_m_at_least_2p_minus_1_no_rank_idles_inside_its_step(p, m):
    h2, h1 = cs.simulate(cs.zb_h2(p, m), p, m, 1), cs.simulate(cs.zb_h1(p, m), p, m, 1)
    assert h2.peak == [min(2 * p - 1, m)] * p
    assert h2.bubble == pytest.approx(h1.bubble)  # the same stagger from rank 0 to rank p - 1
    if m >= 2 * p - 1:
        assert cs.rank_idle(h2.logs) == [0] * p
        assert cs.rank_idle(h1.logs) == [p - 1 - r for r in range(p)]


def test_zb_h2_idles_inside_a_rank_exactly_when_m_is_below_2p_minus_1():
    """The sweep the notebook cites: zero idle inside every rank's span iff m >= 2p - 1."""
    for p in range(2, 8):
        for m in range(1, 20):
            idle = cs.rank_idle(cs.simulate(cs.zb_h2(p, m), p, m, 1).logs)
            assert (idle == [0] * p) == (m >= 2 * p - 1), (p, m, idle)
    assert cs.rank_idle(cs.simulate(cs.zb_h2(4, 4), 4, 4, 1).logs) == [3, 1, 0, 0]


def test_memory_zb_h1_every_rank_p_1f1b_p_minus_r():
    assert cs.simulate(cs.zb_h1(4, 8), 4, 8, 1).peak == [4, 4, 4, 4]
    assert cs.simulate(cs.one_f_one_b_table(4, 8), 4, 8, 1).peak == [4, 3, 2, 1]
    assert cs.simulate(cs.gpipe_table(4, 8), 4, 8, 1).peak == [8, 8, 8, 8]


def test_the_simulator_refuses_broken_tables():
    table = cs.zb_h1(2, 2)
    with pytest.raises(cs.ScheduleError, match="missing"):
        cs.simulate(table[:-1], 2, 2, 1)
    w_first = [r._replace(slot=-1) if (r.rank, r.op, r.mb) == (1, "W", 0) else r for r in table]
    with pytest.raises(cs.ScheduleError, match="before its B"):
        cs.simulate(w_first, 2, 2, 1)
    with pytest.raises(cs.ScheduleError, match="op must be"):
        cs.simulate([*table[:-1], table[-1]._replace(op="X")], 2, 2, 1)
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1, rank 1 wants micro-batch 1 first
    deadlock = cs.from_orders([[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],
                               [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]])
    with pytest.raises(Deadlock, match="rank 0 waits at B0"):
        cs.simulate(deadlock, 2, 2, 1)


def test_needs_is_the_rule_of_the_stages():
    """F needs the previous stage's F, B its own F and the next stage's B, W its own B; the first stage's F
    and the last stage's B nothing from a neighbour. simulate, time_between, run_schedule and notebook 17's
    causal check all ask it; placements (looped chunks, the V) only say which rank holds a stage."""
    assert cs.needs("F", 3, 0, 4) == [] and cs.needs("F", 3, 2, 4) == [("F", 3, 1)]
    assert cs.needs("B", 3, 1, 4) == [("F", 3, 1), ("B", 3, 2)] and cs.needs("B", 3, 3, 4) == [("F", 3, 3)]
    assert cs.needs("W", 3, 1, 4) == [("B", 3, 1)]
    # interleaved, 2 ranks x 2 chunks: rank 0's chunk 1 (stage 2) waits for rank 1's chunk 0 (stage 1)
    logs = cs.simulate(cs.interleaved_1f1b(2, 2, 2), 2, 2, 2, latency=0.5).logs
    start = {(op, i, cs.stage_of(r, c, 2)): a for r, log in enumerate(logs) for op, i, c, a, _ in log}
    end = {(op, i, cs.stage_of(r, c, 2)): b for r, log in enumerate(logs) for op, i, c, _, b in log}
    assert start[("F", 0, 2)] == end[("F", 0, 1)] + 0.5 and start[("B", 0, 1)] == end[("B", 0, 2)] + 0.5
    assert all(start[key] >= end[need] for key in start for need in cs.needs(*key, 4))
    assert "needs(" in inspect.getsource(cs.time_between) and "needs(" in inspect.getsource(cs.run_schedule)


def test_a_message_between_ranks_costs_the_latency_and_one_within_a_rank_costs_nothing():
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}  # a whole backward (no W rows) costs B + W = 2
    gpipe = cs.gpipe_table(2, 1)  # F on rank 0, F and B on rank 1, B on rank 0: two messages
    for latency in (0.0, 0.25):
        logs = cs.simulate(gpipe, 2, 1, 1, cost=cost, latency=latency).logs
        assert max(a[-1] for log in logs for a in log) == 6 + 2 * latency
    # the V placement on 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1; 1 -> 2 stays on rank 1
    v_table = cs.from_orders([[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]] * 2)
    logs = cs.simulate(v_table, 2, 1, 2, "v", cost=cost, latency=0.25).logs
    assert max(a[-1] for log in logs for a in log) == 12 + 4 * 0.25  # 4 messages, not 6
    one_f_one_b = cs.one_f_one_b_table(2, 4)
    assert cs.simulate(one_f_one_b, 2, 4, 1, latency=0.1).bubble > cs.simulate(one_f_one_b, 2, 4, 1).bubble


def test_time_between_recovers_the_gap_and_latency_a_simulated_timeline_was_played_with():
    # per rank and op: a gap after the rank's previous action, a latency after a late input
    for table, p, m, v, layout in [(cs.one_f_one_b_table(3, 5), 3, 5, 1, "loop"),
                                   (cs.interleaved_1f1b(2, 4, 2), 2, 4, 2, "loop"),
                                   (cs.zb_h1(3, 6), 3, 6, 1, "loop"),
                                   (cs.from_orders([[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]] * 2),
                                    2, 1, 2, "v")]:
        gap = {(r, op): 0.01 * (r + 1) + 0.001 * "FBW".index(op) for r in range(p) for op in "FBW"}
        latency = {(r, op): 0.1 * (r + 1) + 0.02 * "FBW".index(op) for r in range(p) for op in "FBW"}
        cost = {(r, op, c): 1 + 0.1 * r + 0.2 * c + 0.3 * "FBW".index(op) for r in range(p) for c in range(v)
                for op in "FBW"}
        logs = cs.simulate(table, p, m, v, layout, cost=cost, latency=latency, gap=gap).logs
        for r, log in enumerate(logs):  # each action took its rank's and chunk's time
            split = any(a[0] == "W" for a in log)
            assert all(abs(end - start - cost[(r, op, c)] - (cost[(r, "W", c)] if op == "B" and not split else 0))
                       < 1e-9 for op, _, c, start, end in log)
        found_gap, found_latency = cs.time_between(logs, p, v, layout)
        seen = {(r, op) for r, log in enumerate(logs) for op in {a[0] for a in log[1:]}}
        assert sum(found_gap[key] == pytest.approx(gap[key]) for key in seen) >= len(seen) / 2
        assert any(found_latency[key] == pytest.approx(latency[key]) for key in found_latency)
        # played again with what was found: the same bubble (a gap next to a late input is ambiguous)
        again = cs.simulate(table, p, m, v, layout, cost=cost, latency=found_latency, gap=found_gap)
        assert again.bubble == pytest.approx(cs.bubble(logs), abs=0.01)
    # a gap makes every schedule idle more, and one of 0 changes nothing
    one_f_one_b = cs.one_f_one_b_table(2, 4)
    assert cs.simulate(one_f_one_b, 2, 4, 1, gap=0.0).bubble == cs.simulate(one_f_one_b, 2, 4, 1).bubble
    assert cs.simulate(one_f_one_b, 2, 4, 1, gap=0.1).bubble > cs.simulate(one_f_one_b, 2, 4, 1).bubble


def test_time_between_on_a_hand_made_timeline():
    # rank 0: F0 0-1, F1 1.5-2.5 (gap 0.5), B0 3.2-4 (its gradient from rank 1 came at 3.0: late, 0.2);
    # rank 1: F0 1.3-2 (its first: rank 0's F0 ended at 1, latency 0.3), B0 2-3 (its own F: gap 0), F1 3.1-4
    # (rank 0's F1 ended at 2.5, before B0 did: gap 0.1)
    logs = [[("F", 0, 0, 0.0, 1.0), ("F", 1, 0, 1.5, 2.5), ("B", 0, 0, 3.2, 4.0)],
            [("F", 0, 0, 1.3, 2.0), ("B", 0, 0, 2.0, 3.0), ("F", 1, 0, 3.1, 4.0)]]
    gap, latency = cs.time_between(logs, 2, 1)
    assert gap[(0, "F")] == pytest.approx(0.5) and gap[(1, "B")] == 0 and gap[(1, "F")] == pytest.approx(0.1)
    assert latency[(0, "B")] == pytest.approx(0.2) and latency[(1, "F")] == pytest.approx(0.3)
    assert gap[(0, "W")] == pytest.approx(0.1) and latency[(1, "B")] == pytest.approx(0.25)  # the medians of all


def test_bubble_fraction_names_its_schedules():
    with pytest.raises(ValueError, match="schedule must be one of"):
        cs.bubble_fraction("dualpipe", 4, 8)
    assert cs.LLAMA3_405B["pp"] == 16


def _fake(p, m, v):
    rounds = max(1, m // p)
    return types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                                 microbatches_per_round=m // rounds)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 4, 4)])
def test_torchs_interleaved_table_is_ours(p, m, v):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    order = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(_fake(p, m, v), r) for r in range(p)}
    assert cs.orders_of(cs.from_torch(order, p), p) == cs.orders_of(cs.interleaved_1f1b(p, m, v), p)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 5)])
def test_torchs_zero_bubble_with_one_stage_per_rank_is_zb_h1(p, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    order = {r: ScheduleInterleavedZeroBubble._calculate_single_rank_operations(_fake(p, m, 1), r) for r in range(p)}
    assert cs.orders_of(cs.from_torch(order, p), p) == cs.orders_of(cs.zb_h1(p, m), p)



@pytest.mark.parametrize("name, p, m, v", [("interleaved", 4, 8, 2), ("interleaved", 4, 8, 1),
                                           ("interleaved", 16, 16, 4), ("zb-h1", 4, 8, 1)])
def test_torchs_activation_liveness_counts_the_simulators_peaks(name, p, m, v):
    """torch 2.15's public analyze_pipeline_activation_liveness, on torch's own tables: the activations
    each rank holds at once are the simulator's peaks (at p = m = 16, v = 4: ranks 0-7 hold all 64)."""
    from torch.distributed.pipelining import analyze_pipeline_activation_liveness
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    cls = ScheduleInterleaved1F1B if name == "interleaved" else ScheduleInterleavedZeroBubble
    order = {r: cls._calculate_single_rank_operations(_fake(p, m, v), r) for r in range(p)}
    schedule = types.SimpleNamespace(pipeline_order=order, _n_microbatches=m)
    slots = [analyze_pipeline_activation_liveness(schedule, pp_rank=r, stage_indices=[c * p + r for c in range(v)],
                                                  granularity="stage_microbatch").num_slots for r in range(p)]
    assert slots == cs.simulate(cs.from_torch(order, p), p, m, v).peak
    if (p, m, v) == (16, 16, 4):
        assert slots[:8] == [m * v] * 8


WIDTH, DEPTH, ROWS = 16, 12, 24


def _run(rank, p, table, v, m, layout):
    """One rank's step; also records, in order, each irecv posted and each chunk's forward, and
    refuses a blocking recv."""
    stages = split(make_model(WIDTH, DEPTH), p * v)
    chunks = [stages[cs.stage_of(rank, c, p, layout)] for c in range(v)]
    x, y = make_batch(ROWS, WIDTH)
    events, irecv = [], dist.irecv
    for block in (block for chunk in chunks for block in chunk):
        block.register_forward_pre_hook(lambda *_: events.append("compute"))

    def recording_irecv(*args, **kwargs):
        events.append("irecv")
        return irecv(*args, **kwargs)

    def blocking_recv(*args, **kwargs):
        raise AssertionError("run_schedule blocked in recv")

    cpu = []
    with mock.patch.object(dist, "irecv", recording_irecv), mock.patch.object(dist, "recv", blocking_recv):
        log = cs.run_schedule(chunks, cs.orders_of(table, p)[rank], list(x.chunk(m)), list(y.chunk(m)), layout, cpu=cpu)
    # each action's CPU time (this thread's) fits inside its wall-clock interval
    assert len(cpu) == len(log) and all(0 <= c <= end - start + 1e-3 for c, (*_, start, end) in zip(cpu, log))
    return [a[:3] for a in log], [q.grad for c in chunks for q in c.parameters()], events


def _messages_to(rank, table, p, v, layout):
    """How many messages ``rank`` receives in a step: each F or B whose input comes from another rank."""
    owner = {cs.stage_of(r, c, p, layout): r for r in range(p) for c in range(v)}
    count = 0
    for row in table:
        k = cs.stage_of(row.rank, row.chunk, p, layout)
        source = k - 1 if row.op == "F" else k + 1
        count += row.rank == rank and row.op != "W" and source in owner and owner[source] != rank
    return count


@pytest.mark.parametrize(
    "name, p, m, v, layout",
    [("gpipe", 2, 4, 1, "loop"), ("1f1b", 3, 4, 1, "loop"), ("interleaved", 2, 3, 2, "loop"),
     ("interleaved", 3, 4, 2, "loop"), ("zb-h1", 3, 4, 1, "loop"), ("zb-h1", 2, 6, 1, "loop"),
     ("1f1b-v", 2, 4, 2, "v")],
)
def test_run_schedule_gives_one_process_gradients(name, p, m, v, layout):
    if name == "1f1b-v":  # the V placement: rank 0 holds the first and the last stage (no message between
        # stages 1 and 2, which rank 1 holds both): every forward, then every backward, per rank
        orders = [[("F", i, c) for c in range(v) for i in range(m)] + [("B", i, c) for c in (1, 0) for i in range(m)]
                  for _ in range(p)]
        table = cs.from_orders(orders)
    else:
        table = cs.SCHEDULES[name](p, m, v) if name == "interleaved" else cs.SCHEDULES[name](p, m)
    cs.simulate(table, p, m, v, layout)
    results = launch(_run, p, table, v, m, layout, show=None, timeout=60)
    model = make_model(WIDTH, DEPTH)
    x, y = make_batch(ROWS, WIDTH)
    nn.functional.mse_loss(model(x), y).backward()
    stages = split(model, p * v)
    for r, (order, grads, events) in enumerate(results):
        assert order == cs.orders_of(table, p)[r]
        # every receive posted (irecv) before the rank's first computation, none blocking
        assert events[:events.index("compute")] == ["irecv"] * events.count("irecv")
        assert events.count("irecv") == _messages_to(r, table, p, v, layout) > 0
        expected = [q.grad for c in range(v) for q in stages[cs.stage_of(r, c, p, layout)].parameters()]
        assert len(grads) == len(expected)
        assert all(torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(grads, expected))


def test_a_table_that_skips_a_w_leaves_a_gradient_out():
    table = [r for r in cs.zb_h1(2, 2) if not (r.rank == 0 and r.op == "W" and r.mb == 1)]
    results = launch(_run, 2, table, 1, 2, "loop", show=None, timeout=60)
    model = make_model(WIDTH, DEPTH)
    x, y = make_batch(ROWS, WIDTH)
    nn.functional.mse_loss(model(x), y).backward()
    expected = [q.grad for q in split(model, 2)[0].parameters()]
    assert not all(torch.allclose(g, e, rtol=1e-5, atol=1e-6) for g, e in zip(results[0][1], expected))
