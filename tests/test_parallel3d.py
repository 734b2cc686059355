"""course.parallel.parallel3d (notebook 18): 3-D parallel training equals one process on several grids, the
mesh's groups are DeviceMesh's, the bytes each rank sends per dimension are what course.parallel.planner's
laws plus gloo's per-message headers predict, and notebook 18 shows the package's code."""

import dataclasses
import functools
import inspect

import pytest
import torch.distributed as dist

from course import launch
from course.parallel import parallel3d, planner
from course.classroom.doctor import PART_II_TORCH, torch_at_least
from course.classroom.notebooks import SOLUTIONS, definitions

# course declares notebooks 11-18 for torch >= PART_II_TORCH (course/classroom/doctor.py, README).
pytestmark = pytest.mark.skipif(
    not torch_at_least(PART_II_TORCH), reason=f"notebooks 11-18 need torch >= {PART_II_TORCH}"
)

NOTEBOOK = SOLUTIONS / "18_putting_it_together.ipynb"
TINY = planner.Model("TinyLM", layers=2, hidden=16, ffn=64, heads=4, kv_heads=4, vocab=32, ffn_matrices=2, bias=True,
                     norms=False, vocab_parallel=False)
MESSAGE, SEND, RECV = 288, 96, 48  # gloo's header bytes per ring message, per send, per recv notice (measured in 16)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 2), (1, 1, 1)])
def test_3d_training_equals_one_process_and_sends_what_the_laws_and_headers_say(shape):
    dp, pp, tp = shape
    m, steps = 2, 2
    for rank, r in enumerate(launch(parallel3d.train, dp * pp * tp, *shape, show=None)):
        assert r["diff"] < 1e-6
        stage = parallel3d.coordinates(rank, *shape)[1]
        assert r["param_bytes"] == 4 * planner.stage_params(TINY, tp, pp, stage)
        config = planner.Config(dp=dp, pp=pp, tp=tp, zero=0, micro_batch=parallel3d.BATCH // (dp * m), sp=False)
        law = planner.traffic(TINY, config, parallel3d.SEQ, parallel3d.BATCH, dtype_bytes=4, stage=stage)
        headers = {"tp": 4 * (TINY.layers // pp) * m * 2 * (tp - 1) * MESSAGE,
                   "pp": m * (SEND + RECV) if pp > 1 else 0, "dp": 2 * (dp - 1) * MESSAGE}
        assert r["sent"] == {dim: steps * (law[dim] + headers[dim]) for dim in ("dp", "pp", "tp")}, (rank, r["sent"])


def test_pipeline_of_4_stages_sends_one_way_at_the_ends_and_both_ways_in_the_middle(monkeypatch, forked_ranks):
    # TinyLM with 4 blocks on dp x pp x tp = 2 x 4 x 1 (forked ranks see the patched module)
    monkeypatch.setattr(parallel3d, "TinyLM", functools.partial(parallel3d.TinyLM, layers=4))
    deep = dataclasses.replace(TINY, layers=4)
    m, steps = 2, 2
    results = launch(parallel3d.train, 8, 2, 4, 1, show=None)
    assert [r["sent"]["pp"] for r in results[:4]] == [4672, 9344, 9344, 4672]  # measured on the sockets
    for rank, r in enumerate(results):
        assert r["diff"] < 1e-6
        stage = parallel3d.coordinates(rank, 2, 4, 1)[1]
        config = planner.Config(dp=2, pp=4, tp=1, zero=0, micro_batch=parallel3d.BATCH // (2 * m), sp=False)
        law = planner.traffic(deep, config, parallel3d.SEQ, parallel3d.BATCH, dtype_bytes=4, stage=stage)
        message = parallel3d.SEQ * config.micro_batch * deep.hidden * 4
        headers = {"tp": 0, "pp": law["pp"] / message * (SEND + RECV), "dp": 2 * (2 - 1) * MESSAGE}
        assert r["sent"] == {dim: steps * (law[dim] + headers[dim]) for dim in ("dp", "pp", "tp")}, (rank, r["sent"])



def _train_sp_slices_zero1(rank, world_size, dp, pp, tp, steps=2, m=2, lr=0.2):
    """parallel3d.train with two changes: each TP rank sends only its 1/tp of the sequence of every activation
    and gradient between stages (the receiving stage all-gathers the slices over TP, as a stage boundary under
    sequence parallelism carries them), and ZeRO-1 over DP (reduce-scatter, SGD on this rank's slice,
    all-gather). Returns the largest difference from one process and the bytes sent per dimension."""
    import torch
    import torch.nn.functional as F

    from course.observe import wire

    d, p, t = parallel3d.coordinates(rank, dp, pp, tp)
    my = parallel3d.make_groups(dp, pp, tp)
    stage = parallel3d.shard_like(parallel3d.TinyLM(), p, pp, my["tp"])
    params = list(stage.parameters())
    flat = torch.cat([q.detach().reshape(-1) for q in params])
    flat = F.pad(flat, (0, -flat.numel() % dp))
    inputs, targets = (x.chunk(dp)[d] for x in parallel3d.make_batch())
    prev, next = (rank - tp if p > 0 else None), (rank + tp if p < pp - 1 else None)

    def receive(shape, peer):  # this rank's slice from the peer stage, then the whole from the TP group's slices
        piece = torch.empty(shape[0], shape[1] // tp, *shape[2:])
        dist.recv(piece, peer)
        parts = [torch.empty_like(piece) for _ in range(tp)]
        dist.all_gather(parts, piece, group=my["tp"])
        return torch.cat(parts, dim=1)

    with wire.measure() as sent:
        for _ in range(steps):
            saved = []
            for x_, y_ in zip(inputs.chunk(m), targets.chunk(m)):
                x = x_ if prev is None else receive((*x_.shape, parallel3d.DIM), prev).requires_grad_()
                y = stage(x)
                if next is None:
                    y = F.cross_entropy(y.reshape(-1, parallel3d.VOCAB), y_.reshape(-1)) / m
                else:
                    dist.send(y.detach().chunk(tp, dim=1)[t].contiguous(), next)
                saved.append((x, y))
            for x, y in reversed(saved):
                y.backward(None if next is None else receive(y.shape, next))
                if prev is not None:
                    dist.send(x.grad.chunk(tp, dim=1)[t].contiguous(), prev)
            grads = F.pad(torch.cat([q.grad.reshape(-1) for q in params]), (0, flat.numel() - sum(q.numel() for q in params)))
            shard = torch.empty(flat.numel() // dp)
            dist.reduce_scatter_tensor(shard, grads, group=my["dp"])
            dist.all_gather_into_tensor(flat, flat.chunk(dp)[d] - lr * shard / dp, group=my["dp"])
            with torch.no_grad():
                for q, new in zip(params, flat.split([q.numel() for q in params])):
                    q.copy_(new.view_as(q))
                    q.grad = None
    per_dim = {"dp": 0, "pp": 0, "tp": 0}
    for peer, n in wire.sent_per_peer(sent).items():
        differ = [dim for dim, a, b in zip(per_dim, parallel3d.coordinates(peer, dp, pp, tp), (d, p, t)) if a != b]
        per_dim[differ[0]] += n
    one = parallel3d.TinyLM()
    optimizer = torch.optim.SGD(one.parameters(), lr=lr)
    x, y = parallel3d.make_batch()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(one(x).reshape(-1, parallel3d.VOCAB), y.reshape(-1)).backward()
        optimizer.step()
    expected = parallel3d.shard_like(one, p, pp, my["tp"])
    return {"diff": max((a - b).abs().max().item() for a, b in zip(params, expected.parameters())), "sent": per_dim}


def test_pipeline_bytes_with_sequence_parallel_slices_and_zero1_on_a_3d_grid():
    # dp x pp x tp = 2 x 2 x 2, 2 micro-batches of 2 sequences, 2 steps, fp32
    m, steps = 2, 2
    config = planner.Config(dp=2, pp=2, tp=2, zero=1, micro_batch=2, sp=True)
    activation = parallel3d.SEQ * config.micro_batch * TINY.hidden * 4  # 1,024 bytes
    for rank, r in enumerate(launch(_train_sp_slices_zero1, 8, 2, 2, 2, show=None)):
        assert r["diff"] < 1e-6
        stage = parallel3d.coordinates(rank, 2, 2, 2)[1]
        law = planner.traffic(TINY, config, parallel3d.SEQ, parallel3d.BATCH, dtype_bytes=4, stage=stage)
        # the pipeline: the model's bytes (1/tp of each activation, per TP rank) and gloo's 96 + 48 per message
        assert law["pp"] == m * activation / 2
        assert r["sent"]["pp"] == steps * (law["pp"] + m * (SEND + RECV))
        # ZeRO-1 on gloo: its reduce-scatter is an all-reduce (notebook 11), so 3/2 of the model's ring bytes,
        # over 3 ring messages (2 of the all-reduce, 1 of the all-gather)
        assert r["sent"]["dp"] == steps * (law["dp"] * 3 / 2 + 3 * MESSAGE)
        # TP: the model's 4 all-reduces per layer and micro-batch, and the receiving stage's all-gather of the
        # slices (one slice, one message per micro-batch): layers that all-reduce need the whole activation,
        # where sequence-parallel layers would begin with that all-gather anyway
        headers = 4 * m * 2 * MESSAGE  # 1 layer per stage; a ring all-reduce on 2 ranks: 2 messages
        assert r["sent"]["tp"] == steps * (law["tp"] + headers + m * (activation / 2 + MESSAGE))

def test_3d_training_fails_loudly_on_a_wrong_grid():
    with pytest.raises(Exception, match="dp \\* pp \\* tp = 8, but there are 4 ranks"):
        launch(parallel3d.train, 4, 2, 2, 2, show=None)


def _device_mesh_groups(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
    return {dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in ("dp", "pp", "tp")}


@pytest.mark.parametrize("shape", [(1, 2, 4), (3, 1, 2)])  # (2, 2, 2): notebook 18
def test_mesh_groups_are_device_mesh_groups(shape):
    expected = parallel3d.mesh_groups(*shape)
    for rank, mine in enumerate(launch(_device_mesh_groups, shape[0] * shape[1] * shape[2], shape, show=None)):
        for dim, group in mine.items():
            assert group in expected[dim] and rank in group


def test_planner_knows_llama3():
    assert planner.LLAMA3_8B.params() == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert planner.LLAMA3_70B.params() == 70_553_706_496
    assert TINY.params() == sum(p.numel() for p in parallel3d.TinyLM().parameters())


def test_planner_best_fits_and_beats_every_other_fitting_configuration():
    model, cluster = planner.LLAMA3_70B, planner.Cluster(64)
    best = planner.best(model, cluster, 512, 8192)
    assert planner.fits(model, cluster, best, 8192, 512) and best.tp <= cluster.per_node
    t = planner.step_time(model, cluster, best, 8192, 512)["total"]
    for config in planner.candidates(model, cluster, 512, 8192):
        if planner.fits(model, cluster, config, 8192, 512):
            assert planner.step_time(model, cluster, config, 8192, 512)["total"] >= t


def test_activation_coefficient_is_measured_from_the_saved_tensors():
    # a GELU block without norms keeps fewer tensors than a SwiGLU block with RMSNorm, and more heads of the
    # same width change nothing per hidden feature
    llama = planner.activation_coefficient(planner.LLAMA3_8B)
    gpt_like = planner.activation_coefficient(TINY)
    assert gpt_like < llama
    # the figures the notebook and the planner use (torch 2.15): CUDA's fused RMSNorm, and CPU's composite one,
    # which keeps fp32 copies of its input; a band around both would not tell them apart
    assert llama == pytest.approx(41.03, abs=0.01)
    assert planner.activation_coefficient(planner.LLAMA3_8B, kernels="cpu") == pytest.approx(53.53, abs=0.01)
    # the norms are all of the difference, and it is the code, not the device: a hand-written fp32 RMSNorm on CUDA
    bare = dataclasses.replace(planner.LLAMA3_8B, norms=False)
    assert planner.activation_coefficient(bare, kernels="cpu") == pytest.approx(
        planner.activation_coefficient(bare, head_dim=8), abs=0.01)
    assert planner.activation_coefficient(planner.LLAMA3_8B, fp32_norm=True) == pytest.approx(49.03, abs=0.01)
    assert abs(planner.activation_coefficient(planner.LLAMA3_70B) - llama) < 2


def test_planner_stage_memory_follows_1f1b():
    config = planner.Config(dp=4, tp=4, pp=4, zero=2)
    act = [planner.memory(planner.LLAMA3_70B, config, 8192, 512, stage=s)["activations"] for s in range(4)]
    assert act[0] > act[1] > act[2] > act[3] > act[0] / 4  # 4, 3, 2, 1 micro-batches held; the last adds the logits


def test_planner_memory_follows_zero_stages():
    model = planner.LLAMA3_8B
    used = {z: planner.memory(model, planner.Config(dp=8, zero=z), 8192, 512) for z in range(4)}
    p = model.params()
    assert used[0]["optimizer"] == 12 * p and used[1]["optimizer"] == 12 * p / 8
    assert used[1]["gradients"] == 2 * p and used[2]["gradients"] == 2 * p / 8
    assert used[2]["parameters"] == 2 * p and used[3]["parameters"] == pytest.approx(
        2 * p / 8 + 3 * 2 * model.layer_params() + 2 * (2 * model.vocab * model.hidden + model.hidden) * 7 / 8)
    # + three whole layers in backward (activations outweigh the rest: see test_planner), and the embedding,
    # output layer and final norm whole (FSDP2's root module)


@pytest.mark.parametrize("name", ["mesh_groups", "shard_like", "pipeline_step", "average_gradients", "make_groups", "train"])
def test_notebook_shows_the_package_code(name):
    assert definitions(NOTEBOOK)[name] == inspect.getsource(getattr(parallel3d, name)).rstrip()
