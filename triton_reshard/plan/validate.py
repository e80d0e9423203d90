"""Self-validation of a plan: exact cover of every destination fragment, every transfer reads a box its
source rank holds, no relay chains."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from operator import add, le, sub

import numpy as np

from ..box import boxes_meet, find_overlap
from ..layout import Fragment, gc_paused
from .index import rank_fragments
from .quant import plan_targets, validate_quant
from .table import widen
from .types import PlanLike, Transfer


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
    """Exact cover of every destination fragment; every transfer reads what its source rank holds; every relay
    reads a box its rank received from non-relay transfers or local copies.

    Linear in the transfers: per transfer, the fragments of its (tensor, rank, local tensor) on each side
    (usually one). A transfer writes inside one destination fragment (the fragments of a local tensor are
    disjoint), so the cover is checked per fragment: usually one transfer of the fragment's size. A relay reads
    inside one destination fragment of its sender; once the cover is exact, the box it reads was written
    entirely by non-relays exactly when no relay writes into that box, so only the (rare) fragments that are
    both read and written by relays are compared.

    The check runs on the transfers' columns first (``table_valid``, vectorized); only a plan it does not pass is
    checked transfer by transfer, which names the problem.
    """
    if table_valid(plan):
        return
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


def cover_dst(plan: PlanLike):
    """The destination layout transfers are checked against: ``plan.dst``, or, when it holds packed quantized
    tensors (NVFP4: their layout is in stored bytes, the transfers in logical elements), the routing view of it
    (every quantized tensor in logical elements, the scales left out: ``validate_quant`` checks those)."""
    if not any(s.quant.format.pack > 1 for s in plan.dst.quantized.values()):
        return plan.dst
    from .quant import routing_view
    return plan.memo("cover_dst", lambda: routing_view(plan.src, plan.dst, plan_targets(plan)))


def quant_scales(plan: PlanLike) -> frozenset[str]:
    """The scale tensors the plan writes by quantizing (plan/quant.py), not by transfers (the global scales of
    formats that have them too: the executor writes them from the amax exchange)."""
    if not plan.dst.quantized:
        return frozenset()
    out = {spec.quant.scale for spec in plan_targets(plan).values()}
    return frozenset(out | {spec.quant.global_scale for spec in plan_targets(plan).values() if spec.quant.global_scale})


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


# --------------------------------------------------------------------------------------------------------
# The whole plan's check on the columns
# --------------------------------------------------------------------------------------------------------


LOCATE_CHUNK = 1 << 18  # rows located at once (``_Frags.locate``)


class _Frags:
    """One layout's fragments of some tensors (``Layout.tensor_rows``) sorted by (tensor, rank, local tensor),
    for locating the fragment that holds each transfer's box."""

    def __init__(self, layout, names: Sequence[str], world: int) -> None:
        tr = self.rows = layout.tensor_rows(list(names))
        self.group = {n: k for k, n in enumerate(tr.names)}
        self.lid = {n: i for i, n in enumerate(tr.local_names)}
        self.world, self.nl = world, max(len(tr.local_names), 1)
        n = len(tr)
        self.tensor_of = np.repeat(np.arange(len(tr.names), dtype=np.int64), np.diff(np.asarray(tr.starts)))
        self.ndim_of_group = np.asarray(tr.ndims, np.int64)
        key = (self.tensor_of * world + tr.ranks.astype(np.int64)) * self.nl + tr.local_ids.astype(np.int64)
        self.order = np.argsort(key, kind="stable") if n else np.zeros(0, np.int64)
        self.keys = key[self.order]
        self.loff, self.lnd = (np.asarray(a, np.int64) for a in tr.local_offset_columns)

    def locate(self, names: tuple, tcode: np.ndarray, rank: np.ndarray, locals_: tuple, lcode: np.ndarray, ndim,
               offsets, sizes, loffs, lnds) -> np.ndarray:
        """Per row, the fragment (row of ``rows``) of its tensor, rank and local tensor holding its box at its
        local offsets, -1 where none does (``reading_fragment``'s answer, on columns). Row by row independent:
        done in chunks of ``LOCATE_CHUNK`` rows, so its [rows, dims] temporaries stay small (at 1,024 ranks the
        whole wire table at once took ~0.9 GB of them, the plan's peak)."""
        m = len(tcode)
        if m > LOCATE_CHUNK:
            return np.concatenate([self.locate(names, tcode[a:a + LOCATE_CHUNK], rank[a:a + LOCATE_CHUNK], locals_,
                                               lcode[a:a + LOCATE_CHUNK], ndim[a:a + LOCATE_CHUNK],
                                               offsets[a:a + LOCATE_CHUNK], sizes[a:a + LOCATE_CHUNK],
                                               loffs[a:a + LOCATE_CHUNK], lnds[a:a + LOCATE_CHUNK])
                                   for a in range(0, m, LOCATE_CHUNK)])
        g = np.array([self.group.get(x, -1) for x in names] or [0], np.int64)[tcode]
        li = np.array([self.lid.get(x, -1) for x in locals_] or [0], np.int64)[lcode]
        out = np.full(m, -1, np.int64)
        ok = (g >= 0) & (li >= 0) & (rank >= 0) & (rank < self.world)
        key = (g * self.world + rank) * self.nl + li
        lo = np.searchsorted(self.keys, key, "left")
        hi = np.searchsorted(self.keys, key, "right")
        cand = np.flatnonzero(ok & (hi > lo))
        j = 0
        tr = self.rows
        D = max(offsets.shape[1], tr.offsets.shape[1])
        L = max(loffs.shape[1], self.loff.shape[1]) + D
        while len(cand):
            f = self.order[lo[cand] + j]
            nd = ndim[cand].astype(np.int64)
            fit = nd == self.ndim_of_group[self.tensor_of[f]]
            off, sz = widen(offsets[cand], D, 0), widen(sizes[cand], D, 1)
            fo, fs = widen(tr.offsets[f], D, 0), widen(tr.sizes[f], D, 1)
            dims = np.arange(D)[None, :] < nd[:, None]
            fit &= ~((dims & ((fo > off) | (off + sz > fo + fs))).any(axis=1))
            flnd = self.lnd[f]
            fit &= lnds[cand].astype(np.int64) == flnd
            extra = flnd - nd
            fit &= extra >= 0
            want = widen(self.loff[f], L, 0)
            rows = np.repeat(np.arange(len(cand)), D)
            cols = (np.maximum(extra, 0)[:, None] + np.arange(D)[None, :]).reshape(-1)
            delta = np.where(dims, off - fo, 0).reshape(-1)
            np.add.at(want, (rows, np.minimum(cols, L - 1)), delta)
            have = widen(loffs[cand], L, 0)
            width = np.arange(L)[None, :] < flnd[:, None]
            fit &= ~((width & (want != have)).any(axis=1))
            out[cand[fit]] = f[fit]
            j += 1
            cand = cand[~fit & (hi[cand] - lo[cand] > j)]
        return out


PAIR_CHUNK = 1 << 20  # pairs of boxes tested at once (4 [pairs, dims] int64 temporaries: ~100 MB at 3 dims)
BIG_GROUP = 64  # a fragment written by more transfers than this: ``find_overlap`` (a sweep) instead of all pairs


def _writes_disjoint(cnt: np.ndarray, tables, d_of) -> bool:
    """Whether the nonempty boxes each destination fragment written more than once gets (``cnt``: writes per
    fragment; ``d_of``: per table each row's fragment) share no element: every pair of a fragment's boxes
    tested on arrays, a fragment with many writes by ``find_overlap``."""
    fi, off, sz, nd = [], [], [], []
    D = max(tb.offsets.shape[1] for tb in tables)
    for tb, d in zip(tables, d_of, strict=True):
        sel = np.flatnonzero((cnt[d] > 1) & (tb.numel > 0))
        fi.append(d[sel])
        off.append(widen(tb.offsets[sel], D, 0))
        sz.append(widen(tb.sizes[sel], D, 1))
        nd.append(tb.ndim[sel])
    fi, off, sz, nd = (np.concatenate(x) for x in (fi, off, sz, nd))
    o = np.argsort(fi, kind="stable")
    fi, off, sz, nd = fi[o], off[o], sz[o], nd[o]
    end = off + sz
    starts = np.flatnonzero(np.concatenate(([True], fi[1:] != fi[:-1])))
    c = np.diff(np.concatenate((starts, [len(fi)])))
    big = c > BIG_GROUP
    for a, n in zip(starts[big].tolist(), c[big].tolist(), strict=True):
        k = int(nd[a])
        if find_overlap([(tuple(off[i, :k].tolist()), tuple(sz[i, :k].tolist()), None)
                         for i in range(a, a + n)]) is not None:
            return False
    # every pair (i, j), i < j, of the small groups: element i's partners are the rest of its group
    grp = np.repeat(np.arange(len(c)), c)
    small = ~big[grp]
    rest = (starts[grp] + c[grp] - 1 - np.arange(len(fi))) * small
    lo = 0
    while lo < len(fi):
        acc = np.cumsum(rest[lo:])
        hi = lo + max(1, int(np.searchsorted(acc, PAIR_CHUNK, side="right")))
        seg = np.repeat(np.arange(lo, hi), rest[lo:hi])
        first = np.concatenate(([0], np.cumsum(rest[lo:hi])[:-1]))
        j = seg + 1 + (np.arange(len(seg)) - first[seg - lo])
        if ((off[seg] < end[j]) & (off[j] < end[seg])).all(axis=1).any():
            return False
        lo = hi
    return True


def table_valid(plan: PlanLike) -> bool:
    """``validate_plan``'s checks on the transfers' columns (``TransferTable``): True when they pass; False when
    one might fail (the caller then runs ``validate_plan``, which names the problem, or passes in the rare case
    this check is stricter: a relay reading a box its rank got from several non-relays)."""
    src, dst = plan.src, cover_dst(plan)
    wire, local = plan.transfers, plan.local_copies
    if local.relay.any():
        return False
    world = max(max(src.ranks, default=0), max(dst.ranks, default=0),
                int(wire.src.max(initial=0)), int(wire.dst.max(initial=0)),
                int(local.dst.max(initial=0))) + 1
    dnames = [t.name for t in dst.tensors]
    dfr = _Frags(dst, dnames, world)
    snames = sorted(set(wire.names[i] for i in np.unique(wire.tensor[~wire.relay]).tolist())
                    | set(local.names[i] for i in np.unique(local.tensor).tolist()))
    if any(n not in src.specs for n in snames):
        return False
    sfr = _Frags(src, snames, world)
    d_of = []
    for tb in (wire, local):
        plain = ~tb.relay
        # the source side: the source layout's fragments (relays: the sender's destination fragments)
        for sel, fr in ((np.flatnonzero(plain), sfr), (np.flatnonzero(~plain), dfr)):
            if len(sel):
                # in chunks of rows: the selected columns' copies stay one chunk's size
                got = np.concatenate([
                    fr.locate(tb.names, tb.tensor[c], tb.src[c], tb.locals, tb.src_local[c], tb.ndim[c],
                              tb.offsets[c], tb.sizes[c], tb.src_offsets[c], tb.src_ndim[c])
                    for c in (sel[a:a + LOCATE_CHUNK] for a in range(0, len(sel), LOCATE_CHUNK))])
                if (got < 0).any():
                    return False
                if fr is dfr:
                    relay_src = got
        d = dfr.locate(tb.names, tb.tensor, tb.dst, tb.locals, tb.dst_local, tb.ndim, tb.offsets, tb.sizes,
                       tb.dst_offsets, tb.dst_ndim)
        if (d < 0).any():
            return False
        d_of.append(d)
    # the cover: per destination fragment, the elements its (nonempty) writes add up to, and no two overlapping
    nf = len(dfr.rows)
    fnumel = dfr.rows.sizes.astype(np.int64).prod(axis=1)
    cnt = np.zeros(nf, np.int64)
    got = np.zeros(nf, np.int64)
    for tb, d in zip((wire, local), d_of, strict=True):
        n = tb.numel
        nz = n > 0
        np.add.at(cnt, d[nz], 1)
        np.add.at(got, d[nz], n[nz])
    scales = quant_scales(plan)
    if scales:
        sk = [dfr.group[s] for s in scales if s in dfr.group]
        exempt = np.isin(dfr.tensor_of, np.array(sk, np.int64))
        fine = np.where(cnt == 0, (fnumel == 0) | exempt, got == fnumel)
    else:
        fine = np.where(cnt == 0, fnumel == 0, got == fnumel)
    if not fine.all():
        return False
    if (cnt > 1).any() and not _writes_disjoint(cnt, (wire, local), d_of):
        return False
    # relays read boxes their rank got from non-relays: when relays also write the fragment a relay reads, the box
    # it reads must be exactly one that a non-relay wrote (the planner's relays read the part their rank received)
    rl = np.flatnonzero(wire.relay & (wire.numel > 0))
    if len(rl):
        dw = d_of[0]
        relay_written = np.zeros(nf, np.bool_)
        relay_written[dw[rl]] = True
        rs = relay_src[wire.numel[wire.relay] > 0]  # (``relay_src``: the relays' read fragments, in row order)
        hit = relay_written[rs]
        if hit.any():
            plain_w = {}
            for tb, d in zip((wire, local), d_of, strict=True):
                sel = np.flatnonzero(~tb.relay & relay_written[d] & (tb.numel > 0))
                for fi, o, s in zip(d[sel].tolist(), tb.offsets[sel].tolist(), tb.sizes[sel].tolist(), strict=True):
                    plain_w.setdefault(fi, set()).add((tuple(o), tuple(s)))
            for i, fi in zip(rl[hit].tolist(), rs[hit].tolist(), strict=True):
                if (tuple(wire.offsets[i].tolist()), tuple(wire.sizes[i].tolist())) not in plain_w.get(fi, ()):
                    return False
    return True
