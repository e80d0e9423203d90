"""Routing: which source rank sends each destination box (holder choice, node topology), from the
decomposition of destination boxes into pieces that the same source ranks hold; and the lower bound of the
wire bytes. Fan-out (relays) is in ``relay``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from itertools import compress
from operator import add, attrgetter, le, lt

import torch

from ..layout import Fragment, Layout, TensorSpec, dtype_name, find_overlap, gc_paused, itemsize_of
from .relay import choose_heads, group_fans, relay_dtype
from .types import Transfer, make_transfer

# --------------------------------------------------------------------------------------------------------
# Geometry helpers
# --------------------------------------------------------------------------------------------------------


def _intersect(a_off, a_size, b_off, b_size):
    off, size = [], []
    for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def _contains(outer_off, outer_size, off, size) -> bool:
    return all(map(le, outer_off, off)) and all(map(le, map(add, off, size), map(add, outer_off, outer_size)))


def boxes_meet(a_off, a_size, b_off, b_size) -> bool:
    """Whether two nonempty boxes share an element (``_intersect(...) is not None``, without building it)."""
    return all(map(lt, a_off, map(add, b_off, b_size))) and all(map(lt, b_off, map(add, a_off, a_size)))


def decompose_box(box_off, box_size, cands: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]):
    """Split ``box`` into sub-boxes, each labelled with the set (bitmask) of candidate boxes containing it.

    Cells of the grid made by all candidate boundaries are merged greedily into larger boxes with the same
    label. A label of 0 means no candidate holds that part.
    """
    nd = len(box_off)
    if nd == 0:
        mask = 0
        for i, _ in enumerate(cands):
            mask |= 1 << i
        return [((), (), mask)]
    cuts = []
    for d in range(nd):
        lo, hi = box_off[d], box_off[d] + box_size[d]
        pts = {lo, hi}
        for c_off, c_size in cands:
            for p in (c_off[d], c_off[d] + c_size[d]):
                if lo < p < hi:
                    pts.add(p)
        cuts.append(sorted(pts))
    shape = [len(c) - 1 for c in cuts]
    if math.prod(shape) == 1:
        mask = 0
        for i, (c_off, c_size) in enumerate(cands):
            if _contains(c_off, c_size, box_off, box_size):
                mask |= 1 << i
        return [(tuple(box_off), tuple(box_size), mask)]
    # label every cell
    import itertools

    labels: dict[tuple[int, ...], int] = {}
    for idx in itertools.product(*[range(n) for n in shape]):
        lo = tuple(cuts[d][i] for d, i in enumerate(idx))
        mask = 0
        for ci, (c_off, c_size) in enumerate(cands):
            if all(c_off[d] <= lo[d] < c_off[d] + c_size[d] for d in range(nd)):
                mask |= 1 << ci
        labels[idx] = mask
    done: set[tuple[int, ...]] = set()
    out = []
    for idx in itertools.product(*[range(n) for n in shape]):
        if idx in done:
            continue
        lab = labels[idx]
        hi = list(idx)
        # grow along each dim, last dim first, while every cell of the slab has the same label
        for d in reversed(range(nd)):
            while hi[d] + 1 < shape[d]:
                ranges = [range(idx[k], hi[k] + 1) if k != d else range(hi[d] + 1, hi[d] + 2) for k in range(nd)]
                slab = list(itertools.product(*ranges))
                if all(labels[c] == lab and c not in done for c in slab):
                    hi[d] += 1
                else:
                    break
        for c in itertools.product(*[range(idx[k], hi[k] + 1) for k in range(nd)]):
            done.add(c)
        off = tuple(cuts[d][idx[d]] for d in range(nd))
        size = tuple(cuts[d][hi[d] + 1] - cuts[d][idx[d]] for d in range(nd))
        out.append((off, size, lab))
    return out


def _distinct_boxes(frags: Iterable[Fragment]) -> dict[tuple, list[Fragment]]:
    out: dict[tuple, list[Fragment]] = {}
    for f in frags:
        if 0 not in f.sizes:
            key = (f.offsets, f.sizes)
            group = out.get(key)
            if group is None:
                out[key] = [f]
            else:
                group.append(f)
    return out


def cover_pieces(box_off, box_size, cands: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]):
    """``decompose_box``, with a fast path for the common case: every candidate contains the box (replicas of one
    shard, or a larger shard), so the box is one piece held by all of them."""
    for c_off, c_size in cands:
        if not _contains(c_off, c_size, box_off, box_size):
            return decompose_box(box_off, box_size, cands)
    return [(box_off, box_size, (1 << len(cands)) - 1)]


def held_numel(box_off, box_size, boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    """Elements of ``box`` inside the union of ``boxes`` (distinct boxes, each intersecting ``box``)."""
    parts = [_intersect(o, s, box_off, box_size) for o, s in boxes]
    if len(parts) == 1:
        return math.prod(parts[0][1])
    if len(parts) <= 16 and not any(
        boxes_meet(a[0], a[1], b[0], b[1]) for i, a in enumerate(parts) for b in parts[i + 1:]
    ):  # disjoint: the union is the sum
        return sum(math.prod(p[1]) for p in parts)
    return sum(math.prod(s) for _, s, mask in decompose_box(box_off, box_size, boxes) if mask)


def wire_dtype_of(src: TensorSpec, dst: TensorSpec) -> torch.dtype:
    return dst.dtype if itemsize_of(dst.dtype) < itemsize_of(src.dtype) else src.dtype


# --------------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------------


def check_gpus_per_node(gpus_per_node, where: str) -> None:
    if gpus_per_node is not None and (
        not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1
    ):
        raise ValueError(f"{where}: gpus_per_node={gpus_per_node!r} must be an int >= 1 or None")


def check_specs(src: Layout, dst: Layout, allow_cast: bool) -> None:
    for spec in dst.tensors:
        frags = dst.fragments_by_tensor.get(spec.name, ())
        where = f"rank {frags[0].rank}" if frags else "no rank"
        s = src.specs.get(spec.name)
        if s is None:
            if any(f.numel for f in frags):
                raise ValueError(
                    f"tensor {spec.name!r} (needed on destination {where}) is not in the source layout"
                )
            continue
        if s.shape != spec.shape:
            raise ValueError(
                f"tensor {spec.name!r}: source global shape {s.shape} != destination global shape {spec.shape} "
                f"(destination {where})"
            )
        if s.dtype != spec.dtype and not allow_cast:
            raise ValueError(
                f"tensor {spec.name!r}: source dtype {dtype_name(s.dtype)} != destination dtype "
                f"{dtype_name(spec.dtype)} (destination {where}); pass allow_cast=True to cast in the copy"
            )


def check_dst_overlap(name: str, frags: Sequence[Fragment]) -> None:
    by_rank: dict[int, list[Fragment]] = defaultdict(list)
    for f in frags:
        by_rank[f.rank].append(f)
    for rank, fs in by_rank.items():
        if len(fs) > 1:
            hit = find_overlap([(f.offsets, f.sizes, f) for f in fs])
            if hit is not None:
                a, b = hit
                raise ValueError(
                    f"overlapping destination boxes of tensor {name!r} on rank {rank}: {a.offsets}+{a.sizes} "
                    f"(local {a.local!r}) and {b.offsets}+{b.sizes} (local {b.local!r})"
                )


_RANK = attrgetter("rank")
_DST_ORDER = attrgetter("rank", "local")
WIRE_ORDER = attrgetter("src_rank", "dst_rank", "tensor", "offsets")
LOCAL_ORDER = attrgetter("dst_rank", "tensor", "offsets", "dst_local")


def check_relay_groups(relay_groups) -> dict[int, int]:
    """``plan_reshard``'s ``relay_groups`` checked: rank -> index of its group (groups of one rank left out)."""
    if relay_groups is None:
        return {}
    if not isinstance(relay_groups, tuple) or not all(isinstance(g, tuple) for g in relay_groups):
        raise TypeError(f"plan_reshard: relay_groups must be a tuple of tuples of ranks, got {relay_groups!r}")
    out: dict[int, int] = {}
    for i, g in enumerate(relay_groups):
        for r in g:
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise TypeError(f"plan_reshard: relay_groups: rank {r!r} of group {g} must be an int >= 0")
            if r in out:
                raise ValueError(f"plan_reshard: relay_groups: rank {r} is in two groups ({relay_groups[out[r]]} "
                                 f"and {g}); the groups must be disjoint")
            out[r] = i
        if len(g) < 2:
            for r in g:
                del out[r]
    return out


def holders_of(frag_lists: Iterable[Sequence[Fragment]]) -> tuple[dict[int, Fragment], tuple]:
    """Per rank, its first holder fragment (local copies read from it); and (holder ranks ascending, per rank
    the holder with the smallest local name, the first holder): what the choice of a sender needs."""
    first: dict[int, Fragment] = {}
    best: dict[int, Fragment] = {}
    for frs in frag_lists:
        for h in frs:
            b = best.get(h.rank)
            if b is None:
                first[h.rank] = best[h.rank] = h
            elif h.local < b.local:
                best[h.rank] = h
    return first, (tuple(sorted(best)), best, next(iter(first.values())))


def route_greedy(src: Layout, dst: Layout, gpus_per_node: int | None, relay: bool = False,
           groups: dict[int, int] | None = None) -> tuple[list[Transfer], list[Transfer]]:
    """The local copies and wire transfers (relays included) of ``plan_reshard``, sorted as the plan lists
    them. ``groups``: rank -> relay group (see ``check_relay_groups``)."""
    world = max(src.ranks + dst.ranks, default=0) + 1
    gpn = gpus_per_node
    local: list[Transfer] = []
    # remote pieces: (dst fragment, piece offsets, piece sizes, holders (see holders_of), wire dtype)
    remote: list[tuple[Fragment, tuple, tuple, tuple, torch.dtype]] = []
    nbytes: list[int] = []  # of each remote piece
    # fan-out groups (relay): (piece offsets, sizes, holders, wire dtype, relay dtype, bytes, {rank: [dst frags]})
    fans: list[tuple] = []
    src_by_tensor = src.fragments_by_tensor
    for spec in dst.tensors:
        dfrags = [f for f in dst.fragments_by_tensor.get(spec.name, ()) if 0 not in f.sizes]
        if not dfrags:
            continue
        if len(dfrags) > 1 and len(set(map(_RANK, dfrags))) < len(dfrags):
            check_dst_overlap(spec.name, dfrags)
        sspec = src.specs[spec.name]
        wdt = wire_dtype_of(sspec, spec)
        isz = itemsize_of(wdt)
        rdt = relay_dtype(sspec.dtype, spec.dtype, wdt) if relay else None
        sboxes = list(_distinct_boxes(src_by_tensor.get(spec.name, ())).items())
        summaries: dict[int, tuple] = {}  # source box -> holders_of of its fragments
        for (d_off, d_size), dgroup in _distinct_boxes(dfrags).items():
            cand = [i for i, (b, _) in enumerate(sboxes) if boxes_meet(b[0], b[1], d_off, d_size)]
            pieces = cover_pieces(d_off, d_size, [sboxes[i][0] for i in cand])
            routed = []
            for p_off, p_size, mask in pieces:
                if mask == 0:
                    raise ValueError(
                        f"tensor {spec.name!r}: element {p_off} (box {p_off}+{p_size}) needed on destination "
                        f"rank {dgroup[0].rank} is held by no source rank"
                    )
                if mask & (mask - 1) == 0:  # one source box holds the piece
                    i = cand[mask.bit_length() - 1]
                    h = summaries.get(i)
                    if h is None:
                        h = summaries[i] = holders_of((sboxes[i][1],))
                else:
                    h = holders_of([sboxes[i][1] for j, i in enumerate(cand) if mask >> j & 1])
                routed.append((p_off, p_size, h[0], h[1], math.prod(p_size) * isz))
            if rdt is not None and len(dgroup) > 1:
                group_fans(spec.name, sorted(dgroup, key=_DST_ORDER), routed, gpn, groups, wdt, rdt, local,
                            remote, nbytes, fans)
                continue
            for df in sorted(dgroup, key=_DST_ORDER) if len(dgroup) > 1 else dgroup:
                for p_off, p_size, first, holders, n in routed:
                    mine = first.get(df.rank)
                    if mine is not None:
                        local.append(make_transfer(spec.name, p_off, p_size, mine, df, wdt))
                    else:
                        remote.append((df, p_off, p_size, holders, wdt))
                        nbytes.append(n)
    # a relayed part is charged to its source holder as what it replaces (the part once per destination of
    # its group): holders are balanced as in the plan without relays, so relays take bytes off the network
    # without moving other pieces to farther holders
    weight = list(nbytes)
    relays = choose_heads(fans, remote, nbytes, gpn, world, weight) if fans else []
    # choose holders: fixed ones first, then largest first onto the least loaded holder
    load = [0] * world
    chosen: list[Fragment | None] = [None] * len(remote)
    flexible = []
    for i, (_df, _o, _s, (ranks, _best, first_holder), _w) in enumerate(remote):
        if len(ranks) == 1:
            chosen[i] = first_holder
            load[ranks[0]] += weight[i]
        else:
            flexible.append(i)
    flexible.sort(key=nbytes.__getitem__, reverse=True)  # largest first; stable: ties keep their order
    if gpn:  # a holder in the destination's node sends, unless that takes it past its fair share
        senders = {r for _df, _o, _s, (ranks, _b, _f), _w in remote for r in ranks}
        # relayed bytes count as if sent from a source: the threshold stays the one without relays, so relays
        # do not make the near holders refuse pieces they would send otherwise
        fair = -(-(sum(nbytes) + sum(t.nbytes for t in relays)) // max(1, len(senders)))
    for i in flexible:
        df, _o, _s, (ranks, best, _first), _w = remote[i]
        r = _least_loaded(ranks, load, df.rank)
        if gpn and r // gpn != df.rank // gpn:
            near = [h for h in ranks if h // gpn == df.rank // gpn]
            if near:
                rn = _least_loaded(near, load, df.rank)
                if load[rn] + weight[i] <= max(fair, load[r] + weight[i]):
                    r = rn
        chosen[i] = best[r]
        load[r] += weight[i]
    wire = [make_transfer(df.tensor, o, s, chosen[i], df, w) for i, (df, o, s, _h, w) in enumerate(remote)]
    wire += relays
    wire.sort(key=WIRE_ORDER)
    local.sort(key=LOCAL_ORDER)
    return local, wire


def _least_loaded(ranks: Sequence[int], load: list[int], dst_rank: int) -> int:
    """The rank of ``ranks`` (ascending) with the least ``load``; ties go to the first at or after ``dst_rank``
    in the cyclic order (the least ``(rank - dst_rank) % world``)."""
    loads = list(map(load.__getitem__, ranks))
    m = min(loads)
    if loads.count(m) == 1:
        return ranks[loads.index(m)]
    ties = list(compress(ranks, map(m.__eq__, loads)))
    k = bisect_left(ties, dst_rank)
    return ties[k] if k < len(ties) else ties[0]


def lower_bound_bytes(src: Layout, dst: Layout) -> int:
    """Least possible wire bytes: for each destination fragment, the bytes its rank does not hold as source.

    Computed from the layouts alone (independently of the transfers a plan chose).
    """
    total = 0
    with gc_paused():
        for spec in dst.tensors:
            sspec = src.specs.get(spec.name)
            if sspec is None:
                continue
            isz = itemsize_of(wire_dtype_of(sspec, spec))
            own: dict[int, dict[tuple, None]] = {}  # rank -> its distinct nonempty boxes, in layout order
            for f in src.fragments_by_tensor.get(spec.name, ()):
                if min(f.sizes, default=1) > 0:
                    own.setdefault(f.rank, {})[(f.offsets, f.sizes)] = None
            missing = 0
            for df in dst.fragments_by_tensor.get(spec.name, ()):
                mine = own.get(df.rank)
                n = df.numel
                if not n:
                    continue
                if mine:
                    boxes = [b for b in mine if boxes_meet(b[0], b[1], df.offsets, df.sizes)]
                    if boxes:
                        n -= held_numel(df.offsets, df.sizes, boxes)
                missing += n
            total += missing * isz
        if dst.quantized:  # block-quantized destinations: plus one fp32 scale per block with a missing element
            from .quant import scale_lower_bound

            total += scale_lower_bound(src, dst)
    return total
