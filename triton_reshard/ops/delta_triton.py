"""The Triton launchers of the delta op (kernels in ``kernels/delta.py``): ``triton_pack`` writes the bytes of
``ops.delta.torch_pack(..., version=1)`` (``version=1``) or of the CPU codec's version 2 (``version=2``, narrow
values: ``ops/delta_v2.py``), so a GPU sender and a CPU receiver interoperate either way; ``triton_unpack``
reads both versions. Split from ``ops/delta.py`` (issue 44) to keep it within the house's module size.

Version 2 on the device: a stats launch per element size (every block's changed elements, width code and
the counts a patched layout needs), the chunk and block layout in torch ops on the device (patched blocks
chosen as the CPU codec chooses them, ``ops/delta_patch.py``; the message length is the one host sync, plus one
to pick the blocks with work), then an encode launch. The unpack checks every narrow chunk's descriptors
(torch ops) and positions (a check launch) before its first write, then applies the narrow blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .delta_format import (
    DEFAULT_CHUNK_ELEMS,
    HEADER_BYTES,
    KIND_DENSE,
    KIND_NAMES,
    KIND_NARROW,
    KIND_OFFSETS,
    MAX_DIMS,
    VERSION,
    VERSION2,
    Pair,
    chunk_list,
    chunks_start,
    pad,
    validate_pairs,
)
from .delta_format import INT_DTYPES as _INT
from .delta_format import check_chunk_elems as _check_chunk_elems
from .delta_format import name_of as _name
from .delta_message import CUDA_BLOCK, INTERPRET_BLOCK, message_layout, read_directory, write_headers
from .delta_patch import LAST_PATCHED, exceptions_torch, layout_torch, split_mode_torch
from .delta_v2 import BLOCK, MODE_ALL, MODE_BITMASK, MODE_OFFSETS, RAW
from .launcher import bits, interpreting, kernel_module, storage_view


def _merge(shape: Sequence[int], *strides: Sequence[int]) -> list[tuple[int, ...]]:
    """``(size, stride, ...)`` per dimension, innermost first, after dropping size-1 dimensions and merging
    neighbours contiguous on every side; the order of the dimensions (row-major) is kept."""
    merged: list[tuple[int, ...]] = []
    for dim in zip(shape, *strides, strict=True):
        n = dim[0]
        if n == 1:
            continue
        if merged and all(merged[-1][k] == n * dim[k] for k in range(1, len(dim))):
            merged[-1] = (merged[-1][0] * n, *dim[1:])
        else:
            merged.append(dim)
    return merged[::-1] or [(1, *(0 for _ in strides))]


def _base(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor whose storage starts lowest: its storage start is the group's base pointer."""
    return min(tensors, key=lambda t: t.untyped_storage().data_ptr())


def _elem_offset(t: torch.Tensor, base: torch.Tensor, what: str) -> int:
    nbytes = t.data_ptr() - base.untyped_storage().data_ptr()
    if nbytes % t.element_size():
        raise ValueError(f"{what}: storage not aligned to its element size across the group")
    return nbytes // t.element_size()


def _check_device(device: torch.device) -> None:
    if interpreting():
        if device.type != "cpu":
            raise ValueError(
                f"under TRITON_INTERPRET=1 the Triton delta kernels run on CPU tensors, got {device}"
            )
    elif device.type != "cuda":
        raise ValueError(f"the Triton delta kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


INTERPRET_BPT = 16  # version 2: blocks of 256 per program (the interpreter pays per program)
CUDA_BPT = 4


def _block() -> int:
    return INTERPRET_BLOCK if interpreting() else CUDA_BLOCK


def _kernels():
    from ..kernels import delta as kdelta  # triton is imported only by the Triton backend

    return kernel_module(kdelta, "delta_pack_kernel")


def _bpt() -> int:
    """Blocks of 256 per program of the version-2 kernels (the interpreter takes big tiles)."""
    return INTERPRET_BPT if interpreting() else CUDA_BPT


def _pack_geometry(pairs: Sequence[Pair], chunks, members: list[int], k, names) -> tuple:
    """(pack table rows (numpy, v1 ``P_*`` fields), source base, snapshot base) of one element size's chunks."""
    used = sorted({chunks[c][0] for c in members})
    sbase, pbase = _base([pairs[i][0] for i in used]), _base([pairs[i][1] for i in used])
    geo = {}
    for i in used:
        src, snap = pairs[i]
        dims = _merge(src.shape, src.stride(), snap.stride())
        if len(dims) > MAX_DIMS:
            raise ValueError(
                f"pair {_name(names, i)}: {len(dims)} dimensions after merging; the delta "
                f"kernels take {MAX_DIMS} (use the torch backend)"
            )
        geo[i] = (
            _elem_offset(src, sbase, f"source {_name(names, i)}"),
            _elem_offset(snap, pbase, f"snapshot {_name(names, i)}"),
            dims,
        )
    per = np.zeros((len(pairs), int(k.P_FIELDS)), dtype=np.int64)  # one row per view, copied to its chunks
    for i, (s_off, p_off, dims) in geo.items():
        per[i, int(k.P_SRC)], per[i, int(k.P_SNAP)] = s_off, p_off
        for d in range(MAX_DIMS):
            size, ss, ps = dims[d] if d < len(dims) else (1, 0, 0)
            per[i, int(k.P_SIZE) + d] = size
            per[i, int(k.P_SSTRIDE) + d], per[i, int(k.P_PSTRIDE) + d] = ss, ps
    cinfo = np.asarray([chunks[c] for c in members], dtype=np.int64).reshape(len(members), 3)
    rows = per[cinfo[:, 0]]
    rows[:, int(k.P_START)], rows[:, int(k.P_NUMEL)] = cinfo[:, 1], cinfo[:, 2]
    return rows, sbase, pbase


def _by_size(chunks, tensors: Sequence[torch.Tensor]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for c, (i, _, _) in enumerate(chunks):
        groups.setdefault(tensors[i].element_size(), []).append(c)
    return groups


def triton_pack(
    pairs: Sequence[Pair],
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    update: bool = True,
    names: Sequence[str] | None = None,
    version: int = VERSION,
    cache: dict | None = None,
    patch: bool = True,
) -> torch.Tensor:
    """Pack with the Triton kernels: the same message as :func:`torch_pack` of ``version``, bit for bit
    (version 2: the CPU codec's bytes, ``ops/delta_v2.py``, with ``patch`` as its; ``cache``: a dict the caller
    keeps for a message that recurs with the same view objects, its :class:`TritonPackPlan` kept there)."""
    _check_chunk_elems(chunk_elems)
    device = validate_pairs(pairs, names)
    _check_device(device)
    if version == VERSION2:
        return _plan(pairs, chunk_elems, names, device, cache).pack(update, patch=patch)
    if version != VERSION:
        raise ValueError(
            f"delta format version {version!r}: the Triton kernels write {VERSION} and {VERSION2}"
        )
    return _pack_v1(pairs, chunk_elems, update, names, device)


def _plan(pairs: Sequence[Pair], chunk_elems: int, names, device, cache: dict | None) -> TritonPackPlan:
    """The version-2 pack plan of ``pairs``: the one kept in ``cache`` if it fits them, else a new one (kept)."""
    plan = cache.get("triton2") if cache is not None else None
    if plan is None or not plan.fits(pairs, chunk_elems):
        plan = TritonPackPlan(pairs, chunk_elems, names, device)
        if cache is not None:
            cache["triton2"] = plan
    return plan


def triton_pack_digest(pairs: Sequence[Pair], coef_for, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                       update: bool = True, names: Sequence[str] | None = None, cache: dict | None = None,
                       patch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`triton_pack` of version 2 whose encode launches also hash every byte they write (the integrity
    digest, issue 46: ``coef_for(n)``, the keyed int64 coefficients of an ``n``-byte message on the device):
    ``(message, its digest)``, the digest a 0-dim int64 tensor on the device (no sync), equal to the CPU digest
    of the message's bytes (the kernels' per-program sums plus the headers', which the launcher writes)."""
    _check_chunk_elems(chunk_elems)
    device = validate_pairs(pairs, names)
    _check_device(device)
    return _plan(pairs, chunk_elems, names, device, cache).pack(update, coef_for, patch)


def _header_digest(msg: torch.Tensor, offsets: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The digest of a message's header, directory and chunk headers (the bytes the launcher writes), by their
    words: every one is whole words at 16-byte offsets (``csrc/digest.c``: a word times its 1 KiB row's
    coefficient)."""
    words = msg.view(torch.int64)
    head = torch.arange(chunks_start(offsets.numel()) // 8, dtype=torch.int64, device=msg.device)
    idx = torch.cat([head, ((offsets // 8)[:, None] + torch.arange(2, device=msg.device)).reshape(-1)])
    return (words[idx] * coef[idx >> 7]).sum()


def _pack_v1(pairs: Sequence[Pair], chunk_elems: int, update: bool, names, device) -> torch.Tensor:
    """:func:`triton_pack` of format version 1: a counting launch per element size, the message's layout
    from the counts, then the encoding launch."""
    k = _kernels()
    chunks = chunk_list([s.numel() for s, _ in pairs], chunk_elems)
    nc = len(chunks)
    numel = torch.tensor([n for _, _, n in chunks], dtype=torch.int64)
    esize = torch.tensor([pairs[i][0].element_size() for i, _, _ in chunks], dtype=torch.int64)
    block = _block()
    count = torch.zeros(nc, dtype=torch.int64, device=device)
    launches = []
    with torch.no_grad():
        for e, members in _by_size(chunks, [s for s, _ in pairs]).items():
            rows, sbase, pbase = _pack_geometry(pairs, chunks, members, k, names)
            table = torch.from_numpy(rows).to(device)
            idx = torch.tensor(members, dtype=torch.int64, device=device)
            gcount = torch.zeros(len(members), dtype=torch.int64, device=device)
            src_p = storage_view(bits(sbase), _INT[e])
            snap_p = storage_view(bits(pbase), _INT[e])
            launches.append((e, members, table, idx, src_p, snap_p))
            dummy = torch.zeros(16, dtype=torch.uint8, device=device)
            k.delta_pack_kernel[(len(members),)](
                src_p,
                snap_p,
                dummy.view(_INT[e]),
                dummy.view(torch.int16),
                dummy.view(torch.int32),
                table,
                gcount,
                len(members),
                ESIZE=e,
                COUNT=True,
                UPDATE=False,
                BLOCK=block,
            )
            count[idx] = gcount
        numel_d, esize_d = numel.to(device), esize.to(device)
        kind, nbytes, offsets, total = message_layout(numel_d, count, esize_d)
        msg = torch.zeros(total, dtype=torch.uint8, device=device)
        write_headers(msg, chunk_elems, numel_d, count, esize_d, kind, nbytes, offsets)
        for e, members, table, idx, src_p, snap_p in launches:
            table[:, int(k.P_OUT)] = offsets[idx]
            table[:, int(k.P_KIND)] = kind[idx]
            table[:, int(k.P_COUNT)] = count[idx]
            k.delta_pack_kernel[(len(members),)](
                src_p,
                snap_p,
                msg.view(_INT[e]),
                msg.view(torch.int16),
                msg.view(torch.int32),
                table,
                count,
                len(members),
                ESIZE=e,
                COUNT=False,
                UPDATE=update,
                BLOCK=block,
            )
    return msg


def _blocks_of(numel: torch.Tensor, members: torch.Tensor, nfields: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block of the chunks ``members`` (global chunk ids, ascending; ``numel`` every chunk's length):
    a ``V_FIELDS`` table with ``V_CHUNK`` (the member's row) and ``V_K`` set, and the blocks' global ids."""
    nbk = (numel + BLOCK - 1) // BLOCK
    b0 = torch.cumsum(nbk, 0) - nbk
    cnt = nbk[members]
    row = torch.repeat_interleave(torch.arange(members.numel(), device=numel.device), cnt)
    kk = torch.arange(row.numel(), device=numel.device) - (torch.cumsum(cnt, 0) - cnt)[row]
    table = torch.zeros((row.numel(), nfields), dtype=torch.int64, device=numel.device)
    table[:, 0], table[:, 1] = row, kk
    return table, b0[members][row] + kk


class BlockIndex:
    """The blocks of 256 of chunks of lengths ``numel`` (device tensors): per chunk its block count and first
    block; per block its chunk and its length."""

    def __init__(self, numel: torch.Tensor) -> None:
        self.numel = numel
        self.nbk = (numel + BLOCK - 1) // BLOCK
        self.b0 = torch.cumsum(self.nbk, 0) - self.nbk
        self.bch = torch.repeat_interleave(torch.arange(numel.numel(), device=numel.device), self.nbk)
        kk = torch.arange(self.bch.numel(), device=numel.device) - self.b0[self.bch]
        self.blen = torch.clamp(numel[self.bch] - kk * BLOCK, max=BLOCK)


def _layout_v2(bi: BlockIndex, esize: torch.Tensor, cnt: torch.Tensor, code: torch.Tensor, over, patch: bool
               ) -> tuple:
    """Every chunk's (kind, changed count, bytes, offset), every block's (stored code, mode 0..2, payload offset,
    position bytes, exceptions, their offset) and the message length (the host sync): ``encode_pair``'s
    choices, on the device (``patch``: patched blocks allowed, ``ops/delta_patch.py``)."""
    numel, nbk, bch = bi.numel, bi.nbk, bi.bch
    code, mode, size, posb, nexc = layout_torch(cnt, code, over, bi.blen, esize[bch], patch)
    count = torch.zeros_like(numel).index_add_(0, bch, cnt)
    narrow = HEADER_BYTES + 2 * nbk + torch.zeros_like(numel).index_add_(0, bch, size)
    dense = HEADER_BYTES + pad(numel * esize)
    kind = torch.where(count == 0, KIND_OFFSETS, torch.where(pad(narrow) < dense, KIND_NARROW, KIND_DENSE))
    nbytes = torch.where(
        kind == KIND_OFFSETS, HEADER_BYTES, torch.where(kind == KIND_NARROW, pad(narrow), dense)
    )
    start = chunks_start(numel.numel())
    offsets = start + torch.cumsum(nbytes, 0) - nbytes
    total = start + int(nbytes.sum())
    csum = torch.cumsum(size, 0) - size
    pay = offsets[bch] + HEADER_BYTES + 2 * nbk[bch] + csum - csum[bi.b0][bch]
    xat = pay + posb + (torch.where(mode == MODE_ALL, bi.blen, cnt) * _wbits(code, esize[bch]) + 7) // 8
    return (kind, count, nbytes, offsets), (code, mode, pay, posb, nexc, xat), total


class TritonPackPlan:
    """One message's version-2 pack on the device: ``pairs`` in chunks of ``ce`` elements, their kernel tables
    (per element size: the chunk table, the block table, its blocks' ids) and block index, built once and kept
    in a caller's cache (``pack_delta(..., cache=)``, a refit's send) for the same view objects (:meth:`fits`).
    Every call overwrites the tables' per-message fields; the message is a new tensor each time."""

    def __init__(self, pairs: Sequence[Pair], ce: int, names, device: torch.device) -> None:
        k = _kernels()
        self.pairs, self.ce, self.device = [(s, p) for s, p in pairs], ce, device
        chunks = chunk_list([s.numel() for s, _ in pairs], ce)
        self.numel = torch.tensor([n for _, _, n in chunks], dtype=torch.int64, device=device)
        self.esize = torch.tensor(
            [pairs[i][0].element_size() for i, _, _ in chunks], dtype=torch.int64, device=device
        )
        self.blocks = BlockIndex(self.numel)
        self.nblocks = sum(-(-n // BLOCK) for _, _, n in chunks)
        self.groups = []
        for e, members in _by_size(chunks, [s for s, _ in pairs]).items():
            rows, sbase, pbase = _pack_geometry(pairs, chunks, members, k, names)
            idx = torch.tensor(members, dtype=torch.int64, device=device)
            blocks, gid = _blocks_of(self.numel, idx, int(k.V_FIELDS))
            views = (storage_view(bits(sbase), _INT[e]), storage_view(bits(pbase), _INT[e]))
            self.groups.append((e, torch.from_numpy(rows).to(device), idx, blocks, gid, views))

    def fits(self, pairs: Sequence[Pair], ce: int) -> bool:
        """Built for exactly these views (the same tensor objects, in order) and chunk size?"""
        return (
            ce == self.ce
            and len(pairs) == len(self.pairs)
            and all(s is a and p is b for (s, p), (a, b) in zip(pairs, self.pairs, strict=True))
        )

    def pack(self, update: bool, coef_for=None, patch: bool = True):
        """Stats launches, the layout on the device, encode launches: the message; with ``coef_for`` (see
        :func:`triton_pack_digest`) ``(message, digest)``, the encode launches hashing what they write;
        ``patch`` False: no patched blocks (the CPU codec's ``patch=False`` bytes)."""
        k, bpt, device = _kernels(), _bpt(), self.device
        cnt = torch.zeros(self.nblocks, dtype=torch.int64, device=device)
        code, over = torch.zeros_like(cnt), torch.zeros_like(cnt)
        fields = [int(getattr(k, f)) for f in ("V_CODE", "V_MODE", "V_PAY", "V_POSB", "V_NEXC", "V_XAT")]
        with torch.no_grad():
            for e, table, _idx, blocks, gid, (src_p, snap_p) in self.groups:
                _launch_pack(k, e, src_p, snap_p, None, table, blocks, True, False, bpt)
                cnt[gid], code[gid] = blocks[:, int(k.V_CNT)], blocks[:, fields[0]]
                over[gid] = blocks[:, int(k.V_OVER)]
            (kind, count, nbytes, offsets), per_block, total = _layout_v2(
                self.blocks, self.esize, cnt, code, over, patch
            )
            msg = torch.zeros(total, dtype=torch.uint8, device=device)
            write_headers(msg, self.ce, self.numel, count, self.esize, kind, nbytes, offsets)
            msg[4:8].view(torch.int32).fill_(VERSION2)
            coef = coef_for(total) if coef_for is not None else None
            h = _header_digest(msg, offsets, coef) if coef is not None else None
            work = (kind[self.blocks.bch] == KIND_DENSE) | (cnt > 0)  # blocks with bytes or snapshot writes
            for e, table, idx, blocks, gid, (src_p, snap_p) in self.groups:
                table[:, int(k.P_OUT)], table[:, int(k.P_KIND)] = offsets[idx], kind[idx]
                table[:, int(k.P_COUNT)] = count[idx]
                blocks[:, fields] = torch.stack(per_block, 1)[gid]
                busy = blocks[work[gid]]
                if busy.numel():
                    part = _launch_pack(k, e, src_p, snap_p, msg, table, busy, False, update, bpt, coef)
                    h = h if part is None else h + part.sum()
        return msg if coef_for is None else (msg, h)


def _launch_pack(k, e, src_p, snap_p, msg, table, blocks, stats: bool, update: bool, bpt: int, coef=None
                 ) -> torch.Tensor | None:
    """One launch of the version-2 pack kernel; with ``coef`` (the encode pass), its programs' digest sums."""
    n = blocks.shape[0]
    if not n:
        return None
    m = msg if msg is not None else torch.zeros(16, dtype=torch.uint8, device=blocks.device)
    grid = triton_cdiv(n, bpt)
    sums = torch.zeros(grid, dtype=torch.int64, device=blocks.device) if coef is not None else None
    k.delta2_pack_kernel[(grid,)](
        src_p,
        snap_p,
        m.view(_INT[e]),
        m,
        m.view(torch.int32),
        table,
        blocks,
        n,
        ESIZE=e,
        STATS=stats,
        UPDATE=update,
        BPT=bpt,
        **({"coef_ptr": coef, "sums_ptr": sums, "DIGEST": True} if coef is not None else {}),
    )
    return sums


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unpack_geometry(dr, dsts: Sequence[torch.Tensor], members: list[int], k, names) -> tuple:
    """(unpack table rows (numpy, v1 ``U_*`` fields, ``U_IN`` / ``U_KIND`` / ``U_COUNT`` left to the caller),
    destination base) of one element size's chunks."""
    used = sorted({dr.chunks[c][0] for c in members})
    base = _base([dsts[i] for i in used])
    geo = {}
    for i in used:
        for n_, st in zip(dsts[i].shape, dsts[i].stride(), strict=True):
            if st == 0 and n_ > 1:
                raise ValueError(f"destination {_name(names, i)}: stride 0 writes elements more than once")
        dims = _merge(dsts[i].shape, dsts[i].stride())
        if len(dims) > MAX_DIMS:
            raise ValueError(
                f"destination {_name(names, i)}: {len(dims)} dimensions after merging; the "
                f"delta kernels take {MAX_DIMS} (use the torch backend)"
            )
        geo[i] = (_elem_offset(dsts[i], base, f"destination {_name(names, i)}"), dims)
    per = np.zeros((len(dsts), int(k.U_FIELDS)), dtype=np.int64)  # one row per view, copied to its chunks
    for i, (off, dims) in geo.items():
        per[i, int(k.U_DST)] = off
        for d in range(MAX_DIMS):
            size, st = dims[d] if d < len(dims) else (1, 0)
            per[i, int(k.U_SIZE) + d], per[i, int(k.U_STRIDE) + d] = size, st
    cinfo = np.asarray([dr.chunks[c] for c in members], dtype=np.int64).reshape(len(members), 3)
    rows = per[cinfo[:, 0]]
    rows[:, int(k.U_START)], rows[:, int(k.U_NUMEL)] = cinfo[:, 1], cinfo[:, 2]
    return rows, base


def triton_unpack(
    msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None = None
) -> None:
    """Unpack a message of either version with the Triton kernels (see :func:`torch_unpack`). Headers, and the
    bodies of narrow chunks, are checked before any write; a v1-kind body found inconsistent while writing
    raises after the launch (the destinations are then torn)."""
    dr = read_directory(msg, dsts, names, versions=(VERSION, VERSION2))
    if not dr.chunks:
        return
    _check_device(msg.device)
    k = _kernels()
    kinds = dr.kind.tolist()
    narrow = [c for c, kd in enumerate(kinds) if kd == KIND_NARROW]
    applies = _check_narrow(msg, dr, dsts, narrow, names, k) if narrow else []
    device = msg.device
    block = _block()
    bad = torch.zeros(len(dr.chunks), dtype=torch.int32, device=device)
    plain = [c for c, kd in enumerate(kinds) if kd != KIND_NARROW]
    with torch.no_grad():
        for e, members in _by_size([dr.chunks[c] for c in plain], dsts).items():
            members = [plain[c] for c in members]
            rows, base = _unpack_geometry(dr, dsts, members, k, names)
            table = torch.from_numpy(rows).to(device)
            idx = torch.tensor(members, dtype=torch.int64, device=device)
            table[:, int(k.U_IN)] = dr.offsets[idx]
            table[:, int(k.U_KIND)] = dr.kind[idx]
            table[:, int(k.U_COUNT)] = dr.count[idx]
            gbad = torch.zeros(len(members), dtype=torch.int32, device=device)
            k.delta_unpack_kernel[(len(members),)](
                storage_view(bits(base), _INT[e]),
                msg.view(_INT[e]),
                msg.view(torch.int16),
                msg.view(torch.int32),
                table,
                gbad,
                len(members),
                ESIZE=e,
                BLOCK=block,
            )
            bad[idx] = gbad
        for args in applies:
            _launch_unpack(k, msg, *args, check=False)
    if bool(bad.any()):
        c = int(bad.to(torch.int8).argmax())
        i, a, n = dr.chunks[c]
        raise ValueError(
            f"delta message: chunk {c} (destination {_name(names, i)}, elements {a}..{a + n - 1}): "
            "body inconsistent with its header; the destinations are torn (partly written)"
        )


def _narrow_blocks(msg: torch.Tensor, dr, narrow: torch.Tensor, esize: torch.Tensor) -> tuple:
    """The descriptors of the narrow chunks ``narrow`` checked (``ops.delta_v2.decode_chunks``'s checks, in
    torch): (bad per chunk, per block: chunk position in ``narrow``, index, count, code, mode, payload
    offset, position bytes)."""
    numel = torch.tensor([dr.chunks[c][2] for c in narrow.tolist()], dtype=torch.int64, device=msg.device)
    nbk = (numel + BLOCK - 1) // BLOCK
    seg = torch.repeat_interleave(torch.arange(narrow.numel(), device=msg.device), nbk)
    b0 = torch.cumsum(nbk, 0) - nbk
    j = torch.arange(seg.numel(), device=msg.device) - b0[seg]
    body = dr.offsets[narrow] + HEADER_BYTES
    at = body[seg] + 2 * j
    d0, cm1 = msg[at].to(torch.int64), msg[at + 1].to(torch.int64)
    code, dmode = d0 & 0x0F, d0 >> 4
    mode, nexc = split_mode_torch(dmode)
    blen = torch.clamp(numel[seg] - j * BLOCK, max=BLOCK)
    e = esize[seg]
    changed = code > 0
    cnt = torch.where(changed, cm1 + 1, 0)
    nv = torch.where(mode == MODE_ALL, blen, cnt)
    ok = ((code == 0) & (dmode == 0) & (cm1 == 0)) | (
        changed
        & (code <= RAW)
        & (dmode <= LAST_PATCHED)
        & (((code == RAW) & (nexc == 0)) | ((1 << torch.clamp(code, max=6)) < 8 * e))
        & (cnt <= blen)
        & (nexc <= nv)
    )
    nb = narrow.numel()
    bad = torch.zeros(nb, dtype=torch.int64, device=msg.device).index_add_(0, seg, (~ok).to(torch.int64)) > 0
    cnt = torch.where(ok, cnt, 0)
    mode = torch.where(ok & changed, mode, MODE_OFFSETS)
    nexc = torch.where(ok & changed, nexc, 0)
    # the sizes of each block's own mode (a packer picks the smallest; a reader takes any)
    size, posb = _mode_sizes(cnt, torch.where(ok, code, 1), blen, e, mode)
    size = size + nexc * (1 + e)
    total = torch.zeros(nb, dtype=torch.int64, device=msg.device).index_add_(0, seg, size)
    bad |= pad(HEADER_BYTES + 2 * nbk + total) != dr.nbytes[narrow]
    bad |= torch.zeros_like(total).index_add_(0, seg, cnt) != dr.count[narrow]
    csum = torch.cumsum(size, 0) - size
    pay = body[seg] + 2 * nbk[seg] + csum - csum[b0][seg]
    xat = pay + posb + (torch.where(mode == MODE_ALL, blen, cnt) * _wbits(code, e) + 7) // 8
    xbad = exceptions_torch(msg, nexc, xat, torch.where(mode == MODE_ALL, blen, cnt))
    bad |= torch.zeros(nb, dtype=torch.int64, device=msg.device).index_add_(0, seg, xbad.to(torch.int64)) > 0
    return bad, (seg, j, cnt, code, mode, pay, posb, nexc, xat)


def _wbits(code, e):
    return torch.where(code == RAW, 8 * e, 1 << torch.clamp(code, max=5))


def _mode_sizes(cnt, code, blen, e, mode) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload bytes, position bytes) of blocks in the given modes (0 for unchanged blocks; a patched
    block's exceptions not included)."""
    w = _wbits(code, e)
    vb = (cnt * w + 7) // 8
    size = torch.where(
        mode == MODE_OFFSETS,
        cnt + vb,
        torch.where(mode == MODE_BITMASK, (blen + 7) // 8 + vb, (blen * w + 7) // 8),
    )
    posb = torch.where(mode == MODE_OFFSETS, cnt, torch.where(mode == MODE_BITMASK, (blen + 7) // 8, 0))
    return torch.where(cnt > 0, size, 0), posb


def _check_narrow(msg: torch.Tensor, dr, dsts, narrow: list[int], names, k) -> list[tuple]:
    """Check every narrow chunk's descriptors and positions (nothing written); raise the CPU codec's error for
    the first bad one. Returns the apply launches' arguments."""
    device = msg.device
    nar = torch.tensor(narrow, dtype=torch.int64, device=device)
    esize = torch.tensor(
        [dsts[dr.chunks[c][0]].element_size() for c in narrow], dtype=torch.int64, device=device
    )
    bad, (seg, j, cnt, code, mode, pay, posb, nexc, xat) = _narrow_blocks(msg, dr, nar, esize)
    if bool(bad.any()):
        _raise_body(dr, narrow[int(bad.to(torch.int8).argmax())], names)
    bpt, out = _bpt(), []
    for e, members in _by_size([dr.chunks[c] for c in narrow], dsts).items():
        rows, base = _unpack_geometry(dr, dsts, [narrow[m] for m in members], k, names)
        pos = torch.full((len(narrow),), -1, dtype=torch.int64, device=device)
        pos[torch.tensor(members, dtype=torch.int64, device=device)] = torch.arange(
            len(members), device=device
        )
        keep = (pos[seg] >= 0) & (cnt > 0)
        blocks = torch.stack([pos[seg], j, cnt, code, mode, pay, posb, nexc, xat, 0 * j], 1)[keep].contiguous()
        args = (e, torch.from_numpy(rows).to(device), storage_view(bits(base), _INT[e]), blocks, bpt)
        gbad = _launch_unpack(k, msg, *args, check=True)
        if gbad is not None and bool(gbad.any()):
            chunk = seg[keep][gbad.bool()]  # the bad blocks' chunks (positions in ``narrow``)
            _raise_body(dr, narrow[int(chunk.min())], names)
        out.append(args)
    return out


def _raise_body(dr, c: int, names) -> None:
    i, a0, n0 = dr.chunks[c]
    raise ValueError(
        f"delta message: chunk {c} (destination {_name(names, i)}, elements {a0}..{a0 + n0 - 1}): "
        f"{KIND_NAMES[int(dr.kind[c])]} body inconsistent with its header (count {int(dr.count[c])})"
    )


def _launch_unpack(k, msg, e, table, dst_p, blocks, bpt, check: bool) -> torch.Tensor | None:
    n = blocks.shape[0]
    if not n:
        return None
    gbad = torch.zeros(n, dtype=torch.int32, device=msg.device)
    k.delta2_unpack_kernel[(triton_cdiv(n, bpt),)](
        dst_p, msg, table, blocks, gbad, n, ESIZE=e, CHECK=check, BPT=bpt
    )
    return gbad
