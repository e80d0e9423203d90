"""Same-host lanes: gloo messages between two ranks on one machine through shared memory.

gloo moves every message over TCP, also between two processes of one host (loopback): per message the
kernel's two copies, TCP's work, and hand-offs between gloo's threads and the caller's at both ends. A
*lane* is one direction between two ranks of a gloo group on the same host: a ring in a shared-memory
segment the sender made, and a doorbell, a FIFO the receiver made (``comm/lane_ends.py``: who shares a host,
how the ends are made and opened safely). A message goes into the ring in pieces: each piece copied in by the
sender and announced by a 40-byte header (sequence, ring position, length, the message's length, the piece's
offset in it) written whole into the doorbell; the receiver copies each piece out into its buffer and
publishes the consumed position (the segment's first cache line), which frees the room. A message that fits
the room goes in one piece at post time (nothing left to do but ring); a larger one, or one that finds the
ring full, is queued and its pieces go in as room frees (pieces of up to a quarter of the ring): so any
message of any size takes the lane, and the receiver's copy out of the ring is where the digest hashes it
(``execute/lane_hash.py``). Both ends decide by the header alone (a receive buffer may be larger than the
message: a delta's inbox).

Progress: no thread of ours. Every wait on a lane's send or receive makes progress on all of this rank's lanes
(pushes queued pieces where their rings have room, copies out what arrived for posted receives), then sleeps
in ``select`` on the doorbells it waits on (a short poll while a queued piece waits for room: the freed room
rings no bell). A step's receives are waited before its sends (``Link.wait``) and every rank waits for what
it posted, so every queued piece is pushed and taken. Measured (``perf/bench_lanes.py``): dense refits on 4
ranks ~1.2-1.5x faster at 8-64 MB than over gloo.

Failure and order: a receive whose pieces do not come within the timeout returns False (the caller's named
timeout); a peer that died closes its end of the pipe (the receiver reads EOF, the sender gets EPIPE): a named
connection error, not a hang; a queued piece whose room never frees times out. A pair's messages and pieces
arrive in posting order (sequence numbers, offsets and positions, checked by the receiver before a byte is
copied). Nothing read from the ring or the pipe is interpreted beyond the header's numbers.

Set up over a group's first handshakes (:class:`Setup`: one small all-gather at each), in use from its fourth
refit on; a group's first call pays nothing for them. x86-64 only (``lane_ends.enabled``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import struct
import time
from collections import deque
from datetime import timedelta

import torch

from . import lane_ends as E

HEADER_FMT = "<5q"  # sequence, ring position, piece length, message length, the piece's offset in the message
HEADER_BYTES = struct.calcsize(HEADER_FMT)  # 40: a pipe writes it whole (PIPE_BUF >= 512)
MIN_PIECE = 64 << 10  # a queued message waits for this much room (or all it has left) before its next piece
POLL_S = 0.0002  # a wait's sleep while a queued piece waits for room (the freed room rings no bell)
MASK64 = (1 << 64) - 1


def _flat(buf: torch.Tensor) -> torch.Tensor:
    return buf.reshape(-1).view(torch.uint8)


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


class OutLane:
    """This rank's end of a lane to a peer: the ring (where the next piece goes, absolute positions: ``% cap``),
    the peer's doorbell (``fd``) and the sends not yet all in the ring, in order."""

    def __init__(self, seg: E.Segment, fd: int, peer: int, timeout: timedelta) -> None:
        self.seg, self.fd, self.peer, self.timeout = seg, fd, peer, timeout
        self.head = self.seq = 0
        self.piece = max(seg.cap // 4 & ~4095, MIN_PIECE)
        self.queue: deque[LaneSend] = deque()

    def push(self, counts: dict) -> bool:
        """Queued sends' pieces into the ring while it has room, each rung; True if any went."""
        seg, moved = self.seg, False
        while self.queue:
            s = self.queue[0]
            left = s.n - s.off
            lim = min(left, self.piece, seg.cap - (self.head - int(seg.ctrl[0])))
            if lim < left and lim < MIN_PIECE:  # too little room yet: the receiver has not taken enough
                counts["waits"] += 1
                break
            at = self.head % seg.cap
            k = min(lim, seg.cap - at)  # up to the ring's end; the next piece goes on from its start
            if k:
                seg.data[at:at + k].copy_(s.flat[s.off:s.off + k])
            hdr = struct.pack(HEADER_FMT, s.seq, self.head, k, s.n, s.off)
            self.head += k
            s.off += k
            counts["pieces"] += 1
            self.ring(hdr)
            moved = True
            if s.off == s.n:
                self.queue.popleft()
                s.flat = None
        return moved

    def ring(self, hdr: bytes) -> None:
        """Write a header into the peer's doorbell (a pipe: 40 bytes are written whole), waiting for room
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
    posted and not yet complete, in order."""

    def __init__(self, seg: E.Segment, fd: int, peer: int) -> None:
        self.seg, self.fd, self.peer = seg, fd, peer
        self.seq = self.consumed = 0
        self.pending: deque[LaneRecv] = deque()
        self.partial = b""  # a header read in part

    def header(self) -> tuple[int, int, int, int, int] | None:
        """The next header if the doorbell has it whole now (None: not yet); EOF is the peer gone."""
        while len(self.partial) < HEADER_BYTES:
            try:
                got = os.read(self.fd, HEADER_BYTES - len(self.partial))
            except BlockingIOError:
                return None
            if not got:
                raise ConnectionError(f"same-host lane from rank {self.peer}: the peer closed its end before the "
                                      f"message came (connection closed: it died or left the group)")
            self.partial += got
        hdr, self.partial = self.partial, b""
        return struct.unpack(HEADER_FMT, hdr)

    def drain(self) -> bool:
        """Every piece that arrived for the posted receives, copied out; True if any."""
        moved = False
        while self.pending:
            hdr = self.header()
            if hdr is None:
                break
            self.pending[0].land(hdr)
            moved = True
        return moved


class LaneSend:
    """A send through a lane: done once its last piece is in the ring (:meth:`wait` makes progress until then;
    the buffer is the caller's again after)."""

    def __init__(self, owner: Lanes, buf: torch.Tensor, seq: int) -> None:
        self.owner, self.seq = owner, seq
        self.flat: torch.Tensor | None = _flat(buf)  # None once every piece is in the ring
        self.n, self.off = _nbytes(buf), 0

    @property
    def done(self) -> bool:
        return self.flat is None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.owner.wait_for(self, timeout)


class LaneRecv:
    """A receive through a lane: :meth:`wait` makes progress until its pieces all came, each copied out of the
    ring into the buffer as its header is read (a pair's receives complete in posting order); False when the
    time runs out."""

    def __init__(self, peer: int, lane: InLane, buf: torch.Tensor, seq: int, owner: Lanes) -> None:
        self.peer, self.lane, self.buf, self.seq, self.owner = peer, lane, buf, seq, owner
        self.done = False
        self.got, self.total = 0, -1
        lane.pending.append(self)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.owner.wait_for(self, timeout)

    def land(self, hdr: tuple[int, int, int, int, int]) -> None:
        """One piece (its header read): checked against the receive and the ring, copied out, its room freed."""
        lane, seg = self.lane, self.lane.seg
        seq, pos, n, total, off = hdr
        room = _nbytes(self.buf)
        if (seq != self.seq or not 0 <= total <= room or off != self.got or not 0 <= n <= total - off
                or (n == 0) != (total == 0) or self.total not in (-1, total)):
            raise RuntimeError(f"same-host lane from rank {self.peer}: header {hdr} does not match the receive "
                               f"posted (message {self.seq}, {self.got} bytes in, room for {room} bytes)")
        at = pos % seg.cap
        if pos != lane.consumed or at + n > seg.cap:
            raise RuntimeError(f"same-host lane from rank {self.peer}: message {seq} at {pos} (+{n} bytes) lies "
                               f"outside the ring (consumed {lane.consumed}, capacity {seg.cap})")
        self._copy_out(seg.data[at:at + n], off, total)
        lane.consumed = pos + n
        seg.ctrl[0] = lane.consumed  # the sender may write there again
        self.got, self.total = off + n, total
        if self.got == total:
            self.done = True
            lane.pending.popleft()

    def _copy_out(self, src: torch.Tensor, off: int, total: int) -> None:
        """A piece's bytes out of the ring, hashed as written where the digest asked for this buffer (the
        hash is linear: the pieces' values add up to the message's)."""
        n = src.numel()
        dst = _flat(self.buf)[off:off + n]
        owner, key = self.owner, (self.buf.data_ptr(), total)
        if owner.copy_hash is not None and key[0] in owner.want:
            owner.hashed[key] = (owner.hashed.get(key, 0) + owner.copy_hash(src, dst, off, total)) & MASK64
            owner.counts["hashed"] += off + n == total
        elif n:
            dst.copy_(src)


class Lanes:
    """This rank's lanes in one gloo process group, by peer (plan ranks). Every message to or from a peer
    with a lane goes this way (its pieces through the ring, announced in the doorbell); the others go over
    gloo as before. ``counts``: messages sent through a lane and their bytes and pieces, pushes that waited for
    room, messages without a lane, and the receives hashed in their copy out of the ring for the digest."""

    def __init__(self, out: dict[int, OutLane], inn: dict[int, InLane], token: int = 0) -> None:
        self.out, self.inn = out, inn
        self.token = token  # in the names of the rings and doorbells this rank made
        self.counts = {"ring": 0, "ring_bytes": 0, "pieces": 0, "waits": 0, "gloo": 0, "hashed": 0}
        # the digest's hook (``execute/lane_hash.py``): receives into buffers at addresses ``want`` are
        # copied out of the ring by ``copy_hash(src, dst, offset, length) -> hash of what it wrote`` (the
        # piece at ``offset`` of a message of ``length`` bytes), the message's value summed in ``hashed``;
        # where the step's unpack was registered for the buffer (``lane_hash.LaneUnpack``), the hook writes
        # the piece straight into the destination views instead and leaves ``dst`` as it was
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
        s = LaneSend(self, buf, lane.seq)
        lane.seq += 1
        self.counts["ring"] += 1
        self.counts["ring_bytes"] += s.n
        lane.queue.append(s)
        lane.push(self.counts)  # into the ring now where it has room: usually nothing left to wait for
        return s

    def recv(self, pg, peer: int, gpeer: int, buf: torch.Tensor):
        lane = self.inn.get(peer)
        if lane is None or buf.device.type != "cpu":
            return pg.recv([buf], gpeer, 0)
        seq = lane.seq
        lane.seq += 1
        return LaneRecv(peer, lane, buf, seq, self)

    def progress(self) -> bool:
        """Push what is queued where there is room, copy out what arrived; True if anything moved."""
        moved = False
        for lane in self.out.values():
            if lane.queue:
                moved |= lane.push(self.counts)
        for lane in self.inn.values():
            if lane.pending:
                moved |= lane.drain()
        return moved

    def wait_for(self, op: LaneSend | LaneRecv, timeout: timedelta | None) -> bool:
        """Progress until ``op`` is done (True), or the timeout ran out (False)."""
        deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 1e9)
        while not op.done:
            if self.progress():
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fds = [lane.fd for lane in self.inn.values() if lane.pending]
            if any(lane.queue for lane in self.out.values()):
                left = min(left, POLL_S)
            if fds:
                select.select(fds, [], [], left)
            else:
                time.sleep(left)
        return True

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
        self.made: dict[int, E.Segment] = {}  # my rings, by receiver
        self.bells: dict[int, int] = {}  # my doorbells (read ends), by sender
        self.mapped: dict[int, E.Segment] = {}  # the peers' rings to me, by sender
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
        on = E.enabled() and os.path.isdir(E.SHM_DIR)
        self.hid = E.host_id() if on else 0
        self.token = secrets.randbits(63)
        self._next = [self.hid, self.token, E.budget_bytes() if on else 0]

    def _make(self, rows: list[list[int]]) -> None:
        self.rows = rows
        me, rank = self.me, self.rank
        peers = [r for k, r in enumerate(self.ranks) if k != me and self.hid and rows[k][0] == self.hid
                 and rows[k][2] > 0]
        cap = E._lane_cap(rows[me][2], len(peers)) if peers else 0
        for q in peers if cap else ():
            seg = E.create(self.token, rank, q, cap + E.CTRL_BYTES)
            if seg is not None:
                self.made[q] = seg
            fd = E.make_fifo(self.token, q, rank)
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
                seg = E.open_peer(self.rows[k][1], q, self.rank, size)
                if seg is not None:
                    self.mapped[q] = seg
            if word >> 62 and q in self.made:
                fd = E.open_fifo(self.rows[k][1], self.rank, q)
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
                inn[q] = InLane(self.mapped[q], self.bells[q], q)
        self._tidy(out, inn)
        self.lanes = Lanes(out, inn, self.token)

    def _tidy(self, out: dict, inn: dict) -> None:
        """Unlink every name this rank made (the lanes in use hold their ends open) and close the ends of
        lanes not in use."""
        for q, seg in self.made.items():
            E._unlink(seg.path)
            if q not in out:
                seg.close()
        for q, fd in self.bells.items():
            E._unlink(E._name(self.token, q, self.rank) + ".fifo")
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
