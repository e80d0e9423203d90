"""The plan handshake: before any byte moves every rank sends every other one a small row (:class:`Row`), and
every rank refuses the run alike when the rows disagree (other plans or options, a rank that rejected its input
or could not plan, relays under verify, or a delta the fence refuses: ``execute/delta.py``).

The row is a typed record: :class:`Row` (and its delta fence, :class:`Fence`) is the one declaration of its
fields, each with its width on the wire and who fills it; :func:`encode` / :func:`decode` are the one codec
between the record and the int64 row the transport carries. Readers ask fields by name; adding a field is one
line in one of the two classes. The last field, the bytes pre-posted from each peer (``prepost``), differs by
peer: the transport's row exchange fills it (``transport.post_rows``' ``last``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch

from .. import ops
from ..comm.group import as_transport
from .delta_cost import COST_FIELDS
from .errors import ReshardError
from .integrity import enabled as digest_enabled
from .options import to_timedelta
from .transport import Link, post_rows

BACKEND_CODES = {None: 0, "torch": 1, "triton": 2}  # the copy backend a rank asked for (None: by device)
_BACKEND_NAMES = {v: k for k, v in BACKEND_CODES.items()}
OK, REJECTED, REFUSED = 0, 1, 2  # a rank's status: ready / rejected its input / could not plan (refuse())


def _word(v) -> tuple[int, ...]:
    return (int(v),)


# the codecs of the kinds of field: (value -> its ints, its ints -> value)
_INT = (_word, lambda w: w[0])
_BOOL = (_word, lambda w: bool(w[0]))
_DIGEST = (lambda v: (int(v, 16) >> 32, int(v, 16) & 0xFFFFFFFF), lambda w: f"{(w[0] << 32) | w[1]:016x}")
_BACKEND = (
    lambda v: (BACKEND_CODES.get(v, len(BACKEND_CODES)),),
    lambda w: _BACKEND_NAMES.get(w[0], "invalid"),
)
_COST = (tuple, tuple)


def _field(default, by: str, codec=_INT, width: int = 1, agree: bool = False):
    """A field of the row: its default, who fills it (``by``), its codec and width (int64 words) on the wire,
    and whether every rank must hold the same value (``agree``: the options the handshake compares)."""
    return field(default=default, metadata={"by": by, "codec": codec, "width": width, "agree": agree})


@dataclass(frozen=True, slots=True)
class Fence:
    """The delta fence's fields (``execute/delta.py``: ``fence_row`` fills them, ``fence`` reads every rank's);
    all zero without a delta request."""

    reasons: int = _field(0, "delta.fence_row")  # why this rank cannot take a delta (delta.py's bits)
    snap: int = _field(0, "delta.fence_row")  # the version this rank's snapshot holds (NO_VERSION: none)
    held: int = _field(0, "delta.fence_row")  # the version this rank's destinations hold (NO_VERSION: none)
    sender: bool = _field(False, "delta.fence_row", _BOOL)  # it sends delta-able messages
    has_dst: bool = _field(False, "delta.fence_row", _BOOL)  # it has destination tensors
    strict: bool = _field(False, "delta.fence_row", _BOOL)  # it asked for a strict delta
    # the predicted times, microseconds (delta_cost.cost_row: dense wire, delta wire, diff, apply; -1 unknown)
    cost: tuple[int, ...] = _field((0,) * COST_FIELDS, "delta_cost.cost_row", _COST, COST_FIELDS)


NO_FENCE = Fence()  # the fence of a run without a delta request (frozen: shared; a Fence() costs ~2 us)


@dataclass(frozen=True, slots=True)
class Row:
    """One rank's handshake row (:func:`handshake_post` fills it; :func:`refuse` a rank that could not plan)."""

    digest: str = _field("0" * 16, "handshake_post: the plan's digest", _DIGEST, 2)
    bucket_bytes: int = _field(0, "handshake_post: options", agree=True)
    direct_min_bytes: int = _field(0, "handshake_post: options", agree=True)
    overlap: bool = _field(False, "handshake_post: options", _BOOL, agree=True)
    verify: bool = _field(False, "handshake_post / refuse: run or verify", _BOOL, agree=True)
    backend: str | None = _field(None, "handshake_post: the copy backend asked for", _BACKEND, agree=True)
    delta: bool = _field(False, "handshake_post: a delta asked for", _BOOL, agree=True)
    # every message digested and compared at the end (execute/integrity.py): a rank that would not take part in
    # the digest exchange must not run with ranks that will
    integrity: bool = _field(False, "handshake_post: options (digest)", _BOOL, agree=True)
    status: int = _field(OK, "handshake_post / refuse: OK, REJECTED or REFUSED")
    relays: int = _field(0, "handshake_post: relay transfers of the plan (verify only)")
    fence: Fence = _field(NO_FENCE, "delta.fence_row", width=0)  # (a record: its own fields)
    # bytes this rank pre-posted to receive from the row's receiver (transport.post_rows fills it per peer)
    prepost: int = _field(0, "transport.post_rows, per peer")

    def agreed(self) -> tuple:
        """The fields every rank must hold alike (``agree``), in declaration order."""
        return tuple(getattr(self, n) for n in _AGREE)


def _layout(cls) -> tuple:
    """``cls``' fields, flattened: (name, codec, width, record class or None) in wire order."""
    out = []
    for f in fields(cls):
        sub = type(f.default) if f.metadata["width"] == 0 else None
        width = sum(w for _n, _c, w, _s in _layout(sub)) if sub else f.metadata["width"]
        out.append((f.name, f.metadata["codec"], width, sub))
    return tuple(out)


_ROW, _FENCE = _layout(Row), _layout(Fence)
_AGREE = tuple(f.name for f in fields(Row) if f.metadata["agree"])
WIDTH = sum(w for _n, _c, w, _s in _ROW)  # int64 words of a row
# the word offset of each field (status and relays: what a row the handshake passes as it is must hold)
_AT = {n: sum(w for _m, _c, w, _s in _ROW[:k]) for k, (n, _c, _w, _s) in enumerate(_ROW)}
assert _ROW[-1][0] == "prepost"  # the per-peer field is the row's last (transport.post_rows' ``last``)


def _encode(rec, layout) -> list[int]:
    out: list[int] = []
    for name, codec, _w, sub in layout:
        v = getattr(rec, name)
        out += _encode(v, _FENCE) if sub is not None else codec[0](v)
    return out


def _decode(cls, words: list[int], layout):
    at, kw = 0, {}
    for name, codec, w, sub in layout:
        part = words[at : at + w]
        kw[name] = _decode(sub, part, _FENCE) if sub is not None else codec[1](part)
        at += w
    return cls(**kw)


def alike(words: list[list[int]], mine: list[int]) -> bool:
    """Every rank's row (``words``, decoded nowhere) is this rank's (``mine``) but for the per-peer last field,
    and this rank's is ``OK`` with no relays: then :func:`_refusal` finds nothing and every rank's fence is this
    rank's (a cached refit's handshake, every call: its rows are checked without decoding them)."""
    return (mine[_AT["status"]] == OK and mine[_AT["relays"]] == 0
            and all(w[:-1] == mine[:-1] for w in words))


def encode(row: Row) -> list[int]:
    """The int64 words of ``row`` (``WIDTH`` of them), in declaration order."""
    return _encode(row, _ROW)


def decode(words: list[int]) -> Row:
    """The :class:`Row` of ``words`` (as :func:`encode` made them)."""
    if len(words) != WIDTH:
        raise ValueError(f"a handshake row of {len(words)} words, want {WIDTH}")
    return _decode(Row, words, _ROW)


def refuse(group, error: Exception, *, verify: bool = False, timeout=timedelta(minutes=5)) -> None:
    """Raise ``error`` (a planning or input error found on this rank before its ``Resharder`` exists) after
    taking part in the plan handshake its peers are in, so that they raise at once ("rank(s) [r] could not
    plan this refit") instead of waiting for the timeout. With rank plans an error in one tensor is found only
    by the ranks that touch it. Peers that pre-posted their first step's receive from this rank (see
    :func:`handshake_post`) get the filler that closes it (:func:`drain`)."""
    comm = as_transport(group)
    if comm.wire:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if comm.backend == "nccl"
            else torch.device("cpu")
        )
        mine = torch.tensor(encode(Row(verify=verify, status=REFUSED)), dtype=torch.int64, device=dev)
        try:
            td = to_timedelta(timeout)
            setup = comm.lane_setup(td) if hasattr(comm, "lane_setup") else None
            if setup is not None:  # the peers' handshake takes a step of the lanes' setup: take it too
                setup.take()
            out, works = post_rows(comm, mine)
            for w in works:
                w.wait(timeout=td)
            if setup is not None:
                setup.post()
            for w in drain(comm, comm.ranks, [decode(o.tolist()) for o in out], dev):
                w.wait(timeout=td)
        except Exception:  # the peers' view of it is theirs to report; ours is the original error
            pass
    raise error


def drain(comm, ranks, rows: list[Row], device) -> list:
    """After a refused handshake: send each peer that pre-posted a receive from this rank (its row's
    ``prepost``, in bytes) a filler of that many zero bytes, so no receive is left open in the group (the peers
    wait for it and drop it; nothing is unpacked). Returns the works to wait for."""
    sends = [
        (r, torch.zeros(row.prepost, dtype=torch.uint8, device=device))
        for r, row in zip(ranks, rows, strict=True)
        if r != comm.rank and row.prepost > 0
    ]
    return comm.post(sends, []) if sends else []


@dataclass(slots=True)
class Preposted:
    """The first step's receives posted with the plan handshake: from ``peers`` (peer -> bytes), their
    ``works`` (in ``recvs`` order) and when they were posted. The step loop posts the rest of that step."""

    recvs: list  # (peer, buffer)
    works: list
    posted: float

    @property
    def peers(self) -> dict[int, int]:
        return {p: buf.numel() * buf.element_size() for p, buf in self.recvs}


@dataclass(slots=True)
class PendingHandshake:
    """A posted plan handshake (:func:`handshake_post`): every rank's row arrives into ``out``; ``pre``: the
    receives of the first step posted behind it (:class:`Preposted`), or None; ``mine``: this rank's row as
    sent; ``rows``: every rank's :class:`Row` (:meth:`decoded`: decoded once, when something reads them)."""

    out: list
    works: list
    started: float
    fence: Fence
    pre: Preposted | None = None
    mine: list[int] | None = None
    words: list[list[int]] | None = None
    rows: list[Row] | None = None

    def decoded(self) -> list[Row]:
        """Every rank's :class:`Row` (decoded on first use)."""
        if self.rows is None:
            self.rows = [decode(w) for w in self.words]
        return self.rows


def handshake_post(
    link: Link,
    plan,
    options,
    error: Exception | None,
    verify: bool = False,
    delta: bool = False,
    fence: Fence | None = None,
    prepost: list | None = None,
) -> PendingHandshake:
    """Post this rank's handshake row (see :func:`handshake`) and return at once: the caller may work (a delta
    refit diffs its first step's messages, writing nothing a refused refit would need) before
    :func:`handshake_finish` waits for the peers' rows and checks them.

    ``prepost``: (peer, staging buffer) receives of this rank's first step, at most one per peer, posted right
    behind the handshake's (issue 32). gloo sends a message only once the receiver's "ready to receive" has
    reached the sender, so a receive posted after the handshake costs a round trip more than one posted now,
    whose notice travels while the handshake does. Nothing moves into them before the handshake passed: the
    peers send their first step only after it, and after a refused handshake each peer sends a filler of the
    size its row was told (the row's ``prepost``, per peer), which lands in staging and is dropped."""
    fence = NO_FENCE if fence is None else fence
    if not link.wire:
        return PendingHandshake([], [], 0.0, fence)
    link.lanes_take()
    row = Row(
        plan.digest,
        options.bucket_bytes,
        options.direct_min_bytes,
        options.overlap,
        verify,
        options.backend or os.environ.get(ops.ENV_VAR) or None,
        delta,
        options.digest and not verify and digest_enabled(),  # TRITON_RESHARD_DIGEST too: ranks must agree
        OK if error is None else REJECTED,
        sum(t.relay for t in plan.transfers) if verify else 0,
        fence,
    )
    words = encode(row)
    mine = torch.tensor(words, dtype=torch.int64, device=link.device())
    pre = Preposted(list(prepost), [], 0.0) if prepost else None
    t0 = time.perf_counter()
    out, works = link.call(post_rows, "the plan handshake", link.ranks, link.comm, mine, pre and pre.peers)
    if pre is not None:  # behind the handshake's receives from the same peers: gloo matches them in order
        pre.posted = time.perf_counter()
        pre.works = link.call(link.post, "the plan handshake", link.ranks, [], pre.recvs)
    return PendingHandshake(out, works, t0, fence, pre, words)


def handshake(
    link: Link,
    plan,
    options,
    error: Exception | None,
    verify: bool = False,
    delta: bool = False,
    fence: Fence | None = None,
) -> list[Fence]:
    """All ranks: same plan digest and options? all running or all verifying? all asking for a delta or
    none (``delta``)? everyone's input valid? Raises on every rank otherwise. ``fence``: this rank's delta
    fence (``execute/delta.py``), carried in the same exchange; returns every rank's (in ``link.ranks``
    order), so a delta refit costs no extra round before its first byte."""
    return handshake_finish(link, handshake_post(link, plan, options, error, verify, delta, fence), error)


def handshake_finish(link: Link, pending: PendingHandshake, error: Exception | None) -> list[Fence]:
    """Wait for every rank's handshake row (posted by :func:`handshake_post`) and check them: raises on every
    rank alike (see :func:`handshake`), after closing the pre-posted receives (:func:`drain`); returns every
    rank's fence."""
    if not link.wire:
        if error is not None:
            raise error
        return [pending.fence]
    link.wait(pending.works, "the plan handshake", link.ranks, pending.started)
    link.lanes_post()  # every rank's row came: the lanes' next round goes now
    pending.words = words = [o.tolist() for o in pending.out]
    if error is None and alike(words, pending.mine):  # the rows agree: nothing to decode but this rank's fence
        return [decode(pending.mine).fence] * len(words)
    rows = pending.decoded()
    refusal = error if error is not None else _refusal(link, rows)
    if refusal is not None:
        close_preposted(link, pending, "the plan handshake")
        raise refusal
    return [row.fence for row in rows]


def close_preposted(link: Link, pending: PendingHandshake, what: str) -> None:
    """After a refusal (of the handshake, or of a delta by its fence): a filler to every peer that pre-posted a
    receive from this rank (:func:`drain`, from every rank's row: ``pending.decoded()``), then wait for those and
    for this rank's own pre-posted receives, so no receive is left open in the group."""
    started = time.perf_counter()
    works = link.call(drain, what, link.ranks, link.comm, link.ranks, pending.decoded(), link.device())
    link.wait(works + (pending.pre.works if pending.pre else []), what, link.ranks, started)


def _refusal(link: Link, rows: list[Row]) -> Exception | None:
    """The error every rank raises for these handshake rows (the same on every rank), or None."""
    by = dict(zip(link.ranks, rows, strict=True))
    refused = [r for r, row in by.items() if row.status == REFUSED]
    if refused:  # ranks that could not even plan (refuse()): no digest to compare
        return ReshardError(
            f"rank {link.rank}: rank(s) {refused} could not plan this refit (see the error on those ranks); "
            f"nothing was moved"
        )
    digests = {r: row.digest for r, row in by.items()}
    if len(set(digests.values())) > 1 or len({row.agreed() for row in rows}) > 1:
        opts = [
            (
                row.bucket_bytes,
                row.direct_min_bytes,
                row.overlap,
                "verify" if row.verify else "run",
                row.backend or "auto",
                row.delta,
            )
            for row in rows
        ]
        digest = {r: row.integrity for r, row in by.items()}
        digest = f"; digest by rank: {digest}" if len(set(digest.values())) > 1 else ""
        return ReshardError(
            f"rank {link.rank}: ranks run different plans or options (plan digest by rank: {digests}; "
            f"(bucket_bytes, direct_min_bytes, overlap, mode, backend, delta) by rank: {opts}{digest}); they must "
            f"agree; nothing was moved"
        )
    relays = {r: row.relays for r, row in by.items() if row.relays}
    if relays:
        return ValueError(
            f"rank {link.rank}: verify needs a plan without relays (relay transfers by rank: {relays}; they read "
            f"the relaying rank's destination tensors, which verify must not trust): plan it with relay=False; "
            f"nothing was moved"
        )
    bad = [r for r, row in by.items() if row.status]
    if bad:
        return ReshardError(
            f"rank {link.rank}: rank(s) {bad} rejected their input (see the error on those ranks); "
            f"nothing was moved"
        )
    return None
