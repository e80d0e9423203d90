"""Per-tensor fragment tables (what a rank planner queries) and the content fingerprint of a layout."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .specs import Fragment, TensorSpec, trusted_fragment


def distinct(a) -> np.ndarray:
    """The sorted distinct values of a 1-D array: ``np.unique(a)`` without numpy 2.3's ``np.ma.is_masked``, whose
    first call imports ``numpy.ma`` (8-30 ms of CPU, paid inside a fresh process's first plan, on every rank)."""
    a = np.sort(np.asarray(a).reshape(-1))
    if a.size < 2:
        return a
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]

# --------------------------------------------------------------------------------------------------------
# Per-tensor fragment tables (what a rank planner queries)
# --------------------------------------------------------------------------------------------------------


class FragmentTable:
    """The fragments of one logical tensor as numpy arrays, rows in Layout order (``fragments_by_tensor``).

    ``ranks`` ``[n]``, ``offsets`` / ``sizes`` / ``ends`` ``[n, nd]`` (``nd = len(spec.shape)``), ``local_ids``
    ``[n]`` into ``local_names``; ``local_offsets`` gives each row's ``Fragment.local_offsets`` (which may have
    extra leading dims), ``local_starts`` ``[n, nd]`` where the box starts in the local tensor's trailing
    ``nd`` dims. ``overlapping(offsets, sizes)`` is an interval query (sorted starts on the dim with most
    distinct starts, prefix maximum of the ends); ``boxes()`` groups the replicas of each distinct box.
    Built by :meth:`Layout.table` (lazily, cached); read-only.
    """

    __slots__ = ("spec", "ranks", "offsets", "sizes", "local_ids", "local_names", "_loff", "_lnd", "_frags",
                 "_index", "_boxes", "_queries", "__weakref__")

    def __init__(self, spec: TensorSpec, ranks, offsets, sizes, local_ids, local_names: Sequence[str],
                 loff, lnd, fragments: tuple[Fragment, ...] | None = None) -> None:
        self.spec = spec
        self.ranks, self.offsets, self.sizes, self.local_ids = ranks, offsets, sizes, local_ids
        self.local_names = tuple(local_names)
        self._loff, self._lnd = loff, lnd  # [n, L] left-aligned, -1 padded; per-row number of local dims
        self._frags, self._index, self._boxes, self._queries = fragments, None, None, 0
        for a in (ranks, offsets, sizes, local_ids, loff, lnd):
            a.setflags(write=False)

    @classmethod
    def from_fragments(cls, spec: TensorSpec, frags: Sequence[Fragment]) -> FragmentTable:
        """The table of ``frags`` (the fragments of ``spec``, in Layout order)."""
        nd = len(spec.shape)
        n = len(frags)
        names = sorted({f.local for f in frags})
        ids = {s: i for i, s in enumerate(names)}
        L = max((len(f.local_offsets) for f in frags), default=nd)
        loff = np.full((n, L), -1, dtype=np.int64)
        for i, f in enumerate(frags):
            loff[i, :len(f.local_offsets)] = f.local_offsets
        return cls(spec, np.fromiter((f.rank for f in frags), np.int64, n),
                   np.array([f.offsets for f in frags], dtype=np.int64).reshape(n, nd),
                   np.array([f.sizes for f in frags], dtype=np.int64).reshape(n, nd),
                   np.fromiter((ids[f.local] for f in frags), np.int32, n), names, loff,
                   np.fromiter((len(f.local_offsets) for f in frags), np.int64, n), tuple(frags))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n(self) -> int:
        return len(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"FragmentTable({self.spec.name!r}, {self.n} fragments on {len(distinct(self.ranks))} ranks)"

    @property
    def ends(self) -> np.ndarray:
        return self.offsets + self.sizes

    def local(self, i: int) -> str:
        """The local tensor of row ``i``."""
        return self.local_names[self.local_ids[i]]

    @property
    def local_offsets(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(row[:k]) for row, k in zip(self._loff.tolist(), self._lnd.tolist(), strict=True))

    @property
    def local_starts(self) -> np.ndarray:
        nd = self.offsets.shape[1]
        idx = (self._lnd - nd)[:, None] + np.arange(nd)[None, :]
        return np.take_along_axis(self._loff, idx, axis=1) if nd else np.zeros((self.n, 0), np.int64)

    def fragment(self, i: int) -> Fragment:
        """The :class:`Fragment` of row ``i``."""
        if self._frags is not None:
            return self._frags[i]
        k = int(self._lnd[i])
        return Fragment(self.spec.name, int(self.ranks[i]), tuple(self.offsets[i].tolist()),
                        tuple(self.sizes[i].tolist()), self.local(i), tuple(self._loff[i, :k].tolist()))

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        if self._frags is None:  # (rows of a validated layout: built without re-running Fragment's checks)
            t, names = self.spec.name, self.local_names
            self._frags = tuple(
                trusted_fragment(t, r, tuple(o), tuple(s), names[li], tuple(lo[:k]))
                for r, o, s, li, lo, k in zip(self.ranks.tolist(), self.offsets.tolist(), self.sizes.tolist(),
                                              self.local_ids.tolist(), self._loff.tolist(), self._lnd.tolist(),
                                              strict=True))
        return self._frags

    def rows_on_rank(self, rank: int) -> np.ndarray:
        """Row indices of the fragments on ``rank`` (rows are sorted by rank)."""
        lo, hi = np.searchsorted(self.ranks, [rank, rank + 1])
        return np.arange(lo, hi)

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Row indices (ascending) of the fragments that share at least one element with the box
        ``offsets``+``sizes``; empty boxes (rows or query) overlap nothing."""
        off = np.asarray(offsets, dtype=np.int64).reshape(-1)
        end = off + np.asarray(sizes, dtype=np.int64).reshape(-1)
        nd = self.offsets.shape[1]
        if len(off) != nd or len(end) != nd:
            raise ValueError(f"tensor {self.spec.name!r}: query box {tuple(offsets)}+{tuple(sizes)} has "
                             f"{len(off)} dims, the tensor has {nd}")
        if (end <= off).any():
            return np.zeros(0, np.int64)
        if self._index is None:
            self._queries += 1
            if self.n <= 16 or self._queries < 3:
                # a few rows, or one of the first two queries of this table: one vectorized test (building the
                # index, a sort, pays off from the third query on)
                o = self.offsets
                return np.flatnonzero((o < end).all(axis=1) & (o + self.sizes > off).all(axis=1)
                                      & (self.sizes > 0).all(axis=1))
            self._build_index()
        d, order, starts, maxend = self._index
        if d < 0:  # 0-d tensor: every row holds its one element
            return order.copy()
        lo = int(np.searchsorted(maxend, off[d], side="right"))
        hi = int(np.searchsorted(starts, end[d], side="left"))
        cand = order[lo:hi]
        if not len(cand):
            return cand
        o, e = self.offsets[cand], self.offsets[cand] + self.sizes[cand]
        hit = (o < end).all(axis=1) & (e > off).all(axis=1)
        return np.sort(cand[hit])

    def _build_index(self) -> None:
        nonempty = np.flatnonzero((self.sizes > 0).all(axis=1))
        nd = self.offsets.shape[1]
        if not nd:
            self._index = (-1, nonempty, None, None)
            return
        o = self.offsets[nonempty]
        d = int(np.argmax(np.ptp(o, axis=0))) if len(nonempty) else 0  # the dim whose starts spread most
        order = nonempty[np.argsort(o[:, d], kind="stable")]
        starts = self.offsets[order, d]
        maxend = np.maximum.accumulate(starts + self.sizes[order, d]) if len(order) else starts
        self._index = (d, order, starts, maxend)

    def boxes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(box_offsets [m, nd], box_sizes [m, nd], row_box [n])``: the distinct boxes (sorted) and each row's
        box id; the holders of box ``b`` are ``ranks[row_box == b]``."""
        if self._boxes is None:
            nd = self.offsets.shape[1]
            if not self.n:
                z = np.zeros((0, nd), np.int64)
                self._boxes = (z, z, np.zeros(0, np.int64))
            else:
                u, inv = np.unique(np.concatenate([self.offsets, self.sizes], axis=1), axis=0, return_inverse=True)
                self._boxes = (u[:, :nd], u[:, nd:], inv.reshape(-1))
        return self._boxes


class TensorRows:
    """The fragments of several logical tensors as numpy columns (``Layout.tensor_rows(names)``), rows grouped
    by tensor in the order asked: rows ``starts[k]:starts[k + 1]`` are tensor ``names[k]``'s (within a tensor,
    in no particular order). ``ranks [n]``; ``offsets`` / ``sizes [n, D]`` (``D``: at least the largest rank of
    these tensors; a tensor's unused dims are 0 / 1, so a box padded the same way compares as it would in its
    own dims); ``local_ids [n]`` into ``local_names``. What a rank plan queries for every tensor it touches in
    a few vectorized passes instead of one table per tensor; ``fragment(i)`` builds row ``i``'s fragment."""

    __slots__ = ("names", "ndims", "starts", "ranks", "offsets", "sizes", "local_ids", "local_names", "_loff",
                 "_lnd")

    def __init__(self, names: Sequence[str], ndims: Sequence[int], starts, ranks, offsets, sizes, local_ids,
                 local_names: Sequence[str], loff, lnd) -> None:
        self.names, self.ndims, self.starts = tuple(names), tuple(ndims), starts
        self.ranks, self.offsets, self.sizes, self.local_ids = ranks, offsets, sizes, local_ids
        self.local_names = tuple(local_names)
        self._loff, self._lnd = loff, lnd  # [n, L] left-aligned, -1 padded; per-row number of local dims

    @classmethod
    def from_fragments(cls, groups: Sequence[tuple[str, int, Sequence[Fragment]]]) -> TensorRows:
        """The rows of ``groups``: per tensor ``(name, number of dims, its fragments)``."""
        frags = [f for _n, _d, fs in groups for f in fs]
        n = len(frags)
        D = max((d for _n, d, _fs in groups), default=0)
        L = max((len(f.local_offsets) for f in frags), default=0)
        zero, one, none = (0,) * D, (1,) * D, (-1,) * L  # the pads (one list of tuples per column: one numpy call)
        off = np.array([f.offsets + zero[len(f.offsets):] for f in frags], np.int64).reshape(n, D)
        sz = np.array([f.sizes + one[len(f.sizes):] for f in frags], np.int64).reshape(n, D)
        loff = np.array([f.local_offsets + none[len(f.local_offsets):] for f in frags], np.int64).reshape(n, L)
        names = sorted({f.local for f in frags})
        ids = {x: i for i, x in enumerate(names)}
        starts = np.cumsum([0] + [len(fs) for _n, _d, fs in groups])
        return cls([g[0] for g in groups], [g[1] for g in groups], starts,
                   np.fromiter((f.rank for f in frags), np.int64, n), off, sz,
                   np.fromiter((ids[f.local] for f in frags), np.int64, n), names, loff,
                   np.fromiter((len(f.local_offsets) for f in frags), np.int64, n))

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def local_offset_columns(self) -> tuple[np.ndarray, np.ndarray]:
        """``(local offsets [n, L] left-aligned, padded with -1; their count per row [n])``."""
        return self._loff, self._lnd

    def local_offsets_of(self, rows: np.ndarray) -> list[tuple[int, ...]]:
        return [tuple(lo[:k]) for lo, k in zip(self._loff[rows].tolist(), self._lnd[rows].tolist(), strict=True)]

    def fragments(self, rows: Sequence[int], ks: Sequence[int]) -> list[Fragment]:
        """``[fragment(i, k) for i, k in zip(rows, ks)]``, the columns read once for all of them."""
        r = np.asarray(rows, np.int64)
        names, ndims, lnames = self.names, self.ndims, self.local_names
        return [trusted_fragment(names[k], rk, tuple(o[:ndims[k]]), tuple(z[:ndims[k]]), lnames[li], tuple(lo[:m]))
                for k, rk, o, z, li, lo, m in zip(ks, self.ranks[r].tolist(), self.offsets[r].tolist(),
                                                  self.sizes[r].tolist(), self.local_ids[r].tolist(),
                                                  self._loff[r].tolist(), self._lnd[r].tolist(), strict=True)]

    def fragment(self, i: int, k: int) -> Fragment:
        """Row ``i``'s fragment (row ``i`` is one of tensor ``names[k]``'s)."""
        nd, m = self.ndims[k], int(self._lnd[i])
        return trusted_fragment(self.names[k], int(self.ranks[i]), tuple(self.offsets[i, :nd].tolist()),
                                tuple(self.sizes[i, :nd].tolist()), self.local_names[int(self.local_ids[i])],
                                tuple(self._loff[i, :m].tolist()))


def content_fingerprint(tensors: tuple, lnames: Sequence[str], copies: Sequence[tuple], locals_: Sequence[tuple],
                        dtype_names: Sequence[str]) -> str:
    """sha256 (16 hex digits) of a layout's contents in a canonical form, whatever builds it.

    ``tensors``: ``(names, shapes, dtype names, {index: quant key})`` sorted by name; ``lnames``: the sorted
    local-tensor names; ``copies``: per copy (in rank order; one for a plain layout) the fragment columns
    sorted by (rank, tensor, local, offsets, local offsets) as ``(rank, tensor id, local id, offsets [n, D],
    sizes [n, D], local offsets [n, L] padded with -1)`` (ids index the sorted names; ``D`` the largest tensor
    rank, ``L`` the largest local-offsets length); ``locals_``: per copy ``(rank, name id, shape [m, S] padded
    with -1, dtype id)`` sorted by (rank, name), dtype ids indexing ``dtype_names``.
    """
    names, shapes, tdtypes, quant = tensors
    h = hashlib.sha256(b"triton_reshard.layout.fingerprint/1\n")
    h.update("\0".join(names).encode())
    D = max(map(len, shapes), default=0)
    sh = np.full((len(shapes), D), -1, dtype="<i8")
    for k in set(map(len, shapes)):
        if k:
            sel = [i for i, x in enumerate(shapes) if len(x) == k]
            sh[sel, :k] = [shapes[i] for i in sel]
    h.update(f"|t:{sh.shape}".encode())
    h.update(sh.tobytes())
    h.update("\0".join(tdtypes).encode())
    h.update(repr(sorted(quant.items())).encode())
    h.update("\0".join(lnames).encode())
    for j in range(6):
        n = sum(len(c[j]) for c in copies)
        small = all(not c[j].size or (int(c[j].min()) >= -(1 << 31) and int(c[j].max()) < 1 << 31) for c in copies)
        dt = "<i4" if small else "<i8"  # half the bytes to hash when every value fits (a function of the contents)
        h.update(f"|f{j}:{n}:{copies[0][j].shape[1:] if copies else ()}:{dt}".encode())
        for c in copies:
            h.update(np.ascontiguousarray(c[j], dtype=dt).tobytes())
    used = distinct(np.concatenate([np.asarray(c[3], dtype=np.int64) for c in locals_])) if locals_ else []
    canon = sorted({dtype_names[i] for i in used.tolist()}) if len(used) else []
    remap = np.full(len(dtype_names), -1, dtype=np.int64)
    for i in (used.tolist() if len(used) else []):
        remap[i] = canon.index(dtype_names[i])
    h.update("\0".join(canon).encode())
    for j in range(4):
        n = sum(len(c[j]) for c in locals_)
        h.update(f"|l{j}:{n}".encode())
        for c in locals_:
            col = remap[np.asarray(c[j], dtype=np.int64)] if j == 3 else c[j]
            h.update(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return h.hexdigest()[:16]
