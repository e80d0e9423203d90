"""The delta message format's constants and the helpers ``ops/delta.py`` (torch, Triton) and
``ops/delta_cpu.py`` (numpy) share: see ``ops/delta.py`` for the format."""

from __future__ import annotations

from collections.abc import Sequence

import torch

Pair = tuple[torch.Tensor, torch.Tensor]

MAGIC = 0x544C4454
VERSION = 1
KIND_DENSE = 0
KIND_BITMASK = 1
KIND_OFFSETS = 2
KIND_NARROW = 3  # version 2 only: narrow differences in blocks of 256 (ops/delta_v2.py)
VERSION2 = 2
KIND_NAMES = {KIND_DENSE: "dense", KIND_BITMASK: "bitmask", KIND_OFFSETS: "offsets", KIND_NARROW: "narrow"}
ALIGN = 16
HEADER_BYTES = 16
DIRECTORY_ENTRY_BYTES = 8
MAX_CHUNK_ELEMS = 1 << 16
# Chosen from perf/bench_delta.py (docs/delta.md): 64 KiB of bf16; at 1-7 % changed its total is within
# 0.05 percentage points (of dense) of 1 MiB chunks, and a chunk is one program of the kernels.
DEFAULT_CHUNK_ELEMS = 1 << 15
MAX_DIMS = 4
INT_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pad(n: torch.Tensor | int) -> torch.Tensor | int:
    """``n`` rounded up to a multiple of ``ALIGN`` bytes."""
    return (n + (ALIGN - 1)) // ALIGN * ALIGN


def chunks_start(num_chunks: int) -> int:
    """Byte offset of the first chunk: message header + directory."""
    return HEADER_BYTES + pad(DIRECTORY_ENTRY_BYTES * num_chunks)


def check_chunk_elems(chunk_elems: int) -> None:
    if not isinstance(chunk_elems, int) or not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"chunk_elems must be an int in [1, {MAX_CHUNK_ELEMS}], got {chunk_elems!r}")


def chunk_list(numels: Sequence[int], chunk_elems: int) -> list[tuple[int, int, int]]:
    """``(view index, first element, length)`` of every chunk, in message order."""
    return [(i, a, min(chunk_elems, n - a)) for i, n in enumerate(numels) for a in range(0, n, chunk_elems)]


def name_of(names: Sequence[str] | None, i: int) -> str:
    return f"{names[i]!r}" if names is not None else f"#{i}"


def validate_pairs(pairs: Sequence[Pair], names: Sequence[str] | None = None) -> torch.device:
    """Same shape, dtype and device on both sides of every pair; a supported element size."""
    device = None
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise TypeError(f"pair {name_of(names, i)}: expected a (src, snapshot) pair of tensors")
        src, snap = pair
        if src.shape != snap.shape or src.dtype != snap.dtype:
            raise ValueError(f"pair {name_of(names, i)}: src {tuple(src.shape)} {src.dtype} vs snapshot "
                             f"{tuple(snap.shape)} {snap.dtype}: shapes and dtypes must be equal")
        if src.element_size() not in INT_DTYPES:
            raise ValueError(f"pair {name_of(names, i)}: element size {src.element_size()} not supported")
        device = device or src.device
        if src.device != device or snap.device != device:
            raise ValueError(f"pair {name_of(names, i)}: mixed devices ({src.device}, {snap.device}, {device})")
    if device is None:
        raise ValueError("no pairs to pack")
    return device


def write_flat(d: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> None:
    """``d`` (an integer view, any strides) at row-major positions ``pos`` ← ``vals``, in place."""
    if d.dim() == 0:
        d = d.unsqueeze(0)
    d[torch.unravel_index(pos, d.shape)] = vals
