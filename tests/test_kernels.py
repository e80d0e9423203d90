"""Tests of the Triton copy kernel (``kernels/copy.py``) and its launcher (``triton_reshard/ops/copy.py``).

Without a GPU the kernel runs in Triton's interpreter on CPU tensors: an autouse fixture sets
``TRITON_INTERPRET=1`` for every test not marked ``gpu`` (the launcher reloads the kernel module if it was
imported in the other mode, so the order in which modules import triton does not matter). ``gpu`` tests
run the compiled kernel on CUDA and are skipped without one.

Every copy is compared bit for bit with :func:`triton_reshard.ops.torch_copy_views` over whole destination
buffers: the destination views sit inside bigger buffers poisoned with NaN / 0xFF, so an element the kernel
did not write, or one it wrote outside its view, shows up as a difference.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from triton_reshard import ops
from triton_reshard.kernels import copy as kcopy  # table layout constants (F_*)
from triton_reshard.ops import copy as triton_copy
from triton_reshard.ops.copy import (
    DtypePlan,
    build_tiles,
    merge_dims,
    plan_dtypes,
    prepare,
    triton_copy_views,
)
from triton_reshard.ops.launcher import kernel_module

CUDA = torch.cuda.is_available()
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


pytestmark = pytest.mark.usefixtures("triton_mode")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as the signed integer dtype of the same size, for bitwise comparisons."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """A buffer whose every byte is 0xFF: NaN for every float dtype, -1 for ints."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    buf.view(torch.uint8).fill_(0xFF) if buf.element_size() == 1 else bits(buf).fill_(-1)
    return buf


def random_tensor(shape, dtype, device="cpu", gen=None) -> torch.Tensor:
    """Random values that never equal the poison (no NaN, no 0xFF byte pattern)."""
    if dtype.is_floating_point and dtype not in FP8:
        return torch.randn(shape, generator=gen).to(dtype).to(device)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=gen) == 1).to(device)
    raw = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)
    if dtype in FP8 or dtype == torch.uint8:
        return raw.view(dtype).to(device)
    return (raw.to(dtype) * 3 - 100).to(device)


def check_against_torch(srcs, carves, dst_shape, dst_dtype, device="cpu", key=None):
    """Copy ``srcs[i]`` into ``carves[i](buffer)`` with Triton and with torch; compare whole buffers."""
    out, ref = poisoned(dst_shape, dst_dtype, device), poisoned(dst_shape, dst_dtype, device)
    triton_copy_views([(s, carve(out)) for s, carve in zip(srcs, carves, strict=True)], key=key)
    ops.torch_copy_views([(s, carve(ref)) for s, carve in zip(srcs, carves, strict=True)])
    assert torch.equal(bits(out), bits(ref)), "Triton copy differs from torch (inside or outside the views)"
    return out


def assert_same_values(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-exact except that NaNs only need to be NaNs (their payload is the hardware's choice)."""
    if out.dtype.is_floating_point:
        out_nan, ref_nan = torch.isnan(out), torch.isnan(ref)
        assert torch.equal(out_nan, ref_nan), "NaN positions differ"
        out, ref = out[~out_nan], ref[~ref_nan]
    mismatch = (bits(out) != bits(ref)).nonzero()
    assert mismatch.numel() == 0, (f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}: "
                                   f"{out[mismatch[0]].item()!r} vs torch {ref[mismatch[0]].item()!r}")


# ---------------------------------------------------------------------------------------------------------
# pure host-side parts


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        pytest.param(torch.float32, torch.float32, DtypePlan(torch.int32, torch.int32), id="f32-bits"),
        pytest.param(torch.bfloat16, torch.bfloat16, DtypePlan(torch.int16, torch.int16), id="bf16-bits"),
        pytest.param(torch.float16, torch.float16, DtypePlan(torch.int16, torch.int16), id="f16-bits"),
        pytest.param(torch.float8_e4m3fn, torch.float8_e4m3fn, DtypePlan(torch.uint8, torch.uint8), id="fp8-bytes"),
        pytest.param(torch.bool, torch.bool, DtypePlan(torch.uint8, torch.uint8), id="bool-bytes"),
        pytest.param(torch.float32, torch.bfloat16,
                     DtypePlan(torch.float32, torch.int16, dst_bf16=True), id="f32-bf16"),
        pytest.param(torch.float32, torch.float16, DtypePlan(torch.float32, torch.float16), id="f32-f16"),
        pytest.param(torch.float64, torch.bfloat16,
                     DtypePlan(torch.float64, torch.int16, via_f32=True, dst_bf16=True), id="f64-bf16"),
        pytest.param(torch.bfloat16, torch.float16,
                     DtypePlan(torch.int16, torch.float16, src_bf16=True), id="bf16-f16"),
        pytest.param(torch.int32, torch.float16,
                     DtypePlan(torch.int32, torch.float16, via_f32=True), id="i32-f16"),
        pytest.param(torch.uint8, torch.int64, DtypePlan(torch.uint8, torch.int64), id="u8-i64"),
        pytest.param(torch.float32, torch.float8_e4m3fn, None, id="f32-fp8-torch"),
        pytest.param(torch.float8_e5m2, torch.bfloat16, None, id="fp8-bf16-torch"),
        pytest.param(torch.float32, torch.int32, None, id="f32-i32-torch"),
        pytest.param(torch.bool, torch.int32, None, id="bool-i32-torch"),
        pytest.param(torch.complex128, torch.complex128, None, id="c128-torch"),
    ],
)
def test_plan_dtypes(src, dst, expected):
    assert plan_dtypes(src, dst) == expected


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(lambda: (torch.empty(4, 5, 6), torch.empty(4, 5, 6)), [(120, 1, 1)], id="contiguous-3d"),
        pytest.param(lambda: (torch.empty(8, 64)[:, 16:48], torch.empty(8, 32)), [(32, 1, 1), (8, 64, 32)],
                     id="column-slice"),
        pytest.param(lambda: (torch.empty(6, 4).t(), torch.empty(4, 6)), [(6, 4, 1), (4, 1, 6)],
                     id="transpose"),
        pytest.param(lambda: (torch.empty(1, 3, 1, 7), torch.empty(9, 3, 1, 7)[2:3]), [(21, 1, 1)],
                     id="size-1-dims"),
        pytest.param(lambda: (torch.empty(()), torch.empty(())), [(1, 1, 1)], id="0d"),
        pytest.param(lambda: (torch.empty(5).expand(3, 5), torch.empty(3, 5)), [(5, 1, 1), (3, 0, 5)],
                     id="broadcast-src"),
    ],
)
def test_merge_dims(make, expected):
    src, dst = make()
    assert merge_dims(src.shape, src.stride(), dst.stride()) == expected


@pytest.mark.parametrize("seed", range(5))
def test_build_tiles_covers_every_element_once(seed):
    rng = np.random.default_rng(seed)
    tile, max_regions = 4096, 8
    numels = np.concatenate([rng.integers(4097, 50_000, size=rng.integers(0, 6)),
                             rng.integers(1, 4097, size=rng.integers(0, 300))]).astype(np.int64)
    if numels.size == 0:
        numels = np.array([1], dtype=np.int64)
    tiles = build_tiles(numels, tile, max_regions)
    assert tiles.shape[1] == kcopy.TILE_FIELDS
    covered = [np.zeros(n, dtype=np.int64) for n in numels]
    for r_lo, r_hi, start, stop in tiles.tolist():
        assert r_hi > r_lo and (r_hi - r_lo == 1 or r_hi - r_lo <= max_regions)
        elems = 0
        for r in range(r_lo, r_hi):
            lo = start if r == r_lo else 0
            hi = stop if r == r_hi - 1 else numels[r]
            covered[r][lo:hi] += 1
            elems += hi - lo
        assert elems <= tile
        assert start % tile == 0  # cuts inside a region fall on multiples of the tile (vector alignment)
    assert all(np.all(c == 1) for c in covered)
    small = int(np.count_nonzero(numels <= tile))
    assert len(tiles) - int(np.sum(-(-numels[numels > tile] // tile))) >= math.ceil(small / max_regions)


def test_tiny_regions_share_programs():
    base = torch.arange(30_000, dtype=torch.float32)
    out = torch.empty_like(base)
    pairs = [(base[3 * i:3 * i + 2], out[3 * i:3 * i + 2]) for i in range(10_000)]
    table = prepare(pairs)
    (group,) = table.groups
    assert group.num_regions == 10_000
    assert group.num_tiles == math.ceil(10_000 / triton_copy.INTERPRET_MAX_REGIONS)


# ---------------------------------------------------------------------------------------------------------
# exact copies, one pair at a time, against torch

COPY_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64, torch.bool,
               *FP8]

# (id, make the source from a random 1-D pool, destination buffer shape, carve the dst view from the buffer)
CASES = [
    *[(f"1d-{n}-offset", lambda p, n=n: p[3:3 + n], (n + 40,), lambda b, n=n: b[17:17 + n]) for n in (1, 33, 63, 4097)],
    ("1d-40000-vector", lambda p: p[:40_000], (40_064,), lambda b: b[32:40_032]),
    ("0d", lambda p: p[7], (9,), lambda b: b[5]),
    ("2d-column-slice", lambda p: p[:63 * 70].view(63, 70)[:, 5:38], (70, 40), lambda b: b[3:66, 4:37]),
    ("2d-vector-rows", lambda p: p[:80 * 512].view(80, 512)[:, 128:384], (84, 256), lambda b: b[2:82]),
    ("2d-odd-rows-aligned-start", lambda p: p[:200 * 136].view(200, 136)[:, 16:133], (216, 117),
     lambda b: b[16:216]),
    ("2d-unaligned-row-stride", lambda p: p[:300 * 133].view(300, 133)[:, :64], (316, 64), lambda b: b[16:316]),
    ("3d-vector", lambda p: p[:20 * 40 * 64].view(20, 40, 64)[:, 4:36, 16:48], (22, 32, 32), lambda b: b[1:21]),
    ("2d-transposed-src", lambda p: p[:33 * 63].view(33, 63).t(), (70, 40), lambda b: b[3:66, 4:37]),
    ("2d-transposed-dst", lambda p: p[:33 * 63].view(33, 63), (70, 40), lambda b: b[3:66, 4:37].t()),
    ("3d-strided", lambda p: p[:5 * 7 * 9].view(5, 7, 9)[:, 1:6, ::2], (7, 9, 12), lambda b: b[1:6, 2:7, 3:8]),
    ("4d-permuted", lambda p: p[:360].view(3, 4, 5, 6).permute(2, 0, 3, 1), (7, 5, 8, 6),
     lambda b: b[1:6, 1:4, 1:7, 1:5]),
    ("5d-permuted-both", lambda p: p[:720].view(2, 3, 4, 5, 6).permute(4, 2, 0, 3, 1)[:, 1:],
     (5, 4, 7, 5, 8), lambda b: b[1:4, 1:3, 1:6, 1:4, 1:7].permute(4, 0, 1, 2, 3)),
    ("broadcast-src", lambda p: p[:10].expand(4, 10), (6, 12), lambda b: b[1:5, 1:11]),
]


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("make_src", "dst_shape", "carve"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_copy_matches_torch(dtype, make_src, dst_shape, carve):
    gen = torch.Generator().manual_seed(0)
    src = make_src(random_tensor((60_000,), dtype, gen=gen))
    check_against_torch([src], [carve], dst_shape, dtype)


@pytest.mark.parametrize("case", [c for c in CASES if "vector" in c[0] or "aligned" in c[0]], ids=lambda c: c[0])
def test_vector_cases_reach_the_vector_path(case):
    """Guard for the cases above: these regions have full blocks, and the aligned ones take 16-byte loads."""
    name, make_src, dst_shape, carve = case
    src = make_src(torch.zeros(60_000, dtype=torch.float32))
    (group,) = prepare([(src, carve(torch.zeros(dst_shape)))]).groups
    row = group.regions[0]
    assert int(row[int(kcopy.F_NUMEL)]) >= triton_copy.INTERPRET_BLOCK
    assert int(row[int(kcopy.F_VEC)]) == (1 if "vector" in name else 0)


def _cast_source(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (every exponent, subnormals, inf, NaN) plus rounding ties for floats; the full
    range for ints."""
    if dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        info = torch.iinfo(ints)
        x = torch.randint(info.min, info.max, (n,), generator=gen, dtype=ints).view(dtype).clone()
        if dtype == torch.float32:
            # exact halfway cases for bf16 (low 16 bits 0x8000) and fp16 (low 13 bits 0x1000), odd and even
            top = torch.randint(0x3000, 0x4800, (64,), generator=gen, dtype=torch.int32)
            x[:64] = ((top << 16) | 0x8000).view(torch.float32)
            x[64:128] = ((top << 13) | 0x1000).view(torch.float32)
            x[128:136] = torch.tensor([65504.0, 65519.99, 65520.0, 3.4e38, -0.0, 1e-40, -6e-8, 2.9e-8])
            # NaNs whose payload sits in the low bits only (naive rounding turns them into inf or 0)
            nans = torch.tensor([0x7F800001, 0xFFFFFFFF, 0xFF800001, 0x7FBFFFFF, 0xFFFF8000], dtype=torch.int64)
            x[136:141] = nans.to(torch.int32).view(torch.float32)
        return x
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64)
    x[:4] = torch.tensor([info.min, info.max, 0, 16_777_217 if info.max > 2**24 else 1])
    return x.to(dtype)


CAST_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
               torch.int16, torch.int32, torch.int64]
CAST_PAIRS = [(s, d) for s in CAST_DTYPES for d in CAST_DTYPES if s != d and plan_dtypes(s, d) is not None]


# numpy (the interpreter's casts) warns about the overflows and NaNs that the test feeds on purpose
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                            "ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), CAST_PAIRS,
                         ids=[f"{s}-{d}".replace("torch.", "") for s, d in CAST_PAIRS])
def test_cast_is_exact(src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(1)
    src = _cast_source(src_dtype, 64 * 80, gen).view(64, 80)[:, 7:70]  # a strided 2-D view
    out = poisoned((66, 64), dst_dtype)
    ref = src.to(dst_dtype)
    triton_copy_views([(src, out[1:65, :63])])
    assert_same_values(out[1:65, :63], ref)
    assert torch.all(bits(out[0]) == -1) and torch.all(bits(out[65]) == -1) and torch.all(bits(out[:, 63:]) == -1)


def test_bf16_rounding_ties_to_even():
    # 1 + 2^-8 is halfway between bf16 1.0 (even) and 1 + 2^-7 (odd): it must round down to 1.0;
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): it must round up.
    # fp32 max lies above the midpoint between bf16 max and 2^128: it rounds to inf.
    src = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4028235e38, float("inf")], dtype=torch.float32)
    out = poisoned((5,), torch.bfloat16)
    triton_copy_views([(src, out)])
    expected = torch.tensor([1.0, 1 + 2**-6, -1.0, float("inf"), float("inf")], dtype=torch.bfloat16)
    assert torch.equal(bits(out), bits(expected))
    assert torch.equal(bits(out), bits(src.to(torch.bfloat16)))


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.float32, torch.float8_e4m3fn),
                                                      (torch.float8_e5m2, torch.bfloat16),
                                                      (torch.float32, torch.int32)],
                         ids=["f32-fp8e4m3", "fp8e5m2-bf16", "f32-i32"])
def test_unsupported_casts_fall_back_to_torch(src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(2)
    src = (torch.randn(40, 30, generator=gen) * 8).to(src_dtype)[:, 3:20]
    carves = [lambda b: b[2:42, 1:18]]
    assert prepare([(src, carves[0](poisoned((44, 20), dst_dtype)))]).fallback == [0]
    check_against_torch([src], carves, (44, 20), dst_dtype)


# ---------------------------------------------------------------------------------------------------------
# many regions per launch


def _count_launches(monkeypatch) -> list[dict]:
    """Wrap the kernel launch; every element of the returned list is one launch (its constexpr args)."""
    launches: list[dict] = []
    real = triton_copy.get_kernel

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def counted(*args, **kwargs):
                launches.append(kwargs)
                return run(*args, **kwargs)

            return counted

    monkeypatch.setattr(triton_copy, "get_kernel", lambda: Counting(real()))
    return launches


def test_hundreds_of_pairs_one_launch_per_dtype_group(monkeypatch):
    launches = _count_launches(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    pools = {dt: random_tensor((300_000,), dt, gen=gen) for dt in dtypes}
    out = {dt: poisoned((200_000,), dt) for dt in dtypes}
    ref = {dt: poisoned((200_000,), dt) for dt in dtypes}
    used = dict.fromkeys(dtypes, 7)
    pairs, ref_pairs = [], []
    for i in range(300):
        # tiny, odd and a few big regions; f32->f32, bf16->bf16 and f16->f16 (one int16 launch), f32->bf16
        rows, cols = [(1, 1), (1, 33), (3, 63), (2, 7), (0, 5)][i % 5] if i % 50 else (150, 129)
        src_dt, dst_dt = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.float32, torch.bfloat16)][i % 4]
        src = pools[src_dt][i * 900:i * 900 + rows * 200].view(rows, 200)[:, 5:5 + cols]
        # destinations: disjoint strided row blocks with a gap, one after the other in the buffer
        off, stride = used[dst_dt], cols + 3
        used[dst_dt] += rows * stride + 5
        pairs.append((src, out[dst_dt][off:off + rows * stride].view(rows, stride)[:, 1:1 + cols]))
        ref_pairs.append((src, ref[dst_dt][off:off + rows * stride].view(rows, stride)[:, 1:1 + cols]))
    triton_copy_views(pairs)
    ops.torch_copy_views(ref_pairs)
    assert len(launches) == 3
    assert sorted((k["SRC_VEC"], k["DST_VEC"], k["DST_BF16"]) for k in launches) == [(4, 4, False), (4, 8, True),
                                                                                       (8, 8, False)]
    for dt in out:
        assert torch.equal(bits(out[dt]), bits(ref[dt])), dt


def test_empty_pairs_launch_nothing(monkeypatch):
    launches = _count_launches(monkeypatch)
    a, b = torch.randn(4, 0), torch.randn(4, 0)
    triton_copy_views([(a, b), (a[:, :0], b[:, :0])])
    triton_copy_views([])
    assert launches == []


def test_mix_of_tiny_and_big_regions():
    gen = torch.Generator().manual_seed(4)
    pool = random_tensor((200_000,), torch.float32, gen=gen)
    sizes = [1, 3, 33, 63, 150_000, 7, 4097, 2, 20_000, 1]
    offsets = np.cumsum([0, *sizes])
    srcs = [pool[o:o + n] for o, n in zip(offsets[:-1], sizes, strict=True)]
    carves = [lambda b, o=int(o), n=n: b[2 * o + 5:2 * o + 5 + 2 * n:2] for o, n in zip(offsets[:-1], sizes, strict=True)]
    check_against_torch(srcs, carves, (2 * int(offsets[-1]) + 10,), torch.float32)


def test_tiles_may_start_and_stop_inside_regions():
    """The kernel honours the whole tile-table contract, also cuts the builder never makes: a tile that
    starts inside its first region and spans several regions."""
    gen = torch.Generator().manual_seed(9)
    pool = random_tensor((1000,), torch.float32, gen=gen)
    srcs = [pool[:30], pool[100:140].view(4, 10)[:, 2:9], pool[200:225]]
    carves = [lambda b: b[3:33], lambda b: b[40:72].view(4, 8)[:, :7], lambda b: b[80:105]]
    out, ref = poisoned((110,), torch.float32), poisoned((110,), torch.float32)
    pairs = [(s, carve(out)) for s, carve in zip(srcs, carves, strict=True)]
    table = prepare(pairs)
    (group,) = table.groups
    # tile 0: all of region 0 (30 elements), then region 1 up to element 10;
    # tile 1: region 1 from element 10 (of 28), then all of region 2 (25 elements)
    group.tiles = torch.tensor([[0, 2, 0, 10], [1, 3, 10, 25]])
    group.num_tiles = 2
    triton_copy.launch(table, pairs)
    ops.torch_copy_views([(s, carve(ref)) for s, carve in zip(srcs, carves, strict=True)])
    assert torch.equal(bits(out), bits(ref))


def test_several_tiles_per_program(monkeypatch):
    """The CUDA configs give a program several tiles (TILES_PER_PROG); run one such config here."""
    import triton

    config = triton.Config({"BLOCK": 2048, "TILES_PER_PROG": 3}, num_warps=4)
    monkeypatch.setattr(triton_copy, "autotune_configs", lambda interpret, tune: [config])
    monkeypatch.setattr(triton_copy, "_KERNELS", {})
    monkeypatch.setattr(triton_copy, "INTERPRET_TILE", 4096)
    monkeypatch.setattr(triton_copy, "INTERPRET_MAX_REGIONS", 3)
    launches = _count_launches(monkeypatch)
    gen = torch.Generator().manual_seed(10)
    pool = random_tensor((40_000,), torch.float32, gen=gen)
    srcs = [pool[:13_000], *(pool[20_000 + 50 * i:20_000 + 50 * i + 41] for i in range(8))]  # 4 + 3 tiles
    carves = [lambda b: b[1:13_001], *(lambda b, i=i: b[14_000 + 60 * i:14_000 + 60 * i + 41] for i in range(8))]
    assert prepare([(s, c(torch.empty(15_000))) for s, c in zip(srcs, carves, strict=True)]).groups[0].num_tiles == 7
    check_against_torch(srcs, carves, (15_000,), torch.float32)
    ((_, kernel),) = triton_copy._KERNELS.values()
    assert len(launches) == 1 and kernel.best_config.kwargs["TILES_PER_PROG"] == 3


# ---------------------------------------------------------------------------------------------------------
# pack / unpack


def _staging_views(shapes_dtypes, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous views of a uint8 staging buffer at 16-byte aligned offsets, as the executor lays them out."""
    views, off = [], 0
    for shape, dtype in shapes_dtypes:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(buffer[off:off + nbytes].view(dtype).view(shape))
        off += -(-nbytes // 16) * 16
    return views


def test_pack_then_unpack_is_identity():
    gen = torch.Generator().manual_seed(5)
    # "TP4 shards": a row block, a column block, a transposed slice, a 3-D slice, a scalar, an empty one
    weights = {
        "qkv": random_tensor((96, 64), torch.bfloat16, gen=gen),
        "o": random_tensor((64, 96), torch.bfloat16, gen=gen),
        "norm": random_tensor((64,), torch.float32, gen=gen),
        "experts": random_tensor((4, 33, 17), torch.float16, gen=gen),
        "fp8": random_tensor((40, 24), torch.float8_e4m3fn, gen=gen),
    }
    slices = [weights["qkv"][32:64], weights["o"][:, 24:48], weights["norm"][8:40], weights["experts"][1:3, 5:30],
              weights["o"].t()[10:20], weights["norm"][3], weights["fp8"][:, 8:16], weights["qkv"][:0]]
    staging = poisoned((64 * 1024,), torch.uint8)
    packed = _staging_views([(tuple(s.shape), s.dtype) for s in slices], staging)
    triton_copy_views(list(zip(slices, packed, strict=True)), key=("pack", 0))
    for s, p in zip(slices, packed, strict=True):
        assert torch.equal(bits(p), bits(s.contiguous()))

    # unpack into fresh poisoned weights of another layout (the slices land at other offsets)
    targets = [poisoned((70, 64), torch.bfloat16)[5:37], poisoned((64, 40), torch.bfloat16)[:, 10:34],
               poisoned((50,), torch.float32)[9:41], poisoned((3, 30, 26), torch.float16)[:2, 1:26, 4:21],
               poisoned((30, 64), torch.bfloat16)[20:30, :], poisoned((2,), torch.float32)[1],
               poisoned((40, 9), torch.float8_e4m3fn)[:, 1:], poisoned((3, 64), torch.bfloat16)[1:1]]
    triton_copy_views(list(zip(packed, targets, strict=True)), key=("unpack", 0))
    for s, t in zip(slices, targets, strict=True):
        assert torch.equal(bits(t), bits(s))
    # and unpack(pack(x)) back through the same cached tables
    triton_copy_views(list(zip(slices, packed, strict=True)), key=("pack", 0))
    assert triton_copy.cache_info()["entries"] == 2


def test_pack_with_cast_then_unpack():
    gen = torch.Generator().manual_seed(6)
    master = [random_tensor((48, 40), torch.float32, gen=gen)[:, 4:36], random_tensor((33,), torch.float32, gen=gen)]
    staging = poisoned((8192,), torch.uint8)
    packed = _staging_views([(tuple(m.shape), torch.bfloat16) for m in master], staging)
    triton_copy_views(list(zip(master, packed, strict=True)))
    back = [poisoned(tuple(m.shape), torch.float32) for m in master]
    triton_copy_views(list(zip(packed, back, strict=True)))
    for m, b in zip(master, back, strict=True):
        assert torch.equal(bits(b), bits(m.to(torch.bfloat16).to(torch.float32)))


# ---------------------------------------------------------------------------------------------------------
# cache, validation, dispatch


def test_cache_reuses_and_rebuilds(monkeypatch):
    builds = []
    real_prepare = triton_copy.prepare
    monkeypatch.setattr(triton_copy, "prepare", lambda pairs: builds.append(1) or real_prepare(pairs))
    src, out = torch.randn(100), torch.zeros(100)
    triton_copy_views([(src[:50], out[50:])], key="k")
    triton_copy_views([(src[:50], out[50:])], key="k")
    assert len(builds) == 1
    src2 = torch.randn(100)  # same key, other tensors: the signature no longer matches
    triton_copy_views([(src2[:50], out[50:])], key="k")
    assert len(builds) == 2
    assert torch.equal(out[50:], src2[:50])
    triton_copy_views([(src[:50], out[:50])], key=None)
    assert len(builds) == 3 and triton_copy.cache_info()["entries"] == 1
    assert torch.equal(out[:50], src[:50])


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(triton_copy, "CACHE_SIZE", 4)
    src, out = torch.randn(10), torch.zeros(10)
    for i in range(10):
        triton_copy_views([(src[i:i + 1], out[i:i + 1])], key=i)
    assert triton_copy.cache_info()["entries"] == 4
    assert list(triton_copy._CACHE) == [6, 7, 8, 9]
    assert torch.equal(out, src)


def test_shape_mismatch_names_the_pair():
    a = torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"pair 1: shape mismatch: src \(4, 5\) vs dst \(5, 4\)"):
        triton_copy_views([(a, torch.zeros(4, 5)), (a, torch.zeros(5, 4))])


def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match="pair 1: mixed devices"):
        triton_copy_views([(torch.zeros(3), torch.zeros(3)), (torch.zeros(3), torch.zeros(3, device="meta"))])


def test_overlapping_destination_is_rejected():
    with pytest.raises(ValueError, match="pair 0: dst .* more than once"):
        triton_copy_views([(torch.zeros(3, 4), torch.zeros(4).expand(3, 4))])


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        triton_copy_views([(torch.zeros(3), torch.zeros(3))])


def test_copy_views_dispatches_to_triton(monkeypatch):
    launches = _count_launches(monkeypatch)
    src, out = torch.randn(8, 8), torch.zeros(8, 8)
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    backend = ops.resolve_backend(src.device)
    assert backend == "triton"
    ops.copy_views([(src.t(), out)], backend=backend, key="dispatch")
    assert len(launches) == 1 and torch.equal(out, src.t())


def test_offsets_past_2_31_elements():
    # Two allocations far apart in the address space: offsets from the lower one need 64-bit math.
    small = torch.randn(64)
    big = torch.zeros(1 << 22)  # 16 MiB: mmap'ed, far from the small heap allocation
    group = prepare([(small, big[-64:]), (big[:64], small)]).groups[0]
    offsets = group.regions[:, :2].abs().max().item()
    if offsets < 2**31:
        pytest.skip(f"the allocator placed the tensors only {offsets} elements apart")
    check_against_torch([small, big[5:69]], [lambda b: b[-64:], lambda b: b[:64]], (1 << 22,), torch.float32)


# ---------------------------------------------------------------------------------------------------------
# the compiled kernel (no GPU needed to compile for one)


def _compile_for_hopper(module, plan: DtypePlan, block: int = 2048):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = {torch.int16: "*i16", torch.int32: "*i32", torch.float32: "*fp32", torch.float16: "*fp16",
           torch.uint8: "*u8", torch.float64: "*fp64"}
    signature = {"src_ptr": ptr[plan.src_view], "dst_ptr": ptr[plan.dst_view], "regions_ptr": "*i64",
                 "tiles_ptr": "*i64", "coef_ptr": "*i64", "sums_ptr": "*i64", "num_tiles": "i64", "slots": "i64",
                 "tile_elems": "i64", "shape_class": "i64"}
    constexprs = {"SRC_VEC": plan.src_vec, "DST_VEC": plan.dst_vec, "VEC": max(plan.src_vec, plan.dst_vec),
                  "SRC_BF16": plan.src_bf16, "VIA_F32": plan.via_f32, "DST_BF16": plan.dst_bf16,
                  "BF16_NAN": 0x7FFF, "BLOCK": block, "TILES_PER_PROG": 2, "DIGEST": False, "MSG_DST": True,
                  "MSG_BYTES": 1}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    src = ASTSource(fn=module.copy_regions_kernel, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_kernel_module_switches_mode_without_reloading(monkeypatch):
    """A process that changes TRITON_INTERPRET after importing the kernels gets a twin in the other mode: the
    imported module is never reloaded (what was taken from it stays), and switching back compiles nothing."""
    from triton.runtime.interpreter import InterpretedFunction

    before = kcopy.copy_regions_kernel
    got = {}
    for mode in ("0", "1", "0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", mode)
        m = kernel_module(kcopy, "copy_regions_kernel")
        assert isinstance(m.copy_regions_kernel, InterpretedFunction) == (mode == "1")
        assert got.setdefault(mode, m) is m  # the same module (and its compiled kernels) every time
    assert got["0"] is not got["1"] and kcopy in got.values()
    assert kcopy.copy_regions_kernel is before


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16),
                                                      (torch.float64, torch.float16)],
                         ids=["bf16-bits", "f32-bf16", "f64-f16"])
def test_kernel_compiles_for_hopper_with_16_byte_accesses(monkeypatch, src_dtype, dst_dtype):
    """The interpreter accepts code the compiler rejects (e.g. branches yielding different types): compile
    the real kernel for sm_90 (no GPU needed) and check that the aligned path uses 16-byte accesses."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = kernel_module(kcopy, "copy_regions_kernel")  # the compiled kernel, whatever mode imported it
    compiled = _compile_for_hopper(module, plan_dtypes(src_dtype, dst_dtype))
    ops_used = set(re.findall(r"(?:ld|st)\.global(?:\.\w+)*", compiled.asm["ptx"]))
    assert "ld.global.v4.b32" in ops_used or "ld.global.v2.b64" in ops_used, ops_used
    assert "st.global.v4.b32" in ops_used, ops_used


# ---------------------------------------------------------------------------------------------------------
# GPU only: the compiled kernel on CUDA, larger sizes, real autotuning

GPU = "cuda"


def _sync() -> None:
    if torch.device(GPU).type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(torch.float32, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16),
                                                      (torch.float32, torch.bfloat16),
                                                      (torch.float32, torch.float16),
                                                      (torch.float8_e4m3fn, torch.float8_e4m3fn)],
                         ids=["f32", "bf16", "f32-bf16", "f32-f16", "fp8"])
def test_gpu_large_copies_match_torch(monkeypatch, src_dtype, dst_dtype):
    monkeypatch.setenv(triton_copy.AUTOTUNE_ENV, "0")  # correctness here; autotuning has its own test
    gen = torch.Generator().manual_seed(7)
    pool = random_tensor((1 << 24,), src_dtype, gen=gen).to(GPU)
    srcs = [pool[:4096 * 1024].view(4096, 1024), pool[1 << 23:].view(2048, 4096)[:, 1024:3072],
            pool[100:100 + 33 * 63].view(33, 63).t(), pool[7:7 + 4_000_001]]
    carves = [lambda b: b[:4096 * 2048].view(4096, 2048)[:, 1024:], lambda b: b[1 << 23:(1 << 23) + (1 << 22)].view(2048, 2048),
              lambda b: b[:4096 * 2048].view(4096, 2048)[10:73, 5:38],  # columns the first view leaves alone
              lambda b: b[(1 << 24) - 4_000_001 - 9:-9]]
    check_against_torch(srcs, carves, (1 << 24,), dst_dtype, device=GPU, key=("gpu", src_dtype, dst_dtype))
    # again through the cached tables
    check_against_torch(srcs, carves, (1 << 24,), dst_dtype, device=GPU, key=("gpu", src_dtype, dst_dtype))


@pytest.mark.gpu
def test_gpu_casts_are_exact(monkeypatch):
    monkeypatch.setenv(triton_copy.AUTOTUNE_ENV, "0")  # one compile per dtype pair, no benchmarking
    gen = torch.Generator().manual_seed(8)
    for src_dtype, dst_dtype in CAST_PAIRS:
        src = _cast_source(src_dtype, 1 << 20, gen).to(GPU).view(1024, 1024)[:, 3:1000]
        out = poisoned((1024, 997), dst_dtype, GPU)
        triton_copy_views([(src, out)])
        assert_same_values(out, src.to(dst_dtype))


@pytest.mark.gpu
def test_gpu_autotune_benchmarks_several_configs(monkeypatch):
    monkeypatch.setenv(triton_copy.AUTOTUNE_ENV, "1")
    kernel = triton_copy.get_kernel()
    assert len(kernel.configs) > 1
    src = torch.randn(1 << 24, device=GPU)
    out = torch.empty(1 << 24, device=GPU)
    triton_copy_views([(src, out)])
    _sync()
    assert torch.equal(out, src)
    assert len(kernel.cache) >= 1 and len(getattr(kernel, "configs_timings", {})) > 1


@pytest.mark.gpu
def test_gpu_bucket_past_2_31_elements(monkeypatch):
    monkeypatch.setenv(triton_copy.AUTOTUNE_ENV, "0")
    n = (1 << 31) + 4096
    if torch.cuda.get_device_properties(0).total_memory < 3 * n:
        pytest.skip("needs ~7 GB of GPU memory")
    bucket = torch.zeros(n, dtype=torch.uint8, device=GPU)
    src = torch.randint(0, 255, (3000,), dtype=torch.uint8, device=GPU)
    back = torch.zeros(3000, dtype=torch.uint8, device=GPU)
    triton_copy_views([(src, bucket[-3001:-1])])
    triton_copy_views([(bucket[-3001:-1], back)])
    _sync()
    assert torch.equal(back, src) and int(bucket[-1]) == 0 and int(bucket[-3002]) == 0
    whole = torch.empty(n, dtype=torch.uint8, device=GPU)
    triton_copy_views([(bucket, whole)])
    assert torch.equal(whole[-3001:-1], src)
