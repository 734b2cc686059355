"""course.observe.wire measures the bytes a rank really sends and receives (Linux's TCP_INFO counters):
the course's own ring sends what its counter says it sends, gloo's collectives send what they send
(not what a ring law says), nothing sent reads as zero, and other systems get a clear error."""

import sys

import pytest
import torch
import torch.distributed as dist

from course import launch
from course.observe import wire
from course.parallel import collectives

pytestmark = pytest.mark.skipif(not wire.available(), reason="course.observe.wire reads Linux's /proc and TCP_INFO")

N = 250_000  # float32 elements: 1 MB


def _measure(rank, world_size, what):
    t = torch.full((N,), float(rank))
    dist.barrier()
    with wire.measure() as m:
        if what == "ring":
            collectives.reset_counts()
            collectives.ring_all_reduce(t)
            counted = collectives.bytes_sent()
        elif what == "nothing":
            counted = 0
        elif what == "all_reduce":
            dist.all_reduce(t)
            counted = None
        elif what == "send":
            if rank == 0:
                dist.send(t, 1)
            else:
                dist.recv(t, 0)
            counted = None
    return m.sent, m.received, counted


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_ring_sends_what_its_counter_says(world_size):
    for sent, received, counted in launch(_measure, world_size, "ring", show=None):
        assert abs(counted - 2 * (world_size - 1) / world_size * 4 * N) <= 8 * world_size  # the law
        # gloo adds a small header to each message: < 1% on 1 MB
        assert counted <= sent < counted * 1.01, (sent, counted)
        assert counted <= received < counted * 1.01


def test_a_send_is_seen_by_both_ends_and_only_there():
    (sent0, received0, _), (sent1, received1, _) = launch(_measure, 2, "send", show=None)
    assert 4 * N <= sent0 < 4 * N * 1.01 and received1 >= 4 * N
    assert sent1 < 1000 and received0 < 1000  # acknowledgements are not payload


def test_nothing_sent_reads_zero():
    for sent, received, _ in launch(_measure, 2, "nothing", show=None):
        assert sent == 0 and received == 0


def test_gloo_all_reduce_on_four_ranks_is_measured_not_assumed():
    # 1.5 x the tensor on 4 ranks here (a ring would send 2(N-1)/N = 1.5 too): the figure comes
    # from the sockets, so a backend that sent more or less would show it
    for sent, _, _ in launch(_measure, 4, "all_reduce", show=None):
        assert 1.0 * 4 * N < sent < 2.0 * 4 * N


def test_other_systems_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert not wire.available()
    with pytest.raises(wire.WireUnavailable, match="Linux"):
        with wire.measure():
            pass


def _per_peer(rank, world_size):
    t = torch.ones(N)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    dist.barrier()
    with wire.measure() as m:
        dist.all_reduce(t, group=groups[rank // 2])  # each pair all-reduces alone
        if rank == 0:
            dist.send(t[:1000], 3)
        elif rank == 3:
            dist.recv(t[:1000], 0)
    return wire.sent_per_peer(m)


def test_bytes_are_attributed_to_the_rank_they_went_to():
    per_peer = launch(_per_peer, 4, show=None)
    partner = {0: 1, 1: 0, 2: 3, 3: 2}
    for rank, sent in enumerate(per_peer):
        assert 4 * N <= sent[partner[rank]] < 4 * N * 1.01  # a 2-rank all-reduce: the tensor, once
    assert 4000 <= per_peer[0][3] < 4100 and set(per_peer[0]) == {1, 3}
    assert set(per_peer[1]) == {0} and set(per_peer[2]) == {3}


def test_a_local_port_two_ranks_share_does_not_confuse_who_is_at_the_other_end():
    """Linux gives two sockets the same local port when they connect to different places (seen in
    CI: rank 4's bytes to its data-parallel peer were put down to another rank). Ranks 1 and 2 both
    connect from port 5000, to ranks 0 and 3; each of rank 0's and 3's sockets has one owner."""
    a, b, c, d = ("127.0.0.1", 4000), ("127.0.0.1", 5000), ("127.0.0.1", 6000), ("127.0.0.1", 7000)
    everyone = [[(a, b)], [(b, a)], [(b, d)], [(d, b)]]  # rank r: [(local, remote), ...]
    other_end = wire.peers(everyone)
    assert other_end[(b, a)] == 1 and other_end[(b, d)] == 2  # rank 0's and rank 3's peers
    assert (a, d) not in other_end


def test_sockets_shared_with_the_parent_are_the_parents():
    """A rank forked from a Jupyter kernel inherits the kernel's sockets, on which the kernel keeps
    sending output while the rank runs: that is not the rank's traffic."""
    import os
    import socket
    import time

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    ready_r, ready_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure while the parent sends on the shared socket
        try:
            with wire.measure() as m:
                os.write(ready_w, b"go")
                time.sleep(0.5)
            os.write(result_w, str(m.sent).encode())
        finally:
            os._exit(0)
    os.read(ready_r, 2)
    client.sendall(b"x" * 100_000)
    received = 0
    while received < 100_000:
        received += len(peer.recv(1 << 20))
    os.waitpid(pid, 0)
    assert int(os.read(result_r, 100)) == 0
    for s in (client, peer, server):
        s.close()
