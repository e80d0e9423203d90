"""Layout validation: one decision, on a layout's columns (:func:`columns_valid`, vectorized), and the eager
checks (:func:`check_layout`) that word a refusal, naming the tensor and rank of the problem."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from operator import add, gt

import numpy as np
import torch

from ..box import boxes_overlap, find_overlap
from .columns import I64, Columns, LogicalTensors
from .fragment_table import distinct
from .specs import Fragment, LocalSpec, TensorSpec, block_scale_box, dtype_name

# --------------------------------------------------------------------------------------------------------
# Eager validation (a Layout's constructor)
# --------------------------------------------------------------------------------------------------------


def check_layout(tensors: Sequence[TensorSpec], fragments: Sequence[Fragment],
                 locals_: Sequence[LocalSpec]) -> None:
    """The eager checks of a Layout on construction (its tensors, fragments and local tensors): names declared
    once, every fragment inside its tensor and its local tensor, no two fragments sharing local memory,
    quantized tensors' scales consistent; a ValueError naming tensor and rank otherwise."""
    specs: dict[str, TensorSpec] = {}
    for t in tensors:
        if t.name in specs:
            raise ValueError(f"tensor {t.name!r} is declared twice")
        specs[t.name] = t
    locs: dict[tuple[int, str], LocalSpec] = {}
    for s in locals_:
        if (s.rank, s.name) in locs:
            raise ValueError(f"local tensor {s.name!r} on rank {s.rank} is declared twice")
        locs[(s.rank, s.name)] = s
    per_local: dict[tuple[int, str], list] = {}
    for f in fragments:
        key = (f.rank, f.local)
        spec = specs.get(f.tensor)
        loc = locs.get(key)
        # fast check of everything check_fragment checks; it names the problem when one fails
        if spec is None or loc is None or loc.dtype is not spec.dtype:
            check_fragment(f, spec, loc)
        else:
            off, sizes, lo, lshape = f.offsets, f.sizes, f.local_offsets, loc.shape
            if (len(off) != len(spec.shape) or len(lo) != len(lshape)
                    or any(map(gt, map(add, off, sizes), spec.shape))
                    or any(map(gt, map(add, lo, sizes if len(lo) == len(sizes) else f.local_sizes), lshape))):
                check_fragment(f, spec, loc)
        group = per_local.get(key)
        if group is None:
            per_local[key] = [f]
        else:
            group.append(f)
    for (rank, local), frs in per_local.items():
        if len(frs) < 2:
            continue
        if len(frs) == 2:  # the common case (gate + up, k + v): no sweep needed
            a, b = frs
            if not (min(a.sizes, default=1) > 0 and min(b.sizes, default=1) > 0
                    and boxes_overlap(a.local_offsets, a.local_sizes, b.local_offsets, b.local_sizes)):
                continue
        hit = find_overlap([(f.local_offsets, f.local_sizes, f) for f in frs])
        if hit is not None:
            a, b = hit
            raise ValueError(
                f"overlapping fragments on rank {rank} in local tensor {local!r}: tensor {a.tensor!r} box "
                f"{a.offsets}+{a.sizes} and tensor {b.tensor!r} box {b.offsets}+{b.sizes} share local memory"
            )
    if any(t.quant is not None for t in tensors):
        validate_quant_fragments(specs, fragments)


# --------------------------------------------------------------------------------------------------------
# Vectorized validation (the eager Layout's checks; on a failure the eager validation names the problem)
# --------------------------------------------------------------------------------------------------------


def columns_valid(c: Columns, lt: LogicalTensors) -> bool:
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
    lkey = c.lr.astype(I64) * nl + c.ln
    fkey = c.fr.astype(I64) * nl + c.fl
    li = np.searchsorted(lkey, fkey)
    if (li >= len(lkey)).any() or (lkey[np.minimum(li, len(lkey) - 1)] != fkey).any():
        return False
    # same number of local dims, at least the box's
    lnd = c.lnd[li]
    if (c.flnd != lnd).any() or (lnd < nd).any():
        return False
    # dtypes: the local tensor's is the tensor's
    if (c.ldt[li] != lt.dtype_ids(c.dtypes)[c.ft]).any():
        return False
    # inside the local tensor: local offsets + (1,)*(lnd-nd) + sizes <= local shape
    L = c.flo.shape[1]
    lsz = _local_sizes(c, nd, L)
    lo = np.where(c.flo < 0, 0, c.flo)
    lsh = c.lsh[li, :L] if L else np.zeros((n, 0), I64)
    valid = np.arange(L)[None, :] < c.flnd[:, None]
    if ((c.flo < 0) & valid).any() or ((lo + lsz > lsh) & valid).any():
        return False
    return overlap_free(li, lo, lsz, c.fsz)


def _local_sizes(c: Columns, nd: np.ndarray, L: int) -> np.ndarray:
    """``[n, L]`` each fragment's sizes in its local tensor's dims (lead dims 1; padding columns 1)."""
    n = c.nfrag
    out = np.ones((n, L), dtype=I64)
    D = c.fsz.shape[1]
    if not L or not D:
        return out
    first = c.flnd - nd  # where the logical dims start in the local dims
    if L >= D and not first.any():  # no lead dims (the common case): the sizes, then 1 (``fsz`` pads with 1)
        out[:, :D] = c.fsz
        return out
    for j in range(L):  # column by column: local dim j is logical dim j - first where that is one of its dims
        src = j - first
        for d in range(D):
            np.copyto(out[:, j], c.fsz[:, d], where=src == d)
    return out


def overlap_free(group: np.ndarray, lo: np.ndarray, ls: np.ndarray, sizes: np.ndarray) -> bool:
    """True if no two non-empty boxes ``lo``+``ls`` (``[n, L]``) with the same ``group`` share an element.

    Exact and vectorized: per dim, the boxes of a group are split into clusters of chained overlapping
    intervals; a box alone in its cluster overlaps nothing; a cluster whose intervals are all equal carries on
    to the next dim as a group of its own; any other cluster is checked box against box (``find_overlap``).
    Boxes equal in every dim overlap. (The answer does not depend on the order of the boxes.)
    """
    if sizes.shape[1]:
        ne = sizes[:, 0] > 0
        for d in range(1, sizes.shape[1]):
            ne &= sizes[:, d] > 0
        keep = np.flatnonzero(ne)
    else:
        keep = np.arange(len(group))
    key = group[keep]
    if len(key) < 2:
        return True
    # only groups of two or more boxes can overlap
    multi = np.bincount(key)[key] > 1
    idx, key = keep[multi], key[multi]
    L = lo.shape[1]
    for d in range(L):
        if len(idx) < 2:
            return True
        s, e = lo[idx, d].astype(I64), lo[idx, d] + ls[idx, d].astype(I64)
        B = int(e.max()) + 1  # (group, start) as one sort key, ends compared within a group
        if int(key.max()) >= (1 << 62) // B:
            u, inv = np.unique(np.concatenate([s, e]), return_inverse=True)  # too wide: ranks of the values
            inv = inv.reshape(-1)
            s, e, B = inv[:len(idx)], inv[len(idx):], len(u) + 1
        key = key.astype(I64)
        order = np.argsort(key * B + s, kind="stable")
        idx, s, e, key = idx[order], s[order], e[order], key[order]
        m = len(idx)
        cm = np.maximum.accumulate(key * B + e)
        same = np.zeros(m, bool)
        same[1:] = key[1:] == key[:-1]
        prev = np.empty(m, I64)
        prev[0] = -1
        prev[1:] = cm[:-1] - key[1:] * B
        joins = same & (prev > s)  # overlaps (in dim d) some earlier box of its group
        cid = np.cumsum(~joins) - 1
        size = np.bincount(cid)
        in_multi = size[cid] > 1
        first = np.flatnonzero(~joins)
        ident = (s == s[first[cid]]) & (e == e[first[cid]])
        all_ident = np.bincount(cid[~ident], minlength=len(size)) == 0
        hard = in_multi & ~all_ident[cid]
        if hard.any():
            rows = idx[hard]
            cl = cid[hard]
            for c_ in distinct(cl):
                members = rows[cl == c_]
                boxes = [(tuple(lo[i, d:].tolist()), tuple(ls[i, d:].tolist()), int(i)) for i in members]
                if find_overlap(boxes) is not None:
                    return False
        nxt = in_multi & all_ident[cid]
        idx, key = idx[nxt], cid[nxt]
    return len(idx) < 2


def check_fragment(f: Fragment, spec: TensorSpec | None, loc: LocalSpec | None) -> None:
    """Raise naming the first problem of fragment ``f`` against its tensor and local tensor (None: unknown)."""
    where = f"tensor {f.tensor!r} on rank {f.rank}"
    if spec is None:
        raise ValueError(f"fragment of unknown {where}")
    if len(f.offsets) != len(spec.shape):
        raise ValueError(f"fragment of {where}: box has {len(f.offsets)} dims, tensor has {len(spec.shape)}")
    for d, (o, s, n) in enumerate(zip(f.offsets, f.sizes, spec.shape, strict=True)):
        if o + s > n:
            raise ValueError(
                f"fragment of {where} is out of bounds in dim {d}: [{o}, {o + s}) outside [0, {n})"
            )
    if loc is None:
        raise ValueError(f"fragment of {where} names local tensor {f.local!r}, which rank {f.rank} lacks")
    if len(loc.shape) != len(f.local_offsets):
        raise ValueError(
            f"fragment of {where}: local_offsets {f.local_offsets} do not match the {len(loc.shape)}-D "
            f"local tensor {f.local!r} {loc.shape}"
        )
    for d, (o, s, n) in enumerate(zip(f.local_offsets, f.local_sizes, loc.shape, strict=True)):
        if o + s > n:
            raise ValueError(
                f"fragment of {where} is out of bounds of local tensor {f.local!r} {loc.shape} in dim "
                f"{d}: [{o}, {o + s}) outside [0, {n})"
            )
    if loc.dtype != spec.dtype:
        raise ValueError(
            f"fragment of {where}: local tensor {f.local!r} is {dtype_name(loc.dtype)}, the tensor is "
            f"{dtype_name(spec.dtype)}"
        )


def misaligned_block(f: Fragment, spec: TensorSpec) -> str | None:
    """Why fragment ``f`` of quantized tensor ``spec`` does not sit on its block grid (None if it does)."""
    block = spec.quant.block
    extra = len(f.local_offsets) - len(block)
    for d, (o, n, b, g) in enumerate(zip(f.offsets, f.sizes, block, spec.shape, strict=True)):
        if o % b:
            return f"starts at {o} in dim {d}, not a multiple of the block {b}"
        if (o + n) % b and o + n != g:
            return (f"ends at {o + n} in dim {d}, neither a multiple of the block {b} nor the tensor's end {g} "
                    f"(a block would be split between ranks)")
        lo = f.local_offsets[extra + d]
        if lo % b:
            return (f"sits at local offset {lo} in dim {d} of local tensor {f.local!r}, not a multiple of the "
                    f"block {b} (its scales would have no place of their own)")
    return None


def validate_quant_fragments(specs: Mapping[str, TensorSpec], fragments: Sequence[Fragment]) -> None:
    """Block-quantized tensors: each has its float32 scale tensor of shape ``ceil(shape / block)``; every
    fragment is block-aligned and its rank holds the matching scale fragment (see ``block_scale_box``); every
    scale fragment belongs to a weight fragment."""
    scale_of: dict[str, str] = {}
    for t in specs.values():
        q = t.quant
        if q is None:
            continue
        s = specs.get(q.scale)
        if s is None:
            raise ValueError(f"quantized tensor {t.name!r}: its scale tensor {q.scale!r} is not declared")
        sdt = q.format.scale_dtype
        if s.quant is not None or s.dtype != sdt or s.shape != t.scale_shape:
            raise ValueError(
                f"quantized tensor {t.name!r}: its scale tensor {q.scale!r} is {s.shape} {dtype_name(s.dtype)}"
                f"{' (quantized itself)' if s.quant is not None else ''}; blocks {q.block} of {t.shape} need a plain "
                f"{t.scale_shape} {dtype_name(sdt)}")
        if q.format.pack > 1 and t.shape[-1] * q.format.pack % q.format.block:
            raise ValueError(f"quantized tensor {t.name!r}: a {q.format.name} tensor's last dim must be whole "
                             f"blocks of {q.format.block} values, got {t.shape[-1] * q.format.pack}")
        if q.global_scale:
            g = specs.get(q.global_scale)
            if g is None or g.quant is not None or g.dtype != torch.float32 or g.shape != (1,):
                raise ValueError(f"quantized tensor {t.name!r}: its global-scale tensor {q.global_scale!r} must be "
                                 f"a declared plain float32 tensor of shape (1,), got {g}")
        if q.scale in scale_of:
            raise ValueError(f"tensors {scale_of[q.scale]!r} and {t.name!r} name the same scale tensor {q.scale!r}")
        scale_of[q.scale] = t.name
    by_tensor: dict[str, list[Fragment]] = defaultdict(list)
    for f in fragments:
        if f.tensor in scale_of or specs[f.tensor].quant is not None:
            by_tensor[f.tensor].append(f)
    for sname, wname in scale_of.items():
        spec = specs[wname]
        block = spec.quant.block
        have = {(f.rank, f.offsets, f.sizes, f.local_offsets): f for f in by_tensor.get(sname, ()) if f.numel}
        used = set()
        for f in by_tensor.get(wname, ()):
            if not f.numel:
                continue
            why = misaligned_block(f, spec)
            if why is not None:
                raise ValueError(f"fragment of quantized tensor {wname!r} on rank {f.rank} (box {f.offsets}+{f.sizes}) "
                                 f"is not block-aligned: it {why}")
            off, sizes, lo = block_scale_box(f, block)
            if (f.rank, off, sizes, lo) not in have:
                raise ValueError(
                    f"fragment of quantized tensor {wname!r} on rank {f.rank} (box {f.offsets}+{f.sizes}, local "
                    f"{f.local!r}@{f.local_offsets}): rank {f.rank} lacks the scale fragment of {sname!r} box "
                    f"{off}+{sizes} at local offsets {lo} (block_quant_layout builds it)")
            used.add((f.rank, off, sizes, lo))
        if len(used) != len(have):
            raise ValueError(f"scale tensor {sname!r} has {len(have)} fragments, its weight {wname!r} {len(used)}: every "
                             f"scale fragment must go with a weight fragment on its rank")
