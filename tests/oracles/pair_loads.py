"""The step rule over the objects, a reference the tests compare the package against (not part of the package):
one pair's transfers cut into chunks and taken in order into loads by the next fit. The package cuts the same
loads on the columns (``plan/pair_schedule.py``, ``_cut``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from triton_reshard.box import align_up, split_box
from triton_reshard.layout import itemsize_of
from triton_reshard.plan.contiguity import Contiguity
from triton_reshard.plan.quant import split_src_chunks
from triton_reshard.plan.types import Chunk, Message, Transfer


def chunks(t: Transfer, cap: int) -> list[tuple[tuple, tuple, int]]:
    """A transfer cut for the schedule: ``[(offsets relative to it, sizes, bytes)]``, each at most ``cap`` once
    aligned (a source-quantized transfer only at block multiples, ``split_src_chunks``)."""
    if t.quant == "src":
        return split_src_chunks(t, cap)
    isz = itemsize_of(t.wire_dtype)
    out = []
    for o, sz in split_box(t.sizes, isz, cap):
        n = math.prod(sz) * isz
        if n:
            out.append((o, sz, n))
    return out


def direct_of(contiguity: Contiguity | None, min_bytes: int) -> Callable[[int, Transfer, tuple, tuple], bool]:
    """Whether a chunk travels in place: ``min_bytes`` or more and contiguous in a local tensor (per object)."""

    def direct(_i: int, t: Transfer, off: tuple, size: tuple) -> bool:
        if contiguity is None or math.prod(size) * itemsize_of(t.wire_dtype) < min_bytes:
            return False
        return contiguity.direct(t, off, size)

    return direct


def in_key_order(transfers: Sequence[tuple[int, Transfer]]) -> list[tuple[int, Transfer]]:
    """One pair's ``(index, transfer)`` in ``Transfer.key`` order (a stable sort)."""
    return sorted(transfers, key=lambda it: it[1].key())


def pair_loads(transfers: Sequence[tuple[int, Transfer]], cap: int,
               direct: Callable[[int, Transfer, tuple, tuple], bool]) -> list[list[Message]]:
    """One pair's stream cut into step loads: ``transfers`` ((index, transfer), in key order) cut into chunks
    of at most ``cap`` bytes, taken in order into loads of at most ``cap`` aligned bytes; a load is one packed
    message (its chunks at aligned offsets) followed by one message per chunk ``direct`` calls direct."""
    out: list[list[Message]] = []
    cs: list[Chunk] = []
    singles: list[Message] = []
    off = used = 0
    s = d = None
    for i, t in transfers:
        s, d = t.src_rank, t.dst_rank
        for o, sz, n in chunks(t, cap):
            a = align_up(n)
            if used + a > cap and used:
                out.append([Message(s, d, off, tuple(cs)), *singles] if cs else singles)
                cs, singles, off, used = [], [], 0, 0
            if direct(i, t, o, sz):
                singles.append(Message(s, d, a, (Chunk(i, o, sz, n, 0),), True))
            else:
                cs.append(Chunk(i, o, sz, n, off))
                off += a
            used += a
    if used:
        out.append([Message(s, d, off, tuple(cs)), *singles] if cs else singles)
    return out
