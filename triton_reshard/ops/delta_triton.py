"""The Triton launchers of the delta op (``ops/delta.py``'s format version 1; kernels in ``kernels/delta.py``):
``triton_pack`` writes the bytes of ``ops.delta.torch_pack(..., version=1)``, ``triton_unpack`` reads version 1.
Split from ``ops/delta.py`` (issue 44) to keep it within the house's module size."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .delta_format import DEFAULT_CHUNK_ELEMS, MAX_DIMS, Pair, chunk_list, validate_pairs
from .delta_format import INT_DTYPES as _INT
from .delta_format import check_chunk_elems as _check_chunk_elems
from .delta_format import name_of as _name
from .delta_message import CUDA_BLOCK, INTERPRET_BLOCK, message_layout, read_directory, write_headers
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
            raise ValueError(f"under TRITON_INTERPRET=1 the Triton delta kernels run on CPU tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"the Triton delta kernels need CUDA tensors (or TRITON_INTERPRET=1), got {device}")


def _block() -> int:
    return INTERPRET_BLOCK if interpreting() else CUDA_BLOCK


def _kernels():
    from ..kernels import delta as kdelta  # triton is imported only by the Triton backend

    return kernel_module(kdelta, "delta_pack_kernel")


def triton_pack(pairs: Sequence[Pair], chunk_elems: int = DEFAULT_CHUNK_ELEMS, update: bool = True,
                names: Sequence[str] | None = None) -> torch.Tensor:
    """Pack with the Triton kernels: the same message as :func:`torch_pack`, bit for bit."""
    _check_chunk_elems(chunk_elems)
    device = validate_pairs(pairs, names)
    _check_device(device)
    k = _kernels()
    chunks = chunk_list([s.numel() for s, _ in pairs], chunk_elems)
    nc = len(chunks)
    numel = torch.tensor([n for _, _, n in chunks], dtype=torch.int64)
    esize = torch.tensor([pairs[i][0].element_size() for i, _, _ in chunks], dtype=torch.int64)
    groups: dict[int, list[int]] = {}
    for c, (i, _, _) in enumerate(chunks):
        groups.setdefault(pairs[i][0].element_size(), []).append(c)
    block = _block()
    count = torch.zeros(nc, dtype=torch.int64, device=device)
    launches = []
    with torch.no_grad():
        for e, members in groups.items():
            used = sorted({chunks[c][0] for c in members})
            sbase, pbase = _base([pairs[i][0] for i in used]), _base([pairs[i][1] for i in used])
            rows = np.zeros((len(members), int(k.P_FIELDS)), dtype=np.int64)
            geo = {}
            for i in used:
                src, snap = pairs[i]
                dims = _merge(src.shape, src.stride(), snap.stride())
                if len(dims) > MAX_DIMS:
                    raise ValueError(f"pair {_name(names, i)}: {len(dims)} dimensions after merging; the delta "
                                     f"kernels take {MAX_DIMS} (use the torch backend)")
                geo[i] = (_elem_offset(src, sbase, f"source {_name(names, i)}"),
                          _elem_offset(snap, pbase, f"snapshot {_name(names, i)}"), dims)
            for r, c in enumerate(members):
                i, a, n = chunks[c]
                s_off, p_off, dims = geo[i]
                rows[r, int(k.P_SRC)], rows[r, int(k.P_SNAP)] = s_off, p_off
                rows[r, int(k.P_START)], rows[r, int(k.P_NUMEL)] = a, n
                for d in range(MAX_DIMS):
                    size, ss, ps = dims[d] if d < len(dims) else (1, 0, 0)
                    rows[r, int(k.P_SIZE) + d] = size
                    rows[r, int(k.P_SSTRIDE) + d], rows[r, int(k.P_PSTRIDE) + d] = ss, ps
            table = torch.from_numpy(rows).to(device)
            idx = torch.tensor(members, dtype=torch.int64, device=device)
            gcount = torch.zeros(len(members), dtype=torch.int64, device=device)
            src_p = storage_view(bits(sbase), _INT[e])
            snap_p = storage_view(bits(pbase), _INT[e])
            launches.append((e, members, table, idx, src_p, snap_p))
            dummy = torch.zeros(16, dtype=torch.uint8, device=device)
            k.delta_pack_kernel[(len(members),)](src_p, snap_p, dummy.view(_INT[e]), dummy.view(torch.int16),
                                                 dummy.view(torch.int32), table, gcount, len(members),
                                                 ESIZE=e, COUNT=True, UPDATE=False, BLOCK=block)
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
                src_p, snap_p, msg.view(_INT[e]), msg.view(torch.int16), msg.view(torch.int32), table, count,
                len(members), ESIZE=e, COUNT=False, UPDATE=update, BLOCK=block)
    return msg


def triton_unpack(msg: torch.Tensor, dsts: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
    """Unpack with the Triton kernel (see :func:`torch_unpack`). Headers are checked before any write; a body
    found inconsistent while writing raises after the launch (the destinations are then torn)."""
    dr = read_directory(msg, dsts, names)
    if not dr.chunks:
        return
    _check_device(msg.device)
    k = _kernels()
    device = msg.device
    groups: dict[int, list[int]] = {}
    for c, (i, _, _) in enumerate(dr.chunks):
        groups.setdefault(dsts[i].element_size(), []).append(c)
    block = _block()
    bad = torch.zeros(len(dr.chunks), dtype=torch.int32, device=device)
    with torch.no_grad():
        for e, members in groups.items():
            used = sorted({dr.chunks[c][0] for c in members})
            base = _base([dsts[i] for i in used])
            geo = {}
            for i in used:
                for n_, st in zip(dsts[i].shape, dsts[i].stride(), strict=True):
                    if st == 0 and n_ > 1:
                        raise ValueError(f"destination {_name(names, i)}: stride 0 writes elements more than once")
                dims = _merge(dsts[i].shape, dsts[i].stride())
                if len(dims) > MAX_DIMS:
                    raise ValueError(f"destination {_name(names, i)}: {len(dims)} dimensions after merging; the "
                                     f"delta kernels take {MAX_DIMS} (use the torch backend)")
                geo[i] = (_elem_offset(dsts[i], base, f"destination {_name(names, i)}"), dims)
            rows = np.zeros((len(members), int(k.U_FIELDS)), dtype=np.int64)
            for r, c in enumerate(members):
                i, a, n = dr.chunks[c]
                off, dims = geo[i]
                rows[r, int(k.U_DST)], rows[r, int(k.U_START)], rows[r, int(k.U_NUMEL)] = off, a, n
                for d in range(MAX_DIMS):
                    size, st = dims[d] if d < len(dims) else (1, 0)
                    rows[r, int(k.U_SIZE) + d], rows[r, int(k.U_STRIDE) + d] = size, st
            table = torch.from_numpy(rows).to(device)
            idx = torch.tensor(members, dtype=torch.int64, device=device)
            table[:, int(k.U_IN)] = dr.offsets[idx]
            table[:, int(k.U_KIND)] = dr.kind[idx]
            table[:, int(k.U_COUNT)] = dr.count[idx]
            gbad = torch.zeros(len(members), dtype=torch.int32, device=device)
            k.delta_unpack_kernel[(len(members),)](
                storage_view(bits(base), _INT[e]), msg.view(_INT[e]), msg.view(torch.int16),
                msg.view(torch.int32), table, gbad, len(members), ESIZE=e, BLOCK=block)
            bad[idx] = gbad
    if bool(bad.any()):
        c = int(bad.to(torch.int8).argmax())
        i, a, n = dr.chunks[c]
        raise ValueError(f"delta message: chunk {c} (destination {_name(names, i)}, elements {a}..{a + n - 1}): "
                         "body inconsistent with its header; the destinations are torn (partly written)")
