"""The integrity digest in the Triton quantizers' own pass (issue 46): a sender's quantizing pack writes fp8 /
NVFP4 values and scales straight into its messages, and each program of ``kernels/quant.py`` also hashes the
bytes it writes there (``DIGEST``), so those bytes take no second read pass. The per-program partials are
added up per message here (one ``index_add_`` per launch); what the kernels did not write (padding between
values and scales, items torch quantized) is returned as byte ranges for the caller to hash from the message.
The hash is ``csrc/digest.c``'s, linear in the bytes, so the sum equals the CPU digest of the same bytes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..layout.formats import FP8_BLOCK, QuantFormat, quant_format
from .copy import Messages
from .launcher import cached_table
from .quantize import CACHE_SIZE, KERNEL_FMT, Item, QuantTable, launch, prepare, rows_per_program, signature

MAX_SLOTS = 8  # partial sums per program of the rows kernel before it keeps one per block row
_CACHE: OrderedDict[Hashable, QuantTable] = OrderedDict()


def program_slots(msg_of: np.ndarray, per: int, nmsg: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The partial sums of programs of ``per`` consecutive block rows whose messages are ``msg_of``: ``(slots
    per program, each row's slot in its program, each partial's message)``; ``nmsg`` (a slot added nowhere)
    for a partial no row fills. A program's rows reaching more than :data:`MAX_SLOTS` messages: a slot per
    row (``slots == per``)."""
    n = len(msg_of)
    starts = np.arange(0, n, per)
    lo, hi = np.minimum.reduceat(msg_of, starts), np.maximum.reduceat(msg_of, starts)
    span = int((hi - lo).max()) + 1
    if span <= MAX_SLOTS and span < per:
        rel = msg_of - np.repeat(lo, per)[:n]
        slot_msg = lo[:, None] + np.arange(span, dtype=np.int64)[None, :]
        return span, rel, np.where(slot_msg <= hi[:, None], slot_msg, nmsg).reshape(-1)
    slot_msg = np.full(len(starts) * per, nmsg, dtype=np.int64)
    slot_msg[:n] = msg_of
    return per, np.arange(n, dtype=np.int64) % per, slot_msg


def _build(items: Sequence[Item], block: Sequence[int], fmt: QuantFormat, msgs: Messages) -> QuantTable:
    """:func:`~triton_reshard.ops.quantize.prepare` with the messages, then every group's slots."""
    from ..kernels import quant as k

    table = prepare(items, block, fmt, msgs)
    table.signature += msgs.spans
    rows = fmt.block is not None  # 1 x B blocks: the rows kernel, many blocks a program
    per = rows_per_program(table.tile[1])[0] if rows else 1
    for g in table.groups:
        slots, rel, slot_msg = program_slots(g.msg_of, per, len(msgs.spans))
        if rows:
            g.table[:, int(k.F_SLOT)] = torch.from_numpy(rel).to(table.device)
        g.slots, g.slot_msg = slots, torch.from_numpy(slot_msg).to(table.device)
    return table


def quantize_digest(items: Sequence[Item], block: Sequence[int], ue8m0: bool, bufs, coef: torch.Tensor,
                    key: Hashable | None = None, fmt: QuantFormat | str = FP8_BLOCK
                    ) -> tuple[torch.Tensor, list[list[tuple[int, int]]]] | None:
    """Quantize ``items`` as ``quantize_views(..., backend="triton")`` does, each program also hashing the bytes
    it writes into the messages ``bufs`` ((uint8 buffer, bytes) each; ``coef``: the keyed int64 coefficients
    on their device). Returns ``(sums, covered)``: per message the digest sum of those bytes (int64 on the
    device, no sync) and the byte ranges the kernels wrote (the rest of the message is the caller's to hash);
    or None, with nothing written, where the format has no kernel or two items write the same message bytes."""
    fmt = quant_format(fmt)
    if not items or fmt not in KERNEL_FMT:
        return None
    msgs = Messages.of(bufs, 1)
    with torch.no_grad():
        build = lambda: _build(items, block, fmt, msgs)  # noqa: E731
        if key is None:
            table = build()
        else:
            sig = lambda: (tuple(block), fmt.name, signature(items)) + msgs.spans  # noqa: E731
            table = cached_table(_CACHE, (key, "digest"), sig, build, CACHE_SIZE)
        covered = [sorted(c) for c in table.covered]
        if any(a < z0 for c in covered for (_a0, z0), (a, _z) in zip(c, c[1:], strict=False)):
            return None  # two items' outputs overlap: the sums would count their bytes twice
        return launch(table, items, ue8m0, block, fmt, coef), covered


def clear_cache() -> None:
    """Forget every cached digesting table."""
    _CACHE.clear()


def minus_ranges(ranges: list[tuple[int, int]], covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges ``ranges`` (sorted, disjoint) less ``covered`` (sorted, disjoint): what is left to hash
    of a message once the quantizers hashed ``covered`` (a fused copy's gaps, or the whole message)."""
    out = []
    for a, z in ranges:
        for ca, cz in covered:
            if cz <= a or ca >= z:
                continue
            if ca > a:
                out.append((a, ca))
            a = max(a, cz)
        if a < z:
            out.append((a, z))
    return out


def add_hashed(fused, lengths: list[int], sums: torch.Tensor, covered: list) -> tuple:
    """A step's fused-pack hashes ``fused`` ((per-send hashes, per-send byte ranges left to hash), or None: nothing
    hashed yet) with per-send ``sums`` over the byte ranges ``covered`` added (the quantizers', or Triton's delta
    encode: the kernels that wrote those bytes); the sends are ``lengths`` bytes each. What ``Ledger.on_post``
    finishes: the ranges left are hashed from the buffers."""
    hashes, gaps = fused if fused is not None else (None, [[(0, n)] if n else [] for n in lengths])
    gaps = [minus_ranges(g, c) for g, c in zip(gaps, covered, strict=True)]
    return (sums if hashes is None else hashes + sums, gaps)
