"""course.parallel.context_parallel (notebook 15): ring attention computes full attention's output and
the gradients of q, k and v on 1-4 ranks, with and without a causal mask, for sequence lengths
that do not divide over the ranks, in both layouts; the zig-zag layout balances causal work;
the forward sends (N-1) K/V chunks per rank; notebook 15 derives the package's code."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from course.parallel import context_parallel as cp
from course.observe import wire
from course.runtime.launcher import launch
from course.classroom.notebooks import SOLUTIONS, definitions

TIGHT = dict(rtol=1e-12, atol=1e-12)  # float64: only the order of additions differs
LAYOUTS = {"contiguous": cp.contiguous_layout, "zigzag": cp.zigzag_layout}


def _inputs(seq_len, seed=0, shape=(2, 3), dim=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, seq_len, dim, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, dL/dout


def _compare_with_full_attention(rank, world_size, cases):
    checked = []
    for seq_len, causal, layout_name in cases:
        q, k, v, upstream = _inputs(seq_len)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*full, is_causal=causal)
        (expected * upstream).sum().backward()

        layout = LAYOUTS[layout_name](seq_len, world_size)
        mine = layout[rank]
        local = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
        out = cp.ring_attention(*local, layout, causal)
        (out * upstream[..., mine, :]).sum().backward()
        torch.testing.assert_close(out, expected[..., mine, :].detach(), **TIGHT)
        for name, got, ref in zip("qkv", local, full):
            torch.testing.assert_close(got.grad, ref.grad[..., mine, :], **TIGHT, msg=f"d{name}, {seq_len=}, {causal=}, {layout_name}")
        checked.append((seq_len, causal, layout_name, len(mine)))
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_attention_equals_full_attention_forward_and_backward(world_size):
    # 13 and 10 tokens do not divide over 2-4 ranks (nor into 2N zig-zag slices): ranks hold different lengths
    cases = [(s, causal, layout) for s in (8, 13, 10) for causal in (False, True) for layout in LAYOUTS]
    checked = launch(_compare_with_full_attention, world_size, cases, show=None, timeout=120)
    assert [len(c) for c in checked] == [len(cases)] * world_size
    if world_size > 1:  # some case really gave the ranks different numbers of tokens
        assert any(len({c[i][3] for c in checked}) > 1 for i in range(len(cases)))


def test_layouts_partition_the_sequence():
    for n in (1, 2, 3, 4):
        for seq_len in (8, 13, 24):
            for layout in (cp.contiguous_layout(seq_len, n), cp.zigzag_layout(seq_len, n)):
                assert len(layout) == n
                assert sorted(torch.cat(layout).tolist()) == list(range(seq_len))
    assert [t.tolist() for t in cp.zigzag_layout(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [t.tolist() for t in cp.contiguous_layout(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def _flops(rank, world_size, layout_name, seq_len):
    q, k, v, _ = _inputs(seq_len, shape=(1,))
    layout = LAYOUTS[layout_name](seq_len, world_size)
    local = [t[..., layout[rank], :] for t in (q, k, v)]
    with FlopCounterMode(display=False) as counter:
        cp.ring_attention(*local, layout, True)
    return counter.get_total_flops()


def test_the_zigzag_layout_balances_causal_work_and_the_contiguous_one_does_not():
    both = launch(lambda rank, world_size: [_flops(rank, world_size, name, 32) for name in ("contiguous", "zigzag")],
                  4, show=None)  # one launch, both layouts
    contiguous, zigzag = ([per_rank[i] for per_rank in both] for i in range(2))
    assert contiguous == sorted(contiguous) and contiguous[-1] > 3 * contiguous[0]  # rank 3 works most
    assert len(set(zigzag)) == 1  # every rank: the same flops
    assert sum(zigzag) == sum(contiguous)  # the same work, redistributed


def _bytes_sent(rank, world_size, seq_len):
    q, k, v, _ = _inputs(seq_len, shape=(1,))
    layout = cp.contiguous_layout(seq_len, world_size)
    local = [t[..., layout[rank], :].float() for t in (q, k, v)]
    with wire.measure() as m:
        cp.ring_forward(*local, layout)
    return m.sent


@pytest.mark.skipif(not wire.available(), reason="course.observe.wire reads Linux's TCP counters")
def test_the_forward_sends_n_minus_1_kv_chunks_per_rank():
    world_size, seq_len, dim = 4, 64, 8
    sent = launch(_bytes_sent, world_size, seq_len, show=None)
    law = (world_size - 1) * 2 * (seq_len // world_size) * dim * 4  # (N-1) passes of K and V, float32
    for b in sent:
        assert law < b <= law + 200 * (world_size - 1)  # plus gloo's headers: 144 B per pass measured (torch 2.15)


def _saved_bytes(rank, world_size, seq_len):
    q, k, v, _ = _inputs(seq_len, shape=(1,))
    layout = cp.contiguous_layout(seq_len, world_size)
    local = [t[..., layout[rank], :].clone().requires_grad_() for t in (q, k, v)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().nbytes()) or t, lambda t: t):
        cp.ring_attention(*local, layout, True)
    return sum(saved)


def test_backward_keeps_only_this_ranks_tokens():
    both = launch(lambda rank, world_size: [_saved_bytes(rank, world_size, n) for n in (32, 64)], 2, show=None)
    one, twice = ([per_rank[i] for per_rank in both] for i in range(2))
    per_token = 8 * (4 * 8 + 1)  # float64 q, k, v, out (dim 8 each) and lse
    assert one == [16 * per_token] * 2 and twice == [32 * per_token] * 2  # linear in tokens, no score matrix


def _bad_layout(rank, world_size):
    q = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="layout must list every rank"):
        cp.ring_attention(q, q, q, cp.contiguous_layout(8, 3))
    with pytest.raises(ValueError, match="layout must list every rank"):
        cp.ring_attention(q, q, q, cp.contiguous_layout(10, 2))
    return True


def test_a_layout_that_does_not_fit_is_refused_with_a_clear_error():
    assert launch(_bad_layout, 2, show=None) == [True, True]


# ------------------------------------------------------------------ notebook 15 derives this code


@pytest.mark.parametrize(
    "name",
    ["contiguous_layout", "zigzag_layout", "visible", "attend", "merge", "start_pass", "ring_forward", "attend_backward", "RingAttention"],
)
def test_the_notebook_derives_the_package_code(name):
    derived = definitions(SOLUTIONS / "15_context_parallel.ipynb")
    assert name in derived, f"notebook 15 no longer defines {name}"
    assert derived[name] == inspect.getsource(getattr(cp, name)).rstrip(), (
        f"notebook 15's {name} differs from course/parallel/context_parallel.py: keep them identical"
    )
