"""Columnar layouts: a :class:`~triton_reshard.layout.Layout` stored as numpy arrays, for thousand-rank worlds.

A 1,024-rank DeepSeek-V3 vLLM layout has ~1.2 million fragments and ~0.9 million local tensors; as Python
objects they take ~20 s and ~0.5 GB to build, on every rank. :class:`ColumnarLayout` keeps one numpy column
per fragment field (tensor id, rank, local id, offsets, sizes, local offsets) and per local-tensor field, sorted
in Layout order (:mod:`.columns`), and answers the per-tensor / per-rank queries a rank planner needs
(:meth:`Layout.table`, :meth:`Layout.tensor_names_on_rank`, :meth:`Layout.fragments_on_rank`,
:meth:`Layout.local_specs`) from them, without building the other ranks' objects. ``instances(n)`` is a
virtual tiling of copy 0 (nothing is copied). Everything else a Layout offers (``fragments``, ``locals``,
``fragments_by_tensor``, ``==``, ``digest``, ``merge``...) works unchanged: the eager objects are built on
first use, once, and equal what an eager Layout of the same contents holds (same order, same digest).
Validation is the eager Layout's, done vectorized (:mod:`.check`); when it finds a problem the layout is
materialized and the eager validation raises its usual message naming tensor and rank. The builder the
presets use is :class:`~triton_reshard.layout.builder.ColumnBuilder`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property

import numpy as np
import torch

from ..box import right_align
from .check import columns_valid
from .columns import I64, Columns, LogicalTensors, as_i64, frag_order, trusted_local
from .fragment_table import FragmentTable, TensorRows, content_fingerprint
from .objects import Layout
from .specs import (
    FRAG_KEY,
    Fragment,
    LocalSpec,
    TensorSpec,
    dtype_name,
    gc_paused,
    itemsize_of,
    trusted_fragment,
)

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


def _ints(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.int32 or a.dtype == I64 else as_i64(a)


class ColumnarLayout(Layout):
    """A :class:`Layout` stored as numpy columns (see the module docstring); built by :class:`ColumnBuilder`
    (the presets) and by ``instances`` of one. Equal (``==``, ``digest``) to the eager Layout of the same
    contents; ``fragments`` / ``locals`` are built on first use."""

    def __init__(self, tensors: LogicalTensors | Sequence[TensorSpec], cols: Columns | None = None, *,
                 base: ColumnarLayout | None = None, copies: int = 1, stride: int = 0, validate: bool = True) -> None:
        lt = tensors if isinstance(tensors, LogicalTensors) else LogicalTensors.from_specs(tensors)
        object.__setattr__(self, "_lt", lt)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_copies", copies)
        object.__setattr__(self, "_stride", stride)
        if cols is not None:
            self.__dict__["_cols"] = cols
        if base is None and validate and not columns_valid(cols, lt):  # raise the eager checks' message
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
    def _cols(self) -> Columns:
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

    _OBJECT_VIEWS = ("fragments", "locals", "_key", "fragments_by_tensor", "fragments_by_local", "_fragments_by_rank",
                     "_locals_by_rank", "_tables")

    @property
    def objects_built(self) -> bool:
        return "fragments" in self.__dict__

    def release_objects(self) -> None:
        # the eager views are caches of the columns: dropped, they are built again on the next read
        for k in self._OBJECT_VIEWS:
            self.__dict__.pop(k, None)

    @cached_property
    def fragments(self) -> tuple[Fragment, ...]:  # type: ignore[override]
        c = self._cols
        names, lnames = c.names, c.lnames
        D = c.foff.shape[1]
        nds = np.fromiter(map(len, self._lt.shapes), I64, len(self._lt))
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
            return tuple(trusted_local(r, c.lnames[n], tuple(sh[:k]), c.dtypes[dt]) for r, n, sh, k, dt in zip(
                c.lr.tolist(), c.ln.tolist(), c.lsh.tolist(), c.lnd.tolist(), c.ldt.tolist(), strict=True))

    @cached_property
    def _key(self) -> tuple:
        frags, locs = self.fragments, self.locals

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
        order = c.rank_order[0]
        fr, rest = c.fr[order], (c.ft[order], c.fl[order], c.foff[order], c.fsz[order], c.flo[order][:, :L])
        n = self._copies if tiled else 1
        copies = [(fr.astype(I64) + i * self._stride, *rest) for i in range(n)]
        S = int(c.lnd.max()) if c.nlocal else 0
        locs = [(c.lr.astype(I64) + i * self._stride, c.ln, c.lsh[:, :S], c.ldt) for i in range(n)]
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
            return {c.lnames[n]: trusted_local(rank, c.lnames[n], tuple(sh[:k]), c.dtypes[dt]) for n, sh, k, dt in zip(
                c.ln[rows.start:rows.stop].tolist(), c.lsh[rows.start:rows.stop].tolist(),
                c.lnd[rows.start:rows.stop].tolist(), c.ldt[rows.start:rows.stop].tolist(), strict=True)}

        return _LazyMap(self.ranks, build)

    def local_specs(self, rank: int) -> dict[str, LocalSpec]:
        return dict(self._locals_by_rank[rank]) if rank in self._locals_by_rank else {}

    @cached_property
    def _lname_id(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self._root._cols.lnames)}

    def local_spec(self, rank: int, name: str) -> LocalSpec | None:  # from the columns: one binary search
        sp = self._split(rank)
        lid = self._lname_id.get(name)
        if sp is None or lid is None:
            return None
        c = self._root._cols
        rows = c.locals_of_rank(sp[1])  # a rank's locals sorted by name id (ids in name order)
        j = rows.start + int(np.searchsorted(c.ln[rows.start:rows.stop], lid))
        if j >= rows.stop or int(c.ln[j]) != lid:
            return None
        return trusted_local(rank, name, tuple(c.lsh[j, :int(c.lnd[j])].tolist()), c.dtypes[int(c.ldt[j])])

    def same_tensors(self, other: Layout) -> bool:  # one LogicalTensors (the presets share it per model)
        return isinstance(other, ColumnarLayout) and other._lt is self._lt

    @cached_property
    def _local_keys(self) -> np.ndarray:
        """Per local row of the root columns ``rank * len(lnames) + name id``: sorted (locals are in (rank, name)
        order), for the batched lookups of ``local_shape_columns``."""
        c = self._root._cols
        return c.lr.astype(I64) * len(c.lnames) + c.ln

    def local_shape_columns(self, ranks: np.ndarray, names: Sequence[str], codes: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, tuple[torch.dtype, ...]]:
        # vectorized: a name's id, a rank's copy (instances), one binary search over the sorted (rank, name) keys
        c = self._root._cols
        ranks = np.asarray(ranks, I64)
        lid = np.array([self._lname_id.get(n, -1) for n in names] or [-1], I64)[np.asarray(codes, I64)]
        if self._base is None:
            base = ranks
        else:
            base = np.full(len(ranks), -1, I64)
            for i in range(self._copies):  # the first copy holding the rank (``_split``)
                r = ranks - i * self._stride
                hit = (base < 0) & np.isin(r, c.ranks)
                base[hit] = r[hit]
        keys = self._local_keys
        if not len(keys):  # no local tensor at all
            return np.ones((len(ranks), 0), I64), np.full(len(ranks), -1, np.int16), tuple(c.dtypes)
        q = base * len(c.lnames) + lid
        j = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
        found = (lid >= 0) & (base >= 0) & (keys[j] == q)
        shp = right_align(c.lsh[j], np.where(found, c.lnd[j], 0), c.lsh.shape[1])
        return shp, np.where(found, c.ldt[j], -1).astype(np.int16), tuple(c.dtypes)

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
            ranks = np.tile(ranks.astype(I64), n) + np.repeat(np.arange(n, dtype=I64) * self._stride, k)
            off, sz, fl, flo, flnd = np.tile(off, (n, 1)), np.tile(sz, (n, 1)), np.tile(fl, n), np.tile(flo, (n, 1)), \
                np.tile(flnd, n)
            if n > 1 and (np.diff(ranks) < 0).any():  # interleaved copies: back to Layout order
                order = frag_order(np.zeros(len(ranks), I64), ranks, fl, off, flo)
                ranks, off, sz, fl, flo, flnd = ranks[order], off[order], sz[order], fl[order], flo[order], flnd[order]
        # views of the columns where they are already compact (int32 holds them: every value < 2**30, a sum of two
        # fits), int64 where they are not: a copy of six columns per table cost a rank plan ~0.1 s at 1,024 ranks
        return FragmentTable(spec, _ints(ranks), _ints(off), _ints(sz), fl if fl.dtype == np.int32 else fl.astype(np.int32),
                             c.lnames, _ints(flo), _ints(flnd))

    def tensor_rows(self, names: Sequence[str]) -> TensorRows:
        """From the columns: every row of these tensors in one gather (copies: their ranks shifted)."""
        root = self._root
        c = root._cols
        tid = np.fromiter((root._tid[n] for n in names), I64, len(names))
        a, b = c.tstart[tid].astype(I64), c.tstart[tid + 1].astype(I64)
        n = 1 if self._base is None else self._copies
        counts = (b - a) * n  # each tensor's rows, once per copy
        starts = np.concatenate(([0], np.cumsum(counts))).astype(I64)
        seg = np.repeat(np.arange(len(tid), dtype=I64), counts)
        pos = np.arange(int(starts[-1]), dtype=I64) - starts[:-1][seg]
        per = (b - a)[seg]
        rows = a[seg] + (pos % np.maximum(per, 1))
        ranks = c.fr[rows].astype(I64)
        if n > 1:
            ranks += (pos // np.maximum(per, 1)) * self._stride
        shapes = root._lt.shapes
        return TensorRows(names, [len(shapes[t]) for t in tid.tolist()], starts, ranks, c.foff[rows], c.fsz[rows],
                          c.fl[rows], c.lnames, c.flo[rows], c.flnd[rows])

    def nbytes(self, rank: int | None = None) -> int:
        c = self._root._cols
        item = np.array([itemsize_of(d) for d in c.dtypes], dtype=I64)
        sh = np.where(c.lsh < 0, 1, c.lsh)
        per = sh.astype(I64).prod(axis=1) * item[c.ldt] if len(c.lr) else np.zeros(0, I64)
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
    foff, fsz, flo = np.zeros((n, D), I64), np.ones((n, D), I64), np.full((n, L), -1, I64)
    for i, f in enumerate(frags):
        if len(f.offsets) > D or len(f.sizes) != len(f.offsets):
            return _eager_raise(lt, frags, locs)
        foff[i, :len(f.offsets)], fsz[i, :len(f.sizes)] = f.offsets, f.sizes
        flo[i, :len(f.local_offsets)] = f.local_offsets
    try:
        ft = np.fromiter((lt.index[f.tensor] for f in frags), I64, n)
    except KeyError:
        return _eager_raise(lt, frags, locs)
    fr = np.fromiter((f.rank for f in frags), I64, n)
    fl = np.fromiter((lid[f.local] for f in frags), I64, n)
    flnd = np.fromiter((len(f.local_offsets) for f in frags), I64, n)
    if (np.fromiter(map(len, lt.shapes), I64, len(lt))[ft] != np.fromiter((len(f.offsets) for f in frags), I64, n)).any():
        return _eager_raise(lt, frags, locs)  # a box with the wrong number of dims
    order = frag_order(ft, fr, fl, foff, flo)
    lsh = np.full((m, S), -1, I64)
    for i, x in enumerate(locs):
        lsh[i, :len(x.shape)] = x.shape
    lr = np.fromiter((x.rank for x in locs), I64, m)
    ln = np.fromiter((lid[x.name] for x in locs), I64, m)
    lo_ = np.lexsort((ln, lr))
    cols = Columns(lt.names, lnames, dtypes, ft[order], fr[order], fl[order], foff[order], fsz[order], flo[order],
                    flnd[order], lr[lo_], ln[lo_], lsh[lo_], np.fromiter((len(x.shape) for x in locs), I64, m)[lo_],
                    np.fromiter((did[x.dtype] for x in locs), I64, m)[lo_])
    return ColumnarLayout(lt, cols, validate=validate)


def _eager_raise(lt: LogicalTensors, frags, locs) -> ColumnarLayout:
    Layout(lt.all(), tuple(frags), tuple(locs))  # raises its message
    raise AssertionError("columnar: parts the eager Layout accepts but the columns cannot hold")


def _restore(tensors, cols) -> ColumnarLayout:
    return ColumnarLayout(tensors, cols, validate=False)


def _restore_tiled(tensors, base, copies, stride) -> ColumnarLayout:
    return ColumnarLayout(tensors, base=base, copies=copies, stride=stride)
