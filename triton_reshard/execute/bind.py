"""Binding: the views for every copy and the buffers for every message of one rank, for one set of tensors
and one mode (run or verify), as a frozen :class:`Bound`. :func:`bind` is a function of the rank's work, the
tensors and the mode; the only state it touches is the :class:`Staging` memory it carves the buffers from
(allocated once and reused while it is big enough)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..box import box_slices, contiguous_strides
from ..layout import QuantFormat
from ..ops.delta_native import reads_in_place
from ..plan import ALIGN
from ..plan.quant import QUANT_DST, QUANT_SRC
from ..plan.table import SMALL
from ..plan.work import RankWork


@dataclass(frozen=True, slots=True)
class BoundQuant:
    """The quantization part of a :class:`Bound` (block-quantized destinations, see plan/quant.py).

    Quantize items are ``(source, values out, scales out)`` (formats with a global scale: plus the group's
    global-scale tensor), grouped by quantizer key ``(format name, block, ue8m0)`` (:func:`qkey`): ``{key:
    items}``; the ops pick the quantizer by the format."""

    packs: list  # per step: {key: items} the pack quantizes
    stage_unpacks: list  # per step: (receive buffer, staging view) pairs
    local: dict  # {key: items} local copies quantized in place
    local_meta: dict  # verify: {key: [(weight meta, scale meta)]}
    local_stage: list  # (source view, staging view) of local pieces of regions
    regions_due: dict  # step position (-1: after the local copies) -> region ids
    region_items: list  # per region: (key, item, (weight meta, scale meta))
    # formats with a global scale: per group its float32 (1,) quantization multiplier on the device (filled by
    # the amax exchange before any pack), this rank's amax inputs (group, source view), and the global-scale
    # destination views it writes (group, view, verify meta)
    globals: dict = None
    amax_views: list = ()
    global_out: list = ()


def with_global(item: tuple, views, tensor: str) -> tuple:
    """A quantize item with its tensor's global scale appended (formats that have one)."""
    q = views.work.quant[tensor]
    return item + (views.globals[q.global_group],) if q.global_group else item


def qkey(fmt: QuantFormat, block: tuple[int, ...], ue8m0: bool) -> tuple:
    """The quantizer key of a group of quantize items."""
    return (fmt, tuple(block), bool(ue8m0))


@dataclass(frozen=True, slots=True)
class Bound:
    """The views and buffers of one set of tensors in one mode (see :func:`bind`). Per-step lists are
    indexed by the position of the step among the rank's steps."""

    local: list  # (source view, destination view) of each plain local copy (verify: split to the bucket)
    local_meta: list | None  # verify: per local pair, (dst local, tensor, logical offsets, local offsets)
    packs: list  # per step: (source view, send buffer view) pairs
    unpacks: list  # per step: (receive buffer view, destination view) pairs
    unpack_meta: list | None  # verify: per step, per unpack pair, as local_meta
    wire: list  # per step: (sends, recvs) of (peer, flat buffer)
    send_area_bytes: int
    recv_area_bytes: int
    in_place_bytes: int
    writes: list  # per step: names of the destination tensors it writes
    local_writes: frozenset  # destination tensors the local copies write
    quant: BoundQuant  # block-quantized destinations
    # per step, per message (in ``wire`` order), for delta refits (execute/delta.py): a send's chunk views in
    # its flat buffer (wire dtype, chunk shape; what the dense pack wrote there); a receive's destination view
    # of each chunk and the range of ``unpacks[pos]`` that lands it when it goes dense (empty: in place)
    send_msgs: list = ()
    recv_msgs: list = ()
    # per step, per send (``wire`` order): (source view of each chunk, range of ``packs[pos]`` that stages
    # it) when every chunk is a plain copy in the wire dtype (a delta diffs the sources themselves, no staging
    # copy first), else None
    send_srcs: list = ()
    # per step, per message, for block deltas (ops/block_delta.py): a message of source-quantized chunks in a
    # format with 1 x B blocks: its chunks' (values, scales) in the send buffer / destination; else None
    send_qmsgs: list = ()
    recv_qmsgs: list = ()
    # delta refits: per message, what its pack or unpack keeps while these views stay (ops/delta_cached.py
    # PackPlan / UnpackPlan): dropped with the Bound when the tensors change
    delta_cache: dict = field(default_factory=dict)


def block_chunks(transfers, m) -> bool:
    """Message ``m`` is all source-quantized chunks of formats with 1 x B blocks (MXFP8, NVFP4): a block delta
    can carry it."""
    return all(
        transfers[c.transfer].quant == QUANT_SRC
        and transfers[c.transfer].fmt.block is not None
        for c in m.chunks
    )


class Staging:
    """The staging memory of one Resharder: the send and receive areas (bytes) and one tensor per
    quantization region, allocated on first use and reused while big enough."""

    def __init__(self) -> None:
        self.send: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None
        self.regions: list[torch.Tensor] = []

    def areas(
        self, send_bytes: int, recv_bytes: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            self.send is None
            or self.send.device != device
            or self.send.numel() < send_bytes
            or self.recv.numel() < recv_bytes
        ):
            self.send = self.recv = None  # free the old areas before allocating the new ones
            self.send = torch.empty(send_bytes, dtype=torch.uint8, device=device)
            self.recv = torch.empty(recv_bytes, dtype=torch.uint8, device=device)
        return self.send, self.recv

    def region_tensors(self, work: RankWork, device: torch.device) -> list[torch.Tensor]:
        if work.regions and (not self.regions or self.regions[0].device != device):
            self.regions = [torch.empty(g.sizes, dtype=g.dtype, device=device) for g in work.regions]
        return self.regions

    @property
    def region_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.regions)


def start_of(base: torch.Tensor, start, off, size) -> tuple[int, ...]:
    """Local coordinates (extra leading dims included) of sub-box ``off`` of the box at ``start``."""
    extra = base.dim() - len(size)
    return start[:extra] + tuple(a + b for a, b in zip(start[extra:], off, strict=True))


def sub_view(base: torch.Tensor, start, off, size) -> torch.Tensor:
    """The sub-box ``off``+``size`` (logical dims) of the box starting at ``start`` in ``base``: one
    ``as_strided`` (a tuple of slices and a reshape cost twice as much, hundreds of times in a first call's
    binding); a box not inside ``base`` takes the slicing path, which raises or clamps as it always did."""
    shape, strides = base.shape, base.stride()
    extra = len(shape) - len(size)
    pos = base.storage_offset()
    inside = len(start) == len(shape) and len(off) == len(size)
    # lengths checked in ``inside`` (a mismatch takes the slicing path, which raises): strict=False
    for a, d, k in zip(start[:extra], shape, strides, strict=False):  # the extra leading dims: size 1 at ``start``
        inside = inside and 0 <= a < d
        pos += a * k
    for a, b, n, d, k in zip(start[extra:], off, size, shape[extra:], strides[extra:], strict=False):
        a += b
        inside = inside and a >= 0 and a + n <= d
        pos += a * k
    if inside:
        return base.as_strided(tuple(size), strides[extra:], pos)
    return base[box_slices(start_of(base, start, off, size), (1,) * extra + tuple(size))].reshape(size)


def scale_box(t, off, size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets in the transfer's scale box, sizes) of the blocks of sub-box ``off``+``size``."""
    return (
        tuple(o // b for o, b in zip(off, t.block, strict=True)),
        tuple(-(-n // b) for n, b in zip(size, t.block, strict=True)),
    )


def quant_buffers(area: torch.Tensor, at: int, c, t) -> tuple[torch.Tensor, torch.Tensor]:
    """A source-quantized chunk in a message: its value bytes (uint8, the stored shape: a packed format's
    last dim divided by its pack), then at the next ALIGN its scales (the format's scale dtype)."""
    fmt = t.fmt
    sizes = stored(c.sizes, fmt.pack)
    n = math.prod(sizes)
    start = at + c.buffer_offset
    q = area[start : start + n].view(sizes)
    s_size = scale_box(t, (0,) * len(c.sizes), c.sizes)[1]
    s0 = start + (n + ALIGN - 1) // ALIGN * ALIGN
    return q, area[s0 : s0 + math.prod(s_size) * fmt.scale_bytes].view(fmt.scale_dtype).view(s_size)


def stored(box: tuple[int, ...], pack: int) -> tuple[int, ...]:
    """Logical offsets or sizes in stored elements (a packed format's last dim divided by its pack)."""
    return box if pack == 1 else box[:-1] + (box[-1] // pack,)


def buffer_view(area: torch.Tensor, at: int, chunk, t, typed: dict | None = None) -> torch.Tensor:
    """Chunk ``chunk`` of transfer ``t`` in a message at ``at`` of ``area``, in the wire dtype. ``typed``: a dict
    the caller keeps for one ``area`` (its views as each wire dtype, made on first use): a chunk is then one
    ``as_strided`` of that view, where a slice and two views cost ~2.5x as much (a first call binds hundreds)."""
    sizes = chunk.sizes
    n = math.prod(sizes)
    if not n:
        return area[:0]
    start = at + chunk.buffer_offset
    dt = t.wire_dtype
    if typed is not None:
        e = dt.itemsize
        if start % e == 0 and chunk.nbytes == n * e and start + chunk.nbytes <= area.numel():
            tv = typed.get(dt)
            if tv is None and area.is_contiguous() and area.storage_offset() % e == 0:
                tv = typed[dt] = area[: area.numel() // e * e].view(dt)
            if tv is not None:
                return tv.as_strided(sizes, contiguous_strides(sizes), tv.storage_offset() + start // e)
    return area[start : start + chunk.nbytes].view(dt).view(sizes)


def in_place(m, t, v: torch.Tensor, receiving: bool, verify: bool) -> torch.Tensor | None:
    """The bytes of view ``v`` of direct message ``m`` as a flat buffer, or None if it must be staged."""
    if m.direct and not (verify and receiving) and v.dtype == t.wire_dtype and v.is_contiguous():
        # contiguous, so its elements are consecutive; as_strided, not reshape: a view whose dims are
        # all size 1 may keep a stride != 1, which view(uint8) refuses
        return v.as_strided((v.numel(),), (1,)).view(torch.uint8)
    return None


@dataclass(frozen=True, slots=True)
class Views:
    """Where the boxes of transfers live in this rank's tensors (and the region staging tensors)."""

    work: RankWork
    src: dict
    dst: dict
    stage: list
    globals: dict  # global group -> its (1,) float32 global scale (formats with one)

    def source(self, t, off, size) -> torch.Tensor:  # a relay reads what this rank received as destination
        return sub_view((self.dst if t.relay else self.src)[t.src_local], t.src_offsets, off, size)

    def staged(self, t, k: int, off, size) -> torch.Tensor:
        """A destination-quantized piece lands in the staging tensor of its region ``k``."""
        g = self.work.regions[k]
        start = tuple(a + b - c for a, b, c in zip(t.offsets, off, g.offsets, strict=True))
        return self.stage[k][box_slices(start, size)]

    def dest(self, t, off, size, k: int | None = None):
        """The destination view; (fp8 view, scale view) for a source-quantized transfer; the staging view
        (of region ``k``) for a destination-quantized one."""
        if t.quant == QUANT_DST:
            return self.staged(t, k, off, size)
        if t.quant == QUANT_SRC:
            p = t.fmt.pack
            v = sub_view(self.dst[t.dst_local], stored(t.dst_offsets, p), stored(off, p), stored(size, p))
            return v, sub_view(self.dst[t.scale_local], t.scale_offsets, *scale_box(t, off, size))
        return sub_view(self.dst[t.dst_local], t.dst_offsets, off, size)

    def meta(self, t, off, size) -> tuple:  # what verify reports about a compared box
        p = t.fmt.pack if t.quant else 1
        return (
            t.dst_local,
            t.tensor,
            stored(tuple(a + b for a, b in zip(t.offsets, off, strict=True)), p),
            start_of(self.dst[t.dst_local], stored(t.dst_offsets, p), stored(off, p), stored(size, p)),
        )

    def scale_meta(self, t, off, size) -> tuple:  # the same for the scales of a source-quantized sub-box
        s_off, s_size = scale_box(t, off, size)
        base = tuple(o // b for o, b in zip(t.offsets, t.block, strict=True))
        return (
            t.scale_local,
            self.work.quant[t.tensor].scale,
            tuple(a + b for a, b in zip(base, s_off, strict=True)),
            start_of(self.dst[t.scale_local], t.scale_offsets, s_off, s_size),
        )


def bind_local(views: Views, verify: bool) -> tuple[list, list | None, dict, dict, list]:
    """The local copies: plain pairs (+ verify meta), source-quantized items (+ verify meta) and the
    staging copies of destination-quantized pieces."""
    work = views.work
    local, local_meta = [], [] if verify else None
    local_q: dict = {}  # {quantizer key: [(source view, values view, scale view)]}
    local_q_meta: dict = {}  # verify: {quantizer key: [(weight meta, scale meta)]}
    local_stage = []
    for t, k in zip(work.local, work.local_region, strict=True):
        z = (0,) * len(t.sizes)
        if t.quant == QUANT_DST:
            local_stage.append((views.source(t, z, t.sizes), views.staged(t, k, z, t.sizes)))
        elif t.quant == QUANT_SRC:  # verify: within half a bucket, like the plain local copies below
            group = qkey(t.fmt, t.block, work.quant[t.tensor].ue8m0)
            for off, size in work.local_chunks(t, 1) if verify else [(z, t.sizes)]:
                q, sc = views.dest(t, off, size)
                local_q.setdefault(group, []).append(
                    with_global((views.source(t, off, size), q, sc), views, t.tensor)
                )
                if verify:
                    local_q_meta.setdefault(group, []).append(
                        (views.meta(t, off, size), views.scale_meta(t, off, size))
                    )
    for t in work.local:
        if t.quant:
            continue
        if verify:
            isz = max(views.src[t.src_local].element_size(), views.dst[t.dst_local].element_size())
            for off, size in work.local_chunks(t, isz):
                local.append((views.source(t, off, size), views.dest(t, off, size)))
                local_meta.append(views.meta(t, off, size))
        else:
            z = (0,) * len(t.sizes)
            local.append((views.source(t, z, t.sizes), views.dest(t, z, t.sizes)))
    return local, local_meta, local_q, local_q_meta, local_stage


def route_messages(views: Views, transfers, verify: bool) -> tuple[list, int, int]:
    """First pass over the rank's steps: which messages go in place, and how much staging the others need
    per slot. Per step: (sends, recvs) of (peer, at, message, view of each chunk, in-place buffer or None)."""
    work = views.work
    need = [0, 0]  # staging bytes per slot: send, receive
    plans = []
    for _i, step in work.steps:
        sides = []
        for k, entries in enumerate((step.sends, step.recvs)):
            out = []
            for peer, at, m in entries:
                if k == 0:
                    vs = [views.source(transfers[c.transfer], c.offsets, c.sizes) for c in m.chunks]
                else:
                    vs = [
                        views.dest(
                            transfers[c.transfer], c.offsets, c.sizes, work.wire_region.get(c.transfer)
                        )
                        for c in m.chunks
                    ]
                buf = in_place(m, transfers[m.chunks[0].transfer], vs[0], k == 1, verify)
                out.append((peer, at, m, vs, buf))
                if buf is None:
                    need[k] = max(need[k], at + m.nbytes)
            sides.append(out)
        plans.append(tuple(sides))
    return plans, need[0], need[1]


def bind_step(
    views: Views, transfers, sends, recvs, send_area, recv_area, s_base: int, r_base: int, verify: bool
) -> tuple:
    """Buffers and copy lists of one step: (packs, quantizing packs, wire (sends, recvs), unpacks, verify
    meta of the unpacks, staging unpacks)."""
    work = views.work
    pk, up, um, wire_s, wire_r, qp, su = [], [], [], [], [], {}, []
    sm, rm, ss, sq, rq = [], [], [], [], []
    s_typed: dict = {}  # the send area's typed views (buffer_view)
    r_typed: dict = {}
    for peer, at, m, vs, buf in sends:
        first = len(pk)
        qm = [] if buf is None and block_chunks(transfers, m) else None
        sq.append(qm)
        if any(transfers[c.transfer].quant for c in m.chunks):  # never a delta (fp8 values and scales)
            sm.append(None)
        elif buf is not None:  # in place: one contiguous chunk, its bytes are the message
            t = transfers[m.chunks[0].transfer]
            sm.append([buf.view(t.wire_dtype).view(m.chunks[0].sizes)])
        else:
            sm.append([buffer_view(send_area, at + s_base, c, transfers[c.transfer], s_typed) for c in m.chunks])
        if buf is None:
            at += s_base
            bvs = sm[-1]  # the chunks' buffers, made above (None: a quantized message's)
            for j, (c, v) in enumerate(zip(m.chunks, vs, strict=True)):
                t = transfers[c.transfer]
                if t.quant == QUANT_SRC:  # the pack quantizes: fp8 values and scales into the buffer
                    qb, sb = quant_buffers(send_area, at, c, t)
                    if qm is not None:
                        qm.append((qb, sb))
                    qp.setdefault(qkey(t.fmt, t.block, work.quant[t.tensor].ue8m0), []).append(
                        with_global((v, qb, sb), views, t.tensor)
                    )
                else:
                    pk.append((v, bvs[j] if bvs is not None else buffer_view(send_area, at, c, t, s_typed)))
            buf = send_area[at : at + m.payload]
        # a CPU source the native codec cannot read where it lies (not contiguous, not 2-D rows) is staged first:
        # diffed from the source it would fall back to the numpy codec (~5x)
        plain = sm[-1] is not None and all(
            v.dtype == transfers[c.transfer].wire_dtype and (v.device.type != "cpu" or reads_in_place(v))
            for c, v in zip(m.chunks, vs, strict=True)
        )
        ss.append((vs, (first, len(pk))) if plain else None)
        wire_s.append((peer, buf))
    for peer, at, m, vs, buf in recvs:
        first = len(up)
        rq.append(list(vs) if buf is None and block_chunks(transfers, m) else None)
        if buf is None:
            at += r_base
            for c, v in zip(m.chunks, vs, strict=True):
                t = transfers[c.transfer]
                if t.quant == QUANT_SRC:  # fp8 bytes and scales, plain copies (verify: compares)
                    qb, sb = quant_buffers(recv_area, at, c, t)
                    qv, sv = v
                    up += [(qb.view(qv.dtype), qv) if verify else (qb, qv.view(torch.uint8)), (sb, sv)]
                    if verify:
                        um += [views.meta(t, c.offsets, c.sizes), views.scale_meta(t, c.offsets, c.sizes)]
                elif t.quant == QUANT_DST:  # into the region's staging, in verify mode too
                    su.append((buffer_view(recv_area, at, c, t, r_typed), v))
                else:
                    up.append((buffer_view(recv_area, at, c, t, r_typed), v))
                    if verify:
                        um.append(views.meta(t, c.offsets, c.sizes))
            buf = recv_area[at : at + m.payload]
        rm.append((vs, first, len(up)))
        wire_r.append((peer, buf))
    return pk, qp, (wire_s, wire_r), up, um, su, sm, rm, ss, sq, rq


def bind_regions(views: Views, plans) -> tuple[dict, list]:
    """When each region is complete (the step position of its last received piece; -1: after the local
    copies), and its quantize item with verify's meta."""
    work = views.work
    last = [-1] * len(work.regions)
    for pos, (_sends, recvs) in enumerate(plans):
        for _p, _a, m, _v, _b in recvs:
            for c in m.chunks:
                k = work.wire_region.get(c.transfer)
                if k is not None:
                    last[k] = max(last[k], pos)
    regions_due: dict[int, list[int]] = {}
    region_items = []
    dst = views.dst
    for k, g in enumerate(work.regions):
        regions_due.setdefault(last[k], []).append(k)
        z = (0,) * len(g.sizes)
        p = g.fmt.pack
        q = sub_view(dst[g.dst_local], stored(g.dst_offsets, p), z, stored(g.sizes, p))
        sc = sub_view(dst[g.scale_local], g.scale_offsets, z, g.scale_sizes)
        meta = (
            (
                g.dst_local,
                g.tensor,
                stored(g.offsets, p),
                start_of(dst[g.dst_local], stored(g.dst_offsets, p), z, stored(g.sizes, p)),
            ),
            (
                g.scale_local,
                g.scale_tensor,
                tuple(o // b for o, b in zip(g.offsets, g.block, strict=True)),
                start_of(dst[g.scale_local], g.scale_offsets, z, g.scale_sizes),
            ),
        )
        region_items.append(
            (qkey(g.fmt, g.block, g.ue8m0), with_global((views.stage[k], q, sc), views, g.tensor), meta)
        )
    return regions_due, region_items


def bind_writes(work: RankWork, transfers, plans, verify: bool) -> tuple[list, frozenset]:
    """The destination tensors each step writes, and those the local copies write (verify: none)."""
    if verify:
        return [frozenset() for _ in plans], frozenset()
    writes = [
        frozenset(transfers[c.transfer].dst_local for _p, _a, m, _v, _b in recvs for c in m.chunks)
        for _sends, recvs in plans
    ]
    local = [t.dst_local for t in work.local] + [t.scale_local for t in work.local if t.quant == QUANT_SRC]
    return writes, frozenset(local)


def bind(
    work: RankWork, transfers, src_tensors, dst_tensors, device: torch.device, verify: bool, staging: Staging
) -> Bound:
    """Views for every copy and buffers for every message of this rank.

    A direct message whose view is contiguous (and already in the wire dtype) goes straight from the
    source tensor or into the destination tensor; every other message is staged. The staging areas are
    sized for the staged messages only (their offsets are a prefix of the schedule's areas). ``verify``:
    every received message is staged (the destination is compared, never written), and the local copies
    are split into sub-boxes within half a bucket, so the compares' temporaries stay bounded too.
    """
    if len(transfers) <= SMALL and hasattr(transfers, "objects"):  # a share's table keeps its objects: index them
        transfers = transfers.objects()  # directly, not through TransferTable.__getitem__ (~10 lookups a chunk)
    globals_ = {g: torch.ones(1, dtype=torch.float32, device=device) for g in work.global_groups}
    views = Views(work, src_tensors, dst_tensors, staging.region_tensors(work, device), globals_)
    local, local_meta, local_q, local_q_meta, local_stage = bind_local(views, verify)
    plans, need_s, need_r = route_messages(views, transfers, verify)
    n_slots = min(work.slots, len(work.steps))
    send_area, recv_area = staging.areas(need_s * n_slots, need_r * n_slots, device)
    per_step = [
        bind_step(views, transfers, sends, recvs, send_area, recv_area, pos % work.slots * need_s,
                  pos % work.slots * need_r, verify)
        for pos, (sends, recvs) in enumerate(plans)
    ]
    # bind_step's lists, each per step
    packs, qpacks, wire, unpacks, unpack_meta, stage_unpacks, send_msgs, recv_msgs, send_srcs, send_q, recv_q = (
        [list(col) for col in zip(*per_step, strict=True)] if per_step else [[] for _ in range(11)]
    )
    in_place_bytes = sum(
        m.payload for sends, recvs in plans for _p, _a, m, _v, buf in sends + recvs if buf is not None
    )
    writes, local_writes = bind_writes(work, transfers, plans, verify)
    regions_due, region_items = bind_regions(views, plans)
    amax_views = [
        (g, sub_view(src_tensors[loc], lo, (0,) * len(sz), sz)) for g, loc, lo, sz in work.amax_sources
    ]
    global_out = [
        (
            g,
            sub_view(dst_tensors[loc], lo, (0,), (1,)),
            (loc, name, (0,), start_of(dst_tensors[loc], lo, (0,), (1,))),
        )
        for g, name, loc, lo in work.global_dst
    ]
    quant = BoundQuant(
        qpacks,
        stage_unpacks,
        local_q,
        local_q_meta,
        local_stage,
        regions_due,
        region_items,
        globals_,
        amax_views,
        global_out,
    )
    return Bound(
        local,
        local_meta,
        packs,
        unpacks,
        unpack_meta if verify else None,
        wire,
        need_s * n_slots,
        need_r * n_slots,
        in_place_bytes,
        writes,
        local_writes,
        quant,
        send_msgs,
        recv_msgs,
        send_srcs,
        send_q,
        recv_q,
    )
