"""The one dispatch point for moving bytes between tensor views.

Everything the executor copies (pack: strided source slice -> send buffer; unpack: receive buffer ->
strided destination slice; local: source slice -> destination slice) goes through :func:`copy_views`.
A *pair* is ``(src_view, dst_view)`` with equal shapes; dtypes may differ (the copy casts with torch's
``.to()`` semantics). ``key`` identifies a list of pairs that recurs (same tensors, same step) so a backend
may cache per-list state (e.g. a region table on the device).

Backends: ``"torch"`` (one ``copy_`` per pair; the reference, used on CPU) and ``"triton"`` (one launch
per dtype pair for the whole list; see ``triton_reshard/ops/copy.py``). ``TRITON_RESHARD_BACKEND``
forces one; otherwise CUDA tensors use Triton and CPU tensors use torch.

:func:`compare_views` is the read-only twin used by verify mode: per pair, how many elements of ``dst`` differ
bit for bit from what copying ``src`` into it would write. It has no kernel of its own (torch ops on any
device; verify is a one-off check, not the per-step path).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from .copy import Pair, torch_copy_views
from .delta import pack_delta as pack_delta
from .delta import unpack_delta as unpack_delta
from .launcher import BACKENDS, ENV_VAR, bits, resolve_backend  # noqa: F401  (the dispatch's names)
from .snapshot import Snapshot as Snapshot


def copy_views(pairs: Sequence[Pair], backend: str = "torch", key: Hashable | None = None) -> None:
    """Copy every pair with the chosen backend. ``backend`` must already be resolved."""
    if not pairs:
        return
    if backend == "torch":
        torch_copy_views(pairs)
    elif backend == "triton":
        from .copy import triton_copy_views

        triton_copy_views(pairs, key=key)
    else:
        raise ValueError(f"unknown copy backend {backend!r}; expected one of {BACKENDS}")


def _want(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """What copying ``src`` into ``dst`` writes (``copy_`` casts like ``.to``)."""
    return src if src.dtype == dst.dtype else src.to(dst.dtype)


def _differs(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(what copying ``src`` into ``dst`` writes, bool mask of the elements of ``dst`` that differ from it).

    Raw bits (signed zeros and NaN payloads count), except that after a cast done here any NaN matches any
    NaN: the NaN bits a cast produces depend on the copy path, not on the data (torch on CPU casts an fp32
    NaN to bf16 bits 0xffff on its contiguous vectorized path and 0x7fc0 on strided or scalar ones; the
    Triton kernel has its own), so refit may have written either."""
    want = _want(src, dst)
    diff = bits(want) != bits(dst)
    if src.dtype != dst.dtype and dst.dtype.is_floating_point:
        diff &= ~(want.isnan() & dst.isnan())
    return want, diff


def compare_views(pairs: Sequence[Pair]) -> list[int]:
    """Per pair ``(src, dst)``: the number of elements where ``dst`` differs, bit for bit (NaN payloads and
    signed zeros included; see ``_differs`` for NaN after a cast), from what ``copy_views`` would write into
    it. Reads only; one host sync per list. Temporaries: bool masks (plus one cast copy when the dtypes
    differ) of the pair's size."""
    out = [0] * len(pairs)
    live = [i for i, (s, _d) in enumerate(pairs) if s.numel()]
    if live:
        counts = [_differs(*pairs[i])[1].sum() for i in live]
        for i, n in zip(live, torch.stack(counts).tolist(), strict=True):
            out[i] = n
    return out


def first_difference(src: torch.Tensor, dst: torch.Tensor) -> tuple[tuple[int, ...], object, object, int, int] | None:
    """The first element (row-major) where ``dst`` differs from what copying ``src`` would write, as
    ``(index, value that would be written, value held, its bits, held bits)`` (bits unsigned); None if none."""
    want, diff = _differs(src, dst)
    diff = diff.reshape(-1)
    if not diff.numel() or not bool(diff.any()):
        return None
    flat = int(diff.to(torch.uint8).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(dst.shape)))
    mask = (1 << (8 * dst.element_size())) - 1
    return idx, want[idx].item(), dst[idx].item(), int(bits(want)[idx].item()) & mask, int(bits(dst)[idx].item()) & mask
