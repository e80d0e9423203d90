"""The column storage of a columnar layout: its logical tensors (:class:`LogicalTensors`, each
:class:`~triton_reshard.layout.specs.TensorSpec` built on first use), the numpy columns of its fragments and local
tensors (:class:`Columns`, in Layout order), and the unchecked spec constructors the builders use."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from itertools import chain
from operator import itemgetter

import numpy as np
import torch

from .specs import (
    MAX_TENSOR_BYTES,
    LocalSpec,
    TensorSpec,
    check_bytes,
    check_names,
    dtype_name,
    slot_setters,
)

I64 = np.int64


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
        dts = [dtype] * len(names)  # (a few exceptions among ~10^5 names: placed by bisection)
        for n, d in dtypes.items():
            dts[bisect_left(names, n)] = d
        shp = itemgetter(*names)(shapes) if len(names) > 1 else tuple(map(shapes.__getitem__, names))
        if set(map(type, shp)) - {tuple}:
            shp = [tuple(x) for x in shp]
        return cls(names, shp, dts)

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
                dn = {d: dtype_name(d) for d in self.distinct_dtypes}
                self._key = tuple(zip(self.names, self.shapes, map(dn.__getitem__, self.dtypes), strict=True))
        return self._key

    @property
    def quantized(self) -> bool:
        return self._specs is not None and any(t is not None and t.quant is not None for t in self._specs)

    @property
    def distinct_dtypes(self) -> tuple[torch.dtype, ...]:
        """The tensors' dtypes, each once, in order of first appearance (cached)."""
        out = self.cache.get("distinct_dtypes")
        if out is None:
            out = self.cache["distinct_dtypes"] = tuple(dict.fromkeys(self.dtypes))
        return out

    def dtype_ids(self, dtypes: Sequence[torch.dtype]) -> np.ndarray:
        """``[T]`` each tensor's dtype as its index in ``dtypes`` (-1: not there), cached per ``dtypes``."""
        key = ("dtype_ids", tuple(dtypes))
        out = self.cache.get(key)
        if out is None:
            did = {d: i for i, d in enumerate(dtypes)}
            if len(self.distinct_dtypes) == 1:
                out = np.full(len(self), did.get(self.distinct_dtypes[0], -1), I64)
            else:
                code = {d: did.get(d, -1) for d in self.distinct_dtypes}
                out = np.fromiter(map(code.__getitem__, self.dtypes), I64, len(self))
            self.cache[key] = out
        return out

    def shape_table(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ndims [T], shapes [T, width])`` (unused columns 1), cached: what validation compares boxes with."""
        key = ("shape_table", width)
        out = self.cache.get(key)
        if out is None:
            nd = np.fromiter(map(len, self.shapes), I64, len(self))
            sh = np.ones((len(self), width), dtype=I64)
            flat = np.fromiter(chain.from_iterable(self.shapes), I64, int(nd.sum()))  # every dim, tensor by tensor
            row = np.repeat(np.arange(len(self)), nd)
            sh[row, np.arange(len(flat)) - np.repeat(np.cumsum(nd) - nd, nd)] = flat
            out = self.cache[key] = (nd, sh)
        return out


# --------------------------------------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------------------------------------


class Columns:
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
            compact, (ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt))
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
    def rank_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fragment rows sorted by rank, stable; the distinct ranks; their starts)."""
        order = np.argsort(self.fr, kind="stable")
        ranks, starts = np.unique(self.fr[order], return_index=True)
        return order, ranks, np.append(starts, len(order))

    def rows_of_rank(self, rank: int) -> np.ndarray:
        order, ranks, starts = self.rank_order
        i = int(np.searchsorted(ranks, rank))
        if i == len(ranks) or ranks[i] != rank:
            return order[:0]
        return order[starts[i]:starts[i + 1]]

    def locals_of_rank(self, rank: int) -> range:
        i = int(np.searchsorted(self.ranks, rank))
        if i == len(self.ranks) or self.ranks[i] != rank:
            return range(0)
        return range(int(self.lrstart[i]), int(self.lrstart[i + 1]))

    def shift(self, n: int, stride: int) -> Columns:
        """The columns of ``n`` copies, copy ``i`` on the ranks shifted by ``i * stride``, in Layout order."""
        k, m = self.nfrag, self.nlocal
        shift_f = np.repeat(np.arange(n, dtype=I64) * stride, k)
        shift_l = np.repeat(np.arange(n, dtype=I64) * stride, m)
        ft, fr, fl = np.tile(self.ft, n), np.tile(self.fr.astype(I64), n) + shift_f, np.tile(self.fl, n)
        foff, fsz, flo, flnd = (np.tile(a, (n, 1)) if a.ndim == 2 else np.tile(a, n)
                                for a in (self.foff, self.fsz, self.flo, self.flnd))
        lr, ln = np.tile(self.lr.astype(I64), n) + shift_l, np.tile(self.ln, n)
        span = int(self.ranks[-1] - self.ranks[0]) + 1 if len(self.ranks) else 0
        if stride >= span:  # copies on disjoint, increasing ranks: Layout order without sorting
            a = self.tstart[:-1][self.ft]  # first row of each row's tensor
            ln_t = (self.tstart[1:] - self.tstart[:-1])[self.ft]
            c = np.repeat(np.arange(n, dtype=I64), k)
            pos = n * np.tile(a, n) + c * np.tile(ln_t, n) + (np.tile(np.arange(k, dtype=I64) - a, n))
            order = np.empty(n * k, dtype=I64)
            order[pos] = np.arange(n * k, dtype=I64)
            lorder = np.arange(n * m)
        else:
            order = frag_order(ft, fr, fl, foff, flo)
            lorder = np.lexsort((ln, lr))
        return Columns(self.names, self.lnames, self.dtypes, ft[order], fr[order], fl[order], foff[order],
                        fsz[order], flo[order], flnd[order], lr[lorder], ln[lorder],
                        np.tile(self.lsh, (n, 1))[lorder], np.tile(self.lnd, n)[lorder],
                        np.tile(self.ldt, n)[lorder])


def compact(a: np.ndarray) -> np.ndarray:
    """``a`` as int32 when every value fits with room for a sum of two (< 2**30), else int64: half the memory
    of a layout's columns (arithmetic on them casts to int64 where a product could overflow)."""
    if a.dtype == np.int32:
        return a
    if not a.size or (int(a.min()) >= -(1 << 30) and int(a.max()) < 1 << 30):
        return a.astype(np.int32)
    return a.astype(I64, copy=False)


def as_i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=I64)


def frag_order(ft, fr, fl, foff, flo) -> np.ndarray:
    """Row order (tensor, rank, local, offsets, local offsets): the Layout's fragment order (a stable sort)."""
    n = len(ft)
    if n > 1 and min(int(ft.min()), int(fr.min()), int(fl.min())) >= 0:
        # (tensor, rank, local) as one key where it fits: one sort instead of one pass per column; the later
        # columns only order rows that tie on it (two boxes of one tensor in one local tensor: rare)
        R, NL = int(fr.max()) + 1, int(fl.max()) + 1
        if (int(ft.max()) + 1) * R * NL < 1 << 62:
            key = (ft.astype(I64) * R + fr) * NL + fl
            order = np.argsort(key, kind="stable")
            k = key[order]
            if not (k[1:] == k[:-1]).any():
                return order
    keys = [flo[:, j] for j in range(flo.shape[1] - 1, -1, -1)]
    keys += [foff[:, j] for j in range(foff.shape[1] - 1, -1, -1)]
    return np.lexsort(keys + [fl, fr, ft])


_SPEC_FIELDS = ("name", "shape", "dtype", "quant")


_FAST_SPECS = getattr(TensorSpec, "__slots__", None) == _SPEC_FIELDS
_set_name, _set_shape, _set_dtype, _set_quant = ((TensorSpec.__dict__[k].__set__ if _FAST_SPECS else None)
                                                 for k in _SPEC_FIELDS)


_LOCAL_FIELDS = ("rank", "name", "shape", "dtype")
_LOCAL_SET = slot_setters(LocalSpec, _LOCAL_FIELDS)


def trusted_local(rank, name, shape, dtype) -> LocalSpec:
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


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)
