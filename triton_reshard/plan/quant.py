"""Block-quantized destinations (block FP8): the planner's post-pass over the routed transfers.

A destination tensor with a :class:`~triton_reshard.layout.BlockQuant` whose source is a plain (e.g. BF16)
tensor is routed like any other tensor, in its source dtype (``routing_view``): routing knows nothing of
quantization. Then ``quantize_transfers`` cuts every routed piece on the block grid of the logical tensor:

* the blocks wholly inside the piece (its aligned inner box) become one ``Transfer(quant="src")``: the
  sender, which holds every element of those blocks, quantizes them while packing (the wire carries fp8
  values plus one fp32 scale per block: about half the BF16 bytes); a local one quantizes straight into the
  destination and its scale tensor;
* the rest of the piece lies in blocks the piece only partly covers (the block straddles source fragments,
  e.g. a source TP split of 24 rows under blocks of 16): ``Transfer(quant="dst")``, in the source dtype; the
  receiver stages these blocks (``QuantRegion``: disjoint block-aligned boxes) and quantizes each region once
  every piece of it is in.

A block's quantization depends only on its own values, so both paths write identical bytes. The scale
tensors are never routed: their fragments are written by the ``src`` transfers (the scales of their blocks,
``Transfer.scale_local`` / ``scale_offsets``) and by the regions; ``validate.validate_quant`` checks that cover.
Relays of quantized tensors are refused (plan with ``relay=False``). A source that is block-quantized the same
way needs no post-pass (fp8 values and scales are copied as plain tensors); a different quantization is refused.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..box import (
    Box,
    align_up,
    intersect_boxes,
    split_box,
    subtract_box,
    union_boxes,
    union_numel,
)
from ..layout import (
    FP8_BLOCK,
    Fragment,
    Layout,
    LocalSpec,
    QuantFormat,
    TensorSpec,
    block_scale_box,
    dtype_name,
    gc_paused,
)
from .types import PlanLike, Transfer

QUANT_SRC = "src"  # the sender quantizes (fp8 + scales on the wire)
QUANT_DST = "dst"  # the receiver stages the source dtype and quantizes whole regions
SCALE_BYTES = 4  # one float32 scale per block (block FP8; other formats: ``QuantFormat.scale_bytes``)



def num_blocks(sizes: Sequence[int], block: Sequence[int]) -> int:
    """Blocks of a block-aligned box of ``sizes`` (a partial last block counts)."""
    return math.prod(-(-s // b) for s, b in zip(sizes, block, strict=True))


def scale_sizes(sizes: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    return tuple(-(-s // b) for s, b in zip(sizes, block, strict=True))


@dataclass(frozen=True, slots=True)
class LogicalQuant:
    """A :class:`~triton_reshard.layout.BlockQuant` in logical (unpacked) elements: ``block`` is the logical block
    (NVFP4: 16 along the last dim where the layout stores 8 bytes)."""

    block: tuple[int, ...]
    scale: str
    ue8m0: bool
    format: object
    global_scale: str
    global_group: str


@dataclass(frozen=True, slots=True)
class QTarget:
    """A destination tensor the plan quantizes, as routing and the block grid see it: its logical shape (the
    source's), its logical block, and its format (``quant``). For an unpacked format these are the layout's."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant: LogicalQuant

    @property
    def pack(self) -> int:
        return self.quant.format.pack


def logical_target(spec: TensorSpec) -> QTarget:
    q = spec.quant
    p = q.format.pack
    shape = spec.shape if p == 1 else spec.shape[:-1] + (spec.shape[-1] * p,)
    return QTarget(spec.name, shape, spec.dtype,
                   LogicalQuant(q.logical_block, q.scale, q.ue8m0, q.format, q.global_scale, q.global_group))


def unpack_fragment(f: Fragment, pack: int) -> Fragment:
    """A stored fragment of a packed tensor in logical elements (its last dims times ``pack``)."""
    if pack == 1:
        return f
    m = lambda b: b[:-1] + (b[-1] * pack,) if b else b  # noqa: E731
    return Fragment(f.tensor, f.rank, m(f.offsets), m(f.sizes), f.local, m(f.local_offsets))


# --------------------------------------------------------------------------------------------------------
# Which tensors, and the layout routing sees
# --------------------------------------------------------------------------------------------------------


def quant_targets(src: Layout, dst: Layout) -> dict[str, QTarget]:
    """Destination tensors this plan quantizes: block-quantized in ``dst``, plain floating point in ``src``.

    A tensor the source holds quantized the same way (block, scale name, ue8m0) is copied as it is (its scale
    tensor is a plain tensor on both sides); a different quantization raises ``ValueError``."""
    out: dict[str, TensorSpec] = {}
    for name, spec in dst.quantized.items():
        s = src.specs.get(name)
        if s is None:
            continue  # the spec check names the missing source tensor
        if s.quant is not None:
            if s.quant != spec.quant:
                raise ValueError(f"tensor {name!r}: the source is block-quantized with {s.quant}, the destination with "
                                 f"{spec.quant}: re-quantization is not supported")
            continue
        if not s.dtype.is_floating_point or s.dtype.itemsize < 2:
            raise ValueError(f"tensor {name!r}: a block-quantized destination needs a float16/bfloat16/float32 "
                             f"source, got {dtype_name(s.dtype)}")
        tg = logical_target(spec)
        if s.shape != tg.shape:
            raise ValueError(f"tensor {name!r}: source global shape {s.shape} != destination global shape {tg.shape}"
                             + (f" ({spec.shape} stored, {tg.pack} values a byte)" if tg.pack > 1 else ""))
        out[name] = tg
    return out


def routing_view(src: Layout, dst: Layout, targets: dict[str, TensorSpec]) -> Layout:
    """``dst`` as routing sees it: every target tensor a plain tensor in its source dtype (its local tensors
    too), the scale tensors of the targets (and the local tensors holding them) left out."""
    scales = {targets[n].quant.scale for n in targets} | {targets[n].quant.global_scale for n in targets
                                                            if targets[n].quant.global_scale}
    specs = [TensorSpec(t.name, targets[t.name].shape, src.specs[t.name].dtype) if t.name in targets else t
             for t in dst.tensors if t.name not in scales]
    holds: dict[tuple[int, str], set[str]] = defaultdict(set)
    for f in dst.fragments:
        holds[(f.rank, f.local)].add(f.tensor)
    locs = []
    for s in dst.locals:
        names = holds.get((s.rank, s.name), set())
        if names & scales:
            if names - scales:
                raise ValueError(f"local tensor {s.name!r} on rank {s.rank} holds scale tensor "
                                 f"{sorted(names & scales)[0]!r} and tensor {sorted(names - scales)[0]!r}: scales need "
                                 f"local tensors of their own")
            continue
        q = names & targets.keys()
        if q:
            dtypes = {src.specs[n].dtype for n in q}
            packs = {targets[n].pack for n in q}
            if names - q or len(dtypes) > 1 or len(packs) > 1:
                raise ValueError(f"local tensor {s.name!r} on rank {s.rank} holds quantized tensor {sorted(q)[0]!r} "
                                 f"with tensors of other source dtypes or quantization")
            p = packs.pop()
            s = LocalSpec(s.rank, s.name, s.shape if p == 1 else s.shape[:-1] + (s.shape[-1] * p,), dtypes.pop())
        locs.append(s)
    frags = tuple(unpack_fragment(f, targets[f.tensor].pack) if f.tensor in targets else f
                  for f in dst.fragments if f.tensor not in scales)
    with gc_paused():
        return Layout(tuple(specs), frags, tuple(locs))


# --------------------------------------------------------------------------------------------------------
# Geometry on the block grid
# --------------------------------------------------------------------------------------------------------


def whole_blocks(off, size, block, shape) -> Box | None:
    """The whole blocks of box ``off``+``size``: the largest block-aligned box inside it (an end at the tensor's
    end counts as aligned), or None."""
    lo, sz = [], []
    for o, n, b, g in zip(off, size, block, shape, strict=True):
        a = -(-o // b) * b
        e = o + n if o + n == g else (o + n) // b * b
        if e <= a:
            return None
        lo.append(a)
        sz.append(e - a)
    return tuple(lo), tuple(sz)


def _expand(off, size, block, shape) -> Box:
    """The blocks box ``off``+``size`` touches (clipped to the tensor)."""
    lo = tuple(o // b * b for o, b in zip(off, block, strict=True))
    hi = tuple(min(-(-(o + n) // b) * b, g) for o, n, b, g in zip(off, size, block, shape, strict=True))
    return lo, tuple(h - a for h, a in zip(hi, lo, strict=True))


# --------------------------------------------------------------------------------------------------------
# The post-pass
# --------------------------------------------------------------------------------------------------------


def _dst_fragment(dst: Layout, t: Transfer, pack: int = 1) -> Fragment:
    """The destination fragment transfer ``t`` writes into (the one whose box and local place contain it), in
    logical elements."""
    for f in dst.fragments_by_local.get((t.tensor, t.dst_rank, t.dst_local), ()):
        f = unpack_fragment(f, pack)
        if f.local_box(t.offsets, t.sizes)[0] == t.dst_offsets and all(
                fo <= o and o + n <= fo + fn for o, n, fo, fn in zip(t.offsets, t.sizes, f.offsets, f.sizes, strict=True)):
            return f
    raise ValueError(f"plan: transfer {t} writes outside the destination fragments of rank {t.dst_rank}")


class _ScaleIndex:
    """Per quantized tensor: the scale fragment that goes with each weight fragment."""

    def __init__(self, dst: Layout, targets: dict[str, TensorSpec]) -> None:
        self.dst = dst
        self.by_key: dict[str, dict[tuple, Fragment]] = {}
        for name, spec in targets.items():
            self.by_key[name] = {(f.rank, f.offsets, f.sizes, f.local_offsets): f
                                 for f in dst.fragments_by_tensor.get(spec.quant.scale, ())}

    def of(self, df: Fragment, block) -> Fragment:
        off, sizes, lo = block_scale_box(df, block)
        return self.by_key[df.tensor][(df.rank, off, sizes, lo)]


def _scale_place(df: Fragment, sf: Fragment, off, block) -> tuple[int, ...]:
    """Local offsets in scale fragment ``sf`` of the block starting at logical ``off`` of weight fragment ``df``."""
    extra = len(sf.local_offsets) - len(block)
    return sf.local_offsets[:extra] + tuple(
        lo + (o - fo) // b for lo, o, fo, b in zip(sf.local_offsets[extra:], off, df.offsets, block, strict=True))


def _sub(t: Transfer, off, size, wire: torch.dtype, mode: str, block, scale_local: str, scale_offsets,
         fmt: QuantFormat) -> Transfer:
    """Sub-box ``off``+``size`` (logical) of ``t`` as a quantized transfer."""
    def shift(start):
        extra = len(start) - len(off)
        return start[:extra] + tuple(s + o - to for s, o, to in zip(start[extra:], off, t.offsets, strict=True))

    return Transfer(t.tensor, tuple(off), tuple(size), t.src_rank, t.src_local, shift(t.src_offsets), t.dst_rank,
                    t.dst_local, shift(t.dst_offsets), wire, t.relay, mode, tuple(block), scale_local,
                    tuple(scale_offsets), fmt)


def quantize_transfers(src: Layout, dst: Layout, targets: dict[str, TensorSpec], local: Sequence[Transfer],
                       wire: Sequence[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
    """The routed ``local`` copies and ``wire`` transfers with every transfer of a target tensor cut on its
    block grid into a ``src`` transfer (its whole blocks) and ``dst`` transfers (the rest, one per region
    they fall in); other transfers unchanged. Raises ``ValueError`` for a relay of a target tensor."""
    if not targets:
        return list(local), list(wire)
    scales = _ScaleIndex(dst, targets)
    out = ([], [])
    pending: dict[tuple, tuple[Fragment, list]] = {}  # dst fragment key -> (fragment, [(kind, t, box)])
    for kind, ts in enumerate((local, wire)):
        for t in ts:
            spec = targets.get(t.tensor)
            if spec is None:
                out[kind].append(t)
                continue
            if t.relay:
                raise ValueError(
                    f"tensor {t.tensor!r} is block-quantized on destination rank {t.dst_rank}: relays of quantized "
                    f"tensors are not supported; plan with relay=False (refit(..., relay=False))")
            if not t.numel:
                continue
            block, shape = spec.quant.block, spec.shape
            df = _dst_fragment(dst, t, spec.pack)
            sf = scales.of(df, block)
            inner = whole_blocks(t.offsets, t.sizes, block, shape)
            fmt = spec.quant.format
            if inner is not None:
                out[kind].append(_sub(t, inner[0], inner[1], fmt.value_dtype, QUANT_SRC, block, sf.local,
                                      _scale_place(df, sf, inner[0], block), fmt))
            rest = subtract_box(t.offsets, t.sizes, inner)
            if rest:
                entry = pending.setdefault((df.rank, df.tensor, df.local, df.offsets, df.local_offsets), (df, []))
                entry[1].extend((kind, t, r) for r in rest)
    for df, parts in pending.values():
        spec = targets[df.tensor]
        block, shape = spec.quant.block, spec.shape
        sf = scales.of(df, block)
        regions = union_boxes([_expand(o, s, block, shape) for _k, _t, (o, s) in parts])
        for kind, t, box in parts:
            for reg in regions:
                hit = intersect_boxes(box, reg)
                if hit is not None:
                    out[kind].append(_sub(t, hit[0], hit[1], t.wire_dtype, QUANT_DST, block, sf.local,
                                          _scale_place(df, sf, reg[0], block), spec.quant.format))
    order = (lambda t: (t.dst_rank, t.tensor, t.offsets, t.dst_local),
             lambda t: (t.src_rank, t.dst_rank, t.tensor, t.offsets))
    return sorted(out[0], key=order[0]), sorted(out[1], key=order[1])


# --------------------------------------------------------------------------------------------------------
# Regions (what a destination rank stages and quantizes itself)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuantRegion:
    """A block-aligned box of quantized tensor ``tensor`` that destination rank ``rank`` receives in the source
    dtype (``dtype``) by ``dst`` transfers (``wire``: indices into ``Plan.transfers``; ``local``: into
    ``Plan.local_copies``), stages, and quantizes once all of them are in: fp8 values into ``dst_local`` at
    ``dst_offsets``, scales into ``scale_local`` at ``scale_offsets``; ``fmt``: the format."""

    tensor: str
    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dst_local: str
    dst_offsets: tuple[int, ...]
    scale_tensor: str
    scale_local: str
    scale_offsets: tuple[int, ...]
    block: tuple[int, ...]
    ue8m0: bool
    dtype: torch.dtype
    wire: tuple[int, ...]
    local: tuple[int, ...]
    fmt: QuantFormat = FP8_BLOCK

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def scale_sizes(self) -> tuple[int, ...]:
        return scale_sizes(self.sizes, self.block)


def quant_regions(plan: PlanLike) -> dict[int, tuple[QuantRegion, ...]]:
    """Per destination rank, the regions its ``dst`` transfers fill (kept by the plan; derived from the
    transfers alone, so every rank computes the same)."""
    return plan.memo("quant_regions", lambda: _quant_regions(plan))


def _quant_regions(plan: PlanLike) -> dict[int, tuple[QuantRegion, ...]]:
    dst = plan.dst
    targets = plan_targets(plan)
    groups: dict[tuple, tuple[Fragment, list]] = {}
    for kind, ts in enumerate((plan.local_copies, plan.transfers)):
        for i, t in enumerate(ts):
            if t.quant == QUANT_DST:
                df = _dst_fragment(dst, t, targets[t.tensor].pack)
                groups.setdefault((df.rank, df.tensor, df.local, df.offsets, df.local_offsets), (df, []))[1].append((kind, i, t))
    out: dict[int, list[QuantRegion]] = defaultdict(list)
    for df, items in groups.values():
        spec = targets[df.tensor]
        block, shape = spec.quant.block, spec.shape
        regions = union_boxes([_expand(t.offsets, t.sizes, block, shape) for _k, _i, t in items])
        for reg in regions:
            mine = [(k, i, t) for k, i, t in items if intersect_boxes((t.offsets, t.sizes), reg) is not None]
            t0 = mine[0][2]
            scale_off = t0.scale_offsets  # quantize_transfers placed it at its region's first block
            for _k, _i, t in mine:
                if t.scale_offsets != scale_off or t.scale_local != t0.scale_local or t.wire_dtype != t0.wire_dtype:
                    raise ValueError(f"plan: destination-quantized transfers {t0} and {t} of one region of "
                                     f"{df.tensor!r} on rank {df.rank} disagree on its scales or dtype")
            out[df.rank].append(QuantRegion(
                df.tensor, df.rank, reg[0], reg[1], df.local, df.local_box(reg[0], reg[1])[0], spec.quant.scale,
                t0.scale_local, scale_off, block, spec.quant.ue8m0, t0.wire_dtype,
                tuple(i for k, i, _t in mine if k == 1), tuple(i for k, i, _t in mine if k == 0),
                spec.quant.format))
    return {r: tuple(v) for r, v in sorted(out.items())}


# --------------------------------------------------------------------------------------------------------
# Checks and bounds
# --------------------------------------------------------------------------------------------------------


def plan_targets(plan: PlanLike) -> dict[str, TensorSpec]:
    return plan.memo("quant_targets", lambda: quant_targets(plan.src, plan.dst))


def scale_lower_bound(src: Layout, dst: Layout) -> int:
    """The scale bytes of the lower bound: per destination fragment of a quantized tensor (plain source), one
    float32 per block with an element its rank does not hold as source (those blocks cannot be quantized from
    what the rank holds alone: their scale, or all their values, must arrive)."""
    total = 0
    for name, spec in quant_targets(src, dst).items():
        block, shape = spec.quant.block, spec.shape
        sbytes = spec.quant.format.scale_bytes
        own: dict[int, dict[Box, None]] = {}
        for f in src.fragments_by_tensor.get(name, ()):
            if f.numel:
                own.setdefault(f.rank, {})[(f.offsets, f.sizes)] = None
        for df in dst.fragments_by_tensor.get(name, ()):
            if not df.numel:
                continue
            df = unpack_fragment(df, spec.pack)
            box = (df.offsets, df.sizes)
            held = [h for h in (intersect_boxes(b, box) for b in own.get(df.rank, ())) if h is not None]
            if not held:
                total += num_blocks(df.sizes, block) * sbytes
                continue
            if any(h == box for h in held):
                continue
            missing = _missing(box, held)
            grid = [_to_blocks(_expand(o, s, block, shape), block) for o, s in missing]
            total += union_numel(grid) * sbytes
    return total


def _to_blocks(box: Box, block) -> Box:
    return (tuple(o // b for o, b in zip(box[0], block, strict=True)),
            tuple(-(-(o + s) // b) - o // b for o, s, b in zip(box[0], box[1], block, strict=True)))


def _missing(box: Box, held: Sequence[Box]) -> list[Box]:
    """``box`` minus the union of ``held`` (boxes inside it), as disjoint boxes."""
    rest = [box]
    for h in held:
        nxt = []
        for r in rest:
            cut = intersect_boxes(r, h)
            nxt.extend([r] if cut is None else subtract_box(r[0], r[1], cut))
        rest = nxt
    return rest


def split_src_chunks(t: Transfer, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """A source-quantized transfer cut for the schedule, only at block multiples: ``[(offsets relative to the
    transfer, sizes, chunk bytes)]``, chunk bytes = the quantized values (padded to ``ALIGN``) + the scales,
    each at most ``cap`` unless one block alone is bigger (then one block per chunk)."""
    block = t.block
    fmt = t.fmt
    grid = scale_sizes(t.sizes, block)
    per_block = fmt.value_bytes(math.prod(block)) + fmt.scale_bytes + 16
    out = []
    for g_off, g_size in split_box(grid, per_block, cap):
        off = tuple(o * b for o, b in zip(g_off, block, strict=True))
        size = tuple(min(n * b, s - o) for n, b, s, o in zip(g_size, block, t.sizes, off, strict=True))
        n = math.prod(size)
        if n:
            out.append((off, size, align_up(fmt.value_bytes(n)) + num_blocks(size, block) * fmt.scale_bytes))
    return out
