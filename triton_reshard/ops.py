"""The one dispatch point for moving bytes between tensor views.

Everything the executor copies (pack: strided source slice -> send buffer; unpack: receive buffer ->
strided destination slice; local: source slice -> destination slice) goes through :func:`copy_views`.
A *pair* is ``(src_view, dst_view)`` with equal shapes; dtypes may differ (the copy casts with torch's
``.to()`` semantics). ``key`` identifies a list of pairs that recurs (same tensors, same step) so a backend
may cache per-list state (e.g. a region table on the device).

Backends: ``"torch"`` (one ``copy_`` per pair; the reference, used on CPU) and ``"triton"`` (one launch
per dtype pair for the whole list; see ``triton_reshard/triton_copy.py``). ``TRITON_RESHARD_BACKEND``
forces one; otherwise CUDA tensors use Triton and CPU tensors use torch.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "TRITON_RESHARD_BACKEND"

Pair = tuple[torch.Tensor, torch.Tensor]


def resolve_backend(device: torch.device | str | None, backend: str | None = None) -> str:
    """Pick the copy backend: explicit argument > ``TRITON_RESHARD_BACKEND`` > by device type."""
    choice = backend or os.environ.get(ENV_VAR) or None
    if choice is not None:
        if choice not in BACKENDS:
            raise ValueError(f"unknown copy backend {choice!r}; expected one of {BACKENDS}")
        return choice
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return "triton" if dev.type == "cuda" else "torch"


def torch_copy_views(pairs: Sequence[Pair]) -> None:
    """Reference: copy every ``src`` view into its ``dst`` view with ``Tensor.copy_`` (casts like ``.to``)."""
    for src, dst in pairs:
        if src.numel():
            dst.copy_(src)


def copy_views(pairs: Sequence[Pair], backend: str = "torch", key: Hashable | None = None) -> None:
    """Copy every pair with the chosen backend. ``backend`` must already be resolved."""
    if not pairs:
        return
    if backend == "torch":
        torch_copy_views(pairs)
    elif backend == "triton":
        from .triton_copy import triton_copy_views

        triton_copy_views(pairs, key=key)
    else:
        raise ValueError(f"unknown copy backend {backend!r}; expected one of {BACKENDS}")
