"""Which chunks may travel in place (direct messages): :class:`Contiguity`, the one answer for whole plans and
rank shares, per chunk (``direct``) and on the columns (:func:`direct_columns`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..box import contiguous_boxes, is_contiguous_box
from ..layout import Layout
from .table import I64, TransferTable
from .types import Transfer


def contiguity(transfers: Sequence[Transfer], src: Layout, dst: Layout, min_bytes: int,
               rank: int | None = None) -> Contiguity:
    """Which chunks of ``transfers`` may travel in place (see :class:`Contiguity`): for the whole plan
    (``rank=None``) and for rank ``rank``'s share alike."""
    return Contiguity(transfers, src, dst, min_bytes, rank)


class Contiguity:
    """Whether a chunk of a wire transfer may travel in place: it is one contiguous run of its source or its
    destination local tensor, held in the wire dtype (``direct``; ``direct_columns``: the same on columns). The
    one answer for the whole plan and a rank's share ("contiguous on either side" is the same on both ends): a
    rank's share (``rank``) tests its own side first and reads a peer's local tensor only when its own side is not
    contiguous. Local tensors are looked up when asked (one ``local_spec`` per local tensor met); a chunk's answer
    depends on a side's shape and the chunk's sizes alone (``is_contiguous_box``), kept per such pair."""

    __slots__ = ("_ts", "_src", "_dst", "_min", "_rank", "_specs", "_seen")

    def __init__(self, transfers, src: Layout, dst: Layout, min_bytes: int, rank: int | None = None) -> None:
        self._ts, self._src, self._dst, self._min, self._rank = transfers, src, dst, min_bytes, rank
        self._specs: dict[tuple[int, int, str], object] = {}  # (destination side?, rank, local) -> its spec
        self._seen: dict[tuple, bool] = {}  # (local shape, chunk sizes) -> contiguous

    def _shape(self, k: int, rank: int, local: str, wdt) -> tuple | None:
        key = (k, rank, local)
        spec = self._specs.get(key, self)
        if spec is self:
            spec = self._specs[key] = (self._dst if k else self._src).local_spec(rank, local)
        return spec.shape if spec is not None and spec.dtype == wdt else None

    def __len__(self) -> int:
        return len(self._ts)

    def _never(self, t: Transfer) -> bool:
        # under the minimum, or source-quantized (the pack quantizes it)
        return t.quant == "src" or t.nbytes < self._min

    def shapes(self, t: Transfer) -> tuple | None:
        """None when ``t`` is never direct, else (source local shape or None, destination local shape or None):
        the local tensors on the sides where its bytes could move in place (their dtype is the wire dtype)."""
        if self._never(t):
            return None
        return (self._shape(1 if t.relay else 0, t.src_rank, t.src_local, t.wire_dtype),
                self._shape(1, t.dst_rank, t.dst_local, t.wire_dtype))

    def direct_columns(self, table: TransferTable, rows: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """``direct`` per chunk, on the columns (``pair_schedule.direct_columns``)."""
        return direct_columns(self._src, self._dst, table, rows, sizes)

    def direct(self, t: Transfer, off, size) -> bool:
        """Whether sub-box ``off``+``size`` of ``t`` is contiguous in its source or its destination local tensor
        (in the wire dtype), this rank's side tested first."""
        if self._never(t):
            return False
        sides = [(1 if t.relay else 0, t.src_rank, t.src_local, t.src_offsets),
                 (1, t.dst_rank, t.dst_local, t.dst_offsets)]
        if self._rank is not None and t.dst_rank == self._rank:
            sides.reverse()
        seen = self._seen
        for k, r, local, start in sides:
            shape = self._shape(k, r, local, t.wire_dtype)
            if shape is None:
                continue
            got = seen.get((shape, size))
            if got is None:
                got = seen[(shape, size)] = is_contiguous_box(shape, start, off, size)
            if got:
                return True
        return False


def direct_columns(src: Layout, dst: Layout, table: TransferTable, rows: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per chunk (row ``rows[i]`` of ``table``, a sub-box of sizes ``sizes[i]``, ``[m, D]`` padded with 1): whether
    it is one contiguous run of its source or its destination local tensor in the wire dtype (``is_contiguous_box``
    on either end; a relay's source is a destination-layout local tensor), from the layouts' batched
    ``local_shape_columns``. The caller has left out chunks under the minimum and source-quantized rows."""
    m = len(rows)
    out = np.zeros(m, np.bool_)
    if not m:
        return out
    # the local tensors looked up once per row, not per chunk (a row's chunks are consecutive)
    new = np.ones(m, np.bool_)
    new[1:] = rows[1:] != rows[:-1]
    inv = np.cumsum(new) - 1
    rows = rows[new]
    nd = table.ndim[rows].astype(I64)[inv]
    wdt = table.wdt[rows]
    relay = table.relay[rows]
    u = len(rows)
    sides = [(table.src[rows], table.src_local[rows], relay, True), (table.dst[rows], table.dst_local[rows], None, False)]
    for ranks, locs, rel, is_src in sides:
        parts = [(np.flatnonzero(~rel), src), (np.flatnonzero(rel), dst)] if is_src else [(np.arange(u), dst)]
        for sel, lay in parts:
            if not len(sel):
                continue
            shp, dcode, dts = lay.local_shape_columns(ranks[sel], table.locals, locs[sel])
            same = np.array([[a == b for b in table.dtypes] for a in dts] or [[False] * len(table.dtypes)], np.bool_)
            ok = dcode >= 0
            ok[ok] = same[dcode[ok], wdt[sel][ok]]
            shapes = np.ones((u, shp.shape[1]), I64)
            shapes[sel] = shp
            good = np.zeros(u, np.bool_)
            good[sel] = ok
            g = good[inv]  # per chunk
            out[g] |= contiguous_boxes(shapes[inv[g]], sizes[g], nd[g])
    return out
