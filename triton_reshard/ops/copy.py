"""The copy op: the torch reference and the launcher of the Triton copy kernel (validate the pairs, build
and cache the region table, launch).

``triton_copy_views(pairs, key)`` copies every ``(src_view, dst_view)`` pair with **one kernel launch per
dtype group** (see :func:`plan_dtypes`). The torch reference of the same function is
:func:`torch_copy_views` (below); pairs that the kernel does not handle (casts to and from fp8,
float -> int, bool and complex casts, more than ``MAX_DIMS`` non-mergeable dimensions) are copied with it.

Design (details in ``kernels/copy.py``):

- **Regions.** Each non-empty pair becomes one region: element offsets of its first element relative to one
  base pointer per side and group (the start of the storage with the lowest address, so offsets are >= 0),
  and its shape and strides after dropping size-1 dimensions, ordering the dimensions by destination stride
  and merging neighbours that are contiguous on both sides; most regions end up 1-D or 2-D.
- **Tiles.** Regions larger than ``tile_elems`` are cut into tiles of ``tile_elems`` elements; runs of
  smaller regions share one tile (at most ``max_regions`` of them and ``tile_elems`` elements together), so
  10,000 tiny regions do not cost 10,000 programs. A program copies ``TILES_PER_PROG`` tiles.
- **Cache.** With a ``key``, the tables are built once and kept on the device in an LRU cache
  (``CACHE_SIZE`` entries) together with a signature (count and data_ptrs of the pairs); a mismatch rebuilds.
- **Casts** are fused (bit-exact with torch's ``.to()`` except for the bits of NaNs, which become a canonical
  NaN); same-dtype copies move raw bits, so e.g. bf16 and fp16 copies share one int16 launch.

Concurrency: the pairs of one call are copied in parallel, so no destination may overlap a source or
another destination of the same call (torch's sequential loop would define an order; the kernel does not).
The kernel writes through raw pointers: autograd version counters of the destinations are not bumped.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .launcher import cached_table, interpreting, kernel_module, storage_view

if TYPE_CHECKING:
    import triton

Pair = tuple[torch.Tensor, torch.Tensor]
CACHE_SIZE = 256
# ``TRITON_RESHARD_AUTOTUNE=0`` pins the default config on CUDA (no benchmarking on the first call).
AUTOTUNE_ENV = "TRITON_RESHARD_AUTOTUNE"

# Same-dtype copies move raw bits of this integer dtype (by element size).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Dtypes the kernel casts between (float -> int excepted: torch's result for NaN/out of range is UB).
_CASTABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16,
                       torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
# Canonical NaN written into bf16: what cvt.rn.bf16.f32 gives on CUDA, c10's scalar path on CPU.
_BF16_NAN = {"cuda": 0x7FFF, "cpu": 0x7FC0}

# Tile parameters. Under the interpreter every program and every loop step costs ~1 ms of Python, so it
# gets few, big tiles and big blocks; on CUDA tiles shrink until there are enough for every SM.
INTERPRET_BLOCK = 16384
INTERPRET_TILE = 1 << 17
INTERPRET_MAX_REGIONS = 64
CUDA_MIN_TILE = 2048
CUDA_MAX_TILE = 1 << 16
CUDA_MAX_REGIONS = 8
CUDA_TILES_PER_SM = 8


# ---------------------------------------------------------------------------------------------------------
# dtype groups


@dataclass(frozen=True, slots=True)
class DtypePlan:
    """How one (src dtype, dst dtype) combination runs in the kernel.

    The views are reinterpreted (``Tensor.view(dtype)``, same element size) as ``src_view`` / ``dst_view``;
    bf16 travels as int16 bits (``src_bf16`` / ``dst_bf16``); ``via_f32``: cast through fp32 first, as
    torch does for 16-bit float destinations.
    """

    src_view: torch.dtype
    dst_view: torch.dtype
    src_bf16: bool = False
    via_f32: bool = False
    dst_bf16: bool = False

    @property
    def src_vec(self) -> int:
        return 16 // self.src_view.itemsize

    @property
    def dst_vec(self) -> int:
        return 16 // self.dst_view.itemsize


def plan_dtypes(src: torch.dtype, dst: torch.dtype) -> DtypePlan | None:
    """The kernel plan for copying ``src`` into ``dst`` dtype, or None if torch must do it."""
    if src == dst:
        bits = _BITS.get(src.itemsize)
        return DtypePlan(bits, bits) if bits is not None else None
    if src not in _CASTABLE or dst not in _CASTABLE or (src in _FLOATS and dst not in _FLOATS):
        return None
    low_float_dst = dst in (torch.float16, torch.bfloat16)
    return DtypePlan(
        src_view=torch.int16 if src == torch.bfloat16 else src,
        dst_view=torch.int16 if dst == torch.bfloat16 else dst,
        src_bf16=src == torch.bfloat16,
        via_f32=low_float_dst and src not in (torch.float32, torch.bfloat16),
        dst_bf16=dst == torch.bfloat16,
    )


# ---------------------------------------------------------------------------------------------------------
# validation and regions


def torch_copy_views(pairs: Sequence[Pair]) -> None:
    """Reference: copy every ``src`` view into its ``dst`` view with ``Tensor.copy_`` (casts like ``.to``)."""
    for src, dst in pairs:
        if src.numel():
            dst.copy_(src)


def validate_pairs(pairs: Sequence[Pair]) -> torch.device:
    """Check shapes and devices of every pair; return the common device."""
    device = None
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise TypeError(f"pair {i}: expected a (src, dst) pair of tensors, got {type(pair).__name__}")
        src, dst = pair
        if src.shape != dst.shape:
            raise ValueError(f"pair {i}: shape mismatch: src {tuple(src.shape)} vs dst {tuple(dst.shape)}")
        if device is None:
            device = src.device
        if src.device != device or dst.device != device:
            raise ValueError(f"pair {i}: mixed devices: src on {src.device}, dst on {dst.device}, "
                             f"earlier pairs on {device}")
        if dst.numel() > 1 and any(st == 0 and n > 1 for n, st in zip(dst.shape, dst.stride(), strict=True)):
            raise ValueError(f"pair {i}: dst {tuple(dst.shape)} with strides {dst.stride()} writes some "
                             "elements more than once")
    if device is None:
        raise ValueError("no pairs to copy")
    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"under TRITON_INTERPRET=1 the Triton copy runs on CPU tensors, got {device}")
    elif device.type != "cuda":
        raise ValueError(f"the Triton copy needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {device}")
    return device


def merge_dims(shape: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int]
               ) -> list[tuple[int, int, int]]:
    """``(size, src_stride, dst_stride)`` per dimension, innermost first, after dropping size-1 dimensions,
    ordering by destination stride (then source stride) and merging dimensions contiguous on both sides."""
    dims = sorted(((n, s, d) for n, s, d in zip(shape, src_strides, dst_strides, strict=True) if n != 1),
                  key=lambda dim: (dim[2], dim[1]), reverse=True)
    merged: list[tuple[int, int, int]] = []
    for n, s, d in dims:  # outermost first
        if merged and merged[-1][1] == n * s and merged[-1][2] == n * d:
            merged[-1] = (merged[-1][0] * n, s, d)
        else:
            merged.append((n, s, d))
    return merged[::-1] or [(1, 1, 1)]


def _vector_ok(dims: list[tuple[int, int, int]], src_off: int, dst_off: int, plan: DtypePlan) -> bool:
    """Whether full blocks of this region may be moved in 16-byte vectors (see ``kernels/copy.py``)."""
    vs, vd = plan.src_vec, plan.dst_vec
    if dims[0][1] != 1 or dims[0][2] != 1 or src_off % vs or dst_off % vd:
        return False
    if len(dims) == 1:
        return True
    return dims[0][0] % max(vs, vd) == 0 and all(s % vs == 0 and d % vd == 0 for _, s, d in dims[1:])


# ---------------------------------------------------------------------------------------------------------
# tables


@dataclass(slots=True)
class Group:
    """One launch: every region of one dtype plan."""

    plan: DtypePlan
    src_base: int  # index of the pair whose source storage is the source base pointer
    dst_base: int
    regions: torch.Tensor  # int64[num_regions, REGION_FIELDS] on the device
    tiles: torch.Tensor  # int64[num_tiles, TILE_FIELDS] on the device
    num_regions: int
    num_tiles: int
    numel: int
    tile_elems: int
    shape_class: int
    slots: int = 1  # the digest: the most regions one tile covers (a slot per (tile, region))
    slot_msg: torch.Tensor | None = None  # the digest: int64[num_tiles * slots], each slot's message index


@dataclass(frozen=True, slots=True)
class Messages:
    """The messages a digesting copy hashes (issue 46): ``side`` 1 where they are the destinations (a pack
    into send buffers), 0 where they are the sources (an unpack out of received ones); ``spans``: each
    message's (address, bytes)."""

    side: int
    spans: tuple[tuple[int, int], ...]

    @staticmethod
    def of(bufs, side: int) -> Messages:
        return Messages(side, tuple((b.data_ptr(), int(n)) for b, n in bufs))

    def find(self, view: torch.Tensor) -> tuple[int, int] | None:
        """(message index, byte offset in it) of the contiguous ``view`` lying inside one message at a whole
        element's offset, else None (the pair is copied by torch and its bytes hashed from the message)."""
        p, nb, e = view.data_ptr(), view.numel() * view.element_size(), view.element_size()
        if not view.is_contiguous():
            return None
        for k, (a, n) in enumerate(self.spans):
            if a <= p and p + nb <= a + n:
                return (k, p - a) if (p - a) % e == 0 else None
        return None


@dataclass(slots=True)
class CopyTable:
    """Everything a call needs besides the tensors: groups (one launch each) and torch fallbacks."""

    signature: tuple[int, ...]
    device: torch.device
    groups: list[Group] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)  # pair indices copied with torch
    msgs: Messages | None = None  # the digest: the messages the kernels hash
    covered: list[list[tuple[int, int]]] | None = None  # per message, the byte ranges the kernels hash

    def summary(self) -> str:
        parts = [f"{g.plan.src_view}->{g.plan.dst_view}: {g.num_regions} regions, {g.num_tiles} tiles of "
                 f"<= {g.tile_elems} elements, {g.numel} elements" for g in self.groups]
        return "; ".join(parts + [f"torch fallback: {len(self.fallback)} pairs"])


def signature(pairs: Sequence[Pair]) -> tuple[int, ...]:
    """Cheap identity of a list of pairs: the count and every data_ptr."""
    return (len(pairs), *(t.data_ptr() for pair in pairs for t in pair))


def _tile_params(device: torch.device, numel: int) -> tuple[int, int]:
    if interpreting():
        return INTERPRET_TILE, INTERPRET_MAX_REGIONS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, numel // (CUDA_TILES_PER_SM * sms))
    tile = 1 << max(0, want.bit_length() - 1)
    return min(max(tile, CUDA_MIN_TILE), CUDA_MAX_TILE), CUDA_MAX_REGIONS


def build_tiles(numels: np.ndarray, tile_elems: int, max_regions: int) -> np.ndarray:
    """Tile table ``int64[num_tiles, 4]`` of ``(r_lo, r_hi, start, stop)`` rows.

    Regions with more than ``tile_elems`` elements must come first in ``numels``; each is cut at multiples
    of ``tile_elems``. The rest are packed greedily, in order, at most ``max_regions`` and ``tile_elems``
    elements per tile.
    """
    big = int(np.count_nonzero(numels > tile_elems))
    assert np.all(numels[:big] > tile_elems) and np.all(numels[big:] <= tile_elems)
    counts = -(-numels[:big] // tile_elems)
    region = np.repeat(np.arange(big, dtype=np.int64), counts)
    first_tile = np.cumsum(counts) - counts
    start = (np.arange(region.size, dtype=np.int64) - np.repeat(first_tile, counts)) * tile_elems
    stop = np.minimum(start + tile_elems, numels[region])
    rows = [np.stack([region, region + 1, start, stop], axis=1)]
    small = []
    lo, total = big, 0
    for r in range(big, numels.size):
        n = int(numels[r])
        if r > lo and (total + n > tile_elems or r - lo >= max_regions):
            small.append((lo, r, 0, int(numels[r - 1])))
            lo, total = r, 0
        total += n
    if lo < numels.size:
        small.append((lo, numels.size, 0, int(numels[-1])))
    rows.append(np.asarray(small, dtype=np.int64).reshape(-1, 4))
    return np.concatenate(rows).astype(np.int64)


def _region_row(dims: list[tuple[int, int, int]], src_off: int, dst_off: int, numel: int,
                plan: DtypePlan, mstart: int = 0, mlen: int = 0) -> list[int]:
    """One row of the region table (layout in ``kernels/copy.py``)."""
    from ..kernels import copy as k  # triton is imported only by the Triton backend

    row = [0] * int(k.REGION_FIELDS)
    row[int(k.F_SRC)], row[int(k.F_DST)] = src_off, dst_off
    row[int(k.F_NUMEL)], row[int(k.F_NDIM)] = numel, len(dims)
    row[int(k.F_VEC)] = int(_vector_ok(dims, src_off, dst_off, plan))
    row[int(k.F_MSTART)], row[int(k.F_MLEN)] = mstart, mlen
    for d in range(int(k.MAX_DIMS)):
        n, s, t = dims[d] if d < len(dims) else (1, 0, 0)
        if d < int(k.MAX_DIMS) - 1:
            row[int(k.F_SIZE) + d] = n
        row[int(k.F_SSTRIDE) + d], row[int(k.F_DSTRIDE) + d] = s, t
    return row


def _group_rows(plan: DtypePlan, members: list[int], pairs: Sequence[Pair], fallback: list[int],
                table: CopyTable) -> tuple[int, int, list[list[int]], list[int], list[int]]:
    """Base pairs, region rows and each region's message (``table.msgs``: the digest's; else 0) of one dtype
    group; pairs the kernel cannot take go to ``fallback``."""
    from ..kernels import copy as k  # triton is imported only by the Triton backend

    src_base = min(members, key=lambda i: pairs[i][0].untyped_storage().data_ptr())
    dst_base = min(members, key=lambda i: pairs[i][1].untyped_storage().data_ptr())
    sptr0 = pairs[src_base][0].untyped_storage().data_ptr()
    dptr0 = pairs[dst_base][1].untyped_storage().data_ptr()
    ss, ds = plan.src_view.itemsize, plan.dst_view.itemsize
    rows, numels, msg_of = [], [], []
    msgs = table.msgs
    for i in members:
        src, dst = pairs[i]
        dims = merge_dims(src.shape, src.stride(), dst.stride())
        sbytes, dbytes = src.data_ptr() - sptr0, dst.data_ptr() - dptr0
        # inner sizes must leave room for the kernel's 32-bit carry; offsets must be whole elements
        too_big = len(dims) > 1 and any(n >= k.MAX_INNER_SIZE for n, _, _ in dims[:-1])
        where = msgs.find(pairs[i][msgs.side]) if msgs is not None else (0, 0)
        if len(dims) > int(k.MAX_DIMS) or too_big or sbytes % ss or dbytes % ds or where is None:
            fallback.append(i)  # copied by torch; with the digest on, its message bytes are hashed as a gap
            continue
        mstart = mlen = 0
        if msgs is not None:
            m, off = where
            mstart = msgs.spans[m][0] - (dptr0 if msgs.side else sptr0)
            mlen = msgs.spans[m][1]
            table.covered[m].append((off, off + src.numel() * pairs[i][msgs.side].element_size()))
        rows.append(_region_row(dims, sbytes // ss, dbytes // ds, src.numel(), plan, mstart, mlen))
        numels.append(src.numel())
        msg_of.append(where[0])
    return src_base, dst_base, rows, numels, msg_of


def _slot_messages(tiles: np.ndarray, msg_of: np.ndarray, nmsg: int) -> tuple[int, np.ndarray]:
    """The digest's slots of a tile table: (slots per tile, each slot's message index; ``nmsg`` for a slot
    no region fills)."""
    lo, hi = tiles[:, 0], tiles[:, 1]
    slots = int((hi - lo).max()) if len(tiles) else 1
    idx = lo[:, None] + np.arange(slots, dtype=np.int64)[None, :]
    valid = idx < hi[:, None]
    return slots, np.where(valid, msg_of[np.minimum(idx, len(msg_of) - 1)], nmsg).reshape(-1).astype(np.int64)


def prepare(pairs: Sequence[Pair], msgs: Messages | None = None) -> CopyTable:
    """Validate ``pairs`` and build the region and tile tables of every dtype group (on the device); with
    ``msgs``, also what the digest needs (each region's message, each slot's message, the bytes covered)."""
    device = validate_pairs(pairs)
    table = CopyTable(signature=signature(pairs), device=device, msgs=msgs)
    if msgs is not None:
        table.signature += msgs.spans
        table.covered = [[] for _ in msgs.spans]
    by_plan: dict[DtypePlan, list[int]] = {}
    for i, (src, dst) in enumerate(pairs):
        if src.numel() == 0:
            continue
        plan = plan_dtypes(src.dtype, dst.dtype)
        if plan is None or src.is_conj() or src.is_neg():
            table.fallback.append(i)
        else:
            by_plan.setdefault(plan, []).append(i)

    host: list[np.ndarray] = []  # every group's regions and tiles, moved to the device in one copy
    built = []
    for plan, members in by_plan.items():
        src_base, dst_base, rows, numels, msg_of = _group_rows(plan, members, pairs, table.fallback, table)
        if not rows:
            continue
        regions, sizes = np.asarray(rows, dtype=np.int64), np.asarray(numels, dtype=np.int64)
        total = int(sizes.sum())
        tile_elems, max_regions = _tile_params(device, total)
        order = np.argsort(sizes <= tile_elems, kind="stable")  # regions cut into several tiles first
        regions, sizes = regions[order], sizes[order]
        tiles = build_tiles(sizes, tile_elems, max_regions)
        slots, slot_msg = _slot_messages(tiles, np.asarray(msg_of, dtype=np.int64)[order], len(msgs.spans)) \
            if msgs is not None else (1, np.zeros(0, dtype=np.int64))
        host += [regions.reshape(-1), tiles.reshape(-1), slot_msg]
        built.append((plan, src_base, dst_base, regions.shape, tiles.shape, total, tile_elems,
                      max(0, round(math.log2(total / len(rows)))), slots, slot_msg.size))
    table.fallback.sort()
    if not built:
        return table
    flat = torch.from_numpy(np.concatenate(host)).to(device)
    off = 0
    for plan, src_base, dst_base, rshape, tshape, total, tile_elems, shape_class, slots, nslot in built:
        regions = flat[off:off + rshape[0] * rshape[1]].view(rshape)
        off += regions.numel()
        tiles = flat[off:off + tshape[0] * tshape[1]].view(tshape)
        off += tiles.numel()
        slot_msg = flat[off:off + nslot] if msgs is not None else None
        off += nslot
        table.groups.append(Group(plan, src_base, dst_base, regions, tiles, rshape[0], tshape[0], total,
                                  tile_elems, shape_class, slots, slot_msg))
    assert off == flat.numel()
    return table


# ---------------------------------------------------------------------------------------------------------
# kernel and launch


def autotune_configs(interpret: bool, tune: bool) -> list[triton.Config]:
    """Configs of the copy kernel: one big-block config under the interpreter (its autotuner cannot time)
    or with autotuning off; BLOCK / num_warps / TILES_PER_PROG choices on CUDA (pruned per dtype group)."""
    import triton

    if interpret:
        return [triton.Config({"BLOCK": INTERPRET_BLOCK, "TILES_PER_PROG": 1}, num_warps=4)]
    if not tune:
        return [triton.Config({"BLOCK": 2048, "TILES_PER_PROG": 1}, num_warps=4)]
    return [
        triton.Config({"BLOCK": block, "TILES_PER_PROG": tpp}, num_warps=warps)
        for block, warps, tpp in [(512, 4, 1), (1024, 4, 1), (2048, 4, 1), (4096, 4, 1), (2048, 8, 1),
                                  (4096, 8, 1), (8192, 8, 1), (16384, 8, 1), (2048, 4, 4), (4096, 8, 4)]
    ]


# Vector groups per thread: at most 4 keeps the kernel near 60 registers on sm_90 (ptxas -v); 8 and more
# doubles them or spills.
MAX_GROUPS_PER_THREAD = 4


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep configs with 1 to ``MAX_GROUPS_PER_THREAD`` vector groups per thread and a block no larger than
    a tile; if none is left, the one with the fewest groups per thread."""

    def groups(c: triton.Config) -> float:
        return c.kwargs["BLOCK"] / kwargs["VEC"] / (32 * c.num_warps)

    fit = [c for c in configs
           if 1 <= groups(c) <= MAX_GROUPS_PER_THREAD and c.kwargs["BLOCK"] <= named_args["tile_elems"]]
    return fit or [min(configs, key=lambda c: (groups(c) < 1, groups(c)))]


_KERNELS: dict[tuple[bool, bool], tuple[object, object]] = {}


def get_kernel():
    """The autotuned copy kernel for the current mode (compiled or ``TRITON_INTERPRET=1``; see
    :func:`~triton_reshard.ops.launcher.kernel_module`)."""
    import triton

    from ..kernels import copy as kcopy

    interpret = interpreting()
    module = kernel_module(kcopy, "copy_regions_kernel")
    tune = os.environ.get(AUTOTUNE_ENV, "1") != "0"
    cached = _KERNELS.get((interpret, tune))
    if cached is None or cached[0] is not module.copy_regions_kernel:
        kernel = triton.autotune(
            configs=autotune_configs(interpret, tune),
            key=["shape_class", "tile_elems"],
            prune_configs_by={"early_config_prune": _prune},
        )(module.copy_regions_kernel)
        cached = _KERNELS[(interpret, tune)] = (module.copy_regions_kernel, kernel)
    return cached[1]


def launch(table: CopyTable, pairs: Sequence[Pair], coef: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run the copies described by ``table`` (built from ``pairs`` or an identical list). With the digest's
    messages in the table and ``coef`` (int64 keyed coefficients on the device): the per-message digest sums
    of the bytes the kernels moved (int64 tensor on the device; mod 2**64), else None."""
    sums = None
    if table.msgs is not None and coef is not None:
        sums = torch.zeros(len(table.msgs.spans) + 1, dtype=torch.int64, device=table.device)
    if table.groups:
        kernel = get_kernel()
        nan = _BF16_NAN[table.device.type]
        for g in table.groups:
            _launch_group(kernel, g, pairs, nan, coef, sums, table.msgs)
    if table.fallback:
        torch_copy_views([pairs[i] for i in table.fallback])
    return None if sums is None else sums[:-1]


def _launch_group(kernel, g: Group, pairs: Sequence[Pair], nan: int, coef, sums, msgs) -> None:
    """One dtype group's launch; with ``sums``, its per-slot digest sums added to their messages'."""
    import triton

    plan, num_tiles = g.plan, g.num_tiles
    digest = sums is not None
    slot_sums = torch.zeros(num_tiles * g.slots if digest else 1, dtype=torch.int64, device=g.tiles.device)
    kernel[lambda meta, n=num_tiles: (triton.cdiv(n, meta["TILES_PER_PROG"]),)](
        storage_view(pairs[g.src_base][0], plan.src_view),
        storage_view(pairs[g.dst_base][1], plan.dst_view),
        g.regions,
        g.tiles,
        coef if digest else g.regions,
        slot_sums,
        num_tiles,
        g.slots,
        g.tile_elems,
        g.shape_class,
        SRC_VEC=plan.src_vec,
        DST_VEC=plan.dst_vec,
        VEC=max(plan.src_vec, plan.dst_vec),
        SRC_BF16=plan.src_bf16,
        VIA_F32=plan.via_f32,
        DST_BF16=plan.dst_bf16,
        BF16_NAN=nan,
        DIGEST=digest,
        MSG_DST=bool(msgs.side) if digest else True,
        MSG_BYTES=(plan.dst_view.itemsize if msgs.side else plan.src_view.itemsize) if digest else 1,
    )
    if digest:
        sums.index_add_(0, g.slot_msg, slot_sums)


_CACHE: OrderedDict[Hashable, CopyTable] = OrderedDict()


def triton_copy_views(pairs: Sequence[Pair], key: Hashable | None = None) -> None:
    """Copy every ``(src, dst)`` pair (``dst.copy_(src)`` semantics) with one launch per dtype group.

    ``key``: equal for a list that recurs with the same tensors; its tables are then cached (LRU of
    ``CACHE_SIZE``) and rebuilt if the pairs' count or data_ptrs changed. ``None`` builds without caching.
    """
    if not pairs:
        return
    with torch.no_grad():
        if key is None:
            launch(prepare(pairs), pairs)
            return
        launch(cached_table(_CACHE, key, lambda: signature(pairs), lambda: prepare(pairs), CACHE_SIZE), pairs)


def triton_copy_digest(pairs: Sequence[Pair], bufs, side: int, coef: torch.Tensor, key: Hashable | None = None
                       ) -> tuple[torch.Tensor, list[list[tuple[int, int]]]] | None:
    """Copy ``pairs`` as :func:`triton_copy_views` does, each program also hashing the message bytes it moves
    (the integrity digest, issue 46: ``bufs``, (uint8 buffer, bytes) per message; ``side`` 1 where they are
    the pairs' destinations, a pack; 0 where they are the sources, an unpack). Returns ``(sums, gaps)``:
    ``sums`` the per-message digest sums of those bytes (int64 on the device, no sync), ``gaps`` per message
    the byte ranges no kernel hashed (the caller hashes them from the buffer: bytes no pair copies, pairs
    torch copied); or None, with nothing copied, where two pairs cover the same message bytes (the sums would
    count them twice)."""
    if not pairs:
        return None
    msgs = Messages.of(bufs, side)
    with torch.no_grad():
        build = lambda: prepare(pairs, msgs)  # noqa: E731
        if key is None:
            table = build()
        else:
            sig = lambda: signature(pairs) + msgs.spans  # noqa: E731
            table = cached_table(_CACHE, (key, "digest", side), sig, build, CACHE_SIZE)
        gaps = _gaps(table)
        if gaps is None:
            return None
        return launch(table, pairs, coef), gaps


def _gaps(table: CopyTable) -> list[list[tuple[int, int]]] | None:
    """Per message, the byte ranges the kernels do not hash; None where two covered ranges overlap."""
    out = []
    for (_a, n), cov in zip(table.msgs.spans, table.covered, strict=True):
        rows, at = [], 0
        for a, z in sorted(cov) + [(n, n)]:
            if a < at:
                return None
            if a > at:
                rows.append((at, a))
            at = max(at, z)
        out.append(rows)
    return out


def clear_cache() -> None:
    """Forget every cached table (e.g. after the weights were reallocated)."""
    _CACHE.clear()


def cache_info() -> dict[str, int]:
    return {"entries": len(_CACHE), "max_entries": CACHE_SIZE}
