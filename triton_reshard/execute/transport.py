"""The transport side of a run: every call and wait with a timeout and a named error, the exchange of every
rank's small row (the plan handshake's, ``execute/handshake.py``; the verify result), one run at a time per
group."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch

from ..comm.group import RefitGroup
from .errors import (
    CONNECTION_WORDS,
    GROUP_DEAD,
    TIMEOUT_WORDS,
    ReshardConnectionError,
    ReshardError,
    ReshardTimeoutError,
    ReshardTransportError,
    classify,
)

# one run or verify at a time per process group in this process: two would match each other's messages
_RUNNING: dict[int, tuple[object, str]] = {}
_RUNNING_LOCK = threading.Lock()


DIRECT_ROWS_MAX_RANKS = 64  # up to this group size the rows go peer to peer or rooted (see post_rows)
# from this group size on gloo the rows go rooted: to the group's first rank, which sends the table back (issue
# 32: 8 ranks on 2 cores spent a 64-byte refit's 8.9 ms mostly waking processes for the 56 row messages)
ROOTED_ROWS_MIN_RANKS = 8


def rows_shape(comm) -> str:
    """How :func:`post_rows` exchanges rows in ``comm``: "direct", "rooted" or "all_gather". It depends only on
    what every rank of the group shares by construction (its size and backend), never on a rank's plan or
    host, so every rank takes the same shape even when their plans differ (the handshake refuses those)."""
    n = len(comm.ranks)
    if n > DIRECT_ROWS_MAX_RANKS:
        return "all_gather"
    return "rooted" if n >= ROOTED_ROWS_MIN_RANKS and comm.backend == "gloo" else "direct"


def post_rows(comm, mine: torch.Tensor, last: dict[int, int] | None = None) -> tuple[list[torch.Tensor], list]:
    """Start the exchange of every rank's small row ``mine`` (the plan handshake, the verify counts): (every
    rank's row in ``comm.ranks`` order, the works to wait for, in order; the list is filled once they are).

    Shapes (:func:`rows_shape`): "direct", each row straight to every peer in one round: one network latency,
    where gloo's ring all-gather waits ``n - 1`` hops in turn (issue 32: ~3 ms a hop between emulated nodes).
    It costs ``n (n - 1)`` messages, each waking a gloo thread at both ends: at 8 ranks on gloo, "rooted"
    (:class:`RootedRows`) sends ``2 (n - 1)``: every row to the group's first rank, the table back. The root
    posts and waits as many as in "direct" and the others one each, so the CPU of all ranks falls by about
    ``n / 2`` (what 8 ranks sharing a host's cores pay; on a cluster each rank's own CPU is not more). The
    latency: the root's receives and the others' receives of the table are posted on entry, so gloo sends each
    row and the table at once (a sender waits for the receiver's notice): the table lands two latencies after
    the last rank entered, as "direct"'s rows do at that rank; three when the root enters last. Larger
    groups (over ``DIRECT_ROWS_MAX_RANKS``) use the all-gather.
    ``last``: per peer, a value for the row's last field in the copy that goes to that peer (the handshake's
    pre-posted bytes; not with the all-gather, which sends one row to all)."""
    ranks = tuple(comm.ranks)
    shape = rows_shape(comm)
    if shape == "all_gather":
        out = [torch.empty_like(mine) for _ in ranks]
        if last:
            raise ValueError(f"per-peer row fields need at most {DIRECT_ROWS_MAX_RANKS} ranks, got {len(ranks)}")
        return out, [comm.all_gather(out, mine)]
    me = ranks.index(comm.rank)
    if shape == "rooted":
        rooted = RootedRows(comm, mine, last)
        return rooted.out, rooted.works
    out = [torch.empty_like(mine) for _ in ranks]
    out[me].copy_(mine)
    peers = [(r, out[k]) for k, r in enumerate(ranks) if k != me]
    sends = []
    for r, _ in peers:
        row = mine
        if last and last.get(r):
            row = mine.clone()
            row[-1] = last[r]
        sends.append((r, row))
    return out, comm.post(sends, peers)


class RootedRows:
    """The "rooted" row exchange (:func:`post_rows`). Each rank sends the root (``comm.ranks[0]``) its row
    without the last field, followed by the last field as it would go to each rank (``last``, else the row's):
    ``F - 1 + n`` values. The root receives them into a table (its own row too), sends the whole table to every
    other rank, and each rank takes its rows from it: every rank's row with the last field meant for it, the
    same rows as "direct" gives. ``works``: on the root this object alone, whose ``wait`` waits for the rows
    and sends the table, all within the timeout; elsewhere the send and the table's receive, then this object,
    whose ``wait`` unpacks the table. ``out`` is filled by that last ``wait``.

    A row the root does not get (its sender died, or never came within the timeout) would leave every other
    rank waiting for a table until its own timeout, where "direct" tells each at once (a closed connection to
    the dead peer): so the root sends them the table with its status row (the last) saying which rank's row
    it lost and how, and they raise that, named (timed out / lost the connection), as the root does."""

    LOST = {1: "timed out", 2: "lost the connection to it", 3: "failed"}  # the status row's codes

    def __init__(self, comm, mine: torch.Tensor, last: dict[int, int] | None) -> None:
        ranks = tuple(comm.ranks)
        n, base = len(ranks), mine.numel() - 1
        self.comm, self.ranks, self.me, self.base = comm, ranks, ranks.index(comm.rank), base
        row = mine.tolist()  # one read of the row, one tensor made (a few small tensor ops cost more)
        tail = [last[r] if last and last.get(r) and k != self.me else row[-1] for k, r in enumerate(ranks)]
        msg = torch.tensor(row[:-1] + tail, dtype=mine.dtype, device=mine.device)
        self.table = torch.zeros((n + 1, base + n), dtype=mine.dtype, device=mine.device)  # + the status row
        self.out: list[torch.Tensor] = [mine.new_empty(0) for _ in ranks]  # filled by wait()
        if self.me == 0:
            self.table[0].copy_(msg)
            self._recvs = comm.post([], [(r, self.table[k]) for k, r in enumerate(ranks) if k])
            self.works = [self]
        else:
            self._msg = msg  # alive until its send completed
            self.works = comm.post([(ranks[0], msg)], [(ranks[0], self.table)]) + [self]

    def wait(self, timeout: timedelta | None = None) -> bool:
        """The last work: on the root, wait for the rows and send the table (or the status of a row it did not
        get), within ``timeout``; then every rank takes its rows from the table."""
        if self.me == 0:
            self._root(time.perf_counter() + (timeout.total_seconds() if timeout is not None else 300.0))
        code, lost = self.table[-1, :2].tolist()
        if code:
            raise RuntimeError(f"the plan handshake's root, rank {self.ranks[0]}, {self.LOST.get(code, 'failed')} "
                               f"waiting for the row of rank {lost}")
        col = self.base + self.me
        self.out[:] = torch.cat([self.table[:-1, :self.base], self.table[:-1, col:col + 1]], 1).unbind(0)
        return True

    def _root(self, deadline: float) -> None:
        """The root's part: the rows in, then the table out; a row lost sets the status row, which goes to every
        other rank still reachable (within a second past the deadline) before the root raises it too."""
        lost, cause = 0, None
        for k, w in enumerate(self._recvs, start=1):
            try:
                ok = w.wait(timeout=timedelta(seconds=max(deadline - time.perf_counter(), 0.001)))
            except Exception as e:
                ok, cause = False, e
            if ok is False:
                lost = k
                break
        if lost:
            text = f"{type(cause).__name__} {cause}".lower() if cause is not None else "timed out"
            code = 1 if any(w in text for w in TIMEOUT_WORDS) else 2 if any(w in text for w in CONNECTION_WORDS) else 3
            self.table[-1, 0], self.table[-1, 1] = code, self.ranks[lost]
        peers = [r for k, r in enumerate(self.ranks) if k and k != lost]
        if peers:
            sends = self.comm.post([(r, self.table) for r in peers], [])
            end = deadline + (1.0 if lost else 0.0)
            for w in sends:
                try:
                    w.wait(timeout=timedelta(seconds=max(end - time.perf_counter(), 0.001)))
                except Exception:
                    if not lost:
                        raise
        if cause is not None:
            raise cause
        if lost and code == 1:
            raise RuntimeError(f"rank {self.ranks[0]} (the plan handshake's root) timed out waiting for the row "
                               f"of rank {self.ranks[lost]}")


class PostedRows:
    """A row exchange posted and not yet waited for: :meth:`rows` waits (the timeout counted from that call,
    not from the post: the caller may work in between) and gives every rank's row. ``later``: an exchange not
    posted at all (no gloo group), made by :meth:`rows` itself."""

    def __init__(self, link, what: str, works=(), out=(), later=None) -> None:
        self.link, self.what, self.works, self.out, self.later = link, what, works, out, later

    def rows(self) -> list[list[int]]:
        if self.later is not None:
            return self.later()
        self.link.wait(self.works, self.what, self.link.ranks)
        return [o.tolist() for o in self.out]


def post_gather(link, row: list[int], what: str, rooted_from: int) -> PostedRows:
    """Post the exchange of every rank's ``row`` (int64) and return it unwaited. On gloo (a torch.distributed
    group or a RefitGroup; CPU tensors) from ``rooted_from`` up to :data:`DIRECT_ROWS_MAX_RANKS` ranks, rooted
    (:class:`RootedRows`), else as :func:`post_rows` shapes it; elsewhere (NCCL; a link without a group) the
    link's own row exchange, made when the rows are asked for (on NCCL a post now would sync the device)."""
    comm = getattr(link, "comm", None)
    if getattr(comm, "backend", None) != "gloo":
        return PostedRows(link, what, later=lambda: link.all_gather_row(row, what))
    mine = torch.tensor(row, dtype=torch.int64)
    if rooted_from <= len(link.ranks) <= DIRECT_ROWS_MAX_RANKS:
        rooted = link.call(RootedRows, what, link.ranks, comm, mine, None)
        return PostedRows(link, what, rooted.works, rooted.out)
    out, works = link.call(post_rows, what, link.ranks, comm, mine)
    return PostedRows(link, what, works, out)


class Link:
    """This rank's end of the transport (``comm``: a torch.distributed group or a RefitGroup), with the
    run's ``timeout``: every call and wait raises a named :class:`ReshardTransportError`."""

    def __init__(self, comm, timeout: timedelta) -> None:
        self.comm = comm
        self.timeout = timeout
        self.rank, self.ranks = comm.rank, tuple(comm.ranks)

    @property
    def wire(self) -> bool:
        return self.comm.wire

    @property
    def is_nccl(self) -> bool:
        return self.comm.backend == "nccl"

    def device(self) -> torch.device:
        if self.is_nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def error(self, what: str, peers, started: float, cause: BaseException | None,
              peer: int | None = None, op: str | None = None) -> ReshardTransportError:
        """The named error for a failure of ``what`` (with ``peers``) that began at ``started``."""
        elapsed = time.perf_counter() - started
        limit = self.timeout.total_seconds()
        msg = str(cause).strip() if cause is not None else ""
        first = msg.splitlines()[0] if msg else (type(cause).__name__ if cause is not None else "")
        cls = ReshardTimeoutError if cause is None else classify(f"{type(cause).__name__} {msg}")
        where = f" ({op} rank {peer})" if op is not None else ""
        if cls is ReshardTimeoutError:
            how = f"timed out: it did not complete within the {limit:g}s timeout (after {elapsed:.2f}s)"
        elif cls is ReshardConnectionError:
            how = (f"lost the connection after {elapsed:.2f}s (timeout {limit:g}s): a peer died or closed, or "
                   f"the group broke earlier")
        else:
            how = f"failed after {elapsed:.2f}s (timeout {limit:g}s)"
        backend = getattr(self.comm, "backend", "?")
        detail = f" [{backend}: {type(cause).__name__}: {first}]" if cause is not None else ""
        return cls(
            f"rank {self.rank}: {what}{where} with peers {sorted(peers)} {how}{detail}; {GROUP_DEAD}",
            rank=self.rank, what=what, peers=tuple(sorted(peers)), peer=peer, elapsed=elapsed, timeout=limit,
        )

    def call(self, fn, what: str, peers, *args):
        """``fn(*args)`` on the transport; any failure becomes a named :class:`ReshardTransportError`."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:
            raise self.error(what, peers, t0, e) from e

    def lanes_take(self) -> None:
        """A handshake's step of the group's same-host lanes' setup, before it posts anything (collective: every
        rank's handshake, of a run or a refusal; ``comm/lanes.Setup``: in use from the fourth)."""
        fn = getattr(self.comm, "lane_setup", None)
        setup = fn(self.timeout) if fn is not None else None
        if setup is not None:
            self.call(setup.take, "the same-host lanes' setup", self.ranks)

    def lanes_post(self) -> None:
        """The step's next round, posted once the handshake's rows came back."""
        fn = getattr(self.comm, "lane_setup", None)
        setup = fn(self.timeout) if fn is not None else None
        if setup is not None:
            self.call(setup.post, "the same-host lanes' setup", self.ranks)

    def post(self, sends, recvs) -> list:
        return self.comm.post(sends, recvs)  # never called with nothing to post: steps without ops are dropped

    def wait(self, works, what: str, peers, started: float | None = None, ops_desc=None) -> None:
        """Wait for ``works`` (posted at ``started``) within the timeout, counted from ``started``.
        ``ops_desc``: per work, ``(operation, peer)`` when each work is one operation."""
        started = time.perf_counter() if started is None else started
        deadline = started + self.timeout.total_seconds()
        if ops_desc is not None and len(ops_desc) != len(works):
            ops_desc = None  # one work for several operations (NCCL coalescing): no peer to name
        for k, w in enumerate(works):
            op, peer = ops_desc[k] if ops_desc else (None, None)
            left = max(deadline - time.perf_counter(), 0.001)
            try:
                ok = w.wait(timeout=timedelta(seconds=left))
            except Exception as e:
                raise self.error(what, peers, started, e, peer, op) from e
            if ok is False:
                raise self.error(what, peers, started, None, peer, op)

    def all_gather_row(self, row: list[int], what: str) -> list[list[int]]:
        """Every rank's ``row`` (one exchange over the group, :func:`post_rows`, with the timeout)."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device())
        t0 = time.perf_counter()
        out, works = self.call(post_rows, what, self.ranks, self.comm, mine)
        self.wait(works, what, self.ranks, t0)
        return [o.tolist() for o in out]

    def all_counts(self, mine: int) -> dict[int, int]:
        """Every rank's mismatch count (verify)."""
        if not self.wire:
            return {self.rank: mine}
        rows = self.all_gather_row([mine], "the verify result exchange")
        return {r: count for r, (count,) in zip(self.ranks, rows, strict=True)}

    @contextlib.contextmanager
    def exclusive(self, what: str, digest: str):
        """Refuse a second run or verify on the same process group while one is in progress in this process
        (another thread): their messages would match each other's. Raises before anything is sent."""
        if not self.wire:  # nothing on the wire: concurrent runs cannot meet
            yield
            return
        key_obj = self.comm if isinstance(self.comm, RefitGroup) else self.comm.key
        me = f"{what} of plan {digest} in thread {threading.current_thread().name!r}"
        with _RUNNING_LOCK:
            busy = _RUNNING.get(id(key_obj))
            if busy is None:
                _RUNNING[id(key_obj)] = (key_obj, me)
        if busy is not None:
            raise ReshardError(
                f"rank {self.rank}: refused {me}: {busy[1]} is in progress on the same process group in this "
                f"process; two at once would match each other's messages: run them one after the other (or on "
                f"separate groups); nothing was sent")
        try:
            yield
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(id(key_obj), None)
