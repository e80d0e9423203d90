"""Delta refits (issue 24, docs/delta.md): the same boxes, peers and steps as a dense refit, but a message
carries only the elements whose bits changed since the version its destination holds.

What changes against a dense run (``steps.py``), and only for *delta-able* messages (:func:`deltable`:
no block-quantized chunk, wire dtype = destination dtype; both ends decide from the plan alone):

- **Sender.** A message whose chunks are plain copies (source dtype = wire dtype) is diffed straight from
  the source views (no dense staging copy first); one that casts is packed dense into its send buffer first
  (the diff is in the wire dtype). The message's chunks are diffed against the sender's
  :class:`MessageSnapshot` (what this rank last sent in that message, wire dtype) by ``ops.pack_delta``
  (``update=True``: the snapshot takes the new values). The snapshot is per *message*, not per source
  tensor: a cast (fp32 masters -> bf16) is diffed in the wire dtype; a box sent to several destinations
  (DP replicas, instances without relays) as the same message (:func:`same_sends`) has one snapshot and is
  diffed once; a relaying engine rank diffs what it forwards the same way. Cost: the dense
  bytes of this rank's delta-able sends, on the tensors' device (an engine rank that relays holds a
  snapshot of what it relays, e.g. (N-1)/N of its shard for N instances).
- **Length round (NCCL only).** A delta message's size depends on the data. NCCL needs matching sizes: per
  step, one round of int64 lengths (one per delta message, same peers, same order) before the payload
  round. Gloo takes a message into a larger buffer, so there each delta message is received into a buffer
  of its largest possible size (``max_message_bytes``: at most the step's dense payload plus the chunk
  headers; one area per slot kept by the snapshot across runs) and its directory says its length: no
  round (issue 32: a round is one more wait on a peer, a few ms between emulated nodes under load).
- **Receiver.** A delta message is received (into a buffer of its announced size on NCCL, of its largest
  size on gloo) and scattered into the destination views by ``ops.unpack_delta`` (headers checked against
  the destinations before any write).
- Everything else stays dense: local copies and the non-delta-able messages.

**Fencing** (:func:`fence`): before any byte moves, each rank's (reasons, snapshot version, held version,
torn) rides on the plan handshake's all-gather (:func:`fence_row`: no round of its own). A delta from base
``v`` runs only if every sender of a delta-able message has a snapshot of ``v`` and every rank with
destination tensors holds ``v`` and is not torn, and the destination is not block-quantized; otherwise every
rank runs the dense refit
(and captures the snapshot as it packs), and the report says why (``RunReport.fallback``), or with
``strict`` every rank raises :class:`DeltaRefusedError` naming the ranks and versions, nothing moved.

**Cost** (:func:`cost_row`, :func:`cost_choice`; ``DeltaRequest.topology``): each rank also puts its predicted
dense wire time and its last delta's measured diff, delta wire and apply times in the handshake row; a refit
every rank then predicts slower as a delta runs plain dense (no snapshot copy; the snapshot is dropped), and
after ``PROBE_EVERY`` of those a snapshot is captured and a delta measures again (docs/delta.md); the refit
after a cost fallback posts its first receives with the handshake as a dense one does (:func:`dense_next`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .. import ops  # noqa: F401  (tests reach ops.pack_delta through this module)
from ..ops.block_delta import max_block_message_bytes
from ..ops.delta import DEFAULT_CHUNK_ELEMS, max_message_bytes
from ..ops.delta_cached import pack_deferred
from ..ops.delta_cpu import undo_updates
from ..ops.delta_native import REUSE
from .bind import block_chunks, buffer_view, quant_buffers
from .delta_cost import COST_FIELDS, COST_WHY, PROBE_EVERY, TOPOLOGY, DeltaCost, cost_choice, cost_row  # noqa: F401
from .errors import ReshardError
from .handshake import NO_FENCE, Fence
from .steps import clock

NO_VERSION = -(1 << 63)  # "no version" in the fence row
_QUANT, _NO_SNAP, _TORN, _NO_HELD = 1, 2, 4, 8
# this rank posted its first step's receives with the handshake, for a dense refit (its last refit was a cost
# fallback, every rank agreeing; :func:`dense_next`): the refit goes dense whatever else the fence says
PREPOSTED = 16


class DeltaRefusedError(ReshardError):
    """A strict delta refit (``delta="strict"``) could not run as a delta; raised on every rank before any
    byte moved (nothing written; the group stays usable)."""


@dataclass(frozen=True, slots=True)
class DeltaRequest:
    """Ask a run for a delta. ``version``: what this refit publishes (an int). ``held``: the version this
    rank's destination tensors hold (``refit_state(...).version``; None: unknown, fresh or restarted),
    ``torn``: whether a failed refit left them partly written. ``strict``: raise instead of a dense fallback."""

    version: int
    held: int | None = None
    torn: bool = False
    strict: bool = False
    # the cluster (tools.topology.Topology: ranks per node, link rates): with it every rank predicts, from what
    # its last delta refit measured, whether a delta beats a dense refit, and a refit predicted slower as a
    # delta runs dense (:func:`cost_row`); None: every refit whose fence passes is a delta
    topology: object = None


def deltable(plan, m) -> bool:
    """Message ``m`` can go as a delta: plain chunks (no quantization) landing in their wire dtype. Relays
    too: the relaying rank diffs what it forwards (its destination, already at the new version) against what
    it forwarded last time, which is what the relay's destination holds."""
    for c in m.chunks:
        t = plan.transfers[c.transfer]
        if t.quant or plan.dst.spec(t.tensor).dtype != t.wire_dtype:
            return False
    return True


def block_deltable(plan, m) -> bool:
    """Message ``m`` can go as a *block* delta (``ops/block_delta.py``): every chunk source-quantized in a format
    with 1 x B blocks (MXFP8, NVFP4). Other quantized messages (destination-quantized pieces, block FP8) go dense."""
    return block_chunks(plan.transfers, m)


def quant_blocks_delta(plan) -> bool:
    """A destination tensor quantized in a format without 1 x B blocks (block FP8: a changed element re-quantizes a
    128 x 128 block; measured: every block touched) makes the whole refit dense."""
    return any(q.quant.format.block is None for q in plan.dst.quantized.values())


@dataclass(frozen=True, slots=True)
class Eligible:
    """Per step position, per send / receive (in ``wire`` order): delta-able? block-delta-able? and, per such
    receive, its largest possible size and the destination local names of its chunks."""

    sends: tuple[tuple[bool, ...], ...]
    recvs: tuple[tuple[bool, ...], ...]
    max_bytes: dict
    names: dict
    bsends: tuple[tuple[bool, ...], ...] = ()
    brecvs: tuple[tuple[bool, ...], ...] = ()
    # the destination has MXFP8 / NVFP4 tensors (block deltas possible somewhere in the plan): the same on
    # every rank, so all ranks agree on the length round (block delta messages are announced by length)
    blocks: bool = False
    # the whole refit goes dense (quant_blocks_delta: a block-FP8 destination): decided here, once per plan;
    # no snapshot is kept and the fence refuses every delta
    dense: bool = False
    rank: int = -1
    # (peer, dense payload bytes) of each delta-able (or block-delta-able) send and receive: the cost model's
    # wire bytes (cost_row)
    send_peers: tuple[tuple[int, int], ...] = ()
    recv_peers: tuple[tuple[int, int], ...] = ()
    # (pos, j) of a delta-able send -> the (pos, j) of an earlier one with the same chunks of the same source
    # boxes (:func:`same_sends`: a box sent to several engine instances or DP replicas): its message is that
    # one's, diffed once, against one snapshot shared by both
    same: dict = field(default_factory=dict)
    repeated: frozenset = frozenset()  # the sends whose message a later send repeats (``same``'s values)
    # per step position, the messages of a delta run as they go on the wire (:func:`wire_groups`): per wire
    # message, the send (receive) indices it carries, in the plan's order; a step's delta-able messages to one
    # peer go as one message (at its first one's place), every other message as itself
    swire: tuple[tuple[tuple[int, ...], ...], ...] = ()
    rwire: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def any_send(self) -> bool:
        return any(any(s) for s in self.sends) or any(any(s) for s in self.bsends)

    def one_pack(self, pos: int, g: tuple[int, ...]) -> bool:
        """Is wire message ``g`` of step ``pos``'s sends (:func:`wire_groups`) several delta-able sends packed in
        one call? Not when one of them shares its message with another send (``same``, ``repeated``: diffed
        once against a shared snapshot): those are packed each alone and joined (``ops.delta.join_messages``)."""
        return len(g) > 1 and not any((pos, j) in self.same or (pos, j) in self.repeated for j in g)


# a step's delta messages to one peer go as one message (issue 44: one header, one send, one receive, one apply
# call instead of ~20 per peer); both ends group alike from the plan (:func:`wire_groups`). False: one delta
# message per plan message (perf/bench_delta.py --part trainer --ab measures both; every rank must agree)
GROUP = True


def wire_groups(peers, ok) -> tuple[tuple[int, ...], ...]:
    """The wire messages of one side of a step (``peers``: each plan message's peer, ``ok``: delta-able?): per
    wire message the plan indices it carries. The delta-able messages to (from) one peer are one wire message,
    at the first one's place; the others keep theirs. A function of the plan alone, the same on both ends (a
    pair's messages keep their order: the k-th sent is the k-th received)."""
    out: list[list[int]] = []
    at: dict[int, int] = {}
    for j, (p, good) in enumerate(zip(peers, ok, strict=True)):
        if good and GROUP:
            if p in at:
                out[at[p]].append(j)
                continue
            at[p] = len(out)
        out.append([j])
    return tuple(tuple(g) for g in out)


def eligible(plan, work) -> Eligible:
    sends, recvs, max_bytes, names, bsends, brecvs = [], [], {}, {}, [], []
    speers, rpeers, swire, rwire = [], [], [], []
    for pos, (_i, step) in enumerate(work.steps):
        sends.append(tuple(deltable(plan, m) for _p, _a, m in step.sends))
        swire.append(wire_groups([p for p, _a, _m in step.sends], sends[-1]))
        bsends.append(tuple(block_deltable(plan, m) for _p, _a, m in step.sends))
        speers += [(p, m.payload) for (p, _a, m), a, b in zip(step.sends, sends[-1], bsends[-1], strict=True)
                   if a or b]
        rs, brs = [], []
        for j, (p, _a, m) in enumerate(step.recvs):
            ok = deltable(plan, m)
            bok = block_deltable(plan, m)
            rs.append(ok)
            brs.append(bok)
            if ok or bok:
                rpeers.append((p, m.payload))
            ts = [plan.transfers[c.transfer] for c in m.chunks]
            if ok:
                max_bytes[pos, j] = max_message_bytes([math.prod(c.sizes) for c in m.chunks],
                                                      [t.wire_dtype.itemsize for t in ts])
                names[pos, j] = [t.dst_local for t in ts]
            elif bok:
                fmts = [t.fmt for t in ts]
                max_bytes[pos, j] = max_block_message_bytes(
                    [(f.value_bytes(math.prod(c.sizes)), math.prod(c.sizes) // f.block * f.scale_bytes)
                     for c, f in zip(m.chunks, fmts, strict=True)])
                names[pos, j] = [t.dst_local for t in ts]
        recvs.append(tuple(rs))
        brecvs.append(tuple(brs))
        rwire.append(wire_groups([p for p, _a, _m in step.recvs], rs))
        for g in rwire[-1]:  # a joined receive: its largest size and its chunks' names, under its first index
            if len(g) > 1:
                cs = [(c, plan.transfers[c.transfer]) for j in g for c in step.recvs[j][2].chunks]
                max_bytes[pos, g[0]] = max_message_bytes([math.prod(c.sizes) for c, _t in cs],
                                                         [t.wire_dtype.itemsize for _c, t in cs])
                names[pos, g[0]] = [t.dst_local for _c, t in cs]
    blocks = any(q.quant.format.block is not None for q in plan.dst.quantized.values())
    same = same_sends(plan, work, sends)
    return Eligible(tuple(sends), tuple(recvs), max_bytes, names, tuple(bsends), tuple(brecvs), blocks,
                    quant_blocks_delta(plan), work.rank, tuple(speers), tuple(rpeers), same,
                    frozenset(same.values()), tuple(swire), tuple(rwire))


def same_sends(plan, work, sends) -> dict[tuple[int, int], tuple[int, int]]:
    """Delta-able sends whose message is byte for byte an earlier one's: the same chunks (sizes, places in the
    message) of the same boxes of the same source local tensors, none a relay (issue 32: with two engine
    instances every trainer rank sent each box twice and diffed it twice). Their dense payloads are equal by
    construction, so their delta messages are too when diffed against equal snapshots: both messages share one
    snapshot (``MessageSnapshot.ensure``), diffed and updated once per run, and the later send reuses the
    earlier one's message. Maps each such (pos, j) to the first (pos, j) with its chunks."""
    first: dict[tuple, tuple[int, int]] = {}
    same = {}
    for pos, (_i, step) in enumerate(work.steps):
        for j, (_p, _a, m) in enumerate(step.sends):
            if not sends[pos][j]:
                continue
            ts = [plan.transfers[c.transfer] for c in m.chunks]
            if not ts or any(t.relay for t in ts):
                continue
            key = (m.payload, tuple((t.src_local, t.src_offsets, t.tensor, t.offsets, t.wire_dtype, c.offsets,
                                     c.sizes, c.buffer_offset) for t, c in zip(ts, m.chunks, strict=True)))
            if key in first:
                same[pos, j] = first[key]
            else:
                first[key] = (pos, j)
    return same


class MessageSnapshot:
    """What this rank last sent in each delta-able message (wire dtype), and the version that was."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.device: torch.device | None = None
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._inbox: dict[int, torch.Tensor] = {}
        self._qviews: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.globals: dict[str, int] = {}  # NVFP4: each group's global scale (float32 bits) at the snapshot
        self.nbytes = 0
        self.cost = DeltaCost()  # what the last delta refit measured on this rank (cost_row)
        # the snapshot writes of a first step diffed during a handshake whose refit has not (yet) gone as a
        # delta: the native pack wrote part of them already (``ops.delta_native.Deferred``); :meth:`settle`
        # undoes them, the delta run that uses the messages commits them
        self.pending: list = []

    def settle(self) -> None:
        """Undo the snapshot writes of a diff whose messages were not used (a refused or failed handshake, a
        fence that sent the refit dense): the snapshot holds its version again."""
        if self.pending:
            pending, self.pending = self.pending, []
            undo_updates(pending)

    def ensure(self, plan, work, elig: Eligible, device: torch.device) -> None:
        """Allocate the buffers (once per device): one per delta-able send, its payload bytes."""
        if self.device == device:
            return
        self._views, self._qviews, self.globals, self.nbytes, self.version = {}, {}, {}, 0, None
        self.pending = []
        for pos, (_i, step) in enumerate(work.steps):
            for j, (_p, _a, m) in enumerate(step.sends):
                if (pos, j) in elig.same:  # the same message as an earlier send: its snapshot
                    self._views[pos, j] = self._views[elig.same[pos, j]]
                elif elig.sends[pos][j]:
                    buf = torch.zeros(m.payload, dtype=torch.uint8, device=device)
                    self._views[pos, j] = [buffer_view(buf, 0, c, plan.transfers[c.transfer]) for c in m.chunks]
                    self.nbytes += m.payload
                elif elig.bsends and elig.bsends[pos][j]:  # the quantized bytes last sent (values, scales)
                    buf = torch.zeros(m.payload, dtype=torch.uint8, device=device)
                    self._qviews[pos, j] = [quant_buffers(buf, 0, c, plan.transfers[c.transfer]) for c in m.chunks]
                    self.nbytes += m.payload
        self.device = device

    def views(self, pos: int, j: int) -> list[torch.Tensor]:
        return self._views[pos, j]

    def inbox(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """The receive area of a step's delta messages on gloo (kept across runs, grown when too small): each
        message is received into the most bytes it can have (``max_message_bytes``), at most a step's dense
        payload plus the chunk headers, so no length round is needed first."""
        buf = self._inbox.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._inbox[slot] = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def qviews(self, pos: int, j: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._qviews[pos, j]


def fence_row(plan, elig: Eligible | None, snap: MessageSnapshot, req: DeltaRequest | None, has_dst: bool
              ) -> Fence:
    """This rank's fence (``handshake.Fence``), sent with the plan handshake (no round of its own): reasons,
    snapshot version, held version, sender?, has destinations?, strict? and the :func:`cost_row` columns.
    Without a delta request: zeros."""
    if req is None or elig is None:
        return NO_FENCE
    sender = elig.any_send
    reasons = _QUANT if elig.dense else 0
    if sender and snap.version is None:
        reasons |= _NO_SNAP
    if has_dst and req.torn:
        reasons |= _TORN
    if has_dst and req.held is None:
        reasons |= _NO_HELD
    return Fence(reasons, NO_VERSION if snap.version is None or not sender else snap.version,
                 NO_VERSION if req.held is None or not has_dst else req.held, sender, has_dst, req.strict,
                 tuple(cost_row(elig, snap.cost, req.topology)))


def dense_expected(frow: Fence) -> bool:
    """This rank's own :func:`fence_row` already says a delta request will not run as a delta: a reason of its
    own (no snapshot, torn, no held version, block-FP8 destinations: dense, or refused when strict) or, unless
    strict, its own cost columns predicting dense. Then it packs step 0 during the handshake as a dense run
    does, instead of diffing it (another rank's unknown prediction can still make the refit a delta, which
    packs what it needs itself)."""
    return bool(frow.reasons) or (not frow.strict and cost_choice([frow.cost]) is not None)


def dense_next(req: DeltaRequest | None, why: str | None) -> bool:
    """After a refit's fence: will this rank's next delta request, if it asks the same way (a topology, not
    strict), go dense again? Yes when this one was a cost fallback (every rank's cost columns said dense): no
    delta ran since, so what the ranks measured is unchanged. Such a next refit posts its first step's
    receives with the handshake as a plain dense refit does (issue 32: a cost fallback cost a round trip and
    a wake-up more than plain dense), and says so in its fence row (``PREPOSTED``), which makes it dense on
    every rank (with a capture when the cost model no longer says dense: the snapshot was dropped)."""
    return req is not None and req.topology is not None and why is not None and why.startswith(COST_WHY)


def fence(plan, ranks, rows: list[Fence]) -> tuple[int | None, str | None, bool]:
    """From every rank's :func:`fence_row` (gathered by the handshake, in ``ranks`` order): (base version,
    None, strict) if every rank can take a delta, else (None, why, strict): the same answer on every rank;
    ``strict``: some rank asked for a strict delta (then every rank refuses together)."""
    by = dict(zip(ranks, rows, strict=True))
    strict = any(r.strict for r in rows)
    if any(r.reasons & _QUANT for r in rows):
        return None, (f"block-quantized destination tensors {sorted(plan.dst.quantized)}: a changed element "
                      f"re-quantizes its whole block, so a delta saves nothing; sent dense"
                      f" (MXFP8 / NVFP4 1 x B blocks go as block deltas; block FP8 does not)"), strict
    why = []
    torn = [r for r, row in by.items() if row.reasons & _TORN]
    if torn:
        why.append(f"destination torn by a failed refit on rank(s) {torn}")
    fresh = [r for r, row in by.items() if row.reasons & _NO_HELD]
    if fresh:
        why.append(f"rank(s) {fresh} hold no refit version (fresh, restarted, or refitted without version=)")
    nosnap = [r for r, row in by.items() if row.reasons & _NO_SNAP]
    if nosnap:
        why.append(f"sender rank(s) {nosnap} hold no snapshot (first delta refit, or the last refit failed, "
                   f"was dense without delta=, or used another Resharder)")
    held = {r: row.held for r, row in by.items() if row.has_dst and row.held != NO_VERSION}
    snaps = {r: row.snap for r, row in by.items() if row.sender and row.snap != NO_VERSION}
    if not why and len(set(held.values()) | set(snaps.values())) > 1:
        why.append(f"versions differ: destinations hold {held}, sender snapshots {snaps}")
    if not why and not snaps:
        why.append("no message of this plan can go as a delta (local copies and relays only)")
    # predicted faster dense (every rank alike, from the gathered cost columns): a plain dense run, which
    # drops the snapshot (no capture copy), whatever else the fence said; strict asks for a delta regardless
    cheaper = None if strict else cost_choice([r.cost for r in rows])
    if cheaper is not None:
        return None, cheaper + (f" (also: {'; '.join(why)})" if why else ""), strict
    pre = [r for r, row in by.items() if row.reasons & PREPOSTED]
    if pre and not why:  # (the cost model no longer says dense: this refit captures the snapshot)
        why.append(f"rank(s) {pre} posted their first receives with the handshake for a dense refit (the last "
                   f"refit was predicted faster dense)")
    if why:
        return None, "; ".join(why), strict
    return next(iter(snaps.values())), None, strict


@dataclass(slots=True)
class Prediff:
    """The first step's delta messages, diffed while the plan handshake was in flight (:func:`prediff`): per
    wire message (its first send index) its message; ``updates``: the snapshot writes still to make once the fence let the refit go as
    a delta (:func:`~triton_reshard.ops.delta_cpu.commit_updates`; the native codec made its narrow blocks'
    in the diff, which ``MessageSnapshot.settle`` undoes otherwise); ``seconds``: the diff's time."""

    msgs: dict[int, torch.Tensor]
    updates: list
    seconds: float


def send_cache(bound, pos: int, j: int) -> dict:
    """The codec's cache of send ``j`` of step ``pos`` (its pack plan): a send is sent and waited within its
    run and its message dropped, so the next run's pack writes into the same buffer (``REUSE``: no fresh
    pages, which the kernel faults in and zeroes, per message per refit)."""
    return bound.delta_cache.setdefault(("send", pos, j), {REUSE: True})


def prediff(work, bound, elig: Eligible, snap: MessageSnapshot, backend: str) -> Prediff | None:
    """Diff step 0's delta-able messages that are plain copies of the sources (numpy, CPU tensors) against the
    snapshot, run between posting the handshake and waiting for it, so the sender's diff overlaps the
    handshake's round (issue 32). The snapshot writes are deferred: the numpy codec keeps them all, the native
    one makes those of its narrow blocks in the pass (in cache: a separate pass over the snapshot cost as much
    as the diff) and keeps the rest; ``snap.pending`` undoes them unless the refit goes as a delta. None when
    there is nothing such to diff."""
    if not work.steps or work.phases[0] or not bound.send_srcs or backend != "torch" or snap.device is None \
            or snap.device.type != "cpu":  # a relay phase's sends read destinations this run has yet to write
        return None
    t = clock()
    msgs, updates = {}, []
    try:
        for g in elig.swire[0]:  # per wire message (a step's delta-able sends to one peer: one message)
            j, srcs = g[0], [bound.send_srcs[0][k] for k in g]
            if not elig.sends[0][j] or any(s is None for s in srcs) or (0, j) in elig.same \
                    or (len(g) > 1 and not elig.one_pack(0, g)):
                continue
            pairs = [pair for k, s in zip(g, srcs, strict=True) for pair in zip(s[0], snap.views(0, k), strict=True)]
            msgs[j] = pack_deferred(pairs, DEFAULT_CHUNK_ELEMS, updates, send_cache(bound, 0, j))
    except BaseException:
        undo_updates(updates)  # the messages diffed so far: their snapshot writes undone
        raise
    snap.pending = updates  # undone unless the refit goes as a delta (DeltaSide.decide)
    return Prediff(msgs, updates, clock() - t) if msgs else None


class DeltaSide:
    """A Resharder's side of delta refits, in one place: which messages can go as deltas (when first asked),
    the snapshot (what this rank last sent in them; a refit session owns it and hands it over), this rank's
    fence for the handshake (:meth:`row`), the fence's answer from every rank's (:meth:`decide`), the first
    step diffed while the handshake travels (:meth:`prediff`), and whether the next refit is predicted dense
    (the last was a cost fallback: :func:`dense_next`)."""

    def __init__(self, plan, work, snapshot: MessageSnapshot | None, has_dst: bool) -> None:
        self.plan, self.work, self.has_dst = plan, work, has_dst
        self.elig: Eligible | None = None
        self.snap = MessageSnapshot() if snapshot is None else snapshot
        # the last refit was a cost fallback: the next delta request with a topology posts its first receives
        # with the handshake, as a dense refit does
        self.dense_next = False

    def row(self, req: DeltaRequest | None, device, verify: bool) -> Fence:
        """Before the handshake: this rank's fence (it rides on the handshake's rows); allocates the snapshot
        buffers on the first delta request. A diff of the last refit whose handshake failed is undone first."""
        self.snap.settle()
        if verify or req is None:
            return NO_FENCE
        if self.elig is None:
            self.elig = eligible(self.plan, self.work)
        if not self.elig.dense and device is not None:
            self.snap.ensure(self.plan, self.work, self.elig, device)
        row = fence_row(self.plan, self.elig, self.snap, req, self.has_dst)
        if self.dense_next and req.topology is not None and not req.strict:
            # predicted dense again: step 0's receives go with the handshake (PREPOSTED makes it dense everywhere)
            row = dataclasses.replace(row, reasons=row.reasons | PREPOSTED)
        return row

    @staticmethod
    def preposts(req: DeltaRequest | None, row: Fence) -> bool:
        """Does this run post its first step's receives with the handshake? A dense run does; so does a delta
        request predicted dense again (its row says so: ``PREPOSTED``)."""
        return req is None or bool(row.reasons & PREPOSTED)

    @staticmethod
    def packs_first(req: DeltaRequest | None, row: Fence) -> bool:
        """Does this run pack step 0 while the handshake travels? A dense run does; so does a delta request this
        rank expects to go dense (its own fence or cost columns say so: a cost fallback must cost what a dense
        refit costs)."""
        return req is None or dense_expected(row)

    def prediff(self, req: DeltaRequest | None, b, backend: str, row: Fence) -> Prediff | None:
        """While the handshake is in flight: step 0's delta messages, if this rank expects the refit to go as a
        delta (it holds a snapshot, its own fence raises nothing, its own cost columns do not predict dense);
        the snapshot is left as it is until the fence passed (a refused refit moves nothing and keeps it). A
        diff that fails here is dropped: the loop diffs again and raises in its place."""
        el = self.elig
        if req is None or el is None or el.dense or not el.any_send or self.snap.version is None \
                or dense_expected(row):
            return None
        try:
            return prediff(self.work, b, el, self.snap, backend)
        except Exception:
            return None

    def decide(self, req: DeltaRequest | None, ranks, rows: list[Fence], close) -> tuple[int | None, str | None]:
        """After the handshake, before any byte moves: may this run go as a delta? (base, None) or (None, why),
        from every rank's fence (``rows``, in ``ranks`` order); without ``req`` the snapshot is dropped (the
        destinations move past it), and what the cost model measured with it (the next delta request starts a
        new sequence: what an earlier one measured, e.g. of another workload, must not decide it). A strict
        refusal raises :class:`DeltaRefusedError` on every rank, after ``close()`` closed the receives posted
        with the handshake (if any rank posted them)."""
        self.dense_next = False
        if req is None:
            self.snap.settle()
            self.snap.version = None
            self.snap.cost = DeltaCost()
            return None, None
        base, why, strict = fence(self.plan, ranks, rows)
        if base is None:  # the first step's diff (if made) is not sent: the snapshot back at its version
            self.snap.settle()
        else:  # the delta run commits the diff's snapshot writes once step 0 is posted (strategies.Delta)
            self.snap.pending = []
        # otherwise a dense refit now, captured afresh (a failure drops the snapshot); a strict refusal moves
        # nothing, so the snapshot still holds what the destinations at its version hold
        if why is not None and strict:
            if any(r.reasons & PREPOSTED for r in rows):  # close the receives posted with the handshake first
                close()
            raise DeltaRefusedError(f"rank {self.work.rank}: delta refit to version {req.version} refused: {why}; "
                                    f"nothing was moved (delta=True falls back to a dense refit)")
        self.dense_next = dense_next(req, why)
        return base, why
