"""The layout: :class:`Layout`, stored as numpy columns, one storage for every layout.

A 1,024-rank DeepSeek-V3 vLLM layout has ~1.2 million fragments and ~0.9 million local tensors; as Python
objects they take ~20 s and ~0.5 GB to build, on every rank. A :class:`Layout` keeps one numpy column per
fragment field (tensor id, rank, local id, offsets, sizes, local offsets) and per local-tensor field, sorted in
layout order (:class:`~triton_reshard.layout.columns.Columns`), however it was built: by
:class:`~triton_reshard.layout.builder.ColumnBuilder` (the presets: ``Layout(tensors, columns)``), or from objects
(``Layout(tensors, fragments, locals)``, ``from_fragments``, ``from_placements``, ``merge``, ``restrict``...:
converted to columns once, :func:`~triton_reshard.layout.objects.to_columns`). ``instances(n)`` is a virtual
tiling of copy 0 (nothing is copied).

The query interface the planner reads is answered from the columns (see the package docstring). The object
view (``fragments``, ``locals``, ``fragments_by_tensor``, ``fragments_by_local``, ``digest``) is built from the
columns on first use, once, kept until ``release_objects``; a layout built from objects starts with the objects
it was given (the same view, already in order). Validation is one decision, on the columns
(:func:`~triton_reshard.layout.check.columns_valid`); when it fails the eager checks
(:func:`~triton_reshard.layout.check.check_layout`) word the problem, naming tensor and rank.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import FrozenInstanceError
from functools import cached_property

import numpy as np
import torch

from ..box import right_align
from .check import check_layout, columns_valid, validate_quant_fragments
from .columns import I64, Columns, LogicalTensors, as_i64, frag_order, trusted_local
from .fragment_table import FragmentTable, TensorRows, content_fingerprint, distinct
from .objects import LayoutBuilders, sorted_parts, to_columns
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
# Layout
# --------------------------------------------------------------------------------------------------------


def _ints(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.int32 or a.dtype == I64 else as_i64(a)


class Layout(LayoutBuilders):
    """Which ranks hold which box of which logical tensor, and where inside which local tensor.

    Build with :meth:`from_placements` (DTensor-style mesh + placements), :meth:`from_fragments` (any
    layout), or combine layouts with :meth:`merge` / ``|``. Validated on construction: fragments inside
    their logical tensor and their local tensor, no two fragments sharing local memory, local tensor dtype
    equal to the logical dtype (a violation raises ``ValueError`` or ``TypeError`` naming the tensor).

    ``Layout(tensors, fragments, locals)`` is what those builders call: it takes already-built ``TensorSpec`` /
    ``Fragment`` / ``LocalSpec`` sequences and works, but prefer the builders, which also fill in local shapes and
    check your inputs' types. ``Layout(tensors, columns)`` (a :class:`~triton_reshard.layout.columns.Columns`, in
    layout order; ``tensors`` a ``LogicalTensors``) is what :class:`ColumnBuilder` calls. Either way the layout is
    stored as columns (see the module docstring). A Layout is immutable and hashable (plans are cached on it);
    ``digest`` names its contents; equal contents are equal layouts, however they were built.
    """

    def __init__(self, tensors: LogicalTensors | Iterable[TensorSpec], fragments: Iterable[Fragment] | Columns,
                 locals: Iterable[LocalSpec] = (), *, validate: bool = True) -> None:  # noqa: A002  (the field's name)
        d = self.__dict__
        d["_base"], d["_copies"], d["_stride"] = None, 1, 0
        if isinstance(fragments, Columns):  # a column builder's columns
            lt = tensors if isinstance(tensors, LogicalTensors) else LogicalTensors.from_specs(tensors)
            d["_lt"], d["_cols"] = lt, fragments
            if validate:
                self._validate(None)
            return
        parts = sorted_parts(tensors, fragments, locals)
        d["_lt"], d["_cols"] = to_columns(*parts)
        d["tensors"], d["fragments"], d["locals"] = parts  # the object view: these objects, already in order
        if validate:
            self._validate(parts)

    @classmethod
    def _tiled(cls, base: Layout, copies: int, stride: int) -> Layout:
        """``copies`` copies of ``base`` (a layout of its own columns), copy ``i`` on its ranks + ``i * stride``."""
        self = cls.__new__(cls)
        d = self.__dict__
        d["_lt"], d["_base"], d["_copies"], d["_stride"] = base._lt, base, copies, stride
        return self

    def _validate(self, parts: tuple | None) -> None:
        """One decision, on the columns; a failure is worded by the eager checks (of ``parts``, the objects it was
        built from, else of objects built from the columns with the checking constructors)."""
        if not columns_valid(self._cols, self._lt):
            if parts is None:
                parts = (self.tensors, tuple(Fragment(f.tensor, f.rank, f.offsets, f.sizes, f.local, f.local_offsets)
                                             for f in self.fragments), self.locals)
            check_layout(*parts)
            raise AssertionError("layout: the column checks refuse parts the eager checks accept")
        if self._lt.quantized:  # block quantization: the scales' checks (on the objects; small layouts)
            validate_quant_fragments(self.specs, self.fragments)

    def __setattr__(self, name: str, value) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def tensor_order(self) -> dict[str, int]:
        """Tensor name -> its index among the layout's tensors (sorted by name); from the columns, kept."""
        return self._lt.index

    def shapes_and_dtypes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Tensor name -> (global shape, dtype), without building the specs."""
        lt = self._lt
        return {n: (shape, dt) for n, shape, dt in zip(lt.names, lt.shapes, lt.dtypes, strict=True)}

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The logical tensors, sorted by name."""
        return self._lt.all()

    @cached_property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Tensor name -> its TensorSpec (each built on first use)."""
        lt = self._lt
        return _LazyMap(lt.names, lambda n: lt.spec(lt.index[n]))

    @cached_property
    def quantized(self) -> dict[str, TensorSpec]:
        """The block-quantized tensors (name -> TensorSpec with ``quant``); empty for a plain layout."""
        return {t.name: t for t in self.tensors if t.quant is not None} if self._lt.quantized else {}

    @cached_property
    def scale_of(self) -> dict[str, str]:
        """Scale tensor name -> the quantized tensor it belongs to."""
        return {t.quant.scale: t.name for t in self.quantized.values()}

    def spec(self, name: str) -> TensorSpec:
        """The logical tensor ``name`` (``ValueError`` if the layout has none of that name)."""
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
    def _root(self) -> Layout:
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

    # -- the object view, built from the columns on first use -------------------------------------------------

    _OBJECT_VIEWS = ("fragments", "locals", "_key", "fragments_by_tensor", "fragments_by_local", "_locals_by_rank",
                     "_tables", "_frags_on_rank")

    @property
    def objects_built(self) -> bool:
        """Whether every fragment exists as an object (``fragments`` read, or the layout built from objects)."""
        return "fragments" in self.__dict__

    def release_objects(self) -> None:
        """Forget the object view (``fragments``, ``locals`` and the maps over them), built again from the columns
        when next read (what a caller that read every fragment of a 1,024-rank layout once may do: ~0.6 GB)."""
        for k in self._OBJECT_VIEWS:
            self.__dict__.pop(k, None)

    @cached_property
    def fragments(self) -> tuple[Fragment, ...]:
        """Every fragment, in layout order: (tensor, rank, local, offsets, local offsets)."""
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
    def locals(self) -> tuple[LocalSpec, ...]:
        """Every local tensor, in (rank, name) order."""
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
    def digest(self) -> str:
        """A hash of the layout's contents (its tensors, fragments and local tensors: the object view's key)."""
        return hashlib.sha256(repr(self._key).encode()).hexdigest()[:16]

    @cached_property
    def fingerprint(self) -> str:
        """A content identity like ``digest`` (equal layouts, equal fingerprints, however they were built),
        computed from the columns (copies of ``instances`` without tiling them), without building every rank's
        objects (~0.1 s for a 1,024-rank DeepSeek-V3 layout): what ranks compare before a rank plan runs."""
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

    def __hash__(self) -> int:
        return self._hash  # cached: equal layouts have equal tensors, counts and ranks; == compares the contents

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, Layout):
            if self._hash != other._hash:
                return False
            a, b = self._cols, other._cols
            if a.names != b.names or a.lnames != b.lnames or a.dtypes != b.dtypes or self._lt.key != other._lt.key:
                return self._key == other._key
            return all(np.array_equal(x, y) for x, y in (
                (a.ft, b.ft), (a.fr, b.fr), (a.fl, b.fl), (a.foff, b.foff), (a.fsz, b.fsz), (a.flo, b.flo),
                (a.lr, b.lr), (a.ln, b.ln), (a.lsh, b.lsh), (a.ldt, b.ldt)))
        return False

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
        """The ranks holding a local tensor, ascending."""
        base = self._root._cols.ranks.tolist()
        if self._base is None:
            return tuple(base)
        return tuple(sorted(r + i * self._stride for i in range(self._copies) for r in base))

    @cached_property
    def fragments_by_tensor(self) -> Mapping[str, tuple[Fragment, ...]]:
        """Tensor name -> its fragments in layout order (tensors with none left out): slices of ``fragments`` once
        built, else each tensor's built from its table when asked."""
        if "fragments" in self.__dict__:
            frags, c = self.fragments, self._cols  # (in the columns' order)
            st = c.tstart.tolist()
            return {n: frags[st[i]:st[i + 1]] for i, n in enumerate(c.names) if st[i + 1] > st[i]}
        root = self._root._cols
        present = [n for i, n in enumerate(root.names) if root.tstart[i + 1] > root.tstart[i]]
        return _LazyMap(present, lambda n: self.table(n).fragments)

    @cached_property
    def _locals_by_rank(self) -> Mapping[int, dict[str, LocalSpec]]:
        def build(rank: int) -> dict[str, LocalSpec]:
            sp = self._split(rank)
            c = self._root._cols
            rows = c.locals_of_rank(sp[1])
            return {c.lnames[n]: trusted_local(rank, c.lnames[n], tuple(sh[:k]), c.dtypes[dt]) for n, sh, k, dt in zip(
                c.ln[rows.start:rows.stop].tolist(), c.lsh[rows.start:rows.stop].tolist(),
                c.lnd[rows.start:rows.stop].tolist(), c.ldt[rows.start:rows.stop].tolist(), strict=True)}

        return _LazyMap(self.ranks, build)

    @cached_property
    def fragments_by_local(self) -> dict[tuple[str, int, str], tuple[Fragment, ...]]:
        """``(tensor, rank, local) -> fragments``, in layout order."""
        frags = self.fragments
        with gc_paused():
            keys = [(f.tensor, f.rank, f.local) for f in frags]
            out = dict(zip(keys, zip(frags), strict=True))  # one fragment per key: the common case
            if len(out) < len(frags):  # some local tensors hold several boxes of one tensor
                out = {}
                for k, f in zip(keys, frags, strict=True):
                    g = out.get(k)
                    out[k] = (f,) if g is None else g + (f,)
        return out

    def local_specs(self, rank: int) -> dict[str, LocalSpec]:
        """The local tensors ``rank`` holds (name -> LocalSpec); empty if the rank has no part."""
        return dict(self._locals_by_rank[rank]) if rank in self._locals_by_rank else {}

    @cached_property
    def _lname_id(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self._root._cols.lnames)}

    def local_spec(self, rank: int, name: str) -> LocalSpec | None:
        """Rank ``rank``'s local tensor ``name``, None if it has none of that name: one binary search of the
        columns (what the schedule asks of a peer's local tensor, without building the peer's ``local_specs``)."""
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

    def same_tensors(self, other: Layout) -> bool:
        """Whether ``other`` is known, without comparing, to hold the same logical tensors (names, shapes, dtypes)
        as this layout: True when both read one set of specs (a preset's source and destination layouts of one
        model share it); False means "not known", not "different"."""
        return isinstance(other, Layout) and other._lt is self._lt

    @cached_property
    def _local_keys(self) -> np.ndarray:
        """Per local row of the root columns ``rank * len(lnames) + name id``: sorted (locals are in (rank, name)
        order), for the batched lookups of ``local_shape_columns``."""
        c = self._root._cols
        return c.lr.astype(I64) * len(c.lnames) + c.ln

    def local_shape_columns(self, ranks: np.ndarray, names: Sequence[str], codes: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, tuple[torch.dtype, ...]]:
        """Row ``i``: rank ``ranks[i]``'s local tensor ``names[codes[i]]``, as columns: ``(shapes, dtype codes,
        dtypes)``: ``shapes`` ``[m, S]`` int64, each shape right-aligned and padded with 1 on the left (S: the
        longest); ``dtype codes`` ``[m]`` int16 into ``dtypes``, -1 where the rank has no such local tensor (its
        shape row is all 1). What the schedule asks of many transfers' local tensors at once (contiguity)."""
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
        """All fragments on ``rank``, in layout order (built from the columns, kept per rank)."""
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
        """The logical tensors with a non-empty fragment on ``rank``, sorted by name."""
        sp = self._split(rank)
        if sp is None:
            return ()
        c = self._root._cols
        rows = c.rows_of_rank(sp[1])
        if c.fsz.shape[1]:
            rows = rows[(c.fsz[rows] > 0).all(axis=1)]
        return tuple(c.names[i] for i in distinct(c.ft[rows]).tolist())

    TABLE_CACHE = 512  # tables kept per layout (least recently used dropped): a 1,024-rank table is ~50 KB

    def table(self, name: str) -> FragmentTable:
        """The fragments of tensor ``name`` as a :class:`FragmentTable` (built from the columns on first use; the
        last ``TABLE_CACHE`` used are kept: rebuilding one costs ~0.1 ms, keeping all of a 46,000-tensor model's
        at 1,024 ranks would cost GBs)."""
        cache = self.__dict__.get("_tables")
        if cache is None:
            cache = self.__dict__["_tables"] = OrderedDict()
        t = cache.get(name)
        if t is None:
            t = cache[name] = self._build_table(name)
            if len(cache) > self.TABLE_CACHE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(name)
        return t

    def overlapping(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Rows of ``table(name)`` whose box shares an element with ``offsets``+``sizes`` (ascending)."""
        return self.table(name).overlapping(offsets, sizes)

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
        """The fragments of the tensors ``names`` (each a tensor of this layout) as one set of numpy columns,
        grouped by tensor in that order (see :class:`TensorRows`): every row in one gather (copies: their ranks
        shifted)."""
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
        """Bytes of the local tensors of ``rank`` (or of every rank)."""
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
        """``n`` copies of this layout on successive rank blocks: copy ``i`` is this layout with every rank
        shifted by ``i * stride`` (default: the span of its ranks, so copies of a layout on consecutive ranks
        follow each other, e.g. ranks 4-7 → 4-7, 8-11, 12-15). Copy 0 is this layout itself. The copies must not
        share a rank. E.g. several independent inference engines, each a full copy of one engine's layout. The
        copies are a tiling of this layout's columns (nothing is copied)."""
        step = self._instance_step(n, stride)
        if n == 1:
            return self
        base = self
        if self._base is not None:  # copies of copies: one level of tiling, over this layout's columns
            base = Layout(self._lt, self._cols, validate=False)
        return Layout._tiled(base, n, step)


ColumnarLayout = Layout  # the name of the column-stored layout before every layout was (kept for its importers)


def columnar(tensors: Iterable[TensorSpec], fragments: Iterable[Fragment], locals_: Iterable[LocalSpec],
             validate: bool = True) -> Layout:
    """``Layout(tensors, fragments, locals_)`` (every layout is stored as columns; kept for its callers)."""
    return Layout(tensors, fragments, locals_, validate=validate)


def _restore(tensors, cols) -> Layout:
    return Layout(tensors, cols, validate=False)


def _restore_tiled(tensors, base, copies, stride) -> Layout:
    return Layout._tiled(base, copies, stride)
