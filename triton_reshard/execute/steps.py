"""The step loop: pack, post, land (unpack or compare), the local copies and the quantization of staged
regions, one small method per kind of step, timed into a :class:`Timing` record. One loop for every run; what
each step does to its messages is a strategy value (``execute/strategies.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import ops
from ..ops import quant_digest
from ..ops import quantize as quant
from . import lane_hash
from .bind import Bound
from .errors import ReshardAbortedError
from .handshake import Preposted
from .integrity import ROW_WORDS
from .reports import RunReport, Tally
from .transport import Link

clock = time.perf_counter


@dataclass(slots=True)
class Timing:
    """Seconds spent per kind of work in one run (``local`` None until the local copies ran)."""

    pack: float = 0.0
    wire: float = 0.0
    unpack: float = 0.0
    local: float | None = None


@dataclass(slots=True)
class Pending:
    """A step on the wire: its position, works, peers, when it was posted, and per work (operation, peer)."""

    pos: int
    works: list
    peers: set
    posted: float
    desc: list


def prepack(work, bound: Bound, backend: str, key, digests=None) -> float | None:
    """Step 0's staging copies (source views into its send buffers), made between posting the plan handshake
    and waiting for it: they write only this rank's send staging, so a refused refit still moved nothing
    (issue 32: the pack overlaps the handshake's round). Its seconds, or None where step 0 is not plain copies
    (quantizing packs read the global scales the loop exchanges first; a relay phase reads destinations)."""
    if not work.steps or work.phases[0] or bound.quant.packs[0] or work.global_groups:
        return None
    t = clock()
    key = (key, "pack", work.steps[0][0])
    if digests is None or not digests.pack_ahead(bound.packs[0], bound.wire[0][0], key, backend):
        ops.copy_views(bound.packs[0], backend, key=key)
    return clock() - t


class StepLoop:
    """One run (or verify, with a ``tally``) of a rank's bound steps: the one loop every run takes, driven by
    the plan's steps. What a step does to its messages is the ``strategy``'s (``execute/strategies.py``: dense,
    capture, delta; quantized chunks are packed and landed by the loop's helpers inside them): per run
    ``begin`` / ``end``, per step ``pack`` (the step's messages as they go on the wire), ``posted`` and
    ``land`` (what the step received, once it arrived). Those are the one place per step where messages are
    made and where they land."""

    def __init__(self, work, bound: Bound, link: Link, backend: str, tally: Tally | None, touched: set[str],
                 key, strategy, preposted: Preposted | None = None, ledger=None) -> None:
        self.work, self.b, self.link, self.backend = work, bound, link, backend
        self.tally, self.touched, self.key = tally, touched, key
        self.strategy = strategy
        self.verify = tally is not None
        self.timing = Timing()
        self.sent = self.recvd = 0
        # step 0's receives posted with the plan handshake (handshake.handshake_post): not posted again
        self.preposted = preposted
        # the run's message digests (execute/integrity.py: Ledger), or None (digest off, verify, no wire)
        self.ledger = ledger
        lane_hash.attach(ledger, link.comm)  # same-host lanes hash the receives they copy in, for it

    def what(self, pos: int) -> str:
        return f"step {pos + 1}/{len(self.work.steps)}"

    def copy_or_compare(self, pairs, meta, list_key) -> None:
        """Unpack or local copies: write them, or in verify mode compare them."""
        if self.tally is None:
            ops.copy_views(pairs, self.backend, key=list_key)
        else:
            self.tally.compare(pairs, meta)

    def quantize(self, groups: dict, metas: dict | None, list_key) -> None:
        """Quantize ``{(format, block, ue8m0): [(source, values out, scales out)]}`` into the outputs (the
        format picks the quantizer); in verify mode (``metas`` given) into temporaries compared with the
        outputs instead."""
        for qk, items in groups.items():
            fmt, block, ue8m0 = qk
            if metas is None:
                quant.quantize_views(items, block, ue8m0, backend=self.backend, key=(list_key, qk), fmt=fmt)
                continue
            temps = [(x, torch.empty(q.shape, dtype=q.dtype, device=q.device),
                      torch.empty(sc.shape, dtype=sc.dtype, device=sc.device), *g) for x, q, sc, *g in items]
            quant.quantize_views(temps, block, ue8m0, backend=self.backend, fmt=fmt)
            pairs, meta = [], []
            for (_x, tq, ts, *_g), (_y, q, sc, *_h), (mq, ms) in zip(temps, items, metas[qk], strict=True):
                pairs += [(tq, q), (ts, sc)]
                meta += [mq, ms]
            self.tally.compare(pairs, meta)

    def global_scales(self) -> None:
        """Formats with a global scale (NVFP4): each group's amax over every source holder (one all-gather of
        this rank's amax per group, the float32 bits as ints: for non-negative floats their order is the
        floats'), then its global scale into the bound state (before any pack reads it) and ``weight_scale_2``
        (``1 / gs``) into the destination's global-scale tensors (verify: compared). A group whose amax is inf or
        NaN raises ``ValueError`` naming it on every rank alike, before any byte of the refit moves."""
        bq = self.b.quant
        groups = self.work.global_groups
        if not groups:
            return
        pos = {g: i for i, g in enumerate(groups)}
        amax = torch.zeros(len(groups), dtype=torch.float32)
        for g, v in bq.amax_views:
            if v.numel():
                m = v.abs().amax().float().cpu()
                amax[pos[g]] = torch.maximum(amax[pos[g]], m) if not torch.isnan(m) else m
        row = amax.view(torch.int32).to(torch.int64)
        row = torch.where(torch.isnan(amax), 0x7FC00000, row)
        if self.link.wire:
            rows = torch.tensor(self.link.all_gather_row(row.tolist(), "the global-scale amax exchange"))
            row = rows.max(dim=0).values
        bits = row.to(torch.int32)
        if bool((bits >= 0x7F800000).any()):
            bad = [g for g, b in zip(groups, bits.tolist(), strict=True) if b >= 0x7F800000]
            raise ValueError(f"rank {self.link.rank}: tensor group {bad[0]!r} holds inf or NaN (amax "
                             f"{'inf' if int(bits[pos[bad[0]]]) == 0x7F800000 else 'NaN'}): NVFP4's global scale "
                             f"needs a finite amax; nothing was moved")
        gs, ws2 = quant.global_scales(bits.view(torch.float32))
        for g, t in bq.globals.items():
            t.copy_(gs[pos[g]:pos[g] + 1])
        if not bq.global_out:
            return
        pairs = [(ws2[pos[g]:pos[g] + 1].to(v.device), v) for g, v, _m in bq.global_out]
        if self.tally is None:
            for a, v in pairs:
                v.copy_(a)
            self.touched.update(m[0] for _g, _v, m in bq.global_out)
        else:
            self.tally.compare(pairs, [m for _g, _v, m in bq.global_out])

    def regions(self, pos: int) -> None:
        """Quantize the staged regions whose last piece arrived in step ``pos`` (-1: the local copies)."""
        ks = self.b.quant.regions_due.get(pos)
        if not ks:
            return
        groups: dict = {}
        metas: dict = {}
        for k in ks:
            qk, item, meta = self.b.quant.region_items[k]
            groups.setdefault(qk, []).append(item)
            metas.setdefault(qk, []).append(meta)
            if not self.verify:
                self.touched.update((meta[0][0], meta[1][0]))
        self.quantize(groups, metas if self.verify else None, (self.key, "regions", pos))

    def local_copies(self) -> None:
        t = clock()
        b = self.b
        self.touched.update(b.local_writes)
        if self.ledger is not None and self.tally is None and self.strategy.local_digest:
            pairs = self.ledger.local(b.local, b.wire, (self.key, "local"), self.backend)
            self.copy_or_compare(pairs, None, (self.key, "local" if pairs is b.local else "local-rest"))
        else:
            self.copy_or_compare(b.local, b.local_meta, (self.key, "local"))
        bq = b.quant
        if bq.local_stage:
            ops.copy_views(bq.local_stage, self.backend, key=(self.key, "local-stage"))
        if bq.local:
            self.quantize(bq.local, bq.local_meta if self.verify else None, (self.key, "local-quant"))
        self.regions(-1)
        self.timing.local = clock() - t

    def quantize_sends(self, pos: int, ledger=None) -> None:
        """Step ``pos``'s source-quantized chunks, quantized straight into their send buffers; with the run's
        ``ledger`` (a dense step's sends go out as these buffers) and the Triton backend, by the kernels that
        hash what they write (``ops/quant_digest.py``), else as before (the buffers hashed once posted)."""
        groups = self.b.quant.packs[pos]
        if not groups:
            return
        key = (self.key, "pack-quant", self.work.steps[pos][0])
        if ledger is not None and self.backend == "triton":
            groups = {qk: items for qk, items in groups.items() if not self._quantize_hashed(pos, qk, items, key)}
        if groups:
            self.quantize(groups, None, key)

    def _quantize_hashed(self, pos: int, qk, items, key) -> bool:
        """Quantize ``items`` into step ``pos``'s send buffers with the kernels hashing what they write, their
        sums handed to the ledger; False (nothing written) where they cannot."""
        bufs = [(b, b.numel()) for _p, b in self.b.wire[pos][0]]
        rows = max(n // (8 * ROW_WORDS) for _b, n in bufs) + 8  # coefficients enough: a row's, a tail byte's each
        coef = self.ledger.coef.get(rows, bufs[0][0].device)
        got = quant_digest.quantize_digest(items, qk[1], qk[2], bufs, coef, (key, qk), qk[0])
        if got is not None:
            self.ledger.add_hashed(pos, [n for _b, n in bufs], *got)
        return got is not None

    def pack_and_post(self, pos: int) -> Pending:
        """Make step ``pos``'s messages (the strategy's ``pack``: the one place they are made; a round it runs
        on the wire first, e.g. a delta's lengths, counts as wire time) and post them."""
        wire, t0 = self.timing.wire, clock()
        sends, recvs = self.strategy.pack(self, pos)
        self.timing.pack += clock() - t0 - (self.timing.wire - wire)
        p = self.post(pos, sends, recvs)
        self.strategy.posted(self, pos)
        if self.ledger is not None:  # the sends digested while the transport reads them
            self.ledger.on_post(pos, sends, recvs, self.strategy.lane_unpack(self, pos))
        return p

    def post(self, pos: int, sends, recvs) -> Pending:
        """Post step ``pos``'s payload round: ``sends`` / ``recvs`` as (peer, buffer), in the plan's order
        (step 0's receives that went with the handshake are waited for with the rest, not posted again)."""
        peers = {p for p, _ in sends} | {p for p, _ in recvs}
        self.touched.update(self.b.writes[pos])  # in-place receives may land as soon as they are posted
        pre = self.preposted if pos == 0 else None
        posted = clock()
        done = pre.peers if pre is not None else {}
        rest = [(p, buf) for p, buf in recvs if p not in done]
        works = self.link.call(self.link.post, self.what(pos), peers, sends, rest) if sends or rest else []
        desc = [("receiving from", p) for p, _ in rest] + [("sending to", p) for p, _ in sends]
        if pre is not None:
            works = pre.works + works
            desc = [("receiving from", p) for p, _ in pre.recvs] + desc
        self.sent += sum(buf.numel() for _, buf in sends)
        self.recvd += sum(buf.numel() for _, buf in recvs)
        return Pending(pos, works, peers, posted, desc)

    def finish(self, p: Pending) -> None:
        """Wait for step ``p`` and land what it received (the strategy's ``land``: the one place messages
        land), then the staged pieces of quantized destinations."""
        b, pos = self.b, p.pos
        i = self.work.steps[pos][0]
        t1 = clock()
        self.link.wait(p.works, self.what(pos), p.peers, p.posted, p.desc)
        t2 = clock()
        landed = self.strategy.land(self, pos)
        if b.quant.stage_unpacks[pos] and not landed.staged:  # (staged: copied, and hashed, with the unpack)
            ops.copy_views(b.quant.stage_unpacks[pos], self.backend, key=(self.key, "stage", i))
        if self.ledger is not None:  # the receives digested over what the unpack wrote
            pairs = landed.unpacked + b.quant.stage_unpacks[pos]
            self.ledger.on_land(pos, pairs, self.backend, landed.lengths, (self.key, pos), landed.wire)
        if landed.apply is not None:
            self.apply(pos, landed.apply)
        self.regions(pos)
        self.timing.wire += t2 - t1
        self.timing.unpack += clock() - t2

    def apply(self, pos: int, fn) -> None:
        """Step ``pos``'s writes left after its digest (``Landed.apply``: a delta's apply, its messages digested
        as they arrived). In the run's last step every message of the run is digested by then: the digest
        exchange is posted first (``Ledger.post_round``) and runs while this rank applies, off the refit's
        critical path. An apply that fails after that waits for the verdict: a message corrupted so that its
        decode fails is then named on every rank (the integrity error), not a timeout on its peers."""
        last = pos == len(self.work.steps) - 1
        if not last or self.ledger is None or not self.ledger.post_round(self.link):
            fn()
            return
        try:
            fn()
        except Exception as e:
            self.ledger.settle(self.link)  # raises ReshardIntegrityError on every rank where a message differs
            raise ReshardAbortedError(
                f"rank {self.ledger.rank}: the run failed on this rank applying its last step ({type(e).__name__}: "
                f"{e}) after the digest round had proven every message of the run: its peers finished and returned; "
                f"no message is in flight, so the process group is still usable (the next refit here goes dense)",
                group_ok=True) from e

    def run(self) -> None:
        """Every step: pack and post step k (with two slots, while step k-1 is still on the wire), run the
        local copies while the first step is on the wire (before the relay phase, whose relays may read
        what they write), then wait for each step and land it."""
        phases, slots = self.work.phases, self.work.slots
        pending: Pending | None = None
        with torch.no_grad():
            self.global_scales()
            self.strategy.begin(self)
            for pos in range(len(self.work.steps)):
                if pending is not None and (slots == 1 or phases[pending.pos] != phases[pos]):
                    # one slot: the previous step's buffers are reused; a new phase: relays read what the
                    # previous phase received
                    self.finish(pending)
                    pending = None
                if self.timing.local is None and phases[pos]:  # relays may read what the local copies write
                    self.local_copies()
                step = self.pack_and_post(pos)
                if self.timing.local is None:  # the local copies run while the first step is on the wire
                    self.local_copies()
                if pending is not None:  # step pos-1 was on the wire while we packed and posted step pos
                    self.finish(pending)
                pending = step
            if pending is not None:
                self.finish(pending)
            if self.timing.local is None:  # no steps on this rank
                self.local_copies()
            self.strategy.end(self)

    def report(self, t0: float, staging_bytes: int) -> RunReport:
        tm = self.timing
        return RunReport(
            rank=self.link.rank,
            steps=len(self.work.steps),
            sent_bytes=self.sent,
            recv_bytes=self.recvd,
            local_bytes=self.work.local_bytes,
            staging_bytes=staging_bytes,
            seconds=time.perf_counter() - t0,
            pack_seconds=tm.pack,
            wire_seconds=tm.wire,
            unpack_seconds=tm.unpack,
            local_seconds=tm.local,
            in_place_bytes=self.b.in_place_bytes,
        )
