"""Plan validation over the objects, a reference the tests compare the package against (not part of the
package): the transfer-by-transfer check of a whole plan (``validate_plan``) and of one rank's share
(``validate_share``), with the error texts the package raises. The package runs the same checks on the
transfers' columns (``plan/validate.py``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from operator import add, le, sub

from triton_reshard.box import boxes_meet, find_overlap
from triton_reshard.layout import Fragment, dtype_name, gc_paused
from triton_reshard.plan.index import rank_fragments
from triton_reshard.plan.quant import (
    QUANT_DST,
    QUANT_SRC,
    logical_target,
    plan_targets,
    quant_regions,
    scale_sizes,
    whole_blocks,
)
from triton_reshard.plan.types import PlanLike, Transfer
from triton_reshard.plan.validate import cover_dst, quant_scales


def reading_fragment(frags: Sequence[Fragment], off, size, local_off) -> Fragment | None:
    """The first of ``frags`` containing box ``off``+``size`` at ``local_off`` of its local tensor, or None.

    (``f.local_box(off, size)[0] == local_off``, inlined: it runs twice per transfer.)
    """
    for f in frags:
        fo = f.offsets
        if off == fo and size == f.sizes:  # the whole fragment (the common case)
            if local_off == f.local_offsets:
                return f
            continue
        lo = f.local_offsets
        extra = len(lo) - len(fo)
        if (
            len(off) == len(fo) == len(size)
            and all(map(le, fo, off))
            and all(map(le, map(add, off, size), map(add, fo, f.sizes)))
            and local_off[:extra] == lo[:extra]
            and local_off[extra:] == tuple(map(add, lo[extra:], map(sub, off, fo)))
        ):
            return f
    return None


def validate_plan(plan: PlanLike) -> None:
    """The weights' check, then, for block-quantized destinations, ``validate_quant``."""
    _weights(plan)
    if plan.dst.quantized:
        validate_quant(plan)


def _weights(plan: PlanLike) -> None:
    """Exact cover of every destination fragment; every transfer reads what its source rank holds; every relay
    reads a box its rank received from non-relay transfers or local copies.

    Linear in the transfers: per transfer, the fragments of its (tensor, rank, local tensor) on each side
    (usually one). A transfer writes inside one destination fragment (the fragments of a local tensor are
    disjoint), so the cover is checked per fragment: usually one transfer of the fragment's size. A relay reads
    inside one destination fragment of its sender; once the cover is exact, the box it reads was written
    entirely by non-relays exactly when no relay writes into that box, so only the (rare) fragments that are
    both read and written by relays are compared.
    """
    src, dst = plan.src, cover_dst(plan)
    s_index, d_index = src.fragments_by_local, dst.fragments_by_local
    written: dict[int, list[Transfer]] = {}  # id(destination fragment) -> the transfers writing into it
    relay_reads: list[tuple[Fragment, Transfer]] = []  # (the sender's destination fragment, the relay)
    relay_written: dict[int, list[Transfer]] = {}  # id(destination fragment) -> the relays writing into it
    with gc_paused():
        for t in plan.transfers + plan.local_copies:
            off, size = t.offsets, t.sizes
            if t.relay:
                if t.src_rank == t.dst_rank:
                    raise ValueError(f"plan: relay {t} of tensor {t.tensor!r} stays on rank {t.src_rank} "
                                     f"(a relay is a wire transfer from another rank's destination tensor)")
                sf = reading_fragment(d_index.get((t.tensor, t.src_rank, t.src_local), ()), off, size, t.src_offsets)
                if sf is None:
                    raise ValueError(
                        f"plan: relay {t} reads a box of tensor {t.tensor!r} outside the destination fragments of "
                        f"rank {t.src_rank} (a relay sends what its rank received; it reads the destination layout)"
                    )
                if 0 not in size:
                    relay_reads.append((sf, t))
            elif reading_fragment(s_index.get((t.tensor, t.src_rank, t.src_local), ()), off, size, t.src_offsets) is None:
                raise ValueError(f"plan: transfer {t} reads a box source rank {t.src_rank} does not hold")
            df = reading_fragment(d_index.get((t.tensor, t.dst_rank, t.dst_local), ()), off, size, t.dst_offsets)
            if df is None:
                raise ValueError(f"plan: transfer {t} writes outside the destination fragments of rank {t.dst_rank}")
            if 0 not in size:
                ts = written.get(id(df))
                if ts is None:
                    written[id(df)] = [t]
                else:
                    ts.append(t)
                if t.relay:
                    relay_written.setdefault(id(df), []).append(t)
        scales = quant_scales(plan)  # scale tensors of quantized destinations: checked by validate_quant
        for f in dst.fragments:
            ts = written.get(id(f))
            if ts is None:
                exact = 0 in f.sizes or f.tensor in scales
            elif len(ts) == 1:
                exact = ts[0].sizes == f.sizes
            else:
                exact = (
                    sum(t.numel for t in ts) == f.numel
                    and find_overlap([(t.offsets, t.sizes, t) for t in ts]) is None
                )
            if not exact:
                _check_cover(plan)  # raises, naming the local tensor
                raise ValueError(f"plan: destination fragment {f} is not covered exactly once")
        if relay_written:
            plain: dict[int, set] = {}  # id(fragment) -> the boxes non-relays write into it (when relays do too)
            for sf, t in relay_reads:
                ws = relay_written.get(id(sf))
                if not ws:
                    continue
                boxes = plain.get(id(sf))
                if boxes is None:
                    boxes = plain[id(sf)] = {(w.offsets, w.sizes) for w in written[id(sf)] if not w.relay}
                if (t.offsets, t.sizes) in boxes:  # exactly what one non-relay wrote: the cover is exact, so no
                    continue  # relay writes into it (the common case: a rank relays the part it received)
                for w in ws:
                    if boxes_meet(w.offsets, w.sizes, t.offsets, t.sizes):
                        raise ValueError(
                            f"plan: relay {t} of tensor {t.tensor!r} reads on rank {t.src_rank} a box that rank "
                            f"itself gets by relay from rank {w.src_rank} ({w}); a relay may only read boxes "
                            f"written by non-relay transfers or local copies (no relay chains)"
                        )


def _check_cover(plan: PlanLike) -> None:
    """Per destination local tensor: no element written twice, every element of its fragments written."""
    covered: dict[tuple[int, str], list] = defaultdict(list)
    for t in plan.transfers + plan.local_copies:
        if t.numel:
            df = reading_fragment(cover_dst(plan).fragments_by_local.get((t.tensor, t.dst_rank, t.dst_local), ()), t.offsets,
                        t.sizes, t.dst_offsets)
            covered[(t.dst_rank, t.dst_local)].append(df.local_box(t.offsets, t.sizes) + (t,))
    for (rank, local), boxes in covered.items():
        hit = find_overlap(boxes)
        if hit is not None:
            raise ValueError(
                f"plan: tensor {hit[0].tensor!r} on destination rank {rank} ({local!r}) is written twice: "
                f"{hit[0]} and {hit[1]}"
            )
    need: dict[tuple[int, str], int] = defaultdict(int)
    scales = quant_scales(plan)
    for f in cover_dst(plan).fragments:
        if f.tensor not in scales:
            need[(f.rank, f.local)] += f.numel
    got = {k: sum(math.prod(b[1]) for b in v) for k, v in covered.items()}
    for key, n in need.items():
        if got.get(key, 0) != n:
            raise ValueError(
                f"plan: destination local tensor {key[1]!r} on rank {key[0]} gets {got.get(key, 0)} of its "
                f"{n} elements"
            )


def validate_share(p: PlanLike) -> None:
    """The cheap self-check of one rank's share of a plan (``Plan(..., rank=r)``): every transfer has rank ``r``
    at one end; what it sends lies inside its own source fragments (relays: its destination fragments); what it
    receives lies inside its own destination fragments and covers each of them exactly once. (Whether a relay
    this rank receives reads a box its sender got from a non-relay is the sender's check; the whole plan checks
    everything at once.)"""
    r = p.rank
    mine_s: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
    mine_d: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
    for f in rank_fragments(p.src, r):
        mine_s[(f.tensor, f.local)].append(f)
    dfrags = rank_fragments(cover_dst(p), r)
    for f in dfrags:
        mine_d[(f.tensor, f.local)].append(f)
    written: dict[int, list[Transfer]] = {}
    with gc_paused():
        for t in p.transfers + p.local_copies:
            if t.src_rank != r and t.dst_rank != r:
                raise ValueError(f"share of rank {r}: transfer {t} does not involve rank {r}")
            if t.src_rank == r:
                frs = (mine_d if t.relay else mine_s).get((t.tensor, t.src_local), ())
                if reading_fragment(frs, t.offsets, t.sizes, t.src_offsets) is None:
                    side = "destination" if t.relay else "source"
                    raise ValueError(f"share of rank {r}: transfer {t} reads a box outside rank {r}'s {side} "
                                     f"fragments of tensor {t.tensor!r}")
            if t.dst_rank == r:
                df = reading_fragment(mine_d.get((t.tensor, t.dst_local), ()), t.offsets, t.sizes, t.dst_offsets)
                if df is None:
                    raise ValueError(f"share of rank {r}: transfer {t} writes outside rank {r}'s destination "
                                     f"fragments of tensor {t.tensor!r}")
                if 0 not in t.sizes:
                    written.setdefault(id(df), []).append(t)
        for t in p.local_copies:
            if t.src_rank != r or t.dst_rank != r:
                raise ValueError(f"share of rank {r}: local copy {t} is not on rank {r}")
        scales = quant_scales(p)  # block-quantized destinations: their scales are checked by validate_quant
        for f in dfrags:
            ts = written.get(id(f))
            if ts is None:
                exact = f.tensor in scales
            elif len(ts) == 1:
                exact = ts[0].sizes == f.sizes
            else:
                exact = (sum(t.numel for t in ts) == f.numel
                         and find_overlap([(t.offsets, t.sizes, t) for t in ts]) is None)
            if not exact:
                raise ValueError(f"share of rank {r}: destination fragment {f} (tensor {f.tensor!r}) is not "
                                 f"covered exactly once by its receives and local copies")
    if scales:
        validate_quant(p, ranks=(r,))


def validate_quant(plan: PlanLike, ranks: Sequence[int] | None = None) -> None:
    """The quantized part of a plan: ``src`` transfers block-aligned in fp8, ``dst`` transfers in their source
    dtype inside their regions, no relays, and every scale fragment written exactly once (by the ``src``
    transfers and the regions). The weights' own exact cover is ``validate_plan``'s. ``ranks``: check the
    scale cover of these destination ranks only (a rank plan: its own), default all."""
    src, dst = plan.src, plan.dst
    quantized = {n: logical_target(s) for n, s in dst.quantized.items()}
    written: dict[tuple[int, str], list] = defaultdict(list)  # (rank, scale local) -> [(local off, sizes, what)]
    for t in plan.transfers + plan.local_copies:
        spec = quantized.get(t.tensor)
        if spec is None or (src.specs.get(t.tensor) is not None and src.specs[t.tensor].quant is not None):
            if t.quant:
                raise ValueError(f"plan: transfer {t} is quantized ({t.quant!r}) but its tensor is not quantized")
            continue
        if (t.relay or t.quant not in (QUANT_SRC, QUANT_DST) or t.block != spec.quant.block
                or t.fmt is not spec.quant.format):
            raise ValueError(f"plan: transfer {t} of block-quantized tensor {t.tensor!r} is not a quantized transfer "
                             f"(quant={t.quant!r}, block {t.block}, relay={t.relay})")
        if t.quant == QUANT_SRC:
            if (t.wire_dtype != spec.quant.format.value_dtype
                    or whole_blocks(t.offsets, t.sizes, t.block, spec.shape) != (t.offsets, t.sizes)):
                raise ValueError(f"plan: source-quantized transfer {t} is not whole blocks in "
                                 f"{dtype_name(spec.quant.format.value_dtype)}")
            written[(t.dst_rank, t.scale_local)].append((t.scale_offsets, _lead(t.scale_offsets, scale_sizes(t.sizes, t.block)), t))
        elif t.wire_dtype != src.specs[t.tensor].dtype:
            raise ValueError(f"plan: destination-quantized transfer {t} does not travel in the source dtype")
    keep = None if ranks is None else set(ranks)
    for rank, regions in quant_regions(plan).items():
        if keep is not None and rank not in keep:
            continue
        for g in regions:
            if whole_blocks(g.offsets, g.sizes, g.block, quantized[g.tensor].shape) != (g.offsets, g.sizes):
                raise ValueError(f"plan: quantization region {g.offsets}+{g.sizes} of {g.tensor!r} on rank {rank} is not "
                                 f"block-aligned")
            written[(rank, g.scale_local)].append((g.scale_offsets, _lead(g.scale_offsets, g.scale_sizes), g))
    need: dict[tuple[int, str], int] = defaultdict(int)
    for name, spec in quantized.items():
        if name not in plan_targets(plan):
            continue
        for f in dst.fragments_by_tensor.get(spec.quant.scale, ()):
            if keep is None or f.rank in keep:
                need[(f.rank, f.local)] += f.numel
    if keep is not None:
        written = {k: v for k, v in written.items() if k[0] in keep}
    for key in set(need) | set(written):
        boxes = written.get(key, [])
        got = sum(math.prod(s) for _o, s, _w in boxes)
        hit = find_overlap(boxes) if len(boxes) > 1 else None
        if hit is not None:
            raise ValueError(f"plan: scale local tensor {key[1]!r} on rank {key[0]} is written twice: {hit[0]} and "
                             f"{hit[1]}")
        if got != need.get(key, 0):
            raise ValueError(f"plan: scale local tensor {key[1]!r} on rank {key[0]} gets {got} of its "
                             f"{need.get(key, 0)} scales")


def _lead(local_offsets, sizes) -> tuple[int, ...]:
    """``sizes`` in the local tensor's dims (extra leading dims of size 1)."""
    return (1,) * (len(local_offsets) - len(sizes)) + tuple(sizes)
