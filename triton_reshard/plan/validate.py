"""Self-validation of a plan, once, on the transfers' columns (``TransferTable``): every transfer reads a box its
source rank holds (a relay: a box of its rank's destination fragments) and writes inside a destination fragment
of its rank, every destination fragment is covered exactly once, and no relay reads a box its rank itself gets by
relay (no chains). One check (``_check``) for the whole plan (``validate_plan``) and for one rank's share
(``validate_share``: the transfers involving that rank, against its own fragments). The check decides on the
columns; where it fails, the first failing transfer or fragment is named in the words of the object form, which
the tests keep as a reference (``tests/oracles/plan_check.py``) and compare against on random bad plans."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ..box import boxes_meet, find_overlap
from ..layout import Fragment, dtype_name, gc_paused
from ..layout.fragment_table import TensorRows, distinct
from .index import rank_fragments
from .quant import logical_target, plan_targets, quant_regions, scale_sizes, whole_blocks
from .table import I64, widen
from .types import PlanLike


def validate_plan(plan: PlanLike) -> None:
    """Exact cover of every destination fragment; every transfer reads what its source rank holds; every relay
    reads a box its rank received from non-relay transfers or local copies (``ValueError`` naming the first
    transfer or fragment that fails, else nothing).

    Linear in the transfers, on their columns: each transfer's box is located in the fragments of its (tensor,
    rank, local tensor) on each side (``_Frags.locate``). A transfer writes inside one destination fragment (the
    fragments of a local tensor are disjoint), so the cover is checked per fragment: the elements its nonempty
    writes add up to, and no two of them overlapping. A relay reads inside one destination fragment of its
    sender; once the cover is exact, the box it reads was written entirely by non-relays exactly when no relay
    writes into that box, so only the (rare) fragments that are both read and written by relays are compared."""
    _check(plan, None)
    if plan.dst.quantized:  # block-quantized destinations: the scales' cover, the modes
        validate_quant(plan)


def validate_share(p: PlanLike) -> None:
    """The self-check of one rank's share of a plan (``Plan(..., rank=r)``), ``validate_plan``'s check on rank
    ``r``'s side: every transfer has rank ``r`` at one end; what it sends lies inside its own source fragments
    (relays: its destination fragments); what it receives lies inside its own destination fragments and covers
    each of them exactly once. (Whether a relay this rank receives reads a box its sender got from a non-relay
    is the sender's check; the whole plan checks everything at once.)"""
    _check(p, p.rank)
    if quant_scales(p):  # block-quantized destinations: their scales are checked by validate_quant
        validate_quant(p, ranks=(p.rank,))


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


# --------------------------------------------------------------------------------------------------------
# The check, on the columns
# --------------------------------------------------------------------------------------------------------


STAYS, NOT_MINE, READS, WRITES = 1, 2, 3, 4  # a row's first failing check, in the order the checks run


def _check(plan: PlanLike, rank: int | None) -> None:
    """``validate_plan`` (``rank`` None) or ``validate_share`` of ``rank``: the rows' reads and writes, the
    cover of the destination fragments (every one, or ``rank``'s), the relay chains (the whole plan)."""
    src, dst = plan.src, cover_dst(plan)
    tables = (plan.transfers, plan.local_copies)
    world = max(max(src.ranks, default=0), max(dst.ranks, default=0),
                *(int(c.max(initial=0)) for tb in tables for c in (tb.src, tb.dst))) + 1
    with gc_paused():
        if rank is None:
            dfr = _Frags(dst.tensor_rows([t.name for t in dst.tensors]), world)
            used = set()
            for tb in tables:
                used.update(tb.names[i] for i in distinct(tb.tensor[~tb.relay]).tolist())
            sfr = _Frags(src.tensor_rows(sorted(n for n in used if n in src.specs)), world)
        else:
            sfr = _Frags.of_fragments(rank_fragments(src, rank), world)
            dfr = _Frags.of_fragments(rank_fragments(dst, rank), world)
        numel = [tb.numel for tb in tables]
        read_of, d_of = _rows(plan, rank, tables, sfr, dfr)
        _cover(plan, rank, tables, numel, dfr, d_of)
        if rank is None:
            _relay_chains(tables, numel, read_of[0], d_of, len(dfr.rows))


def _rows(plan: PlanLike, rank: int | None, tables, sfr: _Frags, dfr: _Frags):
    """Per table, each row's read fragment (of ``sfr``; relays: of ``dfr``) and written fragment (of ``dfr``),
    -1 where a share does not check that side; raises naming the first row (wire rows, then local copies) that
    fails a check, in the order the checks run."""
    read_of, d_of, codes = [], [], []
    for tb in tables:
        n = len(tb)
        code = np.zeros(n, np.int8)
        if rank is None:
            code[tb.relay & (tb.src == tb.dst)] = STAYS
            reads = writes = None
        else:
            code[(tb.src != rank) & (tb.dst != rank)] = NOT_MINE
            reads, writes = tb.src == rank, tb.dst == rank
        read = np.full(n, -1, I64)
        for fr, sel in ((sfr, ~tb.relay), (dfr, tb.relay)):
            rows = np.flatnonzero(sel if reads is None else sel & reads)
            if len(rows):
                read[rows] = _locate(fr, tb, rows, "src")
                bad = rows[read[rows] < 0]
                code[bad[code[bad] == 0]] = READS
        if writes is None:
            d = _locate(dfr, tb, None, "dst")
            code[(d < 0) & (code == 0)] = WRITES
        else:
            d = np.full(n, -1, I64)
            rows = np.flatnonzero(writes)
            d[rows] = _locate(dfr, tb, rows, "dst")
            code[rows[(d[rows] < 0) & (code[rows] == 0)]] = WRITES
        read_of.append(read)
        d_of.append(d)
        codes.append(code)
    for tb, code in zip(tables, codes, strict=True):
        bad = np.flatnonzero(code)
        if len(bad):
            _raise_row(rank, tb[int(bad[0])], int(code[bad[0]]))
    if rank is not None:
        local = tables[1]
        bad = np.flatnonzero((local.src != rank) | (local.dst != rank))
        if len(bad):
            raise ValueError(f"share of rank {rank}: local copy {local[int(bad[0])]} is not on rank {rank}")
    return read_of, d_of


def _raise_row(rank: int | None, t, code: int) -> None:
    """The error of transfer ``t``, which fails check ``code`` (of the whole plan, or of ``rank``'s share)."""
    if rank is not None:
        if code == NOT_MINE:
            raise ValueError(f"share of rank {rank}: transfer {t} does not involve rank {rank}")
        if code == READS:
            side = "destination" if t.relay else "source"
            raise ValueError(f"share of rank {rank}: transfer {t} reads a box outside rank {rank}'s {side} "
                             f"fragments of tensor {t.tensor!r}")
        raise ValueError(f"share of rank {rank}: transfer {t} writes outside rank {rank}'s destination "
                         f"fragments of tensor {t.tensor!r}")
    if code == STAYS:
        raise ValueError(f"plan: relay {t} of tensor {t.tensor!r} stays on rank {t.src_rank} "
                         f"(a relay is a wire transfer from another rank's destination tensor)")
    if code == READS and t.relay:
        raise ValueError(
            f"plan: relay {t} reads a box of tensor {t.tensor!r} outside the destination fragments of "
            f"rank {t.src_rank} (a relay sends what its rank received; it reads the destination layout)"
        )
    if code == READS:
        raise ValueError(f"plan: transfer {t} reads a box source rank {t.src_rank} does not hold")
    raise ValueError(f"plan: transfer {t} writes outside the destination fragments of rank {t.dst_rank}")


def _locate(fr: _Frags, tb, rows: np.ndarray | None, side: str) -> np.ndarray:
    """``fr.locate`` of the rows ``rows`` of ``tb`` (None: all) on its ``side`` ("src" or "dst"), in chunks of
    rows (the selected columns' copies stay one chunk's size)."""
    cols = ((tb.src, tb.src_local, tb.src_offsets, tb.src_ndim) if side == "src"
            else (tb.dst, tb.dst_local, tb.dst_offsets, tb.dst_ndim))
    if rows is not None and not len(rows):
        return np.zeros(0, I64)
    if rows is None:
        return fr.locate(tb.names, tb.tensor, cols[0], tb.locals, cols[1], tb.ndim, tb.offsets, tb.sizes, *cols[2:])
    return np.concatenate([
        fr.locate(tb.names, tb.tensor[c], cols[0][c], tb.locals, cols[1][c], tb.ndim[c], tb.offsets[c], tb.sizes[c],
                  cols[2][c], cols[3][c])
        for c in (rows[a:a + LOCATE_CHUNK] for a in range(0, len(rows), LOCATE_CHUNK))])


def _cover(plan: PlanLike, rank: int | None, tables, numel, dfr: _Frags, d_of) -> None:
    """Per destination fragment of ``dfr``: the elements its nonempty writes add up to, and no two overlapping
    (a fragment nothing writes: empty, or a scale tensor the plan writes by quantizing)."""
    rows = dfr.rows
    nf = len(rows)
    fnumel = rows.sizes.astype(I64).prod(axis=1)
    cnt, got = np.zeros(nf, I64), np.zeros(nf, I64)
    for n, d in zip(numel, d_of, strict=True):
        nz = (n > 0) & (d >= 0)
        np.add.at(cnt, d[nz], 1)
        np.add.at(got, d[nz], n[nz])
    exempt = fnumel == 0
    scales = quant_scales(plan)
    if scales:
        exempt |= np.isin(dfr.tensor_of, np.array([dfr.group[s] for s in scales if s in dfr.group], I64))
    bad = ~np.where(cnt == 0, exempt, got == fnumel)
    twice = overlapping_writes(cnt, tables, d_of, numel) if (cnt > 1).any() else np.zeros(0, I64)
    bad[twice] = True
    if not bad.any():
        return
    if rank is not None:
        f = dfr.frags[int(dfr.at[bad].min())]  # the first in the order of the rank's fragments
        raise ValueError(f"share of rank {rank}: destination fragment {f} (tensor {f.tensor!r}) is not covered "
                         f"exactly once by its receives and local copies")
    if len(twice):
        _raise_twice(tables, numel, dfr, d_of, twice)
    _raise_count(plan, tables, numel, dfr, d_of, fnumel)
    bad_frags = {rows.fragment(i, int(dfr.tensor_of[i])) for i in np.flatnonzero(bad).tolist()}
    f = next(f for f in cover_dst(plan).fragments if f in bad_frags)
    raise ValueError(f"plan: destination fragment {f} is not covered exactly once")


def _local_key(dfr: _Frags, frag_rows: np.ndarray) -> np.ndarray:
    """(rank, local tensor) of fragments ``frag_rows`` of ``dfr`` as one int."""
    rows = dfr.rows
    return rows.ranks[frag_rows].astype(I64) * dfr.nl + rows.local_ids[frag_rows].astype(I64)


def _raise_twice(tables, numel, dfr: _Frags, d_of, twice: np.ndarray) -> None:
    """Some fragments are written twice: name two overlapping writes of the first destination local tensor, in
    the order of their first writes (wire rows, then local copies), that has such a fragment."""
    want = set(_local_key(dfr, twice).tolist())
    key = None
    writes = []
    for tb, n, d in zip(tables, numel, d_of, strict=True):
        rows = np.flatnonzero((n > 0) & (d >= 0))
        keys = _local_key(dfr, d[rows])
        if key is None:
            first = np.flatnonzero(np.isin(keys, list(want)))
            if not len(first):
                continue
            key = int(keys[first[0]])
        writes.extend(tb[i] for i in rows[keys == key].tolist())
    boxes = [(t.dst_offsets, (1,) * (len(t.dst_offsets) - len(t.sizes)) + t.sizes, t) for t in writes]
    hit = find_overlap(boxes)
    r, local = divmod(key, dfr.nl)
    raise ValueError(f"plan: tensor {hit[0].tensor!r} on destination rank {r} ({dfr.rows.local_names[local]!r}) is "
                     f"written twice: {hit[0]} and {hit[1]}")


def _raise_count(plan: PlanLike, tables, numel, dfr: _Frags, d_of, fnumel: np.ndarray) -> None:
    """A destination local tensor (not a scale tensor) whose writes do not add up to its fragments' elements:
    the first in the layout's fragment order."""
    scales = quant_scales(plan)
    rows = dfr.rows
    plain = np.array([rows.names[k] not in scales for k in dfr.tensor_of.tolist()], bool)
    keys = _local_key(dfr, np.arange(len(rows)))
    size = int(keys.max(initial=-1)) + 1
    need, got = np.zeros(size, I64), np.zeros(size, I64)
    np.add.at(need, keys[plain], fnumel[plain])
    has = np.bincount(keys[plain], minlength=size) > 0
    for n, d in zip(numel, d_of, strict=True):
        nz = (n > 0) & (d >= 0)
        np.add.at(got, _local_key(dfr, d[nz]), n[nz])
    off = has & (got != need)
    if not off.any():
        return
    lid = {x: i for i, x in enumerate(rows.local_names)}
    for f in cover_dst(plan).fragments:
        k = f.rank * dfr.nl + lid[f.local]
        if f.tensor not in scales and off[k]:
            raise ValueError(f"plan: destination local tensor {f.local!r} on rank {f.rank} gets {int(got[k])} of "
                             f"its {int(need[k])} elements")


def _relay_chains(tables, numel, read: np.ndarray, d_of, nf: int) -> None:
    """No relay reads a box its rank itself gets by relay: where relays also write the fragment a relay reads,
    the box it reads is exactly one a non-relay wrote (the planner's relays read the part their rank received),
    or meets no relay's box. (``read``: the wire rows' read fragments; relays are wire rows.)"""
    wire, dw = tables[0], d_of[0]
    rl = np.flatnonzero(wire.relay & (numel[0] > 0))
    if not len(rl):
        return
    relay_written = np.zeros(nf, np.bool_)
    relay_written[dw[rl]] = True
    hit = rl[relay_written[read[rl]]]
    if not len(hit):
        return
    frags = distinct(read[hit])
    plain_w: dict[int, set] = {}  # fragment -> the boxes non-relays write into it
    for tb, n, d in zip(tables, numel, d_of, strict=True):
        sel = np.flatnonzero(~tb.relay & (n > 0) & np.isin(d, frags))
        for fi, o, s in zip(d[sel].tolist(), tb.offsets[sel].tolist(), tb.sizes[sel].tolist(), strict=True):
            plain_w.setdefault(fi, set()).add((tuple(o[:len(s)]), tuple(s)))
    for i in hit.tolist():
        t = wire[i]
        fi = int(read[i])
        if (t.offsets, t.sizes) in plain_w.get(fi, ()):  # exactly what one non-relay wrote (the cover is exact)
            continue
        for j in rl[dw[rl] == fi].tolist():
            w = wire[j]
            if boxes_meet(w.offsets, w.sizes, t.offsets, t.sizes):
                raise ValueError(
                    f"plan: relay {t} of tensor {t.tensor!r} reads on rank {t.src_rank} a box that rank "
                    f"itself gets by relay from rank {w.src_rank} ({w}); a relay may only read boxes "
                    f"written by non-relay transfers or local copies (no relay chains)"
                )


LOCATE_CHUNK = 1 << 18  # rows located at once (``_Frags.locate``)


class _Frags:
    """Fragments of one layout (``Layout.tensor_rows``: some tensors on every rank; or one rank's, from its
    fragments) sorted by (tensor, rank, local tensor), for locating the fragment that holds each transfer's box."""

    def __init__(self, tr: TensorRows, world: int) -> None:
        self.rows = tr
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
        self.frags, self.at = (), np.zeros(0, I64)
        self._seen: dict[tuple[int, tuple], np.ndarray] = {}

    def _codes(self, ids: dict[str, int], names: tuple) -> np.ndarray:
        """Per name of ``names`` (a table's tensor or local names) its id in ``ids``, -1: none (kept per tuple)."""
        key = (id(ids), names)
        got = self._seen.get(key)
        if got is None:
            got = self._seen[key] = np.array([ids.get(x, -1) for x in names] or [0], np.int64)
        return got

    @classmethod
    def of_fragments(cls, frags: Sequence[Fragment], world: int) -> _Frags:
        """The rows of ``frags`` (one rank's), grouped by tensor; ``at``: each row's index in ``frags``."""
        by: dict[str, list[int]] = {}
        for i, f in enumerate(frags):
            by.setdefault(f.tensor, []).append(i)
        out = cls(TensorRows.from_fragments([(n, len(frags[ix[0]].offsets), [frags[i] for i in ix])
                                             for n, ix in by.items()]), world)
        out.frags, out.at = frags, np.fromiter((i for ix in by.values() for i in ix), I64, len(frags))
        return out

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
        g = self._codes(self.group, names)[tcode]
        li = self._codes(self.lid, locals_)[lcode]
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


def overlapping_writes(cnt: np.ndarray, tables, d_of, numel=None) -> np.ndarray:
    """The destination fragments written more than once (``cnt``: writes per fragment; ``d_of``: per table each
    row's fragment, -1: none; ``numel``: per table its rows' elements) two of whose nonempty boxes share an
    element (ascending): every pair of a fragment's boxes tested on arrays, a fragment with many writes by
    ``find_overlap``."""
    fi, off, sz, nd = [], [], [], []
    D = max(tb.offsets.shape[1] for tb in tables)
    for tb, d, n in zip(tables, d_of, numel or [tb.numel for tb in tables], strict=True):
        sel = np.flatnonzero((d >= 0) & (cnt[np.maximum(d, 0)] > 1) & (n > 0))
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
    bad = []
    for a, n in zip(starts[big].tolist(), c[big].tolist(), strict=True):
        k = int(nd[a])
        if find_overlap([(tuple(off[i, :k].tolist()), tuple(sz[i, :k].tolist()), None)
                         for i in range(a, a + n)]) is not None:
            bad.append(fi[a:a + 1])
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
        bad.append(fi[seg[((off[seg] < end[j]) & (off[j] < end[seg])).all(axis=1)]])
        lo = hi
    return distinct(np.concatenate(bad)) if bad else np.zeros(0, I64)


# --------------------------------------------------------------------------------------------------------
# The quantized part (block-quantized destinations, ``plan/quant.py``), on the columns too
# --------------------------------------------------------------------------------------------------------


Q_PLAIN, Q_MODE, Q_BLOCKS, Q_DTYPE = 1, 2, 3, 4  # a row's first failing quantization check


def validate_quant(plan: PlanLike, ranks: Sequence[int] | None = None) -> None:
    """The quantized part of a plan: ``src`` transfers block-aligned in fp8, ``dst`` transfers in their source
    dtype inside their regions, no relays, and every scale fragment written exactly once (by the ``src``
    transfers and the regions). The weights' own exact cover is ``validate_plan``'s. ``ranks``: check the
    scale cover of these destination ranks only (a rank plan: its own), default all."""
    src, dst = plan.src, plan.dst
    quantized = {n: logical_target(s) for n, s in dst.quantized.items()}
    written: dict[tuple[int, str], list] = defaultdict(list)  # (rank, scale local) -> [(local off, sizes, what)]
    for tb in (plan.transfers, plan.local_copies):
        _quant_rows(tb, src, quantized, written)
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
            a, b = (x[0][x[1]] if isinstance(x, tuple) else x for x in hit)  # (a row of a table, or a region)
            raise ValueError(f"plan: scale local tensor {key[1]!r} on rank {key[0]} is written twice: {a} and {b}")
        if got != need.get(key, 0):
            raise ValueError(f"plan: scale local tensor {key[1]!r} on rank {key[0]} gets {got} of its "
                             f"{need.get(key, 0)} scales")


def _quant_rows(tb, src, quantized: dict, written: dict) -> None:
    """The rows of ``tb``: a quantized row only of a quantized tensor (a plain source), with its block and format,
    not relayed; a source-quantized row whole blocks in the format's value dtype, a destination-quantized row in
    the source dtype (raises naming the first row that fails, in the order the checks run); appends the scale
    boxes the source-quantized rows write to ``written`` (tagged ``(tb, row)``)."""
    specs = [quantized.get(n) for n in tb.names]
    specs = [s if s is not None and (src.specs.get(n) is None or src.specs[n].quant is None) else None
             for s, n in zip(specs, tb.names, strict=True)]
    k, q = tb.tensor.astype(I64), tb.quant
    qt = np.array([s is not None for s in specs] + [False], bool)[k]
    code = np.zeros(len(tb), np.int8)
    code[~qt & (q != 0)] = Q_PLAIN
    ok = qt & ~tb.relay & ((q == 1) | (q == 2))
    for i, kk in zip(np.flatnonzero(ok).tolist(), k[ok].tolist(), strict=True):
        e, s = tb.extras.get(i), specs[kk].quant
        if e is None or e[0] != s.block or e[3] is not s.format:
            ok[i] = False
    code[qt & ~ok & (code == 0)] = Q_MODE
    D = tb.offsets.shape[1]
    srows, drows = np.flatnonzero(ok & (q == 1)), np.flatnonzero(ok & (q == 2))
    if len(srows):
        value_ok = np.array([[s is not None and d == s.quant.format.value_dtype for d in tb.dtypes] for s in specs])
        block, shape = _per_tensor(specs, D)
        off, sz, kk = tb.offsets[srows].astype(I64), tb.sizes[srows].astype(I64), k[srows]
        end, b = off + sz, block[kk]
        whole = ((off % b == 0) & ((end == shape[kk]) | (end % b == 0)) & (sz > 0)).all(axis=1)
        code[srows[~(whole & value_ok[kk, tb.wdt[srows]])]] = Q_BLOCKS
    if len(drows):
        src_ok = np.array([[s is not None and d == src.specs[n].dtype for d in tb.dtypes]
                           for s, n in zip(specs, tb.names, strict=True)])
        code[drows[~src_ok[k[drows], tb.wdt[drows]]]] = Q_DTYPE
    bad = np.flatnonzero(code)
    if len(bad):
        _raise_quant_row(tb[int(bad[0])], int(code[bad[0]]), quantized)
    for i, r, z, nd in zip(srows.tolist(), tb.dst[srows].tolist(), tb.sizes[srows].tolist(),
                           tb.ndim[srows].tolist(), strict=True):
        blk, local, so = tb.extras[i][:3]
        written[(r, local)].append((so, _lead(so, scale_sizes(tuple(z[:nd]), blk)), (tb, i)))


def _per_tensor(specs: list, D: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor of ``specs`` (None: not quantized) its block and logical shape, ``[K, D]`` padded with 1."""
    block, shape = np.ones((len(specs), D), I64), np.ones((len(specs), D), I64)
    for j, s in enumerate(specs):
        if s is not None:
            n = min(len(s.shape), D)
            block[j, :n], shape[j, :n] = s.quant.block[:n], s.shape[:n]
    return block, shape


def _raise_quant_row(t, code: int, quantized: dict) -> None:
    """The error of row ``t``, which fails quantization check ``code``."""
    if code == Q_PLAIN:
        raise ValueError(f"plan: transfer {t} is quantized ({t.quant!r}) but its tensor is not quantized")
    if code == Q_MODE:
        raise ValueError(f"plan: transfer {t} of block-quantized tensor {t.tensor!r} is not a quantized transfer "
                         f"(quant={t.quant!r}, block {t.block}, relay={t.relay})")
    if code == Q_BLOCKS:
        raise ValueError(f"plan: source-quantized transfer {t} is not whole blocks in "
                         f"{dtype_name(quantized[t.tensor].quant.format.value_dtype)}")
    raise ValueError(f"plan: destination-quantized transfer {t} does not travel in the source dtype")


def _lead(local_offsets, sizes) -> tuple[int, ...]:
    """``sizes`` in the local tensor's dims (extra leading dims of size 1)."""
    return (1,) * (len(local_offsets) - len(sizes)) + tuple(sizes)
