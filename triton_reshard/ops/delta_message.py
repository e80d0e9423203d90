"""The delta message's frame, shared by the torch reference (:mod:`.delta`) and the Triton launchers
(:mod:`.delta_triton`): chunk sizes, the header and directory writer, and the reader that checks every header
against the destinations before anything is written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .delta_format import (
    ALIGN,
    HEADER_BYTES,
    KIND_BITMASK,
    KIND_DENSE,
    KIND_NARROW,
    KIND_OFFSETS,
    MAGIC,
    MAX_CHUNK_ELEMS,
    VERSION,
    VERSION2,
    chunk_list,
    chunks_start,
    pad,
)
from .delta_format import INT_DTYPES as _INT
from .delta_format import name_of as _name

# Block sizes: under the interpreter every loop step costs Python time, so it gets big blocks.
INTERPRET_BLOCK = 4096
CUDA_BLOCK = 1024


def chunk_sizes(
    numel: torch.Tensor, count: torch.Tensor, elem_size: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk (int64 tensors of chunk lengths and changed counts): (kind, encoded bytes incl. header) of
    the smallest encoding; ties go to offsets, then bitmask, then dense."""
    values = pad(count * elem_size)
    offsets = HEADER_BYTES + pad(2 * count) + values
    bitmask = HEADER_BYTES + pad(4 * ((numel + 31) // 32)) + values
    dense = HEADER_BYTES + pad(numel * elem_size)
    best, idx = torch.stack([offsets, bitmask, dense]).min(0)
    kind = torch.tensor([KIND_OFFSETS, KIND_BITMASK, KIND_DENSE], device=numel.device)[idx]
    return kind, best


def message_layout(
    numel: torch.Tensor, count: torch.Tensor, esize: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(kind, nbytes, byte offset per chunk, message length): the length is the one host sync."""
    kind, nbytes = chunk_sizes(numel, count, esize)
    start = chunks_start(numel.numel())
    offsets = start + torch.cumsum(nbytes, 0) - nbytes
    total = start + (int(nbytes.sum()) if numel.numel() else 0)
    return kind, nbytes, offsets, total


def write_headers(
    msg: torch.Tensor,
    chunk_elems: int,
    numel: torch.Tensor,
    count: torch.Tensor,
    esize: torch.Tensor,
    kind: torch.Tensor,
    nbytes: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Message header, directory and every chunk header (vectorized; on the message's device)."""
    nc = numel.numel()
    m32 = msg.view(torch.int32)
    m32[:4] = torch.tensor([MAGIC, VERSION, nc, chunk_elems], dtype=torch.int32, device=msg.device)
    if nc:
        msg[HEADER_BYTES : HEADER_BYTES + 8 * nc].view(torch.int64).copy_(offsets)
        words = torch.stack([kind | (esize << 8), numel, count, nbytes], 1).to(torch.int32)
        idx = (offsets // 4)[:, None] + torch.arange(4, device=msg.device)
        m32[idx.reshape(-1)] = words.reshape(-1)


@dataclass(frozen=True, slots=True)
class Directory:
    """A received message's chunks, checked against the destinations (device tensors, message order)."""

    chunks: list[tuple[int, int, int]]  # (destination index, first element, length)
    offsets: torch.Tensor  # int64 byte offset of each chunk header
    kind: torch.Tensor  # int64
    count: torch.Tensor  # int64
    nbytes: torch.Tensor | None = None  # int64 (each chunk's bytes, header included)
    version: int = VERSION


def _want_bytes(kind, numel, count, nbytes, esize_d, version: int) -> tuple[torch.Tensor, int]:
    """(the bytes each chunk header's kind implies, the highest kind of ``version``): a narrow chunk's exact
    bytes are checked with its body, so its header may claim a multiple of 16 between its descriptors and its
    dense size (``ops.delta_v2.narrow_want``)."""
    values = pad(torch.minimum(count, numel) * esize_d)
    want = torch.stack(
        [
            HEADER_BYTES + pad(numel * esize_d),
            HEADER_BYTES + pad(4 * ((numel + 31) // 32)) + values,
            HEADER_BYTES + pad(2 * torch.minimum(count, numel)) + values,
        ]
    )[torch.clamp(kind, 0, 2), torch.arange(kind.numel(), device=kind.device)]
    if version != VERSION2:
        return want, KIND_OFFSETS
    lo = HEADER_BYTES + 2 * ((numel + 255) // 256)
    fits = (nbytes % ALIGN == 0) & (nbytes >= lo) & (nbytes < HEADER_BYTES + pad(numel * esize_d))
    return torch.where(
        kind == KIND_NARROW, torch.where(fits, nbytes, torch.full_like(nbytes, -1)), want
    ), KIND_NARROW


def read_directory(
    msg: torch.Tensor,
    dsts: Sequence[torch.Tensor],
    names: Sequence[str] | None = None,
    versions: tuple[int, ...] = (VERSION,),
) -> Directory:
    """Check every header of ``msg`` against ``dsts`` and its own bounds (one host sync); raise
    ``ValueError`` naming the first bad chunk and its destination. ``versions``: the formats the caller
    reads (the Triton unpack reads version 2's narrow chunks too, the torch-ops reference only version 1)."""
    if msg.dtype != torch.uint8 or msg.dim() != 1 or not msg.is_contiguous():
        raise ValueError(
            f"a delta message is a contiguous 1-D uint8 tensor, got {msg.dtype} {tuple(msg.shape)}"
        )
    length = msg.numel()
    if length < HEADER_BYTES or length % ALIGN:
        raise ValueError(
            f"delta message of {length} bytes: shorter than its header or not a multiple of {ALIGN}"
        )
    for i, d in enumerate(dsts):
        if d.element_size() not in _INT or d.device != msg.device:
            raise ValueError(
                f"destination {_name(names, i)}: {d.dtype} on {d.device} (message on {msg.device})"
            )
    magic, version, nc, chunk_elems = (int(x) & 0xFFFFFFFF for x in msg[:16].view(torch.int32).tolist())
    if magic != MAGIC or version not in versions:
        raise ValueError(f"not a delta message of version {VERSION} (magic {magic:#x}, version {version})")
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"delta message: chunk_elems {chunk_elems} out of range")
    chunks = chunk_list([d.numel() for d in dsts], chunk_elems)
    if nc != len(chunks):
        raise ValueError(
            f"delta message has {nc} chunks; the destinations {[tuple(d.shape) for d in dsts]} "
            f"cut into chunks of {chunk_elems} elements make {len(chunks)}"
        )
    start = chunks_start(nc)
    empty = torch.zeros(0, dtype=torch.int64, device=msg.device)
    if not nc:
        return Directory(chunks, empty, empty, empty, empty, version)
    if length < start:
        raise ValueError(f"delta message of {length} bytes is shorter than its directory ({start} bytes)")
    dev = msg.device
    offsets = msg[HEADER_BYTES : HEADER_BYTES + 8 * nc].view(torch.int64).clone()
    ok_off = (offsets >= start) & (offsets % ALIGN == 0) & (offsets <= length - HEADER_BYTES)
    safe = torch.where(ok_off, offsets, torch.full_like(offsets, start if start < length else 0))
    idx = (safe // 4)[:, None] + torch.arange(4, device=dev)
    words = msg.view(torch.int32)[idx.reshape(-1)].view(nc, 4).to(torch.int64) & 0xFFFFFFFF
    kind, esize, numel_m, count, nbytes = (
        words[:, 0] & 0xFF,
        words[:, 0] >> 8,
        words[:, 1],
        words[:, 2],
        words[:, 3],
    )
    numel = torch.tensor([n for _, _, n in chunks], dtype=torch.int64, device=dev)
    esize_d = torch.tensor([dsts[i].element_size() for i, _, _ in chunks], dtype=torch.int64, device=dev)
    want, top = _want_bytes(kind, numel, count, nbytes, esize_d, version)
    good = (
        ok_off
        & (kind <= top)
        & (esize == esize_d)
        & (numel_m == numel)
        & (count <= numel)
        & (nbytes == want)
        & (safe + nbytes <= length)
    )
    if not bool(good.all()):
        c = int((~good).to(torch.int8).argmax())
        i, a, n = chunks[c]
        raise ValueError(
            f"delta message: chunk {c} (destination {_name(names, i)}, elements {a}..{a + n - 1}) is "
            f"inconsistent: offset {int(offsets[c])}, kind {int(kind[c])}, elem_size {int(esize[c])} "
            f"(want {int(esize_d[c])}), numel {int(numel_m[c])} (want {n}), count {int(count[c])}, "
            f"nbytes {int(nbytes[c])} (want {int(want[c])}), message {length} bytes"
        )
    return Directory(chunks, offsets, kind, count, nbytes, version)


def join_messages(msgs: Sequence[torch.Tensor], copy=None) -> torch.Tensor:
    """One delta message holding the chunks of ``msgs`` (each a whole message, exactly its length, of one chunk
    size), in order: what packing all their pairs in one call writes, except that each chunk keeps the encoding
    its own pack chose. The version is the highest of theirs (a v2 reader takes v1 kinds). A delta refit joins
    the messages of a step to one peer this way where they cannot be packed in one call (``execute.strategies``:
    a send whose message repeats another's). Any device; a copy of the messages' bytes. ``copy(pairs, out)``:
    writes the bodies, (body, its place in ``out``) pairs, instead of one ``torch.cat`` (a copy that also
    hashes what it writes: the integrity digest)."""
    if len(msgs) == 1:
        return msgs[0]
    heads = [[int(x) & 0xFFFFFFFF for x in m[:HEADER_BYTES].view(torch.int32).tolist()] for m in msgs]
    if any(h[0] != MAGIC for h in heads) or len({h[3] for h in heads}) != 1:
        raise ValueError("join_messages: every message must be a delta message of one chunk size")
    total = sum(h[2] for h in heads)
    start = chunks_start(total)
    dirs, bodies, at = [], [], start
    for m, h in zip(msgs, heads, strict=True):
        s0 = chunks_start(h[2])
        if h[2]:
            dirs.append(m[HEADER_BYTES:HEADER_BYTES + 8 * h[2]].view(torch.int64) + (at - s0))
        bodies.append(m[s0:])
        at += m.numel() - s0
    out = torch.zeros(at, dtype=torch.uint8, device=msgs[0].device)
    out[:HEADER_BYTES].view(torch.int32).copy_(
        torch.tensor([MAGIC, max(h[1] for h in heads), total, heads[0][3]], dtype=torch.int64).to(torch.int32))
    if dirs:
        out[HEADER_BYTES:HEADER_BYTES + 8 * total].view(torch.int64).copy_(torch.cat(dirs))
    if copy is None:
        torch.cat(bodies, out=out[start:])
        return out
    places, at = [], start
    for b in bodies:
        places.append((b, out[at : at + b.numel()]))
        at += b.numel()
    copy(places, out)
    return out
