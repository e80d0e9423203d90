"""Same-host lanes: gloo messages between two ranks on one machine through shared memory.

gloo moves every message over TCP, also between two processes of one host (loopback): per message a few
syscalls, the kernel's two copies and the wake-ups of gloo's threads at both ends. Measured here (2 cores,
``perf/bench_lanes.py``): a 256 KiB message costs ~0.3 ms over loopback against ~0.01 ms for the two copies
through memory; at 64 MiB the two are alike (memory-bound either way). A refit of small tensors (Megatron's
small model: messages of 8-512 KiB) spends much of its CPU there.

A *lane* is one direction between two ranks of a gloo group on the same host: a ring in a shared-memory
segment the sender made. Every message of a pair with a lane goes into the ring (one copy by the sender
at post time) and gloo carries only its header (4 int64: sequence, position, length, how); the receiver,
when it waits for that header, copies the message out of the ring into its buffer and tells the sender
the space is free again (the ring's consumed position, in the segment's first line). A message larger
than half the ring, or that finds no room (the receiver has not yet taken what came before), goes over
gloo beside its header, which says so (tag 1: it never meets the headers). The header is what a receive
waits for either way, so both ends agree without knowing each other's sizes (a receive buffer may be
larger than the message: a delta's inbox).

What stays as it was: every wait is gloo's (the header's), so a timeout and a peer's death are reported as
before; the order of a pair's messages is the posting order (gloo's, and the ring's sequence numbers, which
the receiver checks). Nothing read from the ring is interpreted beyond the header's numbers, which are
bounds-checked against the ring before a byte is copied.

Security: a segment is created by its sender with ``O_CREAT | O_EXCL`` and mode 0600 (a name taken by
someone else is not used: that lane stays on gloo), under a name with a random 64-bit token; the receiver
maps it only if it is a regular file of its own user, mode 0600, of the announced size. Once both ends hold
it, the sender unlinks it: nothing stays in ``/dev/shm`` (a process that dies before that leaves the file,
which the next setup of that sender does not reuse). Trust boundary: the user the ranks run as (a process
of that user can read and write the ring, as it could ptrace the ranks); the per-message digest
(``execute/integrity.py``) covers the ring's bytes as it covers gloo's.

Set up once per process group (:func:`ensure`), collectively, before its first message: every rank's host
identity and token in one all-gather, the segments made, then two more all-gathers for "made" and "mapped".
``TRITON_RESHARD_LANES=0`` turns lanes off (every rank must agree: the setup's first round carries it, and a
pair uses a lane only where both ends have them on). ``TRITON_RESHARD_LANE_MB``: a rank's shared memory for
its outgoing lanes (default 64 MiB, split over its same-host peers, at most 32 MiB a lane).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import secrets
import socket
import stat
import time
from collections import deque
from datetime import timedelta

import numpy as np
import torch

HEADER_WORDS = 4  # sequence, position, length, how
IN_RING, OVER_GLOO = 0, 1  # a header's "how": the bytes are in the ring / follow over gloo (tag 1)
MIN_LANE_BYTES = 1 << 20  # a lane smaller than this is not made (the budget split too thin)
CTRL_BYTES = 64  # the segment's first cache line: the consumed position (int64), written by the receiver
FALLBACK_TAG = 1
MAX_LANE_BYTES = 32 << 20
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    return os.environ.get("TRITON_RESHARD_LANES", "1") not in ("0", "false", "off", "")


def budget_bytes() -> int:
    raw = os.environ.get("TRITON_RESHARD_LANE_MB", "64")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"TRITON_RESHARD_LANE_MB must be a number of MiB, got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"TRITON_RESHARD_LANE_MB must be >= 0, got {raw!r}")
    return int(mb * (1 << 20))


def host_id() -> int:
    """A 63-bit identity of this machine's shared memory: the boot, the host name, ``/dev/shm``'s device (two
    containers of one host with their own ``/dev/shm`` differ) and the network namespace (processes in two
    namespaces are two nodes to us: ``testing/cluster.py`` emulates a cluster that way, and a lane would
    bypass its links)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return 0  # no /dev/shm: no lanes
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    raw = f"{boot}|{socket.gethostname()}|{dev}|{net}|{os.geteuid()}".encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") >> 1 or 1


class Segment:
    """A mapped segment: the control line and the ring's bytes (``data``: a uint8 tensor over the map)."""

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.path, self.size = path, size
        self.map = mmap.mmap(fd, size)
        self.ctrl = np.frombuffer(self.map, dtype=np.int64, count=CTRL_BYTES // 8)
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, offset=CTRL_BYTES)
        self.cap = size - CTRL_BYTES

    def close(self) -> None:
        self.ctrl = self.data = None
        with contextlib.suppress(BufferError):  # a view still alive: the map goes when it does
            self.map.close()


def _name(token: int, sender: int, receiver: int) -> str:
    return os.path.join(SHM_DIR, f"triton_reshard-{token:016x}-{sender}-{receiver}")


def create(token: int, sender: int, receiver: int, size: int) -> Segment | None:
    path = _name(token, sender, receiver)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now: never a SIGBUS on a full /dev/shm later
        seg = Segment(fd, size, path)
    except OSError:
        os.close(fd)
        _unlink(path)
        return None
    os.close(fd)
    seg.ctrl[0] = 0
    return seg


def open_peer(token: int, sender: int, receiver: int, size: int) -> Segment | None:
    path = _name(token, sender, receiver)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                or st.st_size != size):
            return None
        return Segment(fd, size, path)
    except OSError:
        return None
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class OutLane:
    """This rank's end of a lane to a peer: where the next message goes (absolute positions: ``% cap``)."""

    def __init__(self, seg: Segment) -> None:
        self.seg, self.head, self.seq = seg, 0, 0


class InLane:
    """This rank's end of a lane from a peer: the receives posted and not yet completed, in order."""

    def __init__(self, seg: Segment) -> None:
        self.seg, self.seq, self.consumed = seg, 0, 0
        self.pending: deque[LaneRecv] = deque()


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.reshape(-1).view(torch.uint8)


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


def _left(timeout: timedelta | None, t0: float) -> timedelta | None:
    if timeout is None:
        return None
    return timedelta(seconds=max(timeout.total_seconds() - (time.perf_counter() - t0), 0.001))


def _wait(work, timeout: timedelta | None) -> bool:
    return work.wait(timeout=timeout) if timeout is not None else work.wait()


class LaneSend:
    """A send through a lane (its bytes are in the ring already, or go over gloo too): :meth:`wait` waits for
    gloo's sends (the header's; the message's where it went over gloo)."""

    def __init__(self, hdr: torch.Tensor, works: list) -> None:
        self.hdr, self.works = hdr, works

    def wait(self, timeout: timedelta | None = None) -> bool:
        t0 = time.perf_counter()
        return all(_wait(w, _left(timeout, t0)) is not False for w in self.works)


class LaneRecv:
    """A receive through a lane: :meth:`wait` waits for the header (gloo), then copies the message out of the
    ring into the buffer (or, where the header says so, receives it over gloo). A pair's receives complete in
    posting order (an earlier one still pending completes first: the ring's space is freed in order)."""

    def __init__(self, pg, peer: int, rank_peer: int, lane: InLane, buf: torch.Tensor, seq: int) -> None:
        self.pg, self.peer, self.rank_peer, self.lane, self.buf, self.seq = pg, peer, rank_peer, lane, buf, seq
        self.hdr = torch.empty(HEADER_WORDS, dtype=torch.int64)
        self.work = pg.recv([self.hdr], peer, 0)
        self.done = False
        lane.pending.append(self)

    def wait(self, timeout: timedelta | None = None) -> bool:
        t0 = time.perf_counter()
        pending = self.lane.pending
        while not self.done:
            if not pending:
                raise RuntimeError(f"same-host lane from rank {self.rank_peer}: receive {self.seq} is not pending")
            if pending[0]._complete(_left(timeout, t0)) is False:
                return False
        return True

    def _complete(self, timeout: timedelta | None) -> bool:
        t0 = time.perf_counter()
        if _wait(self.work, timeout) is False:
            return False
        seq, pos, n, how = self.hdr.tolist()
        room = _nbytes(self.buf)
        lane, seg = self.lane, self.lane.seg
        if seq != self.seq or not 0 <= n <= room or how not in (IN_RING, OVER_GLOO):
            raise RuntimeError(f"same-host lane from rank {self.rank_peer}: header {(seq, pos, n, how)} does not "
                               f"match the receive posted (message {self.seq}, room for {room} bytes)")
        if how == OVER_GLOO:
            dst = self.buf if n == room else _flat(self.buf)[:n]
            if _wait(self.pg.recv([dst], self.peer, FALLBACK_TAG), _left(timeout, t0)) is False:
                return False
        else:
            off = pos % seg.cap if seg.cap else 0
            if pos < lane.consumed or off + n > seg.cap:
                raise RuntimeError(f"same-host lane from rank {self.rank_peer}: message {seq} at {pos} (+{n} bytes) "
                                   f"lies outside the ring (consumed {lane.consumed}, capacity {seg.cap})")
            _flat(self.buf)[:n].copy_(seg.data[off:off + n])
            lane.consumed = pos + n
            seg.ctrl[0] = lane.consumed  # the sender may write there again
        self.done = True
        self.lane.pending.popleft()
        return True


class Lanes:
    """This rank's lanes in one gloo process group, by peer (plan ranks). Every message to or from a peer
    with a lane goes this way (its header over gloo, its bytes in the ring or, too large or no room yet,
    over gloo); the others go over gloo as before. ``counts``: messages sent in the ring / over gloo beside
    it (too large or no room) / without a lane, and the ring's bytes."""

    def __init__(self, out: dict[int, OutLane], inn: dict[int, InLane]) -> None:
        self.out, self.inn = out, inn
        self.counts = {"ring": 0, "ring_bytes": 0, "beside": 0, "gloo": 0}

    def __bool__(self) -> bool:
        return bool(self.out or self.inn)

    def send(self, pg, peer: int, gpeer: int, buf: torch.Tensor):
        lane = self.out.get(peer)
        if lane is None or buf.device.type != "cpu":
            self.counts["gloo"] += 1
            return pg.send([buf], gpeer, 0)
        seg, n = lane.seg, _nbytes(buf)
        pos = lane.head
        off = pos % seg.cap
        if off + n > seg.cap:  # to the ring's start
            pos += seg.cap - off
            off = 0
        seq = lane.seq
        lane.seq += 1
        if n > seg.cap // 2 or pos + n - int(seg.ctrl[0]) > seg.cap:  # too large, or not taken yet: over gloo
            hdr = torch.tensor([seq, 0, n, OVER_GLOO], dtype=torch.int64)
            self.counts["beside"] += 1
            return LaneSend(hdr, [pg.send([hdr], gpeer, 0), pg.send([buf], gpeer, FALLBACK_TAG)])
        if n:
            seg.data[off:off + n].copy_(_flat(buf))
        lane.head = pos + n
        self.counts["ring"] += 1
        self.counts["ring_bytes"] += n
        hdr = torch.tensor([seq, pos, n, IN_RING], dtype=torch.int64)
        return LaneSend(hdr, [pg.send([hdr], gpeer, 0)])

    def recv(self, pg, peer: int, gpeer: int, buf: torch.Tensor):
        lane = self.inn.get(peer)
        if lane is None or buf.device.type != "cpu":
            return pg.recv([buf], gpeer, 0)
        seq = lane.seq
        lane.seq += 1
        return LaneRecv(pg, gpeer, peer, lane, buf, seq)

    def close(self) -> None:
        for lane in (*self.out.values(), *self.inn.values()):
            lane.seg.close()
        self.out, self.inn = {}, {}


NONE = Lanes({}, {})


def setup(pg, rank: int, ranks: tuple[int, ...], timeout: timedelta) -> Lanes:
    """Collectively (every rank of the gloo group ``pg``, before its first message): this rank's lanes to and
    from the ranks on its host. ``rank`` / ``ranks``: the group's ranks as the plan numbers them."""
    me = ranks.index(rank)
    on = enabled() and os.path.isdir(SHM_DIR)
    hid = host_id() if on else 0
    token = secrets.randbits(63)
    budget = budget_bytes() if on else 0

    def gather(row: list[int]) -> list[list[int]]:
        t = torch.tensor(row, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in ranks]
        w = pg.allgather([out], [t])
        if not w.wait(timeout=timeout):
            raise RuntimeError(f"rank {rank}: the same-host lanes' setup timed out after {timeout.total_seconds():g}s")
        return [o.tolist() for o in out]

    rows = gather([hid, token, budget])
    peers = [r for k, r in enumerate(ranks) if k != me and hid and rows[k][0] == hid and rows[k][2] > 0]
    n_peers = len(peers)
    sizes = {}
    made: dict[int, Segment] = {}
    if peers and budget:
        cap = min(MAX_LANE_BYTES, budget // n_peers) & ~4095
        try:
            st = os.statvfs(SHM_DIR)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        # every same-host rank makes as much: leave half of /dev/shm to others (a container's is often 64 MiB)
        if (cap + CTRL_BYTES) * n_peers * (n_peers + 1) > free // 2:
            cap = 0
        if cap >= MIN_LANE_BYTES:
            for q in peers:
                seg = create(token, rank, q, cap + CTRL_BYTES)
                if seg is not None:
                    made[q] = seg
                    sizes[q] = cap + CTRL_BYTES
    # round 2: which lanes each rank made, as (receiver -> size) in a row over the group's ranks
    made_rows = gather([sizes.get(r, 0) for r in ranks])
    mapped: dict[int, Segment] = {}
    for k, s in enumerate(ranks):
        size = made_rows[k][me]
        if s != rank and size:
            seg = open_peer(rows[k][1], s, rank, size)
            if seg is not None:
                mapped[s] = seg
    # round 3: which lanes each rank mapped
    mapped_rows = gather([1 if r in mapped else 0 for r in ranks])
    out = {}
    for q, seg in made.items():
        _unlink(seg.path)
        if mapped_rows[ranks.index(q)][me]:
            out[q] = OutLane(seg)
        else:
            seg.close()
    return Lanes(out, {s: InLane(seg) for s, seg in mapped.items()})
