"""Transfers as columns: :class:`TransferTable`, the storage of a plan's wire transfers and local copies.

One row per transfer, struct of arrays (numpy): the tensor (a code into ``names``), its box (``offsets`` /
``sizes``, ``[n, D]`` padded with 0 / 1, ``ndim`` per row), each end's rank, local tensor (a code into
``locals``) and where the box starts in it (``src_offsets`` / ``dst_offsets``, ``[n, L]`` padded with 0,
``src_ndim`` / ``dst_ndim`` per row), the wire dtype (a code into ``dtypes``), ``relay``, ``quant`` (0 plain,
1 source-, 2 destination-quantized; their block, scale tensor and scale offsets, rare, in ``extras``) and the
payload ``nbytes``. A table is a read-only ``Sequence`` of :class:`~triton_reshard.plan.types.Transfer`: reading a
row builds its object (a light view; a small table keeps its objects once built), so the few callers that want
objects (the executor of one rank's share, ``describe``) read them, and the checks, statistics, digest and
schedule read the columns. ``src`` / ``dst`` are the rank columns under their short names.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from ..layout import dtype_name, gc_paused, itemsize_of
from ..layout.fragment_table import distinct
from .types import Transfer

I64 = np.int64
QUANT_CODES = {"": 0, "src": 1, "dst": 2}


def _extra(t) -> tuple:
    """A quantized row's extras: block, scale local, scale offsets and the format (a ``QuantFormat``)."""
    return (t.block, t.scale_local, t.scale_offsets, t.fmt)


def _keyed(e: tuple) -> tuple:
    """A row's extras as its digest reads them: the format by its tag (the plan-format version rule of
    ``layout.formats``: block-FP8 tables keep their digests)."""
    return e[:3] + e[3].tag
_QUANT_NAMES = ("", "src", "dst")
_FIELDS = attrgetter("tensor", "offsets", "sizes", "src_rank", "src_local", "src_offsets", "dst_rank", "dst_local",
                     "dst_offsets", "wire_dtype", "relay", "quant")
SMALL = 1 << 16  # a table at most this long keeps the objects it built (one rank's share); a bigger one builds each
_BATCH = 1 << 13  # rows turned into objects per batch when iterating


def _codes(values: Sequence, n: int) -> tuple[tuple, np.ndarray]:
    """``(distinct values in order of first appearance, codes [n] int32)``."""
    ids: dict = {}
    codes = np.fromiter((ids.setdefault(v, len(ids)) for v in values), np.int32, n)
    return tuple(ids), codes


def _padded(tuples: Sequence[tuple[int, ...]], n: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged int tuples as ``([n, W] padded with fill, lengths [n])``."""
    lens = np.fromiter(map(len, tuples), np.int8, n)
    w = int(lens.max()) if n else 0
    flat = np.fromiter(chain.from_iterable(tuples), I64, int(lens.sum(dtype=I64)))
    out = np.full((n, w), fill, I64)
    if w:
        if (lens == w).all():
            out[:] = flat.reshape(n, w)
        else:
            out[np.arange(w)[None, :] < lens[:, None]] = flat
    return out, lens


def widen(a: np.ndarray, w: int, fill: int) -> np.ndarray:
    """``[n, k]`` ints as int64 ``[n, w]`` (``w >= k``), padded with ``fill`` (``a`` itself when already so)."""
    a = np.asarray(a, I64)
    return a if a.shape[1] == w else np.concatenate([a, np.full((len(a), w - a.shape[1]), fill, I64)], 1)


class TransferTable(Sequence):
    """A plan's transfers as columns (see the module doc). Build with :meth:`of` (from ``Transfer`` objects),
    :meth:`concat` and :meth:`take`; never written after."""

    __slots__ = ("names", "locals", "dtypes", "tensor", "ndim", "offsets", "sizes", "src", "src_local",
                 "src_ndim", "src_offsets", "dst", "dst_local", "dst_ndim", "dst_offsets", "wdt", "relay", "quant",
                 "nbytes", "extras", "_objs")

    QUANT_CODES = QUANT_CODES

    def __init__(self, names: tuple[str, ...], locals_: tuple[str, ...], dtypes: tuple[torch.dtype, ...], cols: dict,
                 extras: dict[int, tuple]) -> None:
        self.names, self.locals, self.dtypes = names, locals_, dtypes
        for k, a in cols.items():
            a.setflags(write=False)
            setattr(self, k, a)
        self.extras = extras  # row -> (block, scale_local, scale_offsets, fmt) of its quantized rows
        self._objs: tuple[Transfer, ...] | None = None

    # -- building ---------------------------------------------------------------------------------------

    @classmethod
    def of(cls, transfers: Iterable[Transfer] | TransferTable) -> TransferTable:
        """The table of ``transfers`` (a table is returned as it is)."""
        if isinstance(transfers, TransferTable):
            return transfers
        ts = transfers if isinstance(transfers, (list, tuple)) else list(transfers)
        n = len(ts)
        for t in ts:
            if type(t) is not Transfer:
                raise TypeError(f"plan: a transfer must be a Transfer, got {type(t).__name__} ({t!r})")
        with gc_paused():  # one pass over the objects, then whole columns (its tuples are acyclic)
            cols = tuple(zip(*map(_FIELDS, ts), strict=True)) if n else ((),) * 12
            tensor, off, size, sr, sl, so, dr, dl, do, wdt, relay, quant = cols
            names, tcodes = _codes(tensor, n)
            locs, _ = _codes(chain(sl, dl), 2 * n)
            lid = {s: i for i, s in enumerate(locs)}
            dts, dcodes = _codes(wdt, n)
            offsets, nd = _padded(off, n, 0)
            sizes, nd2 = _padded(size, n, 1)
            if (nd != nd2).any():
                i = int(np.flatnonzero(nd != nd2)[0])
                raise ValueError(f"plan: transfer {ts[i]} of tensor {ts[i].tensor!r}: offsets and sizes differ in length")
            so_a, snd = _padded(so, n, 0)
            do_a, dnd = _padded(do, n, 0)
            q = np.fromiter(map(QUANT_CODES.__getitem__, quant), np.int8, n)
            extras = {i: _extra(ts[i]) for i in np.flatnonzero(q).tolist()}
            table = cls(names, locs, dts, dict(
                tensor=tcodes, ndim=nd, offsets=offsets, sizes=sizes,
                src=np.fromiter(sr, I64, n), src_local=np.fromiter(map(lid.__getitem__, sl), np.int32, n),
                src_ndim=snd, src_offsets=so_a,
                dst=np.fromiter(dr, I64, n), dst_local=np.fromiter(map(lid.__getitem__, dl), np.int32, n),
                dst_ndim=dnd, dst_offsets=do_a,
                wdt=dcodes.astype(np.int8), relay=np.fromiter(relay, np.bool_, n), quant=q,
                nbytes=np.zeros(n, I64)), extras)
        nb = table.sizes.prod(axis=1, dtype=I64) * table.itemsizes[table.wdt]
        for i in extras:  # fp8 values and one fp32 scale per block (``Transfer.nbytes``)
            if q[i] == 1:
                nb[i] = ts[i].nbytes
        table.nbytes = nb
        nb.setflags(write=False)
        if n <= SMALL and isinstance(ts, tuple):
            table._objs = ts
        return table

    @classmethod
    def empty(cls) -> TransferTable:
        return cls.of(())

    @classmethod
    def concat(cls, tables: Sequence[TransferTable]) -> TransferTable:
        """The rows of ``tables`` one after the other."""
        tables = [t for t in tables if len(t)]
        if not tables:
            return cls.empty()
        if len(tables) == 1:
            return tables[0]
        names, locs, dts = {}, {}, {}
        remap = []
        for t in tables:
            remap.append(tuple(np.array([d.setdefault(v, len(d)) for v in vals] or [0], np.int32)
                               for d, vals in ((names, t.names), (locs, t.locals), (dts, t.dtypes))))
        D = max(t.offsets.shape[1] for t in tables)
        L = max(max(t.src_offsets.shape[1], t.dst_offsets.shape[1]) for t in tables)

        cols = dict(
            tensor=np.concatenate([m[0][t.tensor] for t, m in zip(tables, remap, strict=True)]),
            src_local=np.concatenate([m[1][t.src_local] for t, m in zip(tables, remap, strict=True)]),
            dst_local=np.concatenate([m[1][t.dst_local] for t, m in zip(tables, remap, strict=True)]),
            wdt=np.concatenate([m[2][t.wdt] for t, m in zip(tables, remap, strict=True)]).astype(np.int8),
            offsets=np.concatenate([widen(t.offsets, D, 0) for t in tables]),
            sizes=np.concatenate([widen(t.sizes, D, 1) for t in tables]),
            src_offsets=np.concatenate([widen(t.src_offsets, L, 0) for t in tables]),
            dst_offsets=np.concatenate([widen(t.dst_offsets, L, 0) for t in tables]),
        )
        for k in ("ndim", "src", "src_ndim", "dst", "dst_ndim", "relay", "quant", "nbytes"):
            cols[k] = np.concatenate([getattr(t, k) for t in tables])
        extras, base = {}, 0
        for t in tables:
            extras.update({base + i: x for i, x in t.extras.items()})
            base += len(t)
        return cls(tuple(names), tuple(locs), tuple(dts), cols, extras)

    def take(self, rows: np.ndarray) -> TransferTable:
        """The table of ``rows`` (indices, in that order; or a boolean mask)."""
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            rows = np.flatnonzero(rows)
        cols = {k: getattr(self, k)[rows] for k in ("tensor", "ndim", "offsets", "sizes", "src", "src_local",
                                                     "src_ndim", "src_offsets", "dst", "dst_local", "dst_ndim",
                                                     "dst_offsets", "wdt", "relay", "quant", "nbytes")}
        extras = {}
        if self.extras:
            pos = {int(r): j for j, r in enumerate(rows.tolist()) if int(r) in self.extras}
            extras = {j: self.extras[r] for r, j in pos.items()}
        return TransferTable(self.names, self.locals, self.dtypes, cols, extras)

    def sorted(self, by: str) -> TransferTable:
        """The rows in ``"wire"`` order (source rank, destination rank, tensor name, offsets) or ``"local"`` order
        (destination rank, tensor name, offsets, destination local tensor name); stable, as ``list.sort`` with
        ``routing.WIRE_ORDER`` / ``LOCAL_ORDER``."""
        n = len(self)
        if n < 2:
            return self
        name_rank = np.empty(len(self.names), I64)
        name_rank[np.argsort(np.array(self.names, dtype=object), kind="stable")] = np.arange(len(self.names))
        offs = [self.offsets[:, j] for j in range(self.offsets.shape[1] - 1, -1, -1)]
        t = name_rank[self.tensor]
        if by == "wire":
            keys = (*offs, t, self.dst, self.src)
        elif by == "local":
            lrank = np.empty(len(self.locals), I64)
            lrank[np.argsort(np.array(self.locals, dtype=object), kind="stable")] = np.arange(len(self.locals))
            keys = (lrank[self.dst_local], *offs, t, self.dst)
        else:
            raise ValueError(f"TransferTable.sorted: by={by!r} must be 'wire' or 'local'")
        order = np.lexsort(keys)
        if (order == np.arange(n)).all():
            return self
        return self.take(order)

    # -- reading ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.src)

    def _rows(self, a: int, b: int) -> list[Transfer]:
        """Rows ``a:b`` as objects."""
        if a >= b:
            return []
        names, locs, dts = self.names, self.locals, self.dtypes
        nd, snd, dnd = (x[a:b].tolist() for x in (self.ndim, self.src_ndim, self.dst_ndim))
        out = []
        extras = self.extras
        with gc_paused():
            for i, (t, o, s, sr, sl, so, dr, dl, do, w, rl, q, k, ks, kd) in enumerate(zip(
                    self.tensor[a:b].tolist(), self.offsets[a:b].tolist(), self.sizes[a:b].tolist(),
                    self.src[a:b].tolist(), self.src_local[a:b].tolist(), self.src_offsets[a:b].tolist(),
                    self.dst[a:b].tolist(), self.dst_local[a:b].tolist(), self.dst_offsets[a:b].tolist(),
                    self.wdt[a:b].tolist(), self.relay[a:b].tolist(), self.quant[a:b].tolist(), nd, snd, dnd,
                    strict=True), a):
                if q:
                    out.append(Transfer(names[t], tuple(o[:k]), tuple(s[:k]), sr, locs[sl], tuple(so[:ks]), dr,
                                        locs[dl], tuple(do[:kd]), dts[w], rl, _QUANT_NAMES[q], *extras[i]))
                else:
                    out.append(Transfer(names[t], tuple(o[:k]), tuple(s[:k]), sr, locs[sl], tuple(so[:ks]), dr,
                                        locs[dl], tuple(do[:kd]), dts[w], rl))
        return out

    def objects_at(self, rows: np.ndarray) -> list[Transfer]:
        """The objects of ``rows`` (indices), in that order."""
        if self._objs is not None or len(self) <= SMALL:
            objs = self.objects()
            return [objs[i] for i in rows.tolist()]
        if len(rows) and (np.diff(rows) == 1).all():
            return self._rows(int(rows[0]), int(rows[-1]) + 1)
        return self.take(rows)._rows(0, len(rows))

    def objects(self) -> tuple[Transfer, ...]:
        """Every row as an object (kept by a small table)."""
        if self._objs is not None:
            return self._objs
        out = tuple(self._rows(0, len(self)))
        if len(out) <= SMALL:
            self._objs = out
        return out

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"transfer {i} out of range ({n} transfers)")
        if self._objs is None and n <= SMALL:
            self.objects()
        if self._objs is not None:
            return self._objs[i]
        return self._rows(i, i + 1)[0]

    def __iter__(self):
        if self._objs is not None or len(self) <= SMALL:
            yield from self.objects()
            return
        for a in range(0, len(self), _BATCH):
            yield from self._rows(a, min(a + _BATCH, len(self)))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __eq__(self, other) -> bool:
        if isinstance(other, TransferTable):
            return len(self) == len(other) and self.keys_digest() == other.keys_digest()
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<TransferTable: {len(self)} transfers of {len(set(self.tensor.tolist()))} tensors>"

    def keys_digest(self) -> str:
        """sha256 of the rows in a canonical form (names by value, not by code): the same for the same transfers
        in the same order however the table was built."""
        h = hashlib.sha256(b"triton_reshard.plan.transfers/1\n")
        n = len(self)
        h.update(f"{n}".encode())
        if not n:
            return h.hexdigest()
        for vals, codes in ((self.names, self.tensor), (self.locals, self.src_local), (self.locals, self.dst_local),
                            (tuple(dtype_name(d) for d in self.dtypes), self.wdt)):
            order = sorted(range(len(vals)), key=vals.__getitem__)
            rank = np.empty(len(vals), I64)
            rank[order] = np.arange(len(vals))
            used = distinct(codes)
            h.update("\0".join(vals[i] for i in sorted(used.tolist(), key=vals.__getitem__)).encode())
            dense = np.full(len(vals), -1, I64)
            dense[np.sort(rank[used])] = np.arange(len(used))
            h.update(np.ascontiguousarray(dense[rank[codes]], "<i8").tobytes())
        for a, k in ((self.offsets, self.ndim), (self.sizes, self.ndim), (self.src_offsets, self.src_ndim),
                     (self.dst_offsets, self.dst_ndim)):
            mask = np.arange(a.shape[1])[None, :] < k[:, None]
            h.update(np.ascontiguousarray(k, "<i8").tobytes())
            h.update(np.ascontiguousarray(a[mask], "<i8").tobytes())
        for a in (self.src, self.dst, self.relay, self.quant):
            h.update(np.ascontiguousarray(a, "<i8").tobytes())
        if self.extras:
            h.update(repr([(i, _keyed(self.extras[i])) for i in sorted(self.extras)]).encode())
        return h.hexdigest()

    @property
    def itemsizes(self) -> np.ndarray:
        """Per wire-dtype code its element size in bytes (index it with ``wdt``)."""
        return np.array([itemsize_of(d) for d in self.dtypes] or [0], I64)

    @property
    def numel(self) -> np.ndarray:
        """Per row the number of elements of its box."""
        return self.sizes.prod(axis=1, dtype=I64)
