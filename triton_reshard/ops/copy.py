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


@dataclass(slots=True)
class CopyTable:
    """Everything a call needs besides the tensors: groups (one launch each) and torch fallbacks."""

    signature: tuple[int, ...]
    device: torch.device
    groups: list[Group] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)  # pair indices copied with torch

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
                plan: DtypePlan) -> list[int]:
    """One row of the region table (layout in ``kernels/copy.py``)."""
    from ..kernels import copy as k  # triton is imported only by the Triton backend

    row = [0] * int(k.REGION_FIELDS)
    row[int(k.F_SRC)], row[int(k.F_DST)] = src_off, dst_off
    row[int(k.F_NUMEL)], row[int(k.F_NDIM)] = numel, len(dims)
    row[int(k.F_VEC)] = int(_vector_ok(dims, src_off, dst_off, plan))
    for d in range(int(k.MAX_DIMS)):
        n, s, t = dims[d] if d < len(dims) else (1, 0, 0)
        if d < int(k.MAX_DIMS) - 1:
            row[int(k.F_SIZE) + d] = n
        row[int(k.F_SSTRIDE) + d], row[int(k.F_DSTRIDE) + d] = s, t
    return row


def _group_rows(plan: DtypePlan, members: list[int], pairs: Sequence[Pair], fallback: list[int]
                ) -> tuple[int, int, list[list[int]], list[int]]:
    """Base pairs and region rows of one dtype group; pairs the kernel cannot take go to ``fallback``."""
    from ..kernels import copy as k  # triton is imported only by the Triton backend

    src_base = min(members, key=lambda i: pairs[i][0].untyped_storage().data_ptr())
    dst_base = min(members, key=lambda i: pairs[i][1].untyped_storage().data_ptr())
    sptr0 = pairs[src_base][0].untyped_storage().data_ptr()
    dptr0 = pairs[dst_base][1].untyped_storage().data_ptr()
    ss, ds = plan.src_view.itemsize, plan.dst_view.itemsize
    rows, numels = [], []
    for i in members:
        src, dst = pairs[i]
        dims = merge_dims(src.shape, src.stride(), dst.stride())
        sbytes, dbytes = src.data_ptr() - sptr0, dst.data_ptr() - dptr0
        # inner sizes must leave room for the kernel's 32-bit carry; offsets must be whole elements
        too_big = len(dims) > 1 and any(n >= k.MAX_INNER_SIZE for n, _, _ in dims[:-1])
        if len(dims) > int(k.MAX_DIMS) or too_big or sbytes % ss or dbytes % ds:
            fallback.append(i)
            continue
        rows.append(_region_row(dims, sbytes // ss, dbytes // ds, src.numel(), plan))
        numels.append(src.numel())
    return src_base, dst_base, rows, numels


def prepare(pairs: Sequence[Pair]) -> CopyTable:
    """Validate ``pairs`` and build the region and tile tables of every dtype group (on the device)."""
    device = validate_pairs(pairs)
    table = CopyTable(signature=signature(pairs), device=device)
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
        src_base, dst_base, rows, numels = _group_rows(plan, members, pairs, table.fallback)
        if not rows:
            continue
        regions, sizes = np.asarray(rows, dtype=np.int64), np.asarray(numels, dtype=np.int64)
        total = int(sizes.sum())
        tile_elems, max_regions = _tile_params(device, total)
        order = np.argsort(sizes <= tile_elems, kind="stable")  # regions cut into several tiles first
        regions, sizes = regions[order], sizes[order]
        tiles = build_tiles(sizes, tile_elems, max_regions)
        host += [regions.reshape(-1), tiles.reshape(-1)]
        built.append((plan, src_base, dst_base, regions.shape, tiles.shape, total, tile_elems,
                      max(0, round(math.log2(total / len(rows))))))
    table.fallback.sort()
    if not built:
        return table
    flat = torch.from_numpy(np.concatenate(host)).to(device)
    off = 0
    for plan, src_base, dst_base, rshape, tshape, total, tile_elems, shape_class in built:
        regions = flat[off:off + rshape[0] * rshape[1]].view(rshape)
        off += regions.numel()
        tiles = flat[off:off + tshape[0] * tshape[1]].view(tshape)
        off += tiles.numel()
        table.groups.append(Group(plan, src_base, dst_base, regions, tiles, rshape[0], tshape[0], total,
                                  tile_elems, shape_class))
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


def launch(table: CopyTable, pairs: Sequence[Pair]) -> None:
    """Run the copies described by ``table`` (built from ``pairs`` or an identical list)."""
    if table.groups:
        import triton

        kernel = get_kernel()
        nan = _BF16_NAN[table.device.type]
        for g in table.groups:
            plan = g.plan
            num_tiles = g.num_tiles
            kernel[lambda meta, n=num_tiles: (triton.cdiv(n, meta["TILES_PER_PROG"]),)](
                storage_view(pairs[g.src_base][0], plan.src_view),
                storage_view(pairs[g.dst_base][1], plan.dst_view),
                g.regions,
                g.tiles,
                num_tiles,
                g.tile_elems,
                g.shape_class,
                SRC_VEC=plan.src_vec,
                DST_VEC=plan.dst_vec,
                VEC=max(plan.src_vec, plan.dst_vec),
                SRC_BF16=plan.src_bf16,
                VIA_F32=plan.via_f32,
                DST_BF16=plan.dst_bf16,
                BF16_NAN=nan,
            )
    if table.fallback:
        torch_copy_views([pairs[i] for i in table.fallback])


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


def clear_cache() -> None:
    """Forget every cached table (e.g. after the weights were reallocated)."""
    _CACHE.clear()


def cache_info() -> dict[str, int]:
    return {"entries": len(_CACHE), "max_entries": CACHE_SIZE}
