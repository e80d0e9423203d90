"""Columnar layouts: a :class:`~triton_reshard.layout.Layout` stored as numpy arrays, for thousand-rank worlds.

A 1,024-rank DeepSeek-V3 vLLM layout has ~1.2 million fragments and ~0.9 million local tensors; as Python
objects they take ~20 s and ~0.5 GB to build, on every rank. :class:`ColumnarLayout` keeps one numpy column
per fragment field (tensor id, rank, local id, offsets, sizes, local offsets) and per local-tensor field, sorted
in Layout order, and answers the per-tensor / per-rank queries a rank planner needs (:meth:`Layout.table`,
:meth:`Layout.tensor_names_on_rank`, :meth:`Layout.fragments_on_rank`, :meth:`Layout.local_specs`) from
them, without building the other ranks' objects. ``instances(n)`` is a virtual tiling of copy 0 (nothing is
copied). Everything else a Layout offers (``fragments``, ``locals``, ``fragments_by_tensor``, ``==``,
``digest``, ``merge``...) works unchanged: the eager objects are built on first use, once, and equal what an
eager Layout of the same contents holds (same order, same digest).

:class:`ColumnBuilder` builds one from boxes given per call for a whole array of ranks at once (numpy
broadcasting: offsets, starts and even tensor names may differ per rank), which is how the presets describe
a model: one call per tensor family and stage, not per fragment. Validation is the eager Layout's, done
vectorized (fragment bounds, local-tensor bounds, dtypes, overlaps in local memory); when it finds a problem
the layout is materialized and the eager validation raises its usual message naming tensor and rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property

import numpy as np
import torch

from .box import find_overlap
from .layout import (
    MAX_TENSOR_BYTES,
    Fragment,
    FragmentTable,
    Layout,
    LocalSpec,
    TensorSpec,
    check_bytes,
    check_names,
    content_fingerprint,
    dtype_name,
    gc_paused,
    itemsize_of,
    slot_setters,
    trusted_fragment,
)

_I64 = np.int64


# --------------------------------------------------------------------------------------------------------
# Logical tensors, TensorSpec objects built on demand
# --------------------------------------------------------------------------------------------------------


class LogicalTensors:
    """The logical tensors of a layout as parallel tuples sorted by name (``names``, ``shapes``, ``dtypes``),
    with each :class:`TensorSpec` built on first use: a DeepSeek-V3 has ~46,000 tensors, and a rank plan looks
    at the few thousand its rank holds."""

    __slots__ = ("names", "shapes", "dtypes", "index", "_specs", "_key", "cache")

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                 specs: Sequence[TensorSpec] | None = None) -> None:
        self.names, self.shapes, self.dtypes = tuple(names), tuple(shapes), tuple(dtypes)
        self.index = {n: i for i, n in enumerate(self.names)}
        self._specs: list | None = list(specs) if specs is not None else None
        self._key = None
        self.cache: dict = {}  # derived arrays builders share (e.g. the presets' expert tensor ids)

    @classmethod
    def from_specs(cls, specs: Iterable[TensorSpec]) -> LogicalTensors:
        specs = sorted(specs, key=lambda t: t.name)
        return cls([t.name for t in specs], [t.shape for t in specs], [t.dtype for t in specs], specs)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                    dtypes: Mapping[str, torch.dtype] | None = None) -> LogicalTensors:
        """``{name: shape}`` held in ``dtype`` (``dtypes``: the exceptions); shapes are checked as TensorSpec
        checks them when their spec is built."""
        names = sorted(shapes)
        dtypes = dtypes or {}
        check_names("dtypes", dtypes, shapes)
        return cls(names, [tuple(shapes[n]) for n in names], [dtypes.get(n, dtype) for n in names])

    def __len__(self) -> int:
        return len(self.names)

    def spec(self, i: int) -> TensorSpec:
        if self._specs is None:
            self._specs = [None] * len(self.names)
        t = self._specs[i]
        if t is None:
            t = self._specs[i] = trusted_spec(self.names[i], self.shapes[i], self.dtypes[i])
        return t

    def all(self) -> tuple[TensorSpec, ...]:
        if self._specs is None or None in self._specs:
            self._specs = [t if t is not None else trusted_spec(n, sh, dt) for t, n, sh, dt in zip(
                self._specs or [None] * len(self.names), self.names, self.shapes, self.dtypes, strict=True)]
        return tuple(self._specs)

    @property
    def key(self) -> tuple:
        """``Layout._key[0]``: (name, shape, dtype name[, quant key]) per tensor."""
        if self._key is None:
            if self._specs is not None and any(t is not None and t.quant is not None for t in self._specs):
                self._key = tuple((t.name, t.shape, dtype_name(t.dtype)) if t.quant is None
                                  else (t.name, t.shape, dtype_name(t.dtype), t.quant.key()) for t in self.all())
            else:
                dn = {d: dtype_name(d) for d in set(self.dtypes)}
                self._key = tuple(zip(self.names, self.shapes, [dn[d] for d in self.dtypes], strict=True))
        return self._key

    @property
    def quantized(self) -> bool:
        return self._specs is not None and any(t is not None and t.quant is not None for t in self._specs)

    def shape_table(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ndims [T], shapes [T, width])`` (unused columns 1), cached: what validation compares boxes with."""
        key = ("shape_table", width)
        out = self.cache.get(key)
        if out is None:
            nd = np.fromiter(map(len, self.shapes), _I64, len(self))
            sh = np.ones((len(self), width), dtype=_I64)
            for k in set(nd.tolist()):
                if k:
                    sel = np.flatnonzero(nd == k)
                    sh[sel, :k] = [self.shapes[i] for i in sel.tolist()]
            out = self.cache[key] = (nd, sh)
        return out


# --------------------------------------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------------------------------------


class _Columns:
    """Fragment and local-tensor columns of one layout, in Layout order.

    Fragments sorted by (tensor, rank, local, offsets, local offsets): ``ft`` tensor id (index into
    ``names``), ``fr`` rank, ``fl`` local id (index into ``lnames``, sorted, so id order is name order),
    ``foff``/``fsz`` ``[n, D]`` (D: the largest tensor rank; unused columns 0 / 1), ``flo`` ``[n, L]`` local
    offsets left-aligned and padded with -1 (so lexicographic order equals tuple order), ``flnd`` their count.
    Locals sorted by (rank, name): ``lr``, ``ln``, ``lsh`` ``[m, S]`` padded with -1, ``lnd``, ``ldt`` (index
    into ``dtypes``).
    """

    def __init__(self, names, lnames, dtypes, ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt):
        self.names, self.lnames, self.dtypes = tuple(names), tuple(lnames), tuple(dtypes)
        ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt = map(
            _compact, (ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt))
        self.ft, self.fr, self.fl, self.foff, self.fsz, self.flo, self.flnd = ft, fr, fl, foff, fsz, flo, flnd
        self.lr, self.ln, self.lsh, self.lnd, self.ldt = lr, ln, lsh, lnd, ldt
        self.tstart = np.searchsorted(ft, np.arange(len(self.names) + 1))  # rows of tensor i: [tstart[i], tstart[i+1])
        self.ranks, self.lrstart = np.unique(lr, return_index=True)
        self.lrstart = np.append(self.lrstart, len(lr))

    @property
    def nfrag(self) -> int:
        return len(self.ft)

    @property
    def nlocal(self) -> int:
        return len(self.lr)

    @cached_property
    def _rank_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fragment rows sorted by rank, stable; the distinct ranks; their starts)."""
        order = np.argsort(self.fr, kind="stable")
        ranks, starts = np.unique(self.fr[order], return_index=True)
        return order, ranks, np.append(starts, len(order))

    def rows_of_rank(self, rank: int) -> np.ndarray:
        order, ranks, starts = self._rank_order
        i = int(np.searchsorted(ranks, rank))
        if i == len(ranks) or ranks[i] != rank:
            return order[:0]
        return order[starts[i]:starts[i + 1]]

    def locals_of_rank(self, rank: int) -> range:
        i = int(np.searchsorted(self.ranks, rank))
        if i == len(self.ranks) or self.ranks[i] != rank:
            return range(0)
        return range(int(self.lrstart[i]), int(self.lrstart[i + 1]))

    def shift(self, n: int, stride: int) -> _Columns:
        """The columns of ``n`` copies, copy ``i`` on the ranks shifted by ``i * stride``, in Layout order."""
        k, m = self.nfrag, self.nlocal
        shift_f = np.repeat(np.arange(n, dtype=_I64) * stride, k)
        shift_l = np.repeat(np.arange(n, dtype=_I64) * stride, m)
        ft, fr, fl = np.tile(self.ft, n), np.tile(self.fr.astype(_I64), n) + shift_f, np.tile(self.fl, n)
        foff, fsz, flo, flnd = (np.tile(a, (n, 1)) if a.ndim == 2 else np.tile(a, n)
                                for a in (self.foff, self.fsz, self.flo, self.flnd))
        lr, ln = np.tile(self.lr.astype(_I64), n) + shift_l, np.tile(self.ln, n)
        span = int(self.ranks[-1] - self.ranks[0]) + 1 if len(self.ranks) else 0
        if stride >= span:  # copies on disjoint, increasing ranks: Layout order without sorting
            a = self.tstart[:-1][self.ft]  # first row of each row's tensor
            ln_t = (self.tstart[1:] - self.tstart[:-1])[self.ft]
            c = np.repeat(np.arange(n, dtype=_I64), k)
            pos = n * np.tile(a, n) + c * np.tile(ln_t, n) + (np.tile(np.arange(k, dtype=_I64) - a, n))
            order = np.empty(n * k, dtype=_I64)
            order[pos] = np.arange(n * k, dtype=_I64)
            lorder = np.arange(n * m)
        else:
            order = _frag_order(ft, fr, fl, foff, flo)
            lorder = np.lexsort((ln, lr))
        return _Columns(self.names, self.lnames, self.dtypes, ft[order], fr[order], fl[order], foff[order],
                        fsz[order], flo[order], flnd[order], lr[lorder], ln[lorder],
                        np.tile(self.lsh, (n, 1))[lorder], np.tile(self.lnd, n)[lorder],
                        np.tile(self.ldt, n)[lorder])


def _compact(a: np.ndarray) -> np.ndarray:
    """``a`` as int32 when every value fits with room for a sum of two (< 2**30), else int64: half the memory
    of a layout's columns (arithmetic on them casts to int64 where a product could overflow)."""
    if a.dtype == np.int32:
        return a
    if not a.size or (int(a.min()) >= -(1 << 30) and int(a.max()) < 1 << 30):
        return a.astype(np.int32)
    return a.astype(_I64, copy=False)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=_I64)


def _frag_order(ft, fr, fl, foff, flo) -> np.ndarray:
    """Row order (tensor, rank, local, offsets, local offsets): the Layout's fragment order."""
    keys = [flo[:, j] for j in range(flo.shape[1] - 1, -1, -1)]
    keys += [foff[:, j] for j in range(foff.shape[1] - 1, -1, -1)]
    return np.lexsort(keys + [fl, fr, ft])


# --------------------------------------------------------------------------------------------------------
# Vectorized validation (the eager Layout's checks; on a failure the eager validation names the problem)
# --------------------------------------------------------------------------------------------------------


def _valid(c: _Columns, lt: LogicalTensors) -> bool:
    """True if the columns pass every check of ``Layout._validate`` (exactly: no false alarms on layouts the
    eager validation accepts, no layout it rejects passes)."""
    n = c.nfrag
    # local tensors declared once
    if c.nlocal > 1 and ((c.lr[1:] == c.lr[:-1]) & (c.ln[1:] == c.ln[:-1])).any():
        return False
    if not n:
        return True
    if (c.foff < 0).any() or (c.fsz < 0).any() or (c.flo < -1).any() or (c.fr < 0).any():
        return False  # (the eager Fragment refuses these)
    D = c.foff.shape[1]
    nd_t, shape_t = lt.shape_table(max(D, 1))
    nd = nd_t[c.ft]
    # the fragment's box inside its logical tensor (unused columns are 0 + 1 <= 1)
    if D and (c.foff + c.fsz > shape_t[c.ft, :D]).any():
        return False
    # its local tensor exists on its rank
    nl = max(len(c.lnames), 1)
    lkey = c.lr.astype(_I64) * nl + c.ln
    fkey = c.fr.astype(_I64) * nl + c.fl
    li = np.searchsorted(lkey, fkey)
    if (li >= len(lkey)).any() or (lkey[np.minimum(li, len(lkey) - 1)] != fkey).any():
        return False
    # same number of local dims, at least the box's
    lnd = c.lnd[li]
    if (c.flnd != lnd).any() or (lnd < nd).any():
        return False
    # dtypes: the local tensor's is the tensor's
    key = ("dtype_ids", c.dtypes)
    dt_t = lt.cache.get(key)
    if dt_t is None:
        did = {d: i for i, d in enumerate(c.dtypes)}
        dt_t = lt.cache[key] = np.fromiter((did.get(d, -1) for d in lt.dtypes), _I64, len(lt))
    if (c.ldt[li] != dt_t[c.ft]).any():
        return False
    # inside the local tensor: local offsets + (1,)*(lnd-nd) + sizes <= local shape
    L = c.flo.shape[1]
    lsz = _local_sizes(c, nd, L)
    lo = np.where(c.flo < 0, 0, c.flo)
    lsh = c.lsh[li][:, :L] if L else np.zeros((n, 0), _I64)
    valid = np.arange(L)[None, :] < c.flnd[:, None]
    if ((c.flo < 0) & valid).any() or ((lo + lsz > lsh) & valid).any():
        return False
    return overlap_free(li, lo, lsz, c.fsz)


def _local_sizes(c: _Columns, nd: np.ndarray, L: int) -> np.ndarray:
    """``[n, L]`` each fragment's sizes in its local tensor's dims (lead dims 1; padding columns 1)."""
    n = c.nfrag
    out = np.ones((n, L), dtype=_I64)
    if not L or not c.fsz.shape[1]:
        return out
    col = np.arange(L)[None, :]
    first = (c.flnd - nd)[:, None]  # where the logical dims start in the local dims
    src = col - first
    ok = (src >= 0) & (col < c.flnd[:, None])
    vals = np.take_along_axis(c.fsz, np.clip(src, 0, c.fsz.shape[1] - 1), axis=1)
    return np.where(ok, vals, 1)


def overlap_free(group: np.ndarray, lo: np.ndarray, ls: np.ndarray, sizes: np.ndarray) -> bool:
    """True if no two non-empty boxes ``lo``+``ls`` (``[n, L]``) with the same ``group`` share an element.

    Exact and vectorized: per dim, the boxes of a group are split into clusters of chained overlapping
    intervals; a box alone in its cluster overlaps nothing; a cluster whose intervals are all equal carries on
    to the next dim as a group of its own; any other cluster is checked box against box (``find_overlap``).
    Boxes equal in every dim overlap.
    """
    keep = np.flatnonzero((sizes > 0).all(axis=1)) if sizes.shape[1] else np.arange(len(group))
    key = group[keep]
    if len(key) < 2:
        return True
    # only groups of two or more boxes can overlap
    srt = np.argsort(key, kind="stable")
    keep, key = keep[srt], key[srt]
    multi = np.zeros(len(key), bool)
    multi[1:] |= key[1:] == key[:-1]
    multi[:-1] |= key[1:] == key[:-1]
    idx, key = keep[multi], key[multi]
    L = lo.shape[1]
    for d in range(L):
        if len(idx) < 2:
            return True
        s, e = lo[idx, d], lo[idx, d] + ls[idx, d]
        order = np.lexsort((s, key))
        idx, s, e, key = idx[order], s[order], e[order], key[order]
        m = len(idx)
        u, inv = np.unique(np.concatenate([s, e]), return_inverse=True)
        inv = inv.reshape(-1)
        rs, re = inv[:m], inv[m:]
        B = len(u) + 1
        v = key.astype(_I64) * B + re
        cm = np.maximum.accumulate(v)
        same = np.zeros(m, bool)
        same[1:] = key[1:] == key[:-1]
        prev = np.empty(m, _I64)
        prev[0] = -1
        prev[1:] = cm[:-1] - key[1:] * B
        joins = same & (prev > rs)  # overlaps (in dim d) some earlier box of its group
        cid = np.cumsum(~joins) - 1
        size = np.bincount(cid)
        in_multi = size[cid] > 1
        first = np.flatnonzero(~joins)
        ident = (s == s[first[cid]]) & (e == e[first[cid]])
        all_ident = np.ones(len(size), bool)
        np.logical_and.at(all_ident, cid, ident)
        hard = in_multi & ~all_ident[cid]
        if hard.any():
            rows = idx[hard]
            cl = cid[hard]
            for c_ in np.unique(cl):
                members = rows[cl == c_]
                boxes = [(tuple(lo[i, d:].tolist()), tuple(ls[i, d:].tolist()), int(i)) for i in members]
                if find_overlap(boxes) is not None:
                    return False
        nxt = in_multi & all_ident[cid]
        idx, key = idx[nxt], cid[nxt]
    return len(idx) < 2


# --------------------------------------------------------------------------------------------------------
# Lazy mappings (what the planner reads off ``fragments_by_tensor`` / ``_locals_by_rank``)
# --------------------------------------------------------------------------------------------------------


class _LazyMap(Mapping):
    """A read-only mapping whose values are built on first access, from ``keys`` and ``build(key)``."""

    def __init__(self, keys: Sequence, build) -> None:
        self._keys, self._build, self._cache = keys, build, {}
        self._set = None

    def __getitem__(self, key):
        v = self._cache.get(key)
        if v is None:
            if self._set is None:
                self._set = frozenset(self._keys)
            if key not in self._set:
                raise KeyError(key)
            v = self._cache[key] = self._build(key)
        return v

    def __contains__(self, key) -> bool:
        if self._set is None:
            self._set = frozenset(self._keys)
        return key in self._set

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


# --------------------------------------------------------------------------------------------------------
# ColumnarLayout
# --------------------------------------------------------------------------------------------------------


class ColumnarLayout(Layout):
    """A :class:`Layout` stored as numpy columns (see the module docstring); built by :class:`ColumnBuilder`
    (the presets) and by ``instances`` of one. Equal (``==``, ``digest``) to the eager Layout of the same
    contents; ``fragments`` / ``locals`` are built on first use."""

    def __init__(self, tensors: LogicalTensors | Sequence[TensorSpec], cols: _Columns | None = None, *,
                 base: ColumnarLayout | None = None, copies: int = 1, stride: int = 0, validate: bool = True) -> None:
        lt = tensors if isinstance(tensors, LogicalTensors) else LogicalTensors.from_specs(tensors)
        object.__setattr__(self, "_lt", lt)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_copies", copies)
        object.__setattr__(self, "_stride", stride)
        if cols is not None:
            self.__dict__["_cols"] = cols
        if base is None and validate and not _valid(cols, lt):  # raise the eager checks' message
            Layout(self.tensors, tuple(Fragment(f.tensor, f.rank, f.offsets, f.sizes, f.local, f.local_offsets)
                                       for f in self.fragments), self.locals)
        if lt.quantized:  # block quantization: the eager checks (small layouts)
            Layout(self.tensors, self.fragments, self.locals)

    lazy_tables = True

    def tensor_order(self) -> dict[str, int]:  # from the columns, without building the specs
        return self._lt.index

    def shapes_and_dtypes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lt = self._lt
        return {n: (shape, dt) for n, shape, dt in zip(lt.names, lt.shapes, lt.dtypes, strict=True)}

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:  # type: ignore[override]
        return self._lt.all()

    @cached_property
    def specs(self) -> Mapping[str, TensorSpec]:  # type: ignore[override]
        lt = self._lt
        return _LazyMap(lt.names, lambda n: lt.spec(lt.index[n]))

    @cached_property
    def quantized(self) -> dict[str, TensorSpec]:  # type: ignore[override]
        return {t.name: t for t in self.tensors if t.quant is not None} if self._lt.quantized else {}

    def spec(self, name: str) -> TensorSpec:
        i = self._lt.index.get(name)
        if i is None:
            raise ValueError(f"unknown tensor {name!r}")
        return self._lt.spec(i)

    # -- the columns ------------------------------------------------------------------------------------

    @cached_property
    def _cols(self) -> _Columns:
        return self._base._cols.shift(self._copies, self._stride)

    @property
    def _tid(self) -> dict[str, int]:
        return self._lt.index

    @property
    def _root(self) -> ColumnarLayout:
        return self if self._base is None else self._base

    def _split(self, rank: int) -> tuple[int, int] | None:
        """(copy, rank in copy 0) of ``rank``, None if no copy has it."""
        if self._base is None:
            return 0, rank
        ranks = self._base.ranks
        for i in range(self._copies):  # copies are few (engine instances)
            r = rank - i * self._stride
            if ranks and ranks[0] <= r <= ranks[-1]:
                j = np.searchsorted(self._base._cols.ranks, r)
                if j < len(self._base._cols.ranks) and self._base._cols.ranks[j] == r:
                    return i, r
        return None

    # -- eager views, built on first use ------------------------------------------------------------------

    @cached_property
    def fragments(self) -> tuple[Fragment, ...]:  # type: ignore[override]
        c = self._cols
        names, lnames = c.names, c.lnames
        D = c.foff.shape[1]
        nds = np.fromiter(map(len, self._lt.shapes), _I64, len(self._lt))
        with gc_paused():
            out = []
            for i in range(len(names)):
                a, b = int(c.tstart[i]), int(c.tstart[i + 1])
                if a == b:
                    continue
                t, nd = names[i], int(nds[i])
                offs = c.foff[a:b, :nd].tolist() if nd < D else c.foff[a:b].tolist()
                szs = c.fsz[a:b, :nd].tolist() if nd < D else c.fsz[a:b].tolist()
                out.extend(trusted_fragment(t, r, tuple(o), tuple(s), lnames[li], tuple(lo[:k]))
                           for r, o, s, li, lo, k in zip(c.fr[a:b].tolist(), offs, szs, c.fl[a:b].tolist(),
                                                         c.flo[a:b].tolist(), c.flnd[a:b].tolist(), strict=True))
            return tuple(out)

    @cached_property
    def locals(self) -> tuple[LocalSpec, ...]:  # type: ignore[override]
        c = self._cols
        with gc_paused():
            return tuple(_local_spec(r, c.lnames[n], tuple(sh[:k]), c.dtypes[dt]) for r, n, sh, k, dt in zip(
                c.lr.tolist(), c.ln.tolist(), c.lsh.tolist(), c.lnd.tolist(), c.ldt.tolist(), strict=True))

    @cached_property
    def _key(self) -> tuple:
        frags, locs = self.fragments, self.locals
        from .layout import FRAG_KEY

        with gc_paused():
            return (
                self._tensors_key,
                tuple(map(FRAG_KEY, frags)),
                tuple((s.rank, s.name, s.shape, dtype_name(s.dtype)) for s in locs),
            )

    @property
    def _tensors_key(self) -> tuple:
        return self._lt.key

    @cached_property
    def fingerprint(self) -> str:  # type: ignore[override]
        """See :attr:`Layout.fingerprint`: here from the columns (copies of ``instances`` without tiling them)."""
        root = self._root
        c = root._cols
        tiled = self._base is not None
        if tiled:
            span = root.ranks[-1] - root.ranks[0] + 1 if root.ranks else 0
            if self._stride < span:  # interleaved copies: the full columns
                c, tiled = self._cols, False
        L = int(c.flnd.max()) if c.nfrag else 0
        order = c._rank_order[0]
        fr, rest = c.fr[order], (c.ft[order], c.fl[order], c.foff[order], c.fsz[order], c.flo[order][:, :L])
        n = self._copies if tiled else 1
        copies = [(fr.astype(_I64) + i * self._stride, *rest) for i in range(n)]
        S = int(c.lnd.max()) if c.nlocal else 0
        locs = [(c.lr.astype(_I64) + i * self._stride, c.ln, c.lsh[:, :S], c.ldt) for i in range(n)]
        lt = self._lt
        dn = {d: dtype_name(d) for d in set(lt.dtypes)}
        quant = {i: t.quant.key() for i, t in enumerate(lt.all()) if t.quant is not None} if lt.quantized else {}
        return content_fingerprint((lt.names, lt.shapes, [dn[d] for d in lt.dtypes], quant), c.lnames, copies, locs,
                                   [dtype_name(d) for d in c.dtypes])

    @cached_property
    def _hash(self) -> int:
        return hash((self._tensors_key, self._nfrag, self._nlocal, self.ranks))

    @property
    def _nfrag(self) -> int:
        return self._root._cols.nfrag * self._copies

    @property
    def _nlocal(self) -> int:
        return self._root._cols.nlocal * self._copies

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, ColumnarLayout):
            if self._hash != other._hash:
                return False
            a, b = self._cols, other._cols
            if a.names != b.names or a.lnames != b.lnames or a.dtypes != b.dtypes or self._lt.key != other._lt.key:
                return self._key == other._key
            return all(np.array_equal(x, y) for x, y in (
                (a.ft, b.ft), (a.fr, b.fr), (a.fl, b.fl), (a.foff, b.foff), (a.fsz, b.fsz), (a.flo, b.flo),
                (a.lr, b.lr), (a.ln, b.ln), (a.lsh, b.lsh), (a.ldt, b.ldt)))
        return isinstance(other, Layout) and hash(self) == hash(other) and self._key == other._key

    __hash__ = Layout.__hash__

    def __repr__(self) -> str:
        return (f"Layout({len(self._lt)} tensors, {self._nfrag} fragments, {self._nlocal} local tensors on "
                f"ranks {list(self.ranks)}, digest={self.digest})")

    def __reduce__(self):
        if self._base is not None:
            return (_restore_tiled, (self._lt, self._base, self._copies, self._stride))
        return (_restore, (self._lt, self._cols))

    # -- queries ---------------------------------------------------------------------------------------

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        base = self._root._cols.ranks.tolist()
        if self._base is None:
            return tuple(base)
        return tuple(sorted(r + i * self._stride for i in range(self._copies) for r in base))

    @cached_property
    def fragments_by_tensor(self) -> Mapping[str, tuple[Fragment, ...]]:  # type: ignore[override]
        if "fragments" in self.__dict__:
            frags, c = self.fragments, self._cols  # (in the columns' order)
            st = c.tstart.tolist()
            return {n: frags[st[i]:st[i + 1]] for i, n in enumerate(c.names) if st[i + 1] > st[i]}
        root = self._root._cols
        present = [n for i, n in enumerate(root.names) if root.tstart[i + 1] > root.tstart[i]]
        return _LazyMap(present, lambda n: self.table(n).fragments)

    @cached_property
    def _locals_by_rank(self) -> Mapping[int, dict[str, LocalSpec]]:  # type: ignore[override]
        def build(rank: int) -> dict[str, LocalSpec]:
            sp = self._split(rank)
            c = self._root._cols
            rows = c.locals_of_rank(sp[1])
            return {c.lnames[n]: _local_spec(rank, c.lnames[n], tuple(sh[:k]), c.dtypes[dt]) for n, sh, k, dt in zip(
                c.ln[rows.start:rows.stop].tolist(), c.lsh[rows.start:rows.stop].tolist(),
                c.lnd[rows.start:rows.stop].tolist(), c.ldt[rows.start:rows.stop].tolist(), strict=True)}

        return _LazyMap(self.ranks, build)

    def local_specs(self, rank: int) -> dict[str, LocalSpec]:
        return dict(self._locals_by_rank[rank]) if rank in self._locals_by_rank else {}

    def fragments_on_rank(self, rank: int) -> tuple[Fragment, ...]:
        cache = self.__dict__.setdefault("_frags_on_rank", {})
        out = cache.get(rank)
        if out is None:
            out = cache[rank] = self._fragments_on_rank(rank)
        return out

    def _fragments_on_rank(self, rank: int) -> tuple[Fragment, ...]:
        sp = self._split(rank)
        if sp is None:
            return ()
        c = self._root._cols
        rows = c.rows_of_rank(sp[1])
        shapes = self._lt.shapes
        nds = [len(shapes[t]) for t in c.ft[rows].tolist()]
        return tuple(Fragment(c.names[t], rank, tuple(o[:nd]), tuple(s[:nd]), c.lnames[li], tuple(lo[:k]))
                     for t, nd, o, s, li, lo, k in zip(c.ft[rows].tolist(), nds, c.foff[rows].tolist(),
                                                       c.fsz[rows].tolist(), c.fl[rows].tolist(),
                                                       c.flo[rows].tolist(), c.flnd[rows].tolist(), strict=True))

    def tensor_names_on_rank(self, rank: int) -> tuple[str, ...]:
        sp = self._split(rank)
        if sp is None:
            return ()
        c = self._root._cols
        rows = c.rows_of_rank(sp[1])
        if c.fsz.shape[1]:
            rows = rows[(c.fsz[rows] > 0).all(axis=1)]
        return tuple(c.names[i] for i in np.unique(c.ft[rows]).tolist())

    def _build_table(self, name: str) -> FragmentTable:
        spec = self.spec(name)
        root = self._root
        c = root._cols
        i = root._tid[name]
        a, b = int(c.tstart[i]), int(c.tstart[i + 1])
        nd = len(spec.shape)
        ranks, off, sz = c.fr[a:b], c.foff[a:b, :nd], c.fsz[a:b, :nd]
        fl, flo, flnd = c.fl[a:b], c.flo[a:b], c.flnd[a:b]
        L = int(flnd.max()) if b > a else nd
        flo = flo[:, :L]
        if self._base is not None:
            k, n = b - a, self._copies
            ranks = np.tile(ranks.astype(_I64), n) + np.repeat(np.arange(n, dtype=_I64) * self._stride, k)
            off, sz, fl, flo, flnd = np.tile(off, (n, 1)), np.tile(sz, (n, 1)), np.tile(fl, n), np.tile(flo, (n, 1)), \
                np.tile(flnd, n)
            if n > 1 and (np.diff(ranks) < 0).any():  # interleaved copies: back to Layout order
                order = _frag_order(np.zeros(len(ranks), _I64), ranks, fl, off, flo)
                ranks, off, sz, fl, flo, flnd = ranks[order], off[order], sz[order], fl[order], flo[order], flnd[order]
        return FragmentTable(spec, _i64(ranks), _i64(off), _i64(sz), fl.astype(np.int32), c.lnames, _i64(flo),
                             _i64(flnd))

    def nbytes(self, rank: int | None = None) -> int:
        c = self._root._cols
        item = np.array([itemsize_of(d) for d in c.dtypes], dtype=_I64)
        sh = np.where(c.lsh < 0, 1, c.lsh)
        per = sh.astype(_I64).prod(axis=1) * item[c.ldt] if len(c.lr) else np.zeros(0, _I64)
        if rank is None:
            return int(per.sum()) * self._copies
        sp = self._split(rank)
        if sp is None:
            return 0
        rows = c.locals_of_rank(sp[1])
        return int(per[rows.start:rows.stop].sum())

    def instances(self, n: int, stride: int | None = None) -> Layout:
        step = self._instance_step(n, stride)
        if n == 1:
            return self
        if self._base is not None:  # copies of copies: one level of tiling
            return Layout.instances(self, n, stride)
        return ColumnarLayout(self._lt, base=self, copies=n, stride=step)


def columnar(tensors: Iterable[TensorSpec], fragments: Iterable[Fragment], locals_: Iterable[LocalSpec],
             validate: bool = True) -> ColumnarLayout:
    """The :class:`ColumnarLayout` of these parts, as ``Layout(tensors, fragments, locals)`` takes them
    (same validation and messages); ``columnar(*astuple(layout))`` converts an eager layout."""
    tensors = list(tensors)
    frags, locs = list(fragments), list(locals_)
    if len({t.name for t in tensors}) < len(tensors):
        Layout(tuple(tensors), tuple(frags), tuple(locs))  # "declared twice"
    lt = LogicalTensors.from_specs(tensors)
    lnames = sorted({f.local for f in frags} | {x.name for x in locs})
    lid = {n: i for i, n in enumerate(lnames)}
    dtypes = list(dict.fromkeys([*lt.dtypes, *(x.dtype for x in locs)]))
    did = {d: i for i, d in enumerate(dtypes)}
    n, m = len(frags), len(locs)
    D = max(map(len, lt.shapes), default=0)
    L = max([len(f.local_offsets) for f in frags] + [D])
    S = max([len(x.shape) for x in locs] + [0])
    foff, fsz, flo = np.zeros((n, D), _I64), np.ones((n, D), _I64), np.full((n, L), -1, _I64)
    for i, f in enumerate(frags):
        if len(f.offsets) > D or len(f.sizes) != len(f.offsets):
            return _eager_raise(lt, frags, locs)
        foff[i, :len(f.offsets)], fsz[i, :len(f.sizes)] = f.offsets, f.sizes
        flo[i, :len(f.local_offsets)] = f.local_offsets
    try:
        ft = np.fromiter((lt.index[f.tensor] for f in frags), _I64, n)
    except KeyError:
        return _eager_raise(lt, frags, locs)
    fr = np.fromiter((f.rank for f in frags), _I64, n)
    fl = np.fromiter((lid[f.local] for f in frags), _I64, n)
    flnd = np.fromiter((len(f.local_offsets) for f in frags), _I64, n)
    if (np.fromiter(map(len, lt.shapes), _I64, len(lt))[ft] != np.fromiter((len(f.offsets) for f in frags), _I64, n)).any():
        return _eager_raise(lt, frags, locs)  # a box with the wrong number of dims
    order = _frag_order(ft, fr, fl, foff, flo)
    lsh = np.full((m, S), -1, _I64)
    for i, x in enumerate(locs):
        lsh[i, :len(x.shape)] = x.shape
    lr = np.fromiter((x.rank for x in locs), _I64, m)
    ln = np.fromiter((lid[x.name] for x in locs), _I64, m)
    lo_ = np.lexsort((ln, lr))
    cols = _Columns(lt.names, lnames, dtypes, ft[order], fr[order], fl[order], foff[order], fsz[order], flo[order],
                    flnd[order], lr[lo_], ln[lo_], lsh[lo_], np.fromiter((len(x.shape) for x in locs), _I64, m)[lo_],
                    np.fromiter((did[x.dtype] for x in locs), _I64, m)[lo_])
    return ColumnarLayout(lt, cols, validate=validate)


def _eager_raise(lt: LogicalTensors, frags, locs) -> ColumnarLayout:
    Layout(lt.all(), tuple(frags), tuple(locs))  # raises its message
    raise AssertionError("columnar: parts the eager Layout accepts but the columns cannot hold")


def _restore(tensors, cols) -> ColumnarLayout:
    return ColumnarLayout(tensors, cols, validate=False)


def _restore_tiled(tensors, base, copies, stride) -> ColumnarLayout:
    return ColumnarLayout(tensors, base=base, copies=copies, stride=stride)


# --------------------------------------------------------------------------------------------------------
# Builder: boxes for whole arrays of ranks at once
# --------------------------------------------------------------------------------------------------------


def _local_ids(locals_: list, lens: np.ndarray, lid: Mapping[str, int]) -> np.ndarray:
    """The local-tensor id of every row of some blocks: a name per block, or (names, index per row)."""
    if all(type(x) is str for x in locals_):
        return np.repeat(np.fromiter((lid[x] for x in locals_), _I64, len(locals_)), lens)
    return np.concatenate([np.full(k, lid[x], _I64) if type(x) is str
                           else np.fromiter((lid[n] for n in x[0]), _I64, len(x[0]))[x[1]]
                           for x, k in zip(locals_, lens.tolist(), strict=True)])


def _is_scalar(v) -> bool:
    return type(v) is int


_SPEC_FIELDS = ("name", "shape", "dtype", "quant")


_FAST_SPECS = getattr(TensorSpec, "__slots__", None) == _SPEC_FIELDS
_set_name, _set_shape, _set_dtype, _set_quant = ((TensorSpec.__dict__[k].__set__ if _FAST_SPECS else None)
                                                 for k in _SPEC_FIELDS)


_LOCAL_FIELDS = ("rank", "name", "shape", "dtype")
_LOCAL_SET = slot_setters(LocalSpec, _LOCAL_FIELDS)


def _local_spec(rank, name, shape, dtype) -> LocalSpec:
    if _LOCAL_SET is None:
        return LocalSpec(rank, name, shape, dtype)
    x = object.__new__(LocalSpec)
    a, b, c, d = _LOCAL_SET
    a(x, rank)
    b(x, name)
    c(x, shape)
    d(x, dtype)
    return x


def trusted_spec(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
    """``TensorSpec(name, shape, dtype)`` without the argument checks, for builders that make ~10^5 of them
    from a model config (a plain tuple of ints >= 0, a torch.dtype); the checked constructor otherwise."""
    if not _FAST_SPECS or type(dtype) is not torch.dtype or type(shape) is not tuple or min(shape, default=0) < 0:
        return TensorSpec(name, shape, dtype)
    n = 1
    for d in shape:
        n *= d
    if n * 8 > MAX_TENSOR_BYTES:
        check_bytes(shape, dtype, f"tensor {name!r}")
    t = object.__new__(TensorSpec)
    _set_name(t, name)
    _set_shape(t, shape)
    _set_dtype(t, dtype)
    _set_quant(t, None)
    return t


class ColumnBuilder:
    """Collects local tensors and boxes, each call for one rank or a whole array of ranks, then builds a
    :class:`ColumnarLayout`.

    ``local(ranks, name, shape)``: local tensor ``name`` on every rank of ``ranks`` (an int or an int array);
    shape entries may be ints or arrays (one per rank). ``box(tensor, ranks, local, offsets, sizes,
    local_offsets)``: one box per rank; ``tensor`` a name or a sequence of names (one per rank); every
    offset / size entry an int or an array broadcast against ``ranks``. Boxes with a zero size are dropped.
    A local tensor declared twice on a rank must have the same shape (the builder raises otherwise).
    """

    def __init__(self, tensors: LogicalTensors | Iterable[TensorSpec], dtype: torch.dtype) -> None:
        self.tensors = tensors if isinstance(tensors, LogicalTensors) else LogicalTensors.from_specs(tensors)
        self.dtype = dtype
        self._rows: list[tuple] = []  # scalar boxes: (tensor, rank, local, offsets, sizes, local_offsets)
        self._blocks: list[tuple] = []  # array boxes: (tensor ids [n], ranks [n], local, off [n, nd], sz, lo [n, lnd])
        self._lrows: list[tuple] = []  # scalar locals: (rank, name, shape, dtype)
        self._lblocks: list[tuple] = []  # array locals: (ranks [n], name, shape [n, k], dtype)

    @property
    def tensor_ids(self) -> dict[str, int]:
        return self.tensors.index

    def shape_of(self, tensor: str) -> tuple[int, ...]:
        return self.tensors.shapes[self.tensors.index[tensor]]

    def dtype_of(self, tensor: str) -> torch.dtype:
        return self.tensors.dtypes[self.tensors.index[tensor]]

    def local(self, ranks, name: str, shape: Sequence, dtype: torch.dtype | None = None) -> str:
        dtype = self.dtype if dtype is None else dtype
        if _is_scalar(ranks) and type(name) is str and all(map(_is_scalar, shape)):
            self._lrows.append((ranks, name, tuple(shape), dtype))
            return name
        r = np.asarray(ranks, dtype=_I64).reshape(-1)
        sh = np.empty((len(r), len(shape)), _I64)
        for j, x in enumerate(shape):
            sh[:, j] = x
        if type(name) is tuple:  # (names, index per rank)
            name = (tuple(name[0]), np.broadcast_to(np.asarray(name[1], dtype=_I64), (len(r),)))
        self._lblocks.append((r, name, sh, dtype))
        return name

    def box(self, tensor, ranks, local: str, offsets: Sequence, sizes: Sequence, local_offsets: Sequence = ()) -> None:
        if not local_offsets:
            local_offsets = (0,) * len(offsets)
        if (_is_scalar(ranks) and type(tensor) is str and type(local) is str and all(map(_is_scalar, offsets))
                and all(map(_is_scalar, sizes)) and all(map(_is_scalar, local_offsets))):
            if min(sizes, default=1) > 0:
                if tensor not in self.tensors.index:
                    raise AssertionError(f"unknown logical tensor {tensor!r}")
                self._rows.append((tensor, ranks, local, tuple(offsets), tuple(sizes), tuple(local_offsets)))
            return
        r = np.asarray(ranks, dtype=_I64).reshape(-1)
        n = len(r)
        if isinstance(tensor, np.ndarray) and tensor.dtype.kind in "iu":  # tensor ids (index of tensors.names)
            t = np.broadcast_to(tensor.astype(_I64, copy=False), (n,))
            if n and (int(t.min()) < 0 or int(t.max()) >= len(self.tensors)):
                raise AssertionError(f"tensor ids out of range: {t.min()}..{t.max()} of {len(self.tensors)}")
        elif type(tensor) is str:
            if tensor not in self.tensors.index:
                raise AssertionError(f"unknown logical tensor {tensor!r}")
            t = np.full(n, self.tensor_ids[tensor], dtype=_I64)
        else:
            ids = self.tensor_ids
            try:
                t = np.fromiter((ids[x] for x in tensor), _I64, n)
            except KeyError as e:
                raise AssertionError(f"unknown logical tensor {e.args[0]!r}") from None

        def cols(vals) -> np.ndarray:
            out = np.empty((n, len(vals)), _I64)
            for j, x in enumerate(vals):
                out[:, j] = x
            return out

        off, sz, lo = cols(offsets), cols(sizes), cols(local_offsets)
        if sz.shape[1]:
            keep = (sz > 0).all(axis=1)
            if not keep.all():
                t, r, off, sz, lo = t[keep], r[keep], off[keep], sz[keep], lo[keep]
        if type(local) is tuple:  # (names, index per rank): a different local tensor per rank
            names, which = local
            which = np.broadcast_to(np.asarray(which, dtype=_I64), (n,))
            if sz.shape[1] and not keep.all():
                which = which[keep]
            local = (tuple(names), which)
        if len(r):
            self._blocks.append((t, r, local, off, sz, lo))

    def build(self, validate: bool = True) -> ColumnarLayout:
        cols = self._assemble()
        # the collected boxes and the assembly's int64 temporaries are gone before the validation allocates its
        # own: the peak memory of a build
        self._rows, self._blocks, self._lrows, self._lblocks = [], [], [], []
        return ColumnarLayout(self.tensors, cols, validate=validate)

    def _assemble(self) -> _Columns:
        lt = self.tensors
        names = lt.names
        tid = self.tensor_ids
        lnames = sorted({x[1] for x in self._lrows} | {x[2] for x in self._rows}
                        | {n for x in self._lblocks for n in ((x[1],) if type(x[1]) is str else x[1][0])}
                        | {n for x in self._blocks for n in ((x[2],) if type(x[2]) is str else x[2][0])})
        lid = {n: i for i, n in enumerate(lnames)}
        dtypes = list(dict.fromkeys([self.dtype, *lt.dtypes] + [x[3] for x in self._lrows]
                                    + [x[3] for x in self._lblocks]))
        did = {d: i for i, d in enumerate(dtypes)}
        # fragments
        D = max(map(len, lt.shapes), default=0)
        L = max([len(x[5]) for x in self._rows] + [b[5].shape[1] for b in self._blocks] + [D])
        parts = []
        if self._rows:
            rows = self._rows
            k = len(rows)
            t = np.fromiter((tid[x[0]] for x in rows), _I64, k)
            r = np.fromiter((x[1] for x in rows), _I64, k)
            fl = np.fromiter((lid[x[2]] for x in rows), _I64, k)
            off, sz = np.zeros((k, D), _I64), np.ones((k, D), _I64)
            lo = np.full((k, L), -1, _I64)
            flnd = np.fromiter((len(x[5]) for x in rows), _I64, k)
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, x in enumerate(rows):
                by_shape.setdefault((len(x[3]), len(x[5])), []).append(i)
            for (nd, lnd), idx in by_shape.items():
                ix = np.asarray(idx)
                if nd:
                    off[ix, :nd] = [rows[i][3] for i in idx]
                    sz[ix, :nd] = [rows[i][4] for i in idx]
                if lnd:
                    lo[ix, :lnd] = [rows[i][5] for i in idx]
            parts.append((t, r, fl, off, sz, lo, flnd))
        groups: dict[tuple[int, int], list[tuple]] = {}  # (nd, local nd) -> blocks: concatenated per group
        for blk in self._blocks:
            groups.setdefault((blk[3].shape[1], blk[5].shape[1]), []).append(blk)
        for (nd, lnd_), blks in groups.items():
            lens = np.fromiter((len(x[1]) for x in blks), _I64, len(blks))
            k = int(lens.sum())
            off, sz = np.zeros((k, D), _I64), np.ones((k, D), _I64)
            off[:, :nd] = np.concatenate([x[3] for x in blks])
            sz[:, :nd] = np.concatenate([x[4] for x in blks])
            lo = np.full((k, L), -1, _I64)
            lo[:, :lnd_] = np.concatenate([x[5] for x in blks])
            fl = _local_ids([x[2] for x in blks], lens, lid)
            parts.append((np.concatenate([x[0] for x in blks]), np.concatenate([x[1] for x in blks]), fl, off, sz,
                          lo, np.full(k, lnd_, _I64)))
        if parts:
            cat = []
            for j in range(7):  # one column at a time, compacted (int32) and its parts dropped
                cat.append(_compact(np.concatenate([p[j] for p in parts])))
                for k in range(len(parts)):
                    parts[k] = parts[k][:j] + (None,) + parts[k][j + 1:]
            ft, fr, fl, foff, fsz, flo, flnd = cat
            del cat, parts
        else:
            ft = fr = fl = flnd = np.zeros(0, _I64)
            foff, fsz, flo = np.zeros((0, D), _I64), np.zeros((0, D), _I64), np.zeros((0, L), _I64)
        covered = np.zeros(len(names), bool)
        covered[ft] = True
        if not covered.all():
            missing = [names[i] for i in np.flatnonzero(~covered)[:5]]
            raise AssertionError(f"layout builder left tensors without any fragment: {missing}")
        order = _frag_order(ft, fr, fl, foff, flo)
        ft = ft[order]  # (one column at a time: one unsorted copy alive, not seven)
        fr = fr[order]
        fl = fl[order]
        foff = foff[order]
        fsz = fsz[order]
        flo = flo[order]
        flnd = flnd[order]
        del order
        # locals
        S = max([len(x[2]) for x in self._lrows] + [b[2].shape[1] for b in self._lblocks] + [0])
        lparts = []
        if self._lrows:
            lr_ = self._lrows
            k = len(lr_)
            sh = np.full((k, S), -1, _I64)
            for i, x in enumerate(lr_):
                sh[i, :len(x[2])] = x[2]
            lparts.append((np.fromiter((x[0] for x in lr_), _I64, k), np.fromiter((lid[x[1]] for x in lr_), _I64, k),
                           sh, np.fromiter((len(x[2]) for x in lr_), _I64, k),
                           np.fromiter((did[x[3]] for x in lr_), _I64, k)))
        lgroups: dict[int, list[tuple]] = {}
        for blk in self._lblocks:
            lgroups.setdefault(blk[2].shape[1], []).append(blk)
        for nd, blks in lgroups.items():
            lens = np.fromiter((len(x[0]) for x in blks), _I64, len(blks))
            k = int(lens.sum())
            sh = np.full((k, S), -1, _I64)
            sh[:, :nd] = np.concatenate([x[2] for x in blks])
            lparts.append((np.concatenate([x[0] for x in blks]),
                           _local_ids([x[1] for x in blks], lens, lid), sh,
                           np.full(k, nd, _I64), np.repeat(np.fromiter((did[x[3]] for x in blks), _I64, len(blks)), lens)))
        if lparts:
            lr, ln, lsh, lnd, ldt = (np.concatenate([p[j] for p in lparts]) for j in range(5))
        else:
            lr = ln = lnd = ldt = np.zeros(0, _I64)
            lsh = np.zeros((0, S), _I64)
        lorder = np.lexsort((ln, lr))
        lr, ln, lsh, lnd, ldt = lr[lorder], ln[lorder], lsh[lorder], lnd[lorder], ldt[lorder]
        if len(lr) > 1:  # a local tensor declared on a rank more than once: one entry, the same shape each time
            dup = (lr[1:] == lr[:-1]) & (ln[1:] == ln[:-1])
            if dup.any():
                bad = dup & ((lsh[1:] != lsh[:-1]).any(axis=1) | (lnd[1:] != lnd[:-1]))
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise AssertionError(f"local tensor {lnames[ln[i]]!r} on rank {lr[i]} declared twice with "
                                         f"different shapes")
                keep = np.ones(len(lr), bool)
                keep[1:] = ~dup
                lr, ln, lsh, lnd, ldt = lr[keep], ln[keep], lsh[keep], lnd[keep], ldt[keep]
        cols = _Columns(names, lnames, dtypes, ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt)
        return cols


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)
