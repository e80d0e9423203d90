"""What a run does to its messages: the strategy values of the one step loop (``steps.StepLoop``).

Every run takes the same loop over the plan's steps; a strategy says what each step does to its messages, in
five hooks, each called at one place: ``begin`` / ``end`` (per run), ``pack`` (make step k's messages: returns
its (peer, buffer) sends and receives as they go on the wire), ``posted`` (after they were posted) and
``land`` (write or compare what step k received; returns what it wrote, :class:`Landed`, for the message
digests of ``execute/integrity.py``), and ``report`` (the run's report, and the delta snapshot's version once
the run succeeded).

- :class:`Dense`: sources packed into staging, received messages unpacked (verify: compared). A delta request
  that the fence sent dense without a snapshot to keep (a cost fallback, or a plan that is dense: block-FP8
  destinations) is a :class:`Dense` with its reason.
- :class:`Capture`: a dense run that also copies each delta-able message into the snapshot once posted.
- :class:`Delta`: delta-able messages carry only the changed elements (``execute/delta.py`` describes it).

Quantized chunks are packed (``StepLoop.quantize_sends``) and their staged regions quantized by the loop's
helpers, the same in every strategy. :func:`pick` chooses the strategy from the fence's answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import ops
from ..ops.block_delta import pack_block_delta, unpack_block_delta
from ..ops.copy import triton_copy_digest
from ..ops.delta import join_messages, message_length
from ..ops.delta_cpu import commit_updates
from ..ops.delta_triton import triton_pack_digest
from ..ops.quant_digest import minus_ranges
from .delta import COST_WHY, DeltaRequest, DeltaSide, Prediff, send_cache
from .integrity import ROW_WORDS
from .reports import RunReport
from .steps import clock


@dataclasses.dataclass(frozen=True, slots=True)
class Landed:
    """What a step's ``land`` wrote, for the receiver's digest (``integrity.Ledger.on_land``): ``unpacked``, the
    (received view, destination view) pairs it copied out of staged messages (the digest reads them back from
    the destination), and ``lengths``, receive index -> the bytes of a message that came into a larger buffer."""

    unpacked: list
    lengths: dict | None = None
    staged: bool = False  # the step's staging copies of destination-quantized pieces were made with the unpack
    # a delta run's receives as they went on the wire (``Eligible.rwire``): per wire message the plan's receive
    # indices it carried (the digest names a differing message's tensors from them); None: one per receive
    wire: tuple | None = None
    # what the step still writes after its digest (a delta's apply: the messages are digested as they arrived);
    # ``StepLoop.apply`` runs it
    apply: Callable[[], None] | None = None


class Dense:
    """A dense run (or verify). ``prepacked``: step 0's staging copies were made while the handshake was in
    flight (``steps.prepack``; its seconds). ``req`` / ``why``: the delta request the fence sent dense, and why
    (the report says so)."""

    # with the digest on, the local copies hash the in-place sends whose bytes they read (``Ledger.local``)
    local_digest = True

    def __init__(
        self, prepacked: float | None = None, req: DeltaRequest | None = None, why: str | None = None
    ):
        self.prepacked, self.req, self.why = prepacked, req, why

    def begin(self, loop) -> None:
        if self.prepacked is not None:
            loop.timing.pack += self.prepacked

    def pack(self, loop, pos: int) -> tuple[list, list]:
        key = (loop.key, "pack", loop.work.steps[pos][0])
        if pos or self.prepacked is None:  # with the digest on, the hash in the copy (native C or Triton)
            ledger = loop.ledger
            if ledger is None or not ledger.pack(pos, loop.b.packs[pos], loop.b.wire[pos][0], key, loop.backend):
                ops.copy_views(loop.b.packs[pos], loop.backend, key=key)
        elif loop.ledger is not None:  # packed during the handshake: its hashes
            loop.ledger.prepacked(pos, key)
        loop.quantize_sends(pos, loop.ledger)  # (Triton: the quantizing kernels hash what they write)
        return loop.b.wire[pos]

    def posted(self, loop, pos: int) -> None:
        pass

    def land(self, loop, pos: int) -> Landed:
        b = loop.b
        meta = b.unpack_meta[pos] if loop.verify else None
        key = (loop.key, "unpack", loop.work.steps[pos][0])
        ledger = loop.ledger  # the hash in the copy: native C in place of torch's copies, or the Triton kernel
        # Triton: the staging copies of destination-quantized pieces go with the unpack (hashed in its pass)
        staged = b.quant.stage_unpacks[pos] if ledger is not None and loop.backend == "triton" else []
        if ledger is None or not ledger.unpack(pos, b.unpacks[pos] + staged, key, loop.backend):
            loop.copy_or_compare(b.unpacks[pos], meta, key)
            return Landed(b.unpacks[pos])
        return Landed(b.unpacks[pos], staged=bool(staged))

    def lane_unpack(self, loop, pos: int) -> tuple | None:
        """Step ``pos``'s unpack as its same-host lanes may make it, each message straight from the ring into the
        destination (``lane_hash.want``): ``(pairs, key)`` of the fused unpack :meth:`land` makes, or None where the
        receive buffers must hold the messages (verify compares them; staged pieces of quantized destinations are
        copied out of them) or the copies are not the native ones."""
        if loop.verify or loop.backend != "torch" or loop.b.quant.stage_unpacks[pos]:
            return None
        return loop.b.unpacks[pos], (loop.key, "unpack", loop.work.steps[pos][0])

    def end(self, loop) -> None:
        pass

    def report(self, loop, report: RunReport) -> RunReport:
        """The run's report: a dense one as it is; a delta request run dense says why."""
        if self.req is None:
            return report
        return _delta_report(loop, report, "dense-fallback", self.why, None, ())


def _delta_report(
    loop, report: RunReport, mode: str, why: str | None, base: int | None, rescaled
) -> RunReport:
    dense = sum(buf.numel() for sends, _r in loop.b.wire for _p, buf in sends)
    return dataclasses.replace(
        report, mode=mode, fallback=why, delta_base=base, dense_sent_bytes=dense, rescaled=rescaled
    )


def run_seconds(loop) -> float:
    """The seconds of a run's step loop on this rank: its packs (a delta's diffs), waits, unpacks (a delta's
    applies) and local copies (the cost model's measured run, ``delta_cost.DeltaCost.runs``)."""
    tm = loop.timing
    return tm.pack + tm.wire + tm.unpack + (tm.local or 0.0)


def _global_bits(loop) -> dict[str, int]:
    """Each NVFP4 group's global scale of this run, as its float32 bits."""
    return {g: int(t.view(torch.int32).item()) for g, t in loop.b.quant.globals.items()}


class Capture(Dense):
    """A dense run that also copies every delta-able message it sends into the snapshot (``capture=False``: a
    dense run predicted faster than a delta, which skips the copy: the snapshot is then dropped)."""

    def __init__(
        self,
        side: DeltaSide,
        req: DeltaRequest,
        why: str | None,
        capture: bool,
        prepacked: float | None = None,
    ) -> None:
        super().__init__(prepacked, req, why)
        self.elig, self.snap, self.capture = side.elig, side.snap, capture

    def begin(self, loop) -> None:
        super().begin(loop)
        self.snap.globals = _global_bits(loop)

    def posted(self, loop, pos: int) -> None:
        if not self.capture:
            return
        t = clock()
        el, b = self.elig, loop.b
        pairs = [
            (v, s)
            for j, ok in enumerate(el.sends[pos])
            if ok and (pos, j) not in el.same
            for v, s in zip(b.send_msgs[pos][j], self.snap.views(pos, j), strict=True)
        ]
        pairs += [
            pair
            for j, ok in enumerate(el.bsends[pos] if el.bsends else ())
            if ok
            for (q, s), (sq, ss) in zip(b.send_qmsgs[pos][j], self.snap.qviews(pos, j), strict=True)
            for pair in ((q, sq), (s, ss))
        ]
        ops.copy_views([(v, s) for v, s in pairs if v.numel()], loop.backend)
        loop.timing.pack += clock() - t

    def end(self, loop) -> None:
        # what the run took, for delta="auto" to compare with the deltas'
        self.snap.cost = self.snap.cost.after_dense(run_seconds(loop), self.why)

    def report(self, loop, report: RunReport) -> RunReport:
        self.snap.version = self.req.version if self.capture else None
        return super().report(loop, report)


class Delta(Dense):
    """A delta run: delta-able messages carry ``ops.pack_delta`` messages (``ops.block_delta`` ones for MXFP8 /
    NVFP4 chunks); on NCCL (sizes must match) and with block deltas each step's are announced by a length
    round first, otherwise (gloo) they are received into buffers of their largest possible size (a message
    says its own length)."""

    local_digest = False  # (its in-place sends mostly go as delta messages: nothing to take from the local copies)

    def __init__(self, side: DeltaSide, req: DeltaRequest, base: int, pre: Prediff | None = None) -> None:
        super().__init__(None, req, None)
        self.base, self.elig, self.snap = base, side.elig, side.snap
        # step 0's messages diffed during the handshake; their snapshot writes are made once step 0 is posted
        # (the messages are separate buffers: the writes overlap the wire instead of delaying the sends)
        self.pre = pre
        # this run's messages that a later send repeats (Eligible.same), until that send is posted
        self.shared: dict[tuple[int, int], torch.Tensor] = {}
        # Triton with the digest on: each delta message's digest from the pass that wrote it, its encode or its join
        # (id -> (message, digest, the byte ranges it covers))
        self.hashed: dict[int, tuple] = {}
        self.inbox: dict[int, list[torch.Tensor]] = {}
        self.rescaled: tuple[str, ...] = ()
        self.inbox_mode = False  # set by begin (the link's backend)
        # measured for the cost model (DeltaCost): diff / apply seconds, delta and dense bytes each way
        self.diff_s = self.apply_s = 0.0
        self.bytes = [0, 0, 0, 0]  # delta sent, dense sent, delta received, dense received

    def lane_unpack(self, loop, pos: int) -> None:
        return None  # its messages land as deltas (``land``), not as the dense unpack

    def begin(self, loop) -> None:
        # gloo without block deltas: delta messages received into buffers of their largest size, no length
        # round; NCCL (counts must match) and plans with block deltas announce each delta's length first
        self.inbox_mode = not loop.link.is_nccl and not self.elig.blocks
        if self.pre is not None:  # the diff made during the handshake counts as this refit's
            self.diff_s += self.pre.seconds
            loop.timing.pack += self.pre.seconds
        # NVFP4 groups whose global scale moved since the snapshot: every block of them changes, so their chunks
        # go dense inside the block-delta messages; the snapshot takes the new scales
        now = _global_bits(loop)
        self.rescaled = tuple(sorted(g for g, v in now.items() if self.snap.globals.get(g) != v))
        self.snap.globals = now

    def end(self, loop) -> None:
        d_s, s_s, d_r, s_r = self.bytes
        self.snap.cost = self.snap.cost.after_delta(self.diff_s, self.apply_s, run_seconds(loop), (d_s, s_s),
                                                    (d_r, s_r))

    def report(self, loop, report: RunReport) -> RunReport:
        self.snap.version = self.req.version
        return _delta_report(loop, report, "delta", None, self.base, self.rescaled)

    def posted(self, loop, pos: int) -> None:
        if pos == 0 and self.pre is not None and self.pre.updates:
            t = clock()
            commit_updates(self.pre.updates)
            self.pre.updates = []
            loop.timing.pack += clock() - t

    def _stage(self, loop, pos: int) -> list:
        """The dense staging copies step ``pos`` still needs: a delta-able message whose chunks are plain
        copies is diffed straight from its sources (no staging copy first). Returns those sources by send."""
        b, el, i = loop.b, self.elig, loop.work.steps[pos][0]
        if not el.sends[pos]:  # a step this rank only receives in
            return []
        srcs = (
            [s if ok else None for s, ok in zip(b.send_srcs[pos], el.sends[pos], strict=True)]
            if b.send_srcs
            else [None] * len(el.sends[pos])
        )
        skip = [rng for s in srcs if s is not None for rng in (s[1],) if rng[1] > rng[0]]
        if skip:
            packs, lo = [], 0
            for a, z in skip:
                packs += b.packs[pos][lo:a]
                lo = z
            packs += b.packs[pos][lo:]
            if packs:
                ops.copy_views(packs, loop.backend, key=(loop.key, "delta-pack", i))
        else:
            ops.copy_views(b.packs[pos], loop.backend, key=(loop.key, "pack", i))
        return srcs

    def _views(self, loop, pos: int, j: int, srcs: list) -> list:
        """Send ``j`` of step ``pos`` as (source, snapshot) pairs: its sources where it is diffed from them, else
        its chunks in the send buffer (packed dense first)."""
        views = srcs[j][0] if srcs[j] is not None else loop.b.send_msgs[pos][j]
        return list(zip(views, self.snap.views(pos, j), strict=True))

    def _encode(self, loop, pos: int, j: int, pairs: list, hashed: bool = True) -> torch.Tensor:
        """The delta message of ``pairs`` (the snapshot updated), with the codec's cache of send ``j``."""
        cache = send_cache(loop.b, pos, j)
        if hashed and loop.ledger is not None and loop.backend == "triton":  # the encode pass hashes what it writes
            coef, dev = loop.ledger.coef, pairs[0][0].device  # (a message is whole 1 KiB rows' words: n % 16 == 0)
            msg, h = triton_pack_digest(pairs, lambda n: coef.get(-(-n // (8 * ROW_WORDS)), dev), cache=cache)
            self.hashed[id(msg)] = (msg, h, [(0, msg.numel())])
            return msg
        return ops.pack_delta(pairs, update=True, backend=loop.backend, cache=cache)

    def _message(self, loop, pos: int, j: int, srcs: list, hashed: bool = True) -> torch.Tensor:
        """Send ``j`` of step ``pos`` as a delta message (diffed once per run and snapshot). A send whose message
        a later one repeats keeps it (``shared``); one repeating an earlier send of this step not yet packed
        packs that one first (a joined wire message may come before the other's)."""
        b, el = loop.b, self.elig
        if (pos, j) in el.same:  # an earlier send's message (same boxes, one snapshot): not diffed again
            first = el.same[pos, j]
            got = self.shared.get(first)
            return got if got is not None else self._message(loop, first[0], first[1], srcs, hashed)
        if (pos, j) in self.shared:  # packed already, for a send that repeats it
            return self.shared[pos, j]
        t = clock()
        if pos == 0 and self.pre is not None and j in self.pre.msgs:
            msg = self.pre.msgs.pop(j)
        elif el.sends[pos][j]:
            msg = self._encode(loop, pos, j, self._views(loop, pos, j, srcs), hashed)
        else:
            msg = pack_block_delta(b.send_qmsgs[pos][j], self.snap.qviews(pos, j), update=True)
        self.diff_s += clock() - t
        if (pos, j) in el.repeated:
            self.shared[pos, j] = msg
        return msg

    def _wire_message(self, loop, pos: int, g: tuple[int, ...], srcs: list) -> torch.Tensor:
        """Wire message ``g`` of step ``pos`` (``Eligible.swire``): a lone send's delta message, or the delta-able
        sends of the step to one peer as one message: packed in one call (``Eligible.one_pack``), else each alone
        and joined (one of them shares its message with another send)."""
        if len(g) == 1:
            return self._message(loop, pos, g[0], srcs)
        if not self.elig.one_pack(pos, g):
            msgs = [self._message(loop, pos, j, srcs, hashed=False) for j in g]
            t = clock()
            msg = self._join(loop, msgs)
            self.diff_s += clock() - t
            return msg
        if pos == 0 and self.pre is not None and g[0] in self.pre.msgs:
            return self.pre.msgs.pop(g[0])
        t = clock()
        msg = self._encode(loop, pos, g[0], [pair for j in g for pair in self._views(loop, pos, j, srcs)])
        self.diff_s += clock() - t
        return msg

    def _join(self, loop, msgs: list) -> torch.Tensor:
        """``msgs`` joined in one message (``join_messages``); on the Triton backend with the digest on, its bodies
        written by the digesting copy kernel, which hashes what it writes (the join's own pass: its header and
        directory, a few words, are hashed at ``on_post``), not read again in a second pass."""
        if loop.ledger is None or loop.backend != "triton":
            return join_messages(msgs)
        got = []

        def copy(pairs, out):
            coef = loop.ledger.coef.get(-(-out.numel() // (8 * ROW_WORDS)) + 8, out.device)
            got.append(triton_copy_digest(pairs, [(out, out.numel())], 1, coef))
            if got[0] is None:  # (bodies never overlap: the kernel always takes them)
                ops.copy_views(pairs, loop.backend)

        msg = join_messages(msgs, copy)
        if got and got[0] is not None:
            sums, gaps = got[0]
            self.hashed[id(msg)] = (msg, sums[0], minus_ranges([(0, msg.numel())], gaps[0]))
        return msg

    def pack(self, loop, pos: int) -> tuple[list, list]:
        el = self.elig
        srcs = self._stage(loop, pos)
        loop.quantize_sends(pos)  # source-quantized chunks: quantized into the send buffer, as a dense run
        bsends = el.bsends[pos] if el.bsends else ()
        sends, recvs = loop.b.wire[pos]
        out_s, len_s = [], []
        for g in el.swire[pos]:  # the wire messages: a step's delta-able sends to one peer as one
            peer, buf = sends[g[0]]
            if el.sends[pos][g[0]] or (bsends and bsends[g[0]]):
                msg = self._wire_message(loop, pos, g, srcs)
                self.bytes[0] += msg.numel()
                self.bytes[1] += sum(sends[j][1].numel() for j in g)
                out_s.append((peer, msg))
                if not self.inbox_mode:  # (gloo: no length round)
                    len_s.append((peer, torch.tensor([msg.numel()], dtype=torch.int64, device=msg.device)))
            else:
                out_s.append((peer, buf))
        if self.hashed:  # the delta messages hashed by their encode pass, the other sends at on_post
            zero = (None, torch.zeros((), dtype=torch.int64, device=out_s[0][1].device))
            loop.ledger.add_hashed(pos, [m.numel() for _p, m in out_s],
                                   torch.stack([self.hashed.get(id(m), zero)[1] for _p, m in out_s]),
                                   [self.hashed[id(m)][2] if id(m) in self.hashed else [] for _p, m in out_s])
            keep = {id(m) for m in self.shared.values()}  # a later send repeats them
            self.hashed = {k: v for k, v in self.hashed.items() if k in keep}
        dev = (sends or recvs)[0][1].device
        if self.inbox_mode:  # gloo takes a message into a larger buffer: no length round (see land)
            return out_s, self._inbox_recvs(loop, pos, recvs, dev)
        return out_s, self._announced_recvs(loop, pos, sends, recvs, len_s, dev)

    def _delta_recvs(self, pos: int, n: int) -> list[bool]:
        el = self.elig
        brecvs = el.brecvs[pos] if el.brecvs else (False,) * n
        return [el.recvs[pos][j] or brecvs[j] for j in range(n)]

    def _announced_recvs(self, loop, pos: int, sends, recvs, len_s, dev) -> list:
        """Step ``pos``'s receives (per wire message, ``Eligible.rwire``) after the round of delta lengths (NCCL,
        block deltas): each delta message's buffer of its announced size (kept in ``self.inbox[pos]`` for
        :meth:`land`)."""
        el, link, what = self.elig, loop.link, loop.what(pos)
        delta_r = self._delta_recvs(pos, len(recvs))
        peers = {p for p, _ in sends} | {p for p, _ in recvs}
        wire = el.rwire[pos]
        len_r = [(recvs[g[0]][0], torch.zeros(1, dtype=torch.int64, device=dev)) for g in wire if delta_r[g[0]]]
        if len_s or len_r:
            t1 = clock()
            works = link.call(link.post, f"{what} (delta lengths)", peers, len_s, len_r)
            link.wait(works, f"{what} (delta lengths)", peers, t1)
            loop.timing.wire += clock() - t1
        lens = iter(int(x) for _p, x in len_r)  # sent in message order: the k-th length is the k-th delta
        out_r, inbox = [], []
        for g in wire:
            peer, buf = recvs[g[0]]
            if delta_r[g[0]]:
                n, most = next(lens), el.max_bytes[pos, g[0]]
                if not 16 <= n <= most or n % 16:
                    raise ValueError(
                        f"rank {link.rank}: {what}: rank {peer} announced a delta message of "
                        f"{n} bytes (at most {most}, a multiple of 16)"
                    )
                buf = torch.empty(n, dtype=torch.uint8, device=dev)
                inbox.append(buf)
            out_r.append((peer, buf))
        self.inbox[pos] = inbox
        loop.sent += 8 * len(len_s)  # the length round
        loop.recvd += 8 * len(len_r)
        return out_r

    def _inbox_recvs(self, loop, pos: int, recvs, dev) -> list:
        """Step ``pos``'s receives (per wire message, ``Eligible.rwire``) with each delta message's buffer a slice
        of the step's inbox area, its largest possible size (kept in ``self.inbox[pos]`` for :meth:`land`)."""
        el = self.elig
        out_r, inbox, at = [], [], 0
        wire = el.rwire[pos]
        want = sum(el.max_bytes[pos, g[0]] for g in wire if el.recvs[pos][g[0]])
        area = self.snap.inbox(pos % loop.work.slots, want, dev) if want else None
        for g in wire:
            peer, buf = recvs[g[0]]
            if el.recvs[pos][g[0]]:
                n = el.max_bytes[pos, g[0]]
                buf = area[at : at + n]
                at += n
                inbox.append(buf)
            out_r.append((peer, buf))
        self.inbox[pos] = inbox
        return out_r

    def _dsts(self, loop, pos: int, g: tuple[int, ...]) -> tuple[list, dict]:
        """Wire message ``g``'s destination views (its receives' chunks, in order) and its unpack cache."""
        cache = loop.b.delta_cache.setdefault(("recv", pos, g[0]), {})
        dsts = cache.get("dsts")
        if dsts is None:
            dsts = cache["dsts"] = [v for j in g for v in loop.b.recv_msgs[pos][j][0]]
        return dsts, cache

    def land(self, loop, pos: int) -> Landed:
        """Step ``pos``'s dense messages unpacked; its delta messages applied by the returned ``Landed.apply``,
        which the loop runs once they are digested (as they arrived: the apply does not change them), so that
        in the last step the digest exchange is on the wire while this rank applies (``StepLoop.apply``)."""
        b, el = loop.b, self.elig
        inbox = iter(self.inbox.pop(pos))
        dense, lengths = [], {}  # lengths: the bytes of each delta received into a larger buffer, by wire index
        deltas = []  # (message, receive index, wire message)
        brecvs = el.brecvs[pos] if el.brecvs else ()
        for w, g in enumerate(el.rwire[pos]):
            j = g[0]
            if el.recvs[pos][j] or (brecvs and brecvs[j]):
                msg = next(inbox)
                deltas.append((msg, j, g))
                n = _arrived(msg) if self.inbox_mode else msg.numel()
                if self.inbox_mode:  # received into a buffer of the largest size: count what came
                    loop.recvd -= msg.numel() - n
                    lengths[w] = n
                self.bytes[2] += n
                self.bytes[3] += sum(b.wire[pos][1][k][1].numel() for k in g)
            else:
                _vs, a, z = b.recv_msgs[pos][j]
                dense += b.unpacks[pos][a:z]
        ops.copy_views(dense, loop.backend)
        return Landed(dense, lengths, wire=el.rwire[pos], apply=(lambda: self._apply(loop, pos, deltas)) if deltas else None)

    def _apply(self, loop, pos: int, deltas: list) -> None:
        """Write step ``pos``'s delta messages into their destinations (``land``'s deferred part)."""
        b, el = loop.b, self.elig
        for msg, j, g in deltas:
            t = clock()
            if el.recvs[pos][j]:
                dsts, cache = self._dsts(loop, pos, g)
                ops.unpack_delta(msg, dsts, backend=loop.backend, names=el.names[pos, j], cache=cache)
            else:
                unpack_block_delta(msg, b.recv_qmsgs[pos][j], names=el.names[pos, j])
            self.apply_s += clock() - t


def _arrived(msg: torch.Tensor) -> int:
    """The bytes of a delta message received into a larger buffer, read from its header before the unpack
    checked it (``land`` digests it first): a header too damaged to say counts the whole buffer (its digest
    then differs from the sender's; the unpack refuses it)."""
    try:
        n = message_length(msg)
    except (IndexError, ValueError, RuntimeError):
        return msg.numel()
    return n if 0 < n <= msg.numel() else msg.numel()

def pick(
    side: DeltaSide,
    req: DeltaRequest | None,
    base: int | None,
    why: str | None,
    prepacked: float | None,
    pre: Prediff | None,
) -> Dense:
    """The strategy of a run from the fence's answer (``DeltaSide.decide``: ``base`` to go as a delta, else
    ``why`` not): dense without a delta request; a delta from ``base``; else dense, capturing the snapshot
    unless the cost model chose dense (``COST_WHY``: no snapshot is kept) or the plan keeps none."""
    if req is None:
        return Dense(prepacked)
    if base is not None:
        return Delta(side, req, base, pre)
    if side.snap.device is not None:
        return Capture(side, req, why, not (why or "").startswith(COST_WHY), prepacked)
    return Dense(
        prepacked, req, why
    )  # no snapshot: the plan goes dense (Eligible.dense: block-FP8 destinations)
