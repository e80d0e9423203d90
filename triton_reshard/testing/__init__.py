"""Deterministic synthetic weights: any rank can build any box of any tensor without communication.

Element ``i`` (row-major index in the global tensor) of tensor ``name`` has the value
``((i * 2654435761 + seed(name)) mod 2**16) - 2**15``, cast to the dtype (rounded in bf16/fp16, wrapped in
8-bit ints): deterministic, cheap to build for any box, and neighbours differ, so a misplaced element is
caught by a bit-exact check against the same function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def synthetic_box(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    offsets: Sequence[int] | None = None,
    sizes: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The box ``offsets``+``sizes`` (default: all) of the synthetic global tensor ``name``."""
    shape = tuple(shape)
    offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
    sizes = tuple(sizes) if sizes is not None else shape
    idx = torch.zeros(sizes, dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        ar = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64, device=device) * stride
        idx += ar.view((-1,) + (1,) * (len(shape) - d - 1))
        stride *= shape[d]
    vals = (idx * 2654435761 + _seed(name)) % 65536 - 32768
    if dtype == torch.bool:
        return (vals & 1).bool()
    if not dtype.is_floating_point and dtype != torch.bool:
        info = torch.iinfo(dtype)
        vals = vals.clamp(info.min, info.max) if info.bits < 16 else vals
        if info.bits == 8:
            vals = vals % 256 - (128 if info.min < 0 else 0)
        return vals.to(dtype)
    return vals.to(torch.float32).to(dtype) if dtype.itemsize < 4 else vals.to(dtype)


def synthetic_global(name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return synthetic_box(name, shape, dtype)
