"""Block deltas for quantized destinations with 1 x B blocks along the last dim (MXFP8, NVFP4; issue 33).

A changed source element re-quantizes its whole block (its scale and possibly every value), so a quantized
delta moves *blocks*: the sender quantizes its chunks into the send buffer as a dense refit does, then
compares each block's stored bytes (values and scale) with its snapshot of what it last sent in that
message, and sends only the blocks that differ, each with its scale. The receiver writes those blocks'
values and scales into its destination views; a block not in the message keeps the destination's bytes.
If every destination held the snapshot, unpack after pack writes exactly the dense quantized refit's bytes.

A *chunk* is one source-quantized piece of a message: ``(values, scales)``, ``values`` uint8 ``[..., K']``
(the stored bytes: ``K' = K / pack``) and ``scales`` ``[..., K / B]`` (the format's scale dtype, raw bytes
compared and moved), ``K`` a multiple of the block ``B``: block ``i`` (row-major over the scale grid) is
``values.view(-1, Bb)[i]`` (``Bb = B / pack`` bytes) and ``scales.view(-1)[i]``.

Message (every section at a multiple of 16 bytes; the whole a multiple of 16):

- header: ``C`` int64 per chunk, padded to 16: ``-1`` for a dense chunk, else ``n``, its number of blocks sent;
- per chunk, in order: dense: every value byte (padded to 16), then every scale (padded to 16); delta: ``n``
  int32 block indices, ascending (padded), ``n * Bb`` value bytes (padded), ``n`` scales (padded).

A chunk goes dense when its delta would not be smaller (e.g. NVFP4 after its per-tensor global scale moved,
which changes every block of the tensor): the message is never larger than the dense bytes plus its header
(:func:`max_block_message_bytes`). Every field of a received message is checked against the destinations
before the first byte is written (``ValueError`` naming the chunk).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Chunk = tuple[torch.Tensor, torch.Tensor]  # (values uint8 [..., K'], scales [..., nb])


def _pad(n: int) -> int:
    return (n + 15) // 16 * 16


def _flat(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [nb, Bb] uint8, scales [nb, scale bytes] uint8) of a contiguous chunk."""
    nb = s.numel()
    qb = q.reshape(nb, -1) if nb else q.reshape(0, 1)
    sb = s.contiguous().view(torch.uint8).reshape(nb, -1) if nb else s.reshape(0, 1).view(torch.uint8)
    return qb.view(torch.uint8), sb


def max_block_message_bytes(chunks: Sequence[tuple[int, int]]) -> int:
    """The largest message for chunks of ``(value bytes, scale bytes)``: the header plus every chunk dense."""
    return _pad(8 * len(chunks)) + sum(_pad(v) + _pad(s) for v, s in chunks)


def pack_block_delta(chunks: Sequence[Chunk], snaps: Sequence[Chunk], update: bool = True) -> torch.Tensor:
    """The block-delta message of ``chunks`` (contiguous, e.g. views of the send buffer) against ``snaps``
    (the same shapes: what was last sent); ``update``: the snapshots take the chunks' bytes."""
    if len(chunks) != len(snaps):
        raise ValueError(f"pack_block_delta: {len(chunks)} chunks, {len(snaps)} snapshots")
    parts: list[torch.Tensor] = []
    header = []
    dev = chunks[0][0].device if chunks else torch.device("cpu")

    def add(t: torch.Tensor) -> None:
        t = t.reshape(-1).view(torch.uint8)
        parts.append(t)
        if t.numel() % 16:
            parts.append(torch.zeros(16 - t.numel() % 16, dtype=torch.uint8, device=t.device))

    for k, ((q, s), (sq, ss)) in enumerate(zip(chunks, snaps, strict=True)):
        if q.shape != sq.shape or s.shape != ss.shape or q.dtype != sq.dtype or s.dtype != ss.dtype:
            raise ValueError(f"pack_block_delta: chunk {k} {tuple(q.shape)}/{tuple(s.shape)} and its snapshot "
                             f"{tuple(sq.shape)}/{tuple(ss.shape)} differ")
        qb, sb = _flat(q, s)
        qs, ssb = _flat(sq, ss)
        changed = (qb != qs).any(dim=1) | (sb != ssb).any(dim=1)
        idx = changed.nonzero().view(-1).to(torch.int32)
        n, nb, bb, sz = idx.numel(), sb.shape[0], qb.shape[1], sb.shape[1]
        if _pad(4 * n) + _pad(n * bb) + _pad(n * sz) >= _pad(nb * bb) + _pad(nb * sz):
            header.append(-1)
            add(qb)
            add(sb)
        else:
            header.append(n)
            if n:
                add(idx)
                add(qb.index_select(0, idx))
                add(sb.index_select(0, idx))
        if update:
            sq.copy_(q)
            ss.copy_(s)
    head = torch.tensor(header, dtype=torch.int64).to(dev)
    out = [head.view(torch.uint8)]
    if head.numel() * 8 % 16:
        out.append(torch.zeros(8, dtype=torch.uint8, device=dev))
    return torch.cat(out + parts) if out[0].numel() or parts else torch.zeros(16, dtype=torch.uint8, device=dev)


def _check(msg: torch.Tensor, dsts: Sequence[Chunk], names: Sequence[str] | None) -> list[tuple]:
    """Parse and check the whole message against the destinations: [(kind, n, offsets...)] per chunk."""
    def name(k: int) -> str:
        return f"chunk {k}" + (f" ({names[k]})" if names is not None and k < len(names) else "")

    c = len(dsts)
    if msg.dtype != torch.uint8 or msg.dim() != 1 or msg.numel() % 16 or msg.numel() < _pad(8 * c):
        raise ValueError(f"block delta message of {msg.numel()} bytes ({msg.dtype}): not a message for {c} chunks")
    head = msg[:8 * c].cpu().view(torch.int64).tolist() if c else []
    at = _pad(8 * c)
    plan = []
    for k, ((q, s), h) in enumerate(zip(dsts, head, strict=True)):
        nb = s.numel()
        bb = q.numel() * q.element_size() // nb if nb else 0
        sz = s.element_size()
        if h == -1:
            vq, vs = at, at + _pad(nb * bb)
            at = vs + _pad(nb * sz)
            plan.append(("dense", nb, None, vq, vs))
        elif 0 <= h <= nb:
            vi, vq = at, at + _pad(4 * h)
            vs = vq + _pad(h * bb)
            at = vs + _pad(h * sz)
            plan.append(("delta", h, vi, vq, vs))
        else:
            raise ValueError(f"block delta message: {name(k)} announces {h} blocks, its destination has {nb}")
        if at > msg.numel():
            raise ValueError(f"block delta message: {name(k)} runs past the message's {msg.numel()} bytes")
        if plan[-1][0] == "delta" and h:
            idx = msg[vi:vi + 4 * h].view(torch.int32)
            if bool((idx < 0).any()) or bool((idx >= nb).any()) or (h > 1 and not bool((idx[1:] > idx[:-1]).all())):
                raise ValueError(f"block delta message: {name(k)} has block indices outside [0, {nb}) or not ascending")
    if at != msg.numel():
        raise ValueError(f"block delta message: {msg.numel()} bytes, its chunks take {at}")
    return plan


def unpack_block_delta(msg: torch.Tensor, dsts: Sequence[Chunk], names: Sequence[str] | None = None) -> None:
    """Write the blocks of ``msg`` into the destination ``(values, scales)`` views (any strides, last dim of
    the values contiguous; ``values`` may be fp8 or uint8 views of the stored bytes)."""
    plan = _check(msg, dsts, names)
    for (q, s), (kind, n, vi, vq, vs) in zip(dsts, plan, strict=True):
        nb = s.numel()
        if not nb:
            continue
        qd = q.view(torch.uint8)
        sd = s.view(torch.uint8) if s.element_size() == 1 else s  # fp8 scales moved as bytes
        sbytes = s.element_size()
        if kind == "dense":
            qd.copy_(msg[vq:vq + q.numel()].view(qd.shape))
            sd.copy_(msg[vs:vs + nb * sbytes].view(sd.dtype).view(s.shape))
            continue
        if not n:
            continue
        idx = msg[vi:vi + 4 * n].view(torch.int32).to(device=q.device, dtype=torch.int64)
        bb = q.numel() // nb
        vals = msg[vq:vq + n * bb].view(n, bb)
        scs = msg[vs:vs + n * sbytes].view(sd.dtype)
        where = torch.unravel_index(idx, tuple(s.shape))
        qd.unflatten(-1, (s.shape[-1], bb))[where] = vals.to(q.device)
        sd[where] = scs.to(q.device)
