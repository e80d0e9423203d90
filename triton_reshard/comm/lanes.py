"""Same-host lanes: gloo messages between two ranks on one machine through shared memory.

gloo moves every message over TCP, also between two processes of one host (loopback): per message the
kernel's two copies, TCP's work, and hand-offs between gloo's threads and the caller's at both ends. A
*lane* is one direction between two ranks of a gloo group on the same host: a ring in a shared-memory
segment the sender made, and a doorbell, a FIFO the receiver made. Every message of a pair with a lane
goes into the ring (one copy by the sender at post time) and its header (sequence, position, length, how:
32 bytes, written whole into the pipe) into the doorbell; the receiver, when it waits for the message,
reads the header in its own thread (``select`` with the run's timeout), copies the message out of the ring
into its buffer and tells the sender the space is free again (the consumed position, in the segment's
first cache line). A message larger than half the ring, or that finds no room yet (the receiver has not
taken what came before), goes over gloo beside its header, which says so (tag 1: it never meets other
messages). The header is what a receive waits for either way, so both ends agree without knowing each
other's sizes (a receive buffer may be larger than the message: a delta's inbox). Measured
(``perf/bench_lanes.py``): the same dense refits ~1.3-1.4x faster at 8-64 MB on 4 ranks.

Failure and order: a receive whose header does not come within the timeout returns False (the caller's
named timeout); a peer that died closes its end of the pipe (the receiver reads EOF, the sender gets
EPIPE): a named connection error, not a hang. A pair's messages complete in posting order (the ring's
sequence numbers, which the receiver checks). Nothing read from the ring or the pipe is interpreted beyond
the header's numbers, which are checked against the receive and the ring before a byte is copied.

Security: a ring is created by its sender and a doorbell by its receiver, each with ``O_EXCL`` (mkfifo) and
mode 0600 under a name with the maker's random 63-bit token (a name someone else took is not used: that lane
stays on gloo); the other end opens it only if it is of its own user, mode 0600 (a ring: a regular file of
the announced size; a doorbell: a FIFO; no symlinks), then unlinks the name (its maker does too, at the latest
when its process exits): nothing stays in ``/dev/shm`` but what a killed process made. Trust boundary: the user the ranks run as (a process of that user can read
and write the ring, as it could ptrace the ranks); the per-message digest (``execute/integrity.py``) covers
the ring's bytes as it covers gloo's. ``/dev/shm`` is checked for room first and the ring's pages are
reserved when made (``posix_fallocate``): a full ``/dev/shm`` means no lane, never a SIGBUS later.

Set up over a group's first handshakes (:class:`Setup`: one all-gather posted at each, waited for at the
next), in use from its fourth refit on; a group's first call pays nothing for them. Two ranks are on the
same host when boot, host name, ``/dev/shm`` and network namespace agree (``testing/cluster.py``'s emulated
nodes are namespaces). ``TRITON_RESHARD_LANES=0`` turns a rank's lanes off (its peers then talk to it over
gloo). ``TRITON_RESHARD_LANE_MB``: a rank's shared memory for its outgoing lanes (default 64 MiB, split over
its same-host peers, at most 32 MiB a lane).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import platform
import secrets
import select
import socket
import stat
import struct
import time
from collections import deque
from datetime import timedelta

import numpy as np
import torch

HEADER_FMT = "<4q"  # sequence, position, length, how
HEADER_BYTES = struct.calcsize(HEADER_FMT)  # 32: a pipe writes it whole (PIPE_BUF >= 512)
IN_RING, OVER_GLOO = 0, 1  # a header's "how": the bytes are in the ring / follow over gloo (tag 1)
MIN_LANE_BYTES = 1 << 20  # a lane smaller than this is not made (the budget split too thin)
CTRL_BYTES = 64  # the segment's first cache line: the consumed position (int64), written by the receiver
FALLBACK_TAG = 1
MAX_LANE_BYTES = 32 << 20
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    """Lanes on: ``TRITON_RESHARD_LANES`` (default on) on an x86-64 CPU, whose stores become visible in program
    order (the ring's bytes before the consumed position that frees them, the header after the bytes);
    elsewhere (ARM: Grace) the ring would need fences Python cannot issue, so gloo carries everything."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
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
        # mapped now, page by page (MAP_POPULATE), not at each page's first touch by a message: ~0.5 us a page
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
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
    _MADE.add(path)
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
        seg = Segment(fd, size, path)
        _unlink(path)  # both ends hold it now: the name goes (its maker unlinks too, at the latest at exit)
        return seg
    except OSError:
        return None
    finally:
        os.close(fd)


_MADE: set[str] = set()  # names this process made and has not unlinked yet (unlinked at exit at the latest)


def _unlink(path: str) -> None:
    _MADE.discard(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


@atexit.register
def _unlink_made() -> None:
    for path in list(_MADE):
        _unlink(path)


def make_fifo(token: int, sender: int, receiver: int) -> int | None:
    """The receiver's doorbell of the lane ``sender -> receiver``: a FIFO it makes (mode 0600; a name taken
    is not used) and opens for reading, not blocking; its descriptor."""
    path = _name(token, sender, receiver) + ".fifo"
    try:
        os.mkfifo(path, 0o600)
    except OSError:
        return None
    _MADE.add(path)
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        _unlink(path)
        return None


def open_fifo(token: int, sender: int, receiver: int) -> int | None:
    """The sender's end of the receiver's doorbell: only a FIFO of its own user with mode 0600."""
    path = _name(token, sender, receiver) + ".fifo"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    _unlink(path)  # both ends hold it now
    return fd


class OutLane:
    """This rank's end of a lane to a peer: the ring (where the next message goes, absolute positions:
    ``% cap``) and the peer's doorbell (``fd``)."""

    def __init__(self, seg: Segment, fd: int, peer: int, timeout: timedelta) -> None:
        self.seg, self.fd, self.peer, self.timeout = seg, fd, peer, timeout
        self.head = self.seq = 0

    def ring(self, hdr: bytes) -> None:
        """Write a header into the peer's doorbell (a pipe: 32 bytes are written whole), waiting for room
        within the timeout; a peer gone is a named error."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                os.write(self.fd, hdr)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [self.fd], [], left)[1]:
                    raise TimeoutError(f"same-host lane to rank {self.peer}: its doorbell stayed full for "
                                       f"{self.timeout.total_seconds():g}s (timed out)") from None
            except BrokenPipeError:
                raise ConnectionError(f"same-host lane to rank {self.peer}: the peer closed its end (connection "
                                      f"closed: it died or left the group)") from None


class InLane:
    """This rank's end of a lane from a peer: the ring, the doorbell's read end (``fd``) and the receives
    posted and not yet completed, in order."""

    def __init__(self, seg: Segment, fd: int) -> None:
        self.seg, self.fd = seg, fd
        self.seq = self.consumed = 0
        self.pending: deque[LaneRecv] = deque()
        self.partial = b""  # a header read in part

    def header(self, peer: int, timeout: timedelta | None) -> tuple[int, int, int, int] | None:
        """The next header from the doorbell, waiting up to ``timeout`` (None: the time ran out)."""
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 1e9)
        while len(self.partial) < HEADER_BYTES:
            try:
                got = os.read(self.fd, HEADER_BYTES - len(self.partial))
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    return None
                continue
            if not got:
                raise ConnectionError(f"same-host lane from rank {peer}: the peer closed its end before the message "
                                      f"came (connection closed: it died or left the group)")
            self.partial += got
        hdr, self.partial = self.partial, b""
        return struct.unpack(HEADER_FMT, hdr)


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.reshape(-1).view(torch.uint8)


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


def _left(timeout: timedelta | None, t0: float) -> timedelta | None:
    if timeout is None:
        return None
    return timedelta(seconds=max(timeout.total_seconds() - (time.perf_counter() - t0), 0.001))


class LaneSend:
    """A send through a lane: its bytes are in the ring and its header in the doorbell (nothing to wait for),
    or its bytes go over gloo beside the header (:meth:`wait` waits for that send)."""

    def __init__(self, work=None) -> None:
        self.work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.work is None:
            return True
        return self.work.wait(timeout=timeout) if timeout is not None else self.work.wait()


class LaneRecv:
    """A receive through a lane: :meth:`wait` waits for the header (the doorbell), then copies the message out
    of the ring into the buffer (or, where the header says so, receives it over gloo). A pair's receives
    complete in posting order (an earlier one still pending completes first: the ring's space is freed in
    order); False when the time runs out (a header that does not come)."""

    def __init__(self, pg, gpeer: int, peer: int, lane: InLane, buf: torch.Tensor, seq: int, owner: Lanes) -> None:
        self.pg, self.gpeer, self.peer, self.lane, self.buf, self.seq = pg, gpeer, peer, lane, buf, seq
        self.owner = owner
        self.done = False
        lane.pending.append(self)

    def wait(self, timeout: timedelta | None = None) -> bool:
        t0 = time.perf_counter()
        pending = self.lane.pending
        while not self.done:
            if not pending:
                raise RuntimeError(f"same-host lane from rank {self.peer}: receive {self.seq} is not pending")
            if pending[0]._complete(_left(timeout, t0)) is False:
                return False
        return True

    def _complete(self, timeout: timedelta | None) -> bool:
        t0 = time.perf_counter()
        lane, seg = self.lane, self.lane.seg
        hdr = lane.header(self.peer, timeout)
        if hdr is None:
            return False
        seq, pos, n, how = hdr
        room = _nbytes(self.buf)
        if seq != self.seq or not 0 <= n <= room or how not in (IN_RING, OVER_GLOO):
            raise RuntimeError(f"same-host lane from rank {self.peer}: header {hdr} does not match the receive "
                               f"posted (message {self.seq}, room for {room} bytes)")
        if how == OVER_GLOO:
            dst = self.buf if n == room else _flat(self.buf)[:n]
            w = self.pg.recv([dst], self.gpeer, FALLBACK_TAG)
            left = _left(timeout, t0)
            if (w.wait(timeout=left) if left is not None else w.wait()) is False:
                return False
        else:
            off = pos % seg.cap
            if pos < lane.consumed or off + n > seg.cap:
                raise RuntimeError(f"same-host lane from rank {self.peer}: message {seq} at {pos} (+{n} bytes) lies "
                                   f"outside the ring (consumed {lane.consumed}, capacity {seg.cap})")
            self._copy_out(seg.data[off:off + n], n)
            lane.consumed = pos + n
            seg.ctrl[0] = lane.consumed  # the sender may write there again
        self.done = True
        lane.pending.popleft()
        return True

    def _copy_out(self, src: torch.Tensor, n: int) -> None:
        """The message's bytes out of the ring, hashed as written where the digest asked for this buffer."""
        dst = _flat(self.buf)[:n]
        owner, key = self.owner, (self.buf.data_ptr(), n)
        if owner.copy_hash is not None and key[0] in owner.want:
            owner.hashed[key] = owner.copy_hash(src, dst)
            owner.counts["hashed"] += 1
        elif n:
            dst.copy_(src)


class Lanes:
    """This rank's lanes in one gloo process group, by peer (plan ranks). Every message to or from a peer
    with a lane goes this way (its header through the doorbell, its bytes in the ring or, too large or no
    room yet, over gloo); the others go over gloo as before. ``counts``: messages sent in the ring / over
    gloo beside it (too large, or no room) / without a lane, the ring's bytes, and the receives hashed in their
    copy out of the ring for the digest."""

    def __init__(self, out: dict[int, OutLane], inn: dict[int, InLane], token: int = 0) -> None:
        self.out, self.inn = out, inn
        self.token = token  # in the names of the rings and doorbells this rank made
        self.counts = {"ring": 0, "ring_bytes": 0, "beside": 0, "gloo": 0, "hashed": 0}
        # the digest's hook (``execute/lane_hash.py``): receives into buffers at addresses ``want`` are
        # copied out of the ring by ``copy_hash(src, dst) -> hash of what it wrote``, the value in ``hashed``
        self.copy_hash = None
        self.want: set[int] = set()
        self.hashed: dict[tuple[int, int], int] = {}

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
            self.counts["beside"] += 1
            work = pg.send([buf], gpeer, FALLBACK_TAG)
            lane.ring(struct.pack(HEADER_FMT, seq, 0, n, OVER_GLOO))
            return LaneSend(work)
        if n:
            seg.data[off:off + n].copy_(_flat(buf))
        lane.head = pos + n
        self.counts["ring"] += 1
        self.counts["ring_bytes"] += n
        lane.ring(struct.pack(HEADER_FMT, seq, pos, n, IN_RING))
        return LaneSend()

    def recv(self, pg, peer: int, gpeer: int, buf: torch.Tensor):
        lane = self.inn.get(peer)
        if lane is None or buf.device.type != "cpu":
            return pg.recv([buf], gpeer, 0)
        seq = lane.seq
        lane.seq += 1
        return LaneRecv(pg, gpeer, peer, lane, buf, seq, self)

    def close(self) -> None:
        for lane in (*self.out.values(), *self.inn.values()):
            lane.seg.close()
            with contextlib.suppress(OSError):
                os.close(lane.fd)
        self.out, self.inn = {}, {}


NONE = Lanes({}, {})


class Setup:
    """A group's lanes, set up over its first handshakes (the plan handshake of a run or verify, or a refusal
    in its place: every rank makes the same number). Each handshake takes one step in two halves:
    :meth:`take`, before the handshake posts anything, does this rank's part of the step with the rows the
    last handshake's all-gather brought; :meth:`post`, once the handshake's rows came back (every rank alive
    then), makes the next all-gather (a few int64 per rank: ~1 ms). The rounds: who is where
    (host, token, budget); which rings and doorbells each made; which each opened. The fourth handshake's
    ``take`` makes the lanes, used from then on (a lane where all four ends were made and opened). So a group's
    first call pays one small all-gather for them, and a rank lost between two refits fails the next
    handshake as before (no all-gather of the lanes is in flight then)."""

    def __init__(self, pg, rank: int, ranks: tuple[int, ...], timeout: timedelta) -> None:
        self.pg, self.rank, self.ranks, self.timeout = pg, rank, ranks, timeout
        self.me = ranks.index(rank)
        self.stage = 0
        self.lanes: Lanes | None = None  # made by the fourth handshake
        self._next: list[int] | None = None  # the row the next post sends
        self._got: list[list[int]] | None = None  # every rank's row of the last post's all-gather
        self.made: dict[int, Segment] = {}  # my rings, by receiver
        self.bells: dict[int, int] = {}  # my doorbells (read ends), by sender
        self.mapped: dict[int, Segment] = {}  # the peers' rings to me, by sender
        self.rung: dict[int, int] = {}  # the peers' doorbells (write ends), by receiver

    def take(self) -> Lanes | None:
        """The first half of a handshake's step (see the class); the lanes once made (None before)."""
        if self.lanes is not None:
            return self.lanes
        if self.stage == 0:
            self._who()
        elif self._got is not None:
            got, self._got = self._got, None
            (self._make, self._open, self._finish)[self.stage - 1](got)
        else:
            return None  # the last handshake failed before its post: the group is broken, nothing to take
        self.stage += 1
        return self.lanes

    def post(self) -> None:
        """The second half: the next all-gather, once this handshake's rows came back, waited for here (none is
        left in flight across a refit); its rows are what the next :meth:`take` works with."""
        if self._next is None:
            return
        t = torch.tensor(self._next, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in self.ranks]
        self._next = None
        if not self.pg.allgather([out], [t]).wait(timeout=self.timeout):
            raise RuntimeError(f"rank {self.rank}: the same-host lanes' setup timed out after "
                               f"{self.timeout.total_seconds():g}s")
        self._got = [o.tolist() for o in out]

    def _who(self) -> None:
        on = enabled() and os.path.isdir(SHM_DIR)
        self.hid = host_id() if on else 0
        self.token = secrets.randbits(63)
        self._next = [self.hid, self.token, budget_bytes() if on else 0]

    def _make(self, rows: list[list[int]]) -> None:
        self.rows = rows
        me, rank = self.me, self.rank
        peers = [r for k, r in enumerate(self.ranks) if k != me and self.hid and rows[k][0] == self.hid
                 and rows[k][2] > 0]
        cap = _lane_cap(rows[me][2], len(peers)) if peers else 0
        for q in peers if cap else ():
            seg = create(self.token, rank, q, cap + CTRL_BYTES)
            if seg is not None:
                self.made[q] = seg
            fd = make_fifo(self.token, q, rank)
            if fd is not None:
                self.bells[q] = fd
        # per rank: the size of my ring to it, and 1 << 62 where I made its doorbell
        made, bells = self.made, self.bells
        self._next = [(made[r].size if r in made else 0) | ((1 << 62) if r in bells else 0) for r in self.ranks]

    def _open(self, made_rows: list[list[int]]) -> None:
        for k, q in enumerate(self.ranks):
            if q == self.rank:
                continue
            word = made_rows[k][self.me]
            size = word & ((1 << 62) - 1)
            if size and q in self.bells:
                seg = open_peer(self.rows[k][1], q, self.rank, size)
                if seg is not None:
                    self.mapped[q] = seg
            if word >> 62 and q in self.made:
                fd = open_fifo(self.rows[k][1], self.rank, q)
                if fd is not None:
                    self.rung[q] = fd
        # per rank: 1 where I mapped its ring to me (and hold my doorbell), 2 where I opened its doorbell
        self._next = [(1 if r in self.mapped else 0) | (2 if r in self.rung else 0) for r in self.ranks]

    def _finish(self, done_rows: list[list[int]]) -> None:
        out: dict[int, OutLane] = {}
        inn: dict[int, InLane] = {}
        for k, q in enumerate(self.ranks):
            if q == self.rank:
                continue
            if q in self.made and q in self.rung and done_rows[k][self.me] & 1:
                out[q] = OutLane(self.made[q], self.rung[q], q, self.timeout)
            if q in self.mapped and done_rows[k][self.me] & 2:
                inn[q] = InLane(self.mapped[q], self.bells[q])
        self._tidy(out, inn)
        self.lanes = Lanes(out, inn, self.token)

    def _tidy(self, out: dict, inn: dict) -> None:
        """Unlink every name this rank made (the lanes in use hold their ends open) and close the ends of
        lanes not in use."""
        for q, seg in self.made.items():
            _unlink(seg.path)
            if q not in out:
                seg.close()
        for q, fd in self.bells.items():
            _unlink(_name(self.token, q, self.rank) + ".fifo")
            if q not in inn:
                os.close(fd)
        for q, seg in self.mapped.items():
            if q not in inn:
                seg.close()
        for q, fd in self.rung.items():
            if q not in out:
                os.close(fd)
        self.made, self.bells, self.mapped, self.rung = {}, {}, {}, {}

    def close(self) -> None:
        """Close what the setup made so far (the group is going away)."""
        if self.lanes is not None:
            self.lanes.close()
        else:
            self._tidy({}, {})


def _lane_cap(budget: int, n_peers: int) -> int:
    """Each lane's ring: the budget split over the peers, at most :data:`MAX_LANE_BYTES`; 0 (no lanes) below
    :data:`MIN_LANE_BYTES` or where all same-host ranks' rings would take over half of ``/dev/shm`` free
    (a container's is often 64 MiB)."""
    cap = min(MAX_LANE_BYTES, budget // n_peers) & ~4095
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return 0
    if (cap + CTRL_BYTES) * n_peers * (n_peers + 1) > free // 2:
        return 0
    return cap if cap >= MIN_LANE_BYTES else 0
