"""The columnar builder: :class:`ColumnBuilder` builds a
:class:`~triton_reshard.layout.columnar.ColumnarLayout` from boxes given per call for a whole array of ranks
at once (numpy broadcasting: offsets, starts and even tensor names may differ per rank), which is how the
presets describe a model: one call per tensor family and stage, not per fragment."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from .columnar import ColumnarLayout
from .columns import I64, Columns, LogicalTensors, compact, frag_order
from .specs import (
    TensorSpec,
)

# --------------------------------------------------------------------------------------------------------
# Builder: boxes for whole arrays of ranks at once
# --------------------------------------------------------------------------------------------------------


def _local_ids(locals_: list, lens: np.ndarray, lid: Mapping[str, int]) -> np.ndarray:
    """The local-tensor id of every row of some blocks: a name per block, or (names, index per row)."""
    if all(type(x) is str for x in locals_):
        return np.repeat(np.fromiter((lid[x] for x in locals_), I64, len(locals_)), lens)
    return np.concatenate([np.full(k, lid[x], I64) if type(x) is str
                           else np.fromiter((lid[n] for n in x[0]), I64, len(x[0]))[x[1]]
                           for x, k in zip(locals_, lens.tolist(), strict=True)])


def _is_scalar(v) -> bool:
    return type(v) is int


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
        r = np.asarray(ranks, dtype=I64).reshape(-1)
        sh = np.empty((len(r), len(shape)), I64)
        for j, x in enumerate(shape):
            sh[:, j] = x
        if type(name) is tuple:  # (names, index per rank)
            name = (tuple(name[0]), np.broadcast_to(np.asarray(name[1], dtype=I64), (len(r),)))
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
        r = np.asarray(ranks, dtype=I64).reshape(-1)
        n = len(r)
        if isinstance(tensor, np.ndarray) and tensor.dtype.kind in "iu":  # tensor ids (index of tensors.names)
            t = np.broadcast_to(tensor.astype(I64, copy=False), (n,))
            if n and (int(t.min()) < 0 or int(t.max()) >= len(self.tensors)):
                raise AssertionError(f"tensor ids out of range: {t.min()}..{t.max()} of {len(self.tensors)}")
        elif type(tensor) is str:
            if tensor not in self.tensors.index:
                raise AssertionError(f"unknown logical tensor {tensor!r}")
            t = np.full(n, self.tensor_ids[tensor], dtype=I64)
        else:
            ids = self.tensor_ids
            try:
                t = np.fromiter((ids[x] for x in tensor), I64, n)
            except KeyError as e:
                raise AssertionError(f"unknown logical tensor {e.args[0]!r}") from None

        def cols(vals) -> np.ndarray:
            out = np.empty((n, len(vals)), I64)
            for j, x in enumerate(vals):
                out[:, j] = x
            return out

        off, sz, lo = cols(offsets), cols(sizes), cols(local_offsets)
        keep = None  # the rows with every size > 0 (None: all of them), from the size entries that may be 0
        for j, x in enumerate(sizes):
            if not _is_scalar(x) or x <= 0:
                k = sz[:, j] > 0
                keep = k if keep is None else keep & k
        if keep is not None and keep.all():
            keep = None
        if keep is not None:
            t, r, off, sz, lo = t[keep], r[keep], off[keep], sz[keep], lo[keep]
        if type(local) is tuple:  # (names, index per rank): a different local tensor per rank
            names, which = local
            if not (type(which) is np.ndarray and which.dtype == I64 and which.shape == (n,)):
                which = np.broadcast_to(np.asarray(which, dtype=I64), (n,))
            if keep is not None:
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

    def _assemble(self) -> Columns:
        """The columns of everything added: ids for local names and dtypes, then the fragment columns
        (sorted in Layout order) and the local-tensor columns (sorted by rank and name, one entry each)."""
        lt = self.tensors
        names = lt.names
        lnames = sorted({x[1] for x in self._lrows} | {x[2] for x in self._rows}
                        | {n for x in self._lblocks for n in ((x[1],) if type(x[1]) is str else x[1][0])}
                        | {n for x in self._blocks for n in ((x[2],) if type(x[2]) is str else x[2][0])})
        lid = {n: i for i, n in enumerate(lnames)}
        dtypes = list(dict.fromkeys([self.dtype, *lt.distinct_dtypes] + [x[3] for x in self._lrows]
                                    + [x[3] for x in self._lblocks]))
        did = {d: i for i, d in enumerate(dtypes)}
        D = max(map(len, lt.shapes), default=0)
        L = max([len(x[5]) for x in self._rows] + [b[5].shape[1] for b in self._blocks] + [D])
        ft, fr, fl, foff, fsz, flo, flnd = self._fragment_columns(self._fragment_parts(lid, D, L), D, L)
        lr, ln, lsh, lnd, ldt = self._local_columns(lid, did, lnames)
        return Columns(names, lnames, dtypes, ft, fr, fl, foff, fsz, flo, flnd, lr, ln, lsh, lnd, ldt)

    def _fragment_parts(self, lid: Mapping[str, int], D: int, L: int) -> list[tuple]:
        """The fragment columns of the rows added one by one, then of each group of blocks of one (tensor
        dims, local dims): (tensor id, rank, local id, offsets, sizes, local offsets, local dims) per part."""
        tid = self.tensor_ids
        parts = []
        if self._rows:
            rows = self._rows
            k = len(rows)
            t = np.fromiter((tid[x[0]] for x in rows), I64, k)
            r = np.fromiter((x[1] for x in rows), I64, k)
            fl = np.fromiter((lid[x[2]] for x in rows), I64, k)
            off, sz = np.zeros((k, D), I64), np.ones((k, D), I64)
            lo = np.full((k, L), -1, I64)
            flnd = np.fromiter((len(x[5]) for x in rows), I64, k)
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
            lens = np.fromiter((len(x[1]) for x in blks), I64, len(blks))
            k = int(lens.sum())
            off, sz = np.zeros((k, D), I64), np.ones((k, D), I64)
            off[:, :nd] = np.concatenate([x[3] for x in blks])
            sz[:, :nd] = np.concatenate([x[4] for x in blks])
            lo = np.full((k, L), -1, I64)
            lo[:, :lnd_] = np.concatenate([x[5] for x in blks])
            fl = _local_ids([x[2] for x in blks], lens, lid)
            parts.append((np.concatenate([x[0] for x in blks]), np.concatenate([x[1] for x in blks]), fl, off, sz,
                          lo, np.full(k, lnd_, I64)))
        return parts

    def _fragment_columns(self, parts: list[tuple], D: int, L: int) -> tuple[np.ndarray, ...]:
        """The parts concatenated one column at a time (compacted), every tensor covered, in Layout order."""
        names = self.tensors.names
        if parts:
            cat = []
            for j in range(7):  # one column at a time, compacted (int32) and its parts dropped
                cat.append(compact(np.concatenate([p[j] for p in parts])))
                for k in range(len(parts)):
                    parts[k] = parts[k][:j] + (None,) + parts[k][j + 1:]
            ft, fr, fl, foff, fsz, flo, flnd = cat
            del cat, parts
        else:
            ft = fr = fl = flnd = np.zeros(0, I64)
            foff, fsz, flo = np.zeros((0, D), I64), np.zeros((0, D), I64), np.zeros((0, L), I64)
        covered = np.zeros(len(names), bool)
        covered[ft] = True
        if not covered.all():
            missing = [names[i] for i in np.flatnonzero(~covered)[:5]]
            raise AssertionError(f"layout builder left tensors without any fragment: {missing}")
        order = frag_order(ft, fr, fl, foff, flo)
        ft = ft[order]  # (one column at a time: one unsorted copy alive, not seven)
        fr = fr[order]
        fl = fl[order]
        foff = foff[order]
        fsz = fsz[order]
        flo = flo[order]
        flnd = flnd[order]
        del order
        return ft, fr, fl, foff, fsz, flo, flnd

    def _local_columns(self, lid: Mapping[str, int], did: Mapping, lnames: Sequence[str]) -> tuple[np.ndarray, ...]:
        """The local-tensor columns (rank, name id, shape, dims, dtype id) sorted by (rank, name), a local
        tensor declared more than once kept once (it must have the same shape each time)."""
        S = max([len(x[2]) for x in self._lrows] + [b[2].shape[1] for b in self._lblocks] + [0])
        lparts = []
        if self._lrows:
            lr_ = self._lrows
            k = len(lr_)
            sh = np.full((k, S), -1, I64)
            for i, x in enumerate(lr_):
                sh[i, :len(x[2])] = x[2]
            lparts.append((np.fromiter((x[0] for x in lr_), I64, k), np.fromiter((lid[x[1]] for x in lr_), I64, k),
                           sh, np.fromiter((len(x[2]) for x in lr_), I64, k),
                           np.fromiter((did[x[3]] for x in lr_), I64, k)))
        lgroups: dict[int, list[tuple]] = {}
        for blk in self._lblocks:
            lgroups.setdefault(blk[2].shape[1], []).append(blk)
        for nd, blks in lgroups.items():
            lens = np.fromiter((len(x[0]) for x in blks), I64, len(blks))
            k = int(lens.sum())
            sh = np.full((k, S), -1, I64)
            sh[:, :nd] = np.concatenate([x[2] for x in blks])
            lparts.append((np.concatenate([x[0] for x in blks]),
                           _local_ids([x[1] for x in blks], lens, lid), sh,
                           np.full(k, nd, I64), np.repeat(np.fromiter((did[x[3]] for x in blks), I64, len(blks)), lens)))
        if lparts:
            lr, ln, lsh, lnd, ldt = (np.concatenate([p[j] for p in lparts]) for j in range(5))
        else:
            lr = ln = lnd = ldt = np.zeros(0, I64)
            lsh = np.zeros((0, S), I64)
        if len(lr) and min(int(lr.min()), int(ln.min())) >= 0 and (int(lr.max()) + 1) * len(lnames) < 1 << 62:
            lorder = np.argsort(lr * len(lnames) + ln, kind="stable")  # (rank, name) as one key
        else:
            lorder = np.lexsort((ln, lr))
        lr, ln, lsh, lnd, ldt = lr[lorder], ln[lorder], lsh[lorder], lnd[lorder], ldt[lorder]
        if len(lr) > 1:  # a local tensor declared on a rank more than once: one entry, the same shape each time
            dup = (lr[1:] == lr[:-1]) & (ln[1:] == ln[:-1])
            if dup.any():
                differ = lnd[1:] != lnd[:-1]
                for j in range(S):  # (column by column: a reduction over a short last axis is slow)
                    differ |= lsh[1:, j] != lsh[:-1, j]
                bad = dup & differ
                if bad.any():
                    i = int(np.flatnonzero(bad)[0])
                    raise AssertionError(f"local tensor {lnames[ln[i]]!r} on rank {lr[i]} declared twice with "
                                         f"different shapes")
                keep = np.ones(len(lr), bool)
                keep[1:] = ~dup
                lr, ln, lsh, lnd, ldt = lr[keep], ln[keep], lsh[keep], lnd[keep], ldt[keep]
        return lr, ln, lsh, lnd, ldt
