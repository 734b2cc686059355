"""Bytes on the wire: what this rank really sent and received, as the kernel counts it.

A formula says what an algorithm *should* send (a ring all-reduce: 2(N-1)/N times the
tensor). What a backend *does* send can differ: gloo, for one, builds
``reduce_scatter_tensor`` from a whole all-reduce and keeps one chunk. So the course
measures instead of trusting the law::

    with wire.measure() as m:
        dist.all_reduce(t)
    m.sent, m.received            # bytes, this rank only
    wire.sent_per_peer(m)         # {peer rank: bytes sent to it} (a collective: every rank calls it)

gloo talks over TCP sockets, and Linux keeps two counters for every TCP socket
(``getsockopt(IPPROTO_TCP, TCP_INFO)``): ``tcpi_bytes_acked``, the bytes this end sent
that the other end acknowledged, and ``tcpi_bytes_received``. :func:`measure` adds up
how much they grew over the sockets of *this process* (``/proc/self/fd``), so traffic of
other processes on the machine does not count. What it counts:

* payload bytes: TCP/IP headers are not included, but everything this rank wrote on
  its sockets is, the few bytes gloo adds to each message and the TCPStore's messages too
  (one collective of a few MB adds well under 1% of such overhead);
* only sockets open at the end of the block (a socket closed inside it is lost), and only
  this process's own: a socket it shares with its parent (a rank forked from a Jupyter
  kernel inherits the kernel's sockets, on which the kernel keeps sending the cell's output)
  is the parent's traffic, not the rank's;
* before reading, it waits (at most 1 s) until every byte written has been sent and
  acknowledged, so the last message of a collective is not missed.

Linux only (kernel >= 4.1: Colab and most servers). On macOS and Windows
:func:`measure` raises :class:`WireUnavailable` with what to do instead.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# Offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields, then u32s.
_UNACKED = 24  # __u32 tcpi_unacked: segments sent and not yet acknowledged
_BYTES_ACKED = 120  # __u64 tcpi_bytes_acked (Linux 4.1)
_BYTES_RECEIVED = 128  # __u64 tcpi_bytes_received (Linux 4.1)
_NOTSENT = 144  # __u32 tcpi_notsent_bytes: written by the program, not yet sent (Linux 4.6)
_TCP_INFO_SIZE = 148


class WireUnavailable(RuntimeError):
    """This system does not let a process read its own sockets' byte counters."""


@dataclass
class Measurement:
    """Bytes this rank sent and received inside a :func:`measure` block (filled in at its end)."""

    sent: int = 0
    received: int = 0
    per_socket: dict = field(default_factory=dict)  # socket -> bytes sent on it


def available() -> bool:
    """True where :func:`measure` works: Linux, with ``/proc`` mounted."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")


def _sockets(pid="self") -> dict:
    """{"socket:[inode]": fd} for the sockets process ``pid`` has open."""
    found = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # another user's process, or gone
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since listdir (the listing's own fd, a socket gloo just closed)
            continue
        if target.startswith("socket:"):
            found[target] = int(fd)
    return found


def tcp_counters() -> dict:
    """{socket inode: (bytes sent and acknowledged, bytes received, bytes still in flight)} for
    every TCP socket this process has open and does not share with its parent."""
    if not available():
        raise WireUnavailable(
            "bytes on the wire are read from Linux's per-socket TCP_INFO counters, which this system "
            f"({sys.platform}) does not offer: run this cell on Linux (Colab works)."
        )
    counters = {}
    inherited = _sockets(os.getppid())
    for target, fd in _sockets().items():
        if target in inherited:
            continue
        try:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:  # a duplicate fd
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:  # not a TCP socket (a Unix socket, a pipe to the kernel...)
            continue
        if len(info) < _TCP_INFO_SIZE:
            continue
        (unacked,) = struct.unpack_from("I", info, _UNACKED)
        acked, received = struct.unpack_from("QQ", info, _BYTES_ACKED)
        (notsent,) = struct.unpack_from("I", info, _NOTSENT)
        counters[target] = (acked, received, unacked + notsent)
    return counters


def settled_counters(wait: float = 1.0) -> dict:
    """:func:`tcp_counters` once nothing written is still unsent or unacknowledged (a
    delayed ACK can take ~40 ms), or after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        counters = tcp_counters()
        if all(in_flight == 0 for _, _, in_flight in counters.values()) or time.monotonic() > deadline:
            return counters
        time.sleep(0.002)


@contextmanager
def measure():
    """Measure the bytes this process sends and receives inside the block (see the module's
    docstring for what is counted). Yields a :class:`Measurement` filled in when the block ends."""
    before = settled_counters()
    result = Measurement()
    yield result
    after = settled_counters()
    for sock, (acked, received, _) in after.items():
        acked0, received0, _ = before.get(sock, (0, 0, 0))
        result.sent += acked - acked0
        result.received += received - received0
        result.per_socket[sock] = acked - acked0


def endpoints() -> dict:
    """{socket: ((local host, port), (remote host, port))} for this process's connected TCP sockets."""
    found = {}
    fds = _sockets()
    for sock in tcp_counters():
        fd = fds.get(sock)
        if fd is None:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:  # the family (IPv4/IPv6) is read from the fd
                found[sock] = (s.getsockname()[:2], s.getpeername()[:2])
        except OSError:  # a listening socket has no peer
            continue
    return found


def sent_per_peer(measurement: Measurement) -> dict:
    """{rank: bytes this rank sent to it} for a :func:`measure` block. A collective over the
    default group (every rank must call it): the ranks swap their sockets' addresses, and a
    socket leads to the rank that holds its other end, the socket with the same two addresses
    swapped. (The local address alone is not enough: Linux gives two sockets the same local port
    when they connect to different places.)"""
    import torch.distributed as dist

    mine = endpoints()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(mine.values()))
    other_end = peers(everyone)
    per_peer = {}
    for sock, sent in measurement.per_socket.items():
        if sock in mine and sent and (peer := other_end.get((mine[sock][1], mine[sock][0]))) is not None:
            per_peer[peer] = per_peer.get(peer, 0) + sent
    return per_peer


def peers(everyone: list) -> dict:
    """{(local, remote): rank} for every rank's connected sockets, given as ``everyone[rank] =
    [(local, remote), ...]``: look up (remote, local) of a socket to find who holds its other end."""
    return {(local, remote): rank for rank, pairs in enumerate(everyone) for local, remote in pairs}
