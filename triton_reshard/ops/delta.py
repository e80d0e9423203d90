"""The delta op (issue 24): encode only the elements whose bits changed since a snapshot, and scatter them.

``pack_delta(pairs)`` takes ``(src_view, snapshot_view)`` pairs (same shape and dtype; any strides) and
returns one *delta message* (a ``uint8`` tensor) holding, chunk by chunk, the elements of ``src`` whose
bits differ from the snapshot's; with ``update=True`` it also writes them into the snapshot.
``unpack_delta(message, dsts)`` writes the changed values into destination views of the same shapes (any
strides) in place: an element not in the message keeps the destination's bits. If every destination held
the snapshot, unpack ∘ pack is a dense copy of the sources. Bits are compared and moved as integers of the
element's size (NaN payloads, signed zeros exact); any dtype of 1, 2, 4 or 8 bytes (fp8 and int8 as bytes).

Backends, side by side as in ``ops/copy.py``: ``torch_pack`` / ``torch_unpack`` (the reference, any
device, used on CPU) and ``triton_pack`` / ``triton_unpack`` (kernels in ``kernels/delta.py``: pack is two
launches per element size, a count pass and an encode pass, with the layout computed on the device in
between and one host sync for the message length; unpack is one launch per element size after a vectorized
header check with one host sync). Both write the same bytes: a message is bit-identical across backends.

Chunks
------
Each view is cut, in row-major order of its elements (the box's own order, independent of the strides on
either side), into chunks of ``chunk_elems`` elements (the last one shorter); ``1 <= chunk_elems <= 65536``
so that an offset inside a chunk fits in 16 bits. Views with no elements have no chunks. The chunks of the
message are those of ``pairs[0]``, then of ``pairs[1]``, ...; the receiver's ``dsts`` must have the same
shapes in the same order (checked per chunk: element size and length).

Version 2 (issue 44; the default of CPU packs: ``version=2``): the same container with ``VERSION`` 2 and one
more chunk kind, narrow differences of the bit patterns in blocks of 256 (``ops/delta_v2.py``); readers take
both versions (the torch-ops reference on other devices reads version 1), the Triton kernels write either.

Encoded message (all integers little-endian; every section starts at a multiple of 16 bytes from the
start of the message; padding bytes are zero; the whole message is a multiple of 16 bytes)
-----------------------------------------------------------------------------------------------------
- **Message header**, 16 bytes, four uint32: ``MAGIC`` (0x544C4454, the bytes "TDLT"), ``VERSION`` (1),
  number of chunks ``C``, ``chunk_elems``.
- **Directory** at byte 16: ``C`` int64 byte offsets (from the start of the message) of the chunk
  headers, ascending; padded to 16 bytes. The chunks follow, back to back, in directory order.
- **Chunk header**, 16 bytes, four uint32: ``kind | elem_size << 8``, ``numel`` (elements in the chunk),
  ``count`` (elements whose bits changed), ``nbytes`` (the chunk's bytes, header included, a multiple of
  16). Then the body at header + 16:

  ========================= ===============================================================================
  ``KIND_OFFSETS`` (2)      ``count`` uint16: the changed elements' indices in the chunk, ascending;
                            padded to 16 bytes; then ``count`` values (``elem_size`` bytes each).
  ``KIND_BITMASK`` (1)      ``ceil(numel / 32)`` uint32 words: bit ``k`` (LSB first) of word ``w`` is
                            set iff element ``32 w + k`` changed; padded to 16; then ``count`` values in
                            index order.
  ``KIND_DENSE`` (0)        ``numel`` values (all of them; ``count`` is still the number that changed).
  ========================= ===============================================================================

  Values are the raw bits of the source elements, ``elem_size`` bytes each, little-endian.

The kind of a chunk is the smallest of the three (ties: offsets, then bitmask, then dense):
offsets ``16 + pad16(2 c) + pad16(e c)``, bitmask ``16 + pad16(4 ceil(n/32)) + pad16(e c)``,
dense ``16 + pad16(e n)`` for ``n`` elements of ``e`` bytes with ``c`` changed. For bf16 (e = 2), offsets
win below 1/16 = 6.25 % changed, the bitmask up to 15/16, dense above: an unchanged chunk costs its
16-byte header and 8-byte directory entry. Why these three, and why uint16 rather than int32 offsets:
``perf/bench_delta.py`` and ``docs/delta.md``.

Errors: every field of a received message is checked against the destinations (and its own bounds) before
the first byte is written (``ValueError`` naming the chunk and destination). The two checks that need the
body (an offset past the chunk, a bitmask whose popcount is not ``count``) are made by the kernel as it
writes (the destination is then torn, and ``ValueError`` says so) and by the reference before it writes.

Concurrency: with ``update=True`` no two pairs of one call may overlap in their snapshots (the second would
compare against the first's update); pack with ``update=False`` and update the snapshot once after every
message of a version was packed (``Snapshot.capture``) when one source box goes to several destinations.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from .delta_cached import pack_plan, unpack_plan, unpack_with
from .delta_cpu import numpy_pack
from .delta_format import ALIGN as ALIGN  # re-exported: the format's constants are read from this module too
from .delta_format import (
    DEFAULT_CHUNK_ELEMS,
    HEADER_BYTES,
    KIND_BITMASK,
    KIND_DENSE,
    KIND_NAMES,
    KIND_OFFSETS,
    VERSION2,
    Pair,
    chunk_list,
    chunks_start,
    pad,
    validate_pairs,
)
from .delta_format import INT_DTYPES as _INT
from .delta_format import MAGIC as MAGIC
from .delta_format import MAX_CHUNK_ELEMS as MAX_CHUNK_ELEMS
from .delta_format import VERSION as VERSION
from .delta_format import check_chunk_elems as _check_chunk_elems
from .delta_format import name_of as _name
from .delta_format import write_flat as _write_flat
from .delta_message import chunk_sizes as chunk_sizes
from .delta_message import join_messages as join_messages
from .delta_message import message_layout as _message_layout
from .delta_message import read_directory
from .delta_message import write_headers as _write_headers
from .delta_native import in_place_bytes, pack_v2, unpack_v2
from .delta_triton import triton_pack, triton_unpack
from .launcher import bits, resolve_backend

CPU = torch.device("cpu")
CPU_VERSION = 2  # the format CPU packs write by default (issue 44: narrow values, ops/delta_v2.py)

def max_message_bytes(numels: Sequence[int], elem_sizes: Sequence[int],
                      chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """The largest message that views of these sizes can produce (every chunk dense): a receive buffer
    that always fits."""
    total, nc = 0, 0
    for n, e in zip(numels, elem_sizes, strict=True):
        for a in range(0, n, chunk_elems):
            total += HEADER_BYTES + pad(min(chunk_elems, n - a) * e)
            nc += 1
    return chunks_start(nc) + total


def _wrap(x: torch.Tensor, bits_: int, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative integers below 2**bits_ as the signed integer dtype of that width (two's complement)."""
    half = 1 << (bits_ - 1)
    return torch.where(x >= half, x - (1 << bits_), x).to(dtype)


def ragged(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments of ``lengths`` (int64): (segment of every item, its rank inside the segment)."""
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return seg, torch.arange(seg.numel(), device=lengths.device) - first[seg]


def _chunk_rows(flat: torch.Tensor, chunk_elems: int, nch: int) -> torch.Tensor:
    """A flat vector cut into ``nch`` rows of ``chunk_elems`` (the last one zero-padded)."""
    return torch.nn.functional.pad(flat, (0, nch * chunk_elems - flat.numel())).view(nch, chunk_elems)


def _chunk_counts(mask: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """Set elements of a flat bool vector per chunk (int64; no widened copy of the mask)."""
    full = mask.numel() // chunk_elems
    parts = [mask[:full * chunk_elems].view(full, chunk_elems).count_nonzero(1)] if full else []
    if mask.numel() > full * chunk_elems:
        parts.append(mask[full * chunk_elems:].count_nonzero().reshape(1))
    return torch.cat(parts)


_BIT_WEIGHTS = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)


def _value_base(kind: torch.Tensor, body: torch.Tensor, count: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
    """Byte offset of each chunk's values (its body + the offsets or bitmask section)."""
    return torch.where(kind == KIND_OFFSETS, body + pad(2 * count),
                       torch.where(kind == KIND_BITMASK, body + pad(4 * ((numel + 31) // 32)), body))


# ---------------------------------------------------------------------------------------------------------
# torch reference


def _tensor_pack(pairs: Sequence[Pair], chunk_elems: int = DEFAULT_CHUNK_ELEMS, update: bool = True,
                 names: Sequence[str] | None = None) -> torch.Tensor:
    """Reference pack in torch ops (any device; :func:`torch_pack` runs :func:`~triton_reshard.ops.delta_cpu.numpy_pack` on CPU): the delta message of ``pairs`` (see the module docstring); with ``update`` each
    snapshot is brought up to date with its source. Vectorized over all pairs at once: the change masks of
    every pair go into one buffer cut into whole chunks (each pair's last chunk zero-padded), so counting,
    choosing the kinds, the bitmasks, the offsets and the value positions are a fixed number of tensor ops
    whatever the number of pairs; per pair only its compare and its value gather remain (many small
    tensors of a model cost ~2 ops each, not ~30)."""
    _check_chunk_elems(chunk_elems)
    device = validate_pairs(pairs, names)
    ce = chunk_elems
    flat = [(bits(s).reshape(-1), bits(p).reshape(-1)) for s, p in pairs]
    numels = [s.numel() for s, _ in flat]
    nchs = [-(-n // ce) for n in numels]
    c0s = [0]
    for nch in nchs:
        c0s.append(c0s[-1] + nch)
    nc = c0s[-1]
    chunks = chunk_list(numels, ce)
    numel = torch.tensor([n for _, _, n in chunks], dtype=torch.int64, device=device)
    esizes = [s.element_size() for s, _ in flat]
    esize = torch.tensor([esizes[i] for i, _, _ in chunks], dtype=torch.int64, device=device)
    mask = torch.empty(nc * ce, dtype=torch.bool, device=device)  # every element written below, once
    for (s, p), c0, nch in zip(flat, c0s, nchs, strict=False):
        if s.numel():
            torch.ne(s, p, out=mask[c0 * ce:c0 * ce + s.numel()])
            mask[c0 * ce + s.numel():(c0 + nch) * ce] = False  # the last chunk's padding
    rows = mask.view(nc, ce)
    idx = _nonzero(mask)  # every changed element (padded position): counts per chunk from it
    shift = ce.bit_length() - 1 if ce & (ce - 1) == 0 else None  # the default chunk is a power of two
    ch = idx >> shift if shift is not None else idx // ce
    count = torch.bincount(ch, minlength=nc) if nc else numel
    kind, nbytes, offsets, total = _message_layout(numel, count, esize)
    msg = torch.zeros(total, dtype=torch.uint8, device=device)
    _write_headers(msg, ce, numel, count, esize, kind, nbytes, offsets)
    if not nc:
        return _finish_pack(msg, pairs, update)
    body = offsets + HEADER_BYTES
    vbase = _value_base(kind, body, count, numel)
    # bitmask words of the bitmask chunks, built as bytes (little-endian words, LSB first), written at once
    bc = (kind == KIND_BITMASK).nonzero().squeeze(1)
    if bc.numel():
        nw = -(-ce // 32)
        wbytes = _packbits(rows[bc], 32 * nw)
        col = torch.arange(4 * nw, device=device)
        keep = col[None, :] < (4 * ((numel[bc] + 31) // 32))[:, None]
        msg[(body[bc][:, None] + col[None, :])[keep]] = wbytes[keep]
    # every element of the dense chunks: one slice copy each; then their elements leave the sparse list
    dense = (kind == KIND_DENSE).nonzero().squeeze(1).tolist()
    for c in dense:
        i, a, n = chunks[c]
        e = esizes[i]
        o = int(body[c])
        msg.view(_INT[e])[o // e:o // e + n] = flat[i][0][a:a + n]
    if dense:
        keep = kind[ch] != KIND_DENSE
        idx, ch = idx[keep], ch[keep]
    # the changed elements of the sparse chunks, in order: their offsets and values, scattered at once
    if idx.numel():
        local = idx & (ce - 1) if shift is not None else idx - ch * ce
        sparse_count = torch.where(kind == KIND_DENSE, torch.zeros_like(count), count)
        r = torch.arange(idx.numel(), device=device) - (torch.cumsum(sparse_count, 0) - sparse_count)[ch]
        off = kind[ch] == KIND_OFFSETS
        msg.view(torch.int16)[(body[ch] // 2 + r)[off]] = _wrap(local[off], 16, torch.int16)
        bounds = torch.searchsorted(idx, torch.tensor(c0s, dtype=torch.int64, device=device) * ce).tolist()
        by_size: dict[int, list[tuple[int, int, int]]] = {}
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if hi > lo:
                by_size.setdefault(esizes[i], []).append((i, lo, hi))
        for e, parts in by_size.items():
            vals = torch.cat([flat[i][0][idx[lo:hi] - c0s[i] * ce] for i, lo, hi in parts])
            sel = torch.cat([torch.arange(lo, hi, device=device) for _, lo, hi in parts]) if len(by_size) > 1 \
                else slice(None)
            msg.view(_INT[e])[(vbase[ch] // e + r)[sel]] = vals
    return _finish_pack(msg, pairs, update)


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Indices of the set elements of a 1-D bool tensor (int64); on CPU numpy's, ~4x faster than torch's."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy())).to(torch.int64)
    return mask.nonzero().squeeze(1)


def _packbits(rows: torch.Tensor, nbits: int) -> torch.Tensor:
    """Bool rows (k, n <= nbits) as little-endian bit bytes (k, nbits // 8), LSB first; numpy's on CPU."""
    if rows.device.type == "cpu":
        return torch.from_numpy(np.packbits(rows.numpy(), axis=1, bitorder="little")).reshape(rows.shape[0], -1) \
            if rows.shape[1] == nbits else \
            torch.from_numpy(np.packbits(torch.nn.functional.pad(rows.view(torch.uint8), (0, nbits - rows.shape[1]))
                                         .numpy(), axis=1, bitorder="little"))
    brow = torch.nn.functional.pad(rows.view(torch.uint8), (0, nbits - rows.shape[1])).view(-1, nbits // 8, 8)
    return (brow * _BIT_WEIGHTS.to(rows.device)).sum(2, dtype=torch.uint8)


def _unpackbits(b: torch.Tensor) -> torch.Tensor:
    """Bytes (n,) as their bits (n, 8) uint8, LSB first; numpy's on CPU."""
    if b.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(b.numpy(), bitorder="little")).view(-1, 8)
    return (b[:, None] >> torch.arange(8, dtype=torch.uint8, device=b.device)) & 1


def _finish_pack(msg: torch.Tensor, pairs: Sequence[Pair], update: bool) -> torch.Tensor:
    if update:
        for s, p in pairs:
            bits(p).copy_(bits(s))
    return msg


def _tensor_unpack(msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
    """Reference unpack in torch ops (any device; :func:`torch_unpack` runs :func:`~triton_reshard.ops.delta_cpu.numpy_unpack` on CPU): every chunk's values into its destination view, in place. The whole message
    (headers and bodies) is checked before the first write. Vectorized over all chunks of the message at
    once; per destination one scatter (and a slice copy per dense chunk)."""
    dr = read_directory(msg, dsts, names)
    if not dr.chunks:
        return
    dev = msg.device
    numel = torch.tensor([n for _, _, n in dr.chunks], dtype=torch.int64, device=dev)
    start = torch.tensor([a for _, a, _ in dr.chunks], dtype=torch.int64, device=dev)
    owner = torch.tensor([i for i, _, _ in dr.chunks], dtype=torch.int64, device=dev)
    bit_views = [bits(d) for d in dsts]
    contiguous = [d.is_contiguous() for d in bit_views]
    esizes = [d.element_size() for d in dsts]
    k, body, cnt, nel = dr.kind, dr.offsets + HEADER_BYTES, dr.count, numel
    vbase = _value_base(k, body, cnt, nel)
    zero = torch.zeros_like(cnt)
    # offsets chunks
    seg, r = ragged(torch.where(k == KIND_OFFSETS, cnt, zero))
    o = msg.view(torch.int16)[body[seg] // 2 + r].to(torch.int64) & 0xFFFF
    bad_o = torch.zeros_like(cnt).index_add_(0, seg, (o >= nel[seg]).to(torch.int64))
    # bitmask chunks: popcount must be the header's count
    isb = k == KIND_BITMASK
    segw, w = ragged(torch.where(isb, 4 * ((nel + 31) // 32), zero))  # the bitmask bytes
    wbytes = msg[body[segw] + w]
    bitsm = _unpackbits(wbytes)  # (bytes, 8) uint8, LSB first
    pop = torch.zeros_like(cnt).index_add_(0, segw, bitsm.sum(1, dtype=torch.int64))
    flat_bits = _nonzero(bitsm.view(-1))
    row = flat_bits // 8
    sb = segw[row]
    jb = w[row] * 8 + (flat_bits - row * 8)
    rank = torch.arange(sb.numel(), device=dev) - (torch.cumsum(pop, 0) - pop)[sb]
    bad = (bad_o > 0) | (isb & (pop != cnt))
    if bool(bad.any()):
        c = int(bad.to(torch.int8).argmax())
        j, a0, n0 = dr.chunks[c]
        raise ValueError(f"delta message: chunk {c} (destination {_name(names, j)}, elements {a0}..{a0 + n0 - 1}): "
                         f"{KIND_NAMES[int(dr.kind[c])]} body inconsistent with its header (count {int(dr.count[c])})")
    # dense chunks: slice copies into contiguous destinations, scattered like the rest into the others
    isd = k == KIND_DENSE
    groups = [(seg, o, r), (sb, jb, rank)]  # (chunk, element in the chunk, index among its values) per item
    dense = []
    if bool(isd.any()):
        scatter = isd & ~torch.tensor(contiguous, dtype=torch.bool, device=dev)[owner]
        segd, jd = ragged(torch.where(scatter, nel, zero))
        groups.append((segd, jd, jd))
        dense = (isd & ~scatter).nonzero().squeeze(1).tolist()
    bounds = torch.arange(len(dsts) + 1, dtype=torch.int64, device=dev)
    for chunk, elem, ridx in groups:  # items sorted by chunk, chunks by destination: one slice per destination
        if not chunk.numel():
            continue
        cut = torch.searchsorted(owner[chunk], bounds).tolist()
        pos = start[chunk] + elem  # element index in the destination (row-major)
        at = vbase[chunk]
        for i, (lo, hi) in enumerate(zip(cut[:-1], cut[1:], strict=True)):
            if hi == lo:
                continue
            e = esizes[i]
            vals = msg.view(_INT[e])[at[lo:hi] // e + ridx[lo:hi]]
            if contiguous[i]:
                bit_views[i].view(-1)[pos[lo:hi]] = vals
            else:
                _write_flat(bit_views[i], pos[lo:hi], vals)
    for c in dense:
        i, a0, n0 = dr.chunks[c]
        e = esizes[i]
        ob = int(body[c])
        bit_views[i].view(-1)[a0:a0 + n0] = msg.view(_INT[e])[ob // e:ob // e + n0]


def torch_pack(pairs: Sequence[Pair], chunk_elems: int = DEFAULT_CHUNK_ELEMS, update: bool = True,
               names: Sequence[str] | None = None, cache: dict | None = None, version: int = CPU_VERSION
               ) -> torch.Tensor:
    """Reference pack: the delta message of ``pairs`` (see the module docstring); with ``update`` each
    snapshot is brought up to date with its source. CPU tensors: ``version`` 2 (the default) the narrow
    format by :func:`~triton_reshard.ops.delta_native.pack_v2`; 1: :func:`~triton_reshard.ops.delta_cpu.numpy_pack`
    (with ``cache``, a dict the caller keeps for this message: its :class:`~triton_reshard.ops.delta_cached.PackPlan`,
    the same bytes); others: :func:`_tensor_pack` (version 1, the same bytes)."""
    _check_chunk_elems(chunk_elems)
    device = validate_pairs(pairs, names)
    if device.type == "cpu":
        if version == VERSION2:
            return pack_v2(pairs, chunk_elems, update, cache)
        if cache is not None:
            return pack_plan(cache, pairs, chunk_elems).pack(update)
        return numpy_pack(pairs, chunk_elems, update)
    return _tensor_pack(pairs, chunk_elems, update, names)


def torch_unpack(msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                 cache: dict | None = None) -> None:
    """Reference unpack: every chunk's values into its destination view, in place; the whole message (headers
    and bodies) is checked before the first write. CPU: :func:`~triton_reshard.ops.delta_cpu.numpy_unpack` (with
    ``cache``: the message's :class:`~triton_reshard.ops.delta_cached.UnpackPlan`, the same checks and result);
    others: :func:`_tensor_unpack`."""
    plan = cache.get("unpack") if cache is not None else None
    if plan is not None and plan.fits(dsts) and plan.cpu and msg.device.type == "cpu":
        return unpack_with(plan, msg, names)
    if msg.device.type == "cpu" and all(d.device.type == "cpu" for d in dsts):
        if cache is not None:
            return unpack_with(unpack_plan(cache, dsts), msg, names)
        return unpack_v2(msg, dsts, names)
    return _tensor_unpack(msg, dsts, names)


def message_length(msg: torch.Tensor) -> int:
    """The length a delta message's own header and directory give (its last chunk's end; a message with no
    chunks is its header and directory): the bytes that arrived when it was received into a larger buffer.
    Call after :func:`read_directory` (or an unpack) accepted it."""
    n = msg.numel()
    if in_place_bytes(msg):  # read where they lie: ~3 µs (every delta receive asks); bounds kept as numpy's
        at = msg.data_ptr()
        nc = ctypes.c_int32.from_address(at + 8).value
        if not nc:
            return chunks_start(0)
        if nc > 0 and HEADER_BYTES + 8 * nc <= n:
            last = ctypes.c_int64.from_address(at + HEADER_BYTES + 8 * (nc - 1)).value
            if last >= 0 and last + 16 <= n:
                return last + ctypes.c_uint32.from_address(at + last + 12).value
    if msg.device.type == "cpu":  # numpy: a few µs instead of torch's per-op costs
        mn = msg.numpy()
        nc = int(mn[8:12].view(np.int32)[0])
        if not nc:
            return chunks_start(0)
        last = int(mn[HEADER_BYTES + 8 * (nc - 1):HEADER_BYTES + 8 * nc].view(np.int64)[0])
        return last + int(mn[last + 12:last + 16].view(np.uint32)[0])
    nc = int(msg[:16].view(torch.int32)[2])
    if not nc:
        return chunks_start(0)
    last = int(msg[HEADER_BYTES + 8 * (nc - 1):HEADER_BYTES + 8 * nc].view(torch.int64)[0])
    return last + (int(msg[last + 12:last + 16].view(torch.int32)[0]) & 0xFFFFFFFF)


def describe(msg: torch.Tensor) -> list[dict]:
    """Every chunk's header as a dict (kind name, elem_size, numel, count, nbytes): for tests and reports."""
    nc = int(msg[:16].view(torch.int32)[2])
    offs = msg[HEADER_BYTES:HEADER_BYTES + 8 * nc].view(torch.int64).tolist()
    out = []
    for o in offs:
        w = [int(x) & 0xFFFFFFFF for x in msg[o:o + 16].view(torch.int32).tolist()]
        out.append({"kind": KIND_NAMES[w[0] & 0xFF], "elem_size": w[0] >> 8, "numel": w[1], "count": w[2],
                    "nbytes": w[3], "offset": o})
    return out


# ---------------------------------------------------------------------------------------------------------
# dispatch


def _backend(device: torch.device, backend: str | None) -> str:

    return resolve_backend(device, backend)


def pack_delta(pairs: Sequence[Pair], chunk_elems: int = DEFAULT_CHUNK_ELEMS, update: bool = True,
               backend: str | None = None, names: Sequence[str] | None = None, cache: dict | None = None,
               version: int = CPU_VERSION) -> torch.Tensor:
    """The delta message of ``pairs`` (``(src, snapshot)`` views) with the chosen backend (as ``copy_views``:
    argument > ``TRITON_RESHARD_BACKEND`` > Triton on CUDA, torch otherwise). ``cache``: a dict the caller keeps
    for a message that recurs with the same view objects (a refit's send): on CPU its per-message plan is kept
    there and its checks are made once (``ops/delta_cached.py``). ``version``: the format a CPU pack writes
    (2, narrow values: ``ops/delta_v2.py``; 1: the v1 kinds only), the Triton backend's too."""
    plan = cache.get("pack2" if version == VERSION2 else "pack") if cache is not None else None
    if plan is not None and plan.fits(pairs, chunk_elems) and _backend(CPU, backend) == "torch":
        return plan.pack(update)
    device = validate_pairs(pairs, names)
    if _backend(device, backend) == "triton":
        return triton_pack(pairs, chunk_elems=chunk_elems, update=update, names=names, version=version,
                           cache=cache)
    return torch_pack(pairs, chunk_elems=chunk_elems, update=update, names=names, cache=cache, version=version)


def unpack_delta(msg: torch.Tensor, dsts: Sequence[torch.Tensor], backend: str | None = None,
                 names: Sequence[str] | None = None, cache: dict | None = None) -> None:
    """Scatter a delta message into ``dsts`` in place with the chosen backend. ``cache``: as :func:`pack_delta`'s,
    for a receive that recurs with the same destination views."""
    if _backend(msg.device, backend) == "triton":
        return triton_unpack(msg, dsts, names=names)
    return torch_unpack(msg, dsts, names=names, cache=cache)


