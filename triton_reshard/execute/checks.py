"""Input checks, before any byte moves: names, shapes, dtypes, devices and storage of every local tensor, and
memory that a destination shares with itself or with a source."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..plan.index import rank_fragments

_EXACT_MAX = 1 << 22  # elements: above this, an exact memory check would cost too much; be conservative


def extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element of ``t`` in its storage (0 when empty)."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1


def storage_problem(t: torch.Tensor) -> str | None:
    """Why ``t`` has no valid memory to read or write (None when it has)."""
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor (only dense strided tensors can be resharded)"
    if t.numel() == 0:
        return None
    try:
        have = t.untyped_storage().nbytes()
    except Exception as e:  # e.g. a tensor subclass without real storage
        return f"has no accessible storage ({type(e).__name__}: {e})"
    need = (t.storage_offset() + extent(t)) * t.element_size()
    if have < need:
        return (f"has no valid storage: it holds {have} bytes, the view needs {need} (freed, e.g. with "
                f"untyped_storage().resize_(0) as FSDP does between steps? re-materialize it first)")
    return None


def addresses(t: torch.Tensor) -> torch.Tensor:
    """The start address (bytes) of every element of ``t`` (flat, int64)."""
    offs = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride(), strict=True):
        offs = (offs.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return offs.reshape(-1) * t.element_size() + t.data_ptr()


def self_overlap(t: torch.Tensor) -> bool | None:
    """Does ``t`` have two elements at one address (e.g. ``expand``)? None: too large to tell exactly."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False  # each dim steps past everything the smaller ones reach: no two elements meet
    if any(st == 0 for st, _n in dims):
        return True
    if t.numel() > _EXACT_MAX:
        return None
    return bool(addresses(t).unique().numel() < t.numel())


def bytes_meet(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Do any bytes of ``a`` and ``b`` coincide (exactly, element by element)? None: too large to tell."""
    if a.numel() > _EXACT_MAX or b.numel() > _EXACT_MAX:
        return None
    aa = addresses(a).sort().values
    bb = addresses(b)
    idx = torch.searchsorted(aa, bb + (b.element_size() - 1), right=True) - 1
    ok = idx >= 0
    return bool((ok & (aa[idx.clamp(min=0)] + a.element_size() > bb)).any())


def sub_box_shift(outer: torch.Tensor, inner: torch.Tensor) -> tuple[int, ...] | None:
    """``c`` with ``inner`` the box ``outer[c0:c0+n0, c1:c1+n1, ...]`` (same dtype, dims and strides; ``outer``
    without internal overlap), else None."""
    if inner.dtype != outer.dtype or inner.dim() != outer.dim() or not inner.numel() or not outer.numel():
        return None
    if any(n > 1 and si != so for n, si, so in zip(inner.shape, inner.stride(), outer.stride(), strict=True)):
        return None
    es = outer.element_size()
    delta, rem = divmod(inner.data_ptr() - outer.data_ptr(), es)
    if rem or delta < 0:
        return None
    shift = [0] * outer.dim()
    for d in sorted(range(outer.dim()), key=lambda d: -outer.stride(d)):  # the largest stride first
        if outer.shape[d] > 1 and outer.stride(d) > 0:
            shift[d], delta = divmod(delta, outer.stride(d))
    if delta or any(c + n > m for c, n, m in zip(shift, inner.shape, outer.shape, strict=True)):
        return None
    return tuple(shift)


def check_side(rank: int, side: str, tensors: Mapping[str, torch.Tensor], specs) -> torch.device | None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"rank {rank}: {side} tensors must be a dict name -> Tensor, got {type(tensors).__name__}")
    unknown = sorted(set(tensors) - set(specs))
    missing = sorted(set(specs) - set(tensors))
    if missing:
        raise ValueError(f"rank {rank}: {side} tensor {missing[0]!r} is missing (expected {sorted(specs)})")
    if unknown:
        raise ValueError(f"rank {rank}: unknown {side} tensor {unknown[0]!r} (expected {sorted(specs)})")
    device = None
    for name, spec in specs.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rank {rank}: {side} tensor {name!r} is a {type(t).__name__}, not a Tensor")
        if tuple(t.shape) != spec.shape:
            raise ValueError(
                f"rank {rank}: {side} tensor {name!r} has shape {tuple(t.shape)}, the layout says {spec.shape}"
            )
        if t.dtype != spec.dtype:
            raise ValueError(
                f"rank {rank}: {side} tensor {name!r} has dtype {t.dtype}, the layout says {spec.dtype}"
            )
        if t.device.type == "meta":  # no data: would fail after the handshake and leave the peers waiting
            raise ValueError(f"rank {rank}: {side} tensor {name!r} is on the meta device (it holds no data)")
        problem = storage_problem(t)  # e.g. freed storage: a copy from it would read freed memory
        if problem:
            raise ValueError(f"rank {rank}: {side} tensor {name!r} {problem}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"rank {rank}: {side} tensor {name!r} is on {t.device}, other tensors are on {device}"
            )
    return device


def check_memory(rank: int, src_tensors, dst_tensors, alias_problem) -> None:
    """A run reads the source while it writes the destination, in several steps: a destination byte that is
    also a source byte could be overwritten before a later step sends it. Raise for every destination that
    overlaps itself, and for every destination/source pair that shares bytes, unless the pair is provably
    safe (``alias_problem(source name, destination name, shift)``: see :func:`alias_problem`; None when safe)."""
    for name, t in dst_tensors.items():
        hit = self_overlap(t)
        if hit is not False:
            raise ValueError(
                f"rank {rank}: destination tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) "
                + ("overlaps itself (several elements at one address, e.g. an expand()ed view)" if hit else
                   "may overlap itself (its strides are too irregular to prove it does not)")
                + ": writing it is ill-defined; pass a tensor with its own memory")
    spans = []  # (start, end, is_destination, name) of every non-empty tensor's byte range
    for is_dst, tensors in ((False, src_tensors), (True, dst_tensors)):
        for name, t in tensors.items():
            if t.numel():
                start = t.data_ptr()
                spans.append((start, start + extent(t) * t.element_size(), is_dst, name))
    spans.sort()
    active: list[tuple] = []
    for span in spans:
        active = [a for a in active if a[1] > span[0]]
        for other in active:
            if other[2] != span[2]:
                s_name, d_name = (other[3], span[3]) if span[2] else (span[3], other[3])
                check_pair(rank, s_name, src_tensors[s_name], d_name, dst_tensors[d_name], alias_problem)
        active.append(span)

def check_pair(rank: int, s_name: str, s: torch.Tensor, d_name: str, d: torch.Tensor, alias_problem) -> None:
    """Source ``s`` and destination ``d`` have overlapping byte ranges: allowed if no byte is shared, or if
    ``d`` is a box of ``s`` (the same view, say) and every write into it is provably a no-op."""
    shift = sub_box_shift(s, d)
    if shift is not None:
        problem = alias_problem(s_name, d_name, shift)
        if problem is None:
            return
    else:
        meet = bytes_meet(s, d)
        if meet is False:
            return
        problem = "shares bytes with it" if meet else "may share bytes with it (too large to check exactly)"
    raise ValueError(
        f"rank {rank}: destination tensor {d_name!r} and source tensor {s_name!r} share memory: the "
        f"destination {problem}; a run reads the source while it writes the destination, in several "
        f"steps, so a write can change what a later step sends; pass separate tensors (e.g. clone the "
        f"source); nothing was moved")

def alias_problem(plan, rank: int, s_name: str, d_name: str, shift: tuple[int, ...]) -> str | None:
    """Destination ``d_name`` is the box at ``shift`` of source ``s_name``. None (safe) if every element the
    plan writes into it lands where the source layout says that very element already is (same tensor, same
    index): the write stores what is there (replicas of an element are equal; same dtype, no cast), so
    every read, before or after it, sees the same value. Else a description of the first unsafe write."""
    extra_d = None
    sfr = [f for f in rank_fragments(plan.src, rank) if f.local == s_name]
    for t in plan.transfers + plan.local_copies:
        if t.dst_rank != rank or t.dst_local != d_name or not t.numel:
            continue
        extra_d = len(t.dst_offsets) - len(t.offsets)
        w_off = tuple(o + c for o, c in zip(t.dst_offsets, shift, strict=True))  # in source coordinates
        w_size = (1,) * extra_d + t.sizes
        for f in sfr:
            f_off, f_size = f.local_offsets, f.local_sizes
            if not f.numel or len(f_off) != len(w_off) or not all(
                    a < b + m and b < a + n for a, n, b, m in zip(w_off, w_size, f_off, f_size, strict=True)):
                continue
            ex = len(f.local_offsets) - len(f.offsets)
            same = (f.tensor == t.tensor and ex == extra_d and f.local_offsets[:ex] == w_off[:ex] and all(
                lf - of == lw - ow for lf, of, lw, ow in zip(f.local_offsets[ex:], f.offsets, w_off[ex:],
                                                              t.offsets, strict=True)))
            if not same:
                box = ", ".join(f"{o}:{o + n}" for o, n in zip(t.offsets, t.sizes, strict=True))
                return (f"is the same memory as a box of it, and the reshard writes {t.tensor}[{box}] (from rank "
                        f"{t.src_rank}) where the source holds {f.tensor!r} box {f.offsets}+{f.sizes} at other "
                        f"indices")
    return None


def signature(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """What the checks and the binding depend on: names, addresses, shapes, strides, dtypes, devices and the
    bytes each tensor's storage holds (``storage_problem``: freed or shrunk in place). Raises (``AttributeError``,
    ``TypeError``, ``RuntimeError``) for what is not a dict of dense tensors: :func:`check_side` names it."""
    return tuple(
        (n, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t.untyped_storage().nbytes())
        for n, t in sorted(tensors.items())
    )


def quick_signature(src_tensors, dst_tensors) -> tuple | None:
    """Both sides' :func:`signature`, or None where one cannot be taken (the full checks then say why)."""
    try:
        return signature(src_tensors), signature(dst_tensors)
    except Exception:  # not a dict, not tensors, a layout without storage: check_side names it
        return None
