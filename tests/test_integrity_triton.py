"""Issue 46 on the GPU path: the Triton copy kernel hashes the message bytes it moves (a per-program partial
per (tile, region), added up per message by the launcher), and the result EQUALS the CPU digest of the same
message (``execute.integrity.partial``: numpy or the native one-pass hash), so a CPU sender and a GPU
receiver agree. Without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``); the ``gpu``
test runs it compiled; a subprocess compiles the digesting kernel for sm_90 and sm_100 without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.ops import copy as triton_copy

MASK = (1 << 64) - 1


pytestmark = pytest.mark.usefixtures("triton_mode")  # tests/conftest.py


def _coef(key: bytes = b"t" * 32) -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": key})()))


def _random(shape, dtype, g, device="cpu") -> torch.Tensor:
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
    else:
        x = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return x.to(device)


def _message(dtypes, g, device="cpu", cast=False):
    """A message of pieces (one per dtype), each a strided source view (a column block, a transposed slice,
    a 3-d slice with a storage offset, a plain run), laid out at element-aligned, not word-aligned offsets
    with gaps between them and bytes no piece takes at both ends; an odd total length (a tail). Returns the
    message buffer and the (source view, message view) pairs."""
    pieces = []
    for k, dt in enumerate(dtypes):
        src_dt = torch.float32 if cast and dt in (torch.bfloat16, torch.float16) else dt
        base = _random((37 + k, 70), src_dt, g, device)
        view = [base[:, 9:40], base.t()[5:30, 3:20], base.view(-1)[11:11 + 3 * 5 * 7].view(3, 5, 7)[:, 1:4, ::2],
                base[3:4, :61]][k % 4]
        pieces.append((view, dt))
    at, spans = 13, []
    for view, dt in pieces:
        es = torch.empty(0, dtype=dt).element_size()
        at = -(-at // es) * es
        spans.append(at)
        at += view.numel() * es + 5
    n = at + 3  # 3 more bytes no piece takes: with at odd, a tail of n % 8 bytes
    msg = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)
    pairs = []
    for (view, dt), off in zip(pieces, spans, strict=True):
        es = torch.empty(0, dtype=dt).element_size()
        pairs.append((view, msg[off:off + view.numel() * es].view(dt).view(view.shape)))
    return msg, pairs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer view (bit-exact comparisons, fp8 and NaN included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _whole(msg: torch.Tensor, got, coef: ig.Coefficients) -> int:
    """The kernel's per-message sum plus the gaps' (bytes no kernel hashed), as the ledger adds them."""
    sums, gaps = got
    led = ig.Ledger(b"k", coef, 0, "p", None, ())
    return int(led._gaps_torch(sums[0], gaps[0], msg, msg.numel())) & MASK


DTYPE_SETS = {
    "bf16-fp32-int8-fp16": (torch.bfloat16, torch.float32, torch.int8, torch.float16),
    "fp8-fp32": (torch.float8_e4m3fn, torch.float32, torch.float8_e5m2),
    "fp64-uint8-bf16": (torch.float64, torch.uint8, torch.bfloat16, torch.float32, torch.int8),
}


@pytest.mark.parametrize("dtypes", list(DTYPE_SETS.values()), ids=list(DTYPE_SETS))
def test_the_triton_pack_digest_is_the_cpu_digest_of_the_message(dtypes):
    g = torch.Generator().manual_seed(len(dtypes))
    msg, pairs = _message(dtypes, g)
    c = _coef()
    got = triton_copy.triton_copy_digest(pairs, [(msg, msg.numel())], 1, c.get(ig._entries(msg.numel()), msg.device))
    for s, m in pairs:  # packed as torch packs
        assert torch.equal(_bits(m), _bits(s))
    assert _whole(msg, got, c) == ig.partial(msg, c) == ig._partial_np(msg.numpy(), c)


@pytest.mark.parametrize("dtypes", list(DTYPE_SETS.values()), ids=list(DTYPE_SETS))
def test_the_triton_unpack_digest_is_the_cpu_digest_and_sees_a_flipped_bit(dtypes):
    g = torch.Generator().manual_seed(10 + len(dtypes))
    msg, packs = _message(dtypes, g)
    for s, m in packs:
        m.copy_(s)
    pairs = [(m, s) for s, m in packs]  # the message views are now the sources
    want = [m.clone() for m, _d in pairs]
    for _m, d in pairs:  # poisoned destinations
        _bits(d).fill_(-1)
    c = _coef()
    coef = c.get(ig._entries(msg.numel()), msg.device)
    got = triton_copy.triton_copy_digest(pairs, [(msg, msg.numel())], 0, coef, key=("t", 0))
    for (_m, d), w in zip(pairs, want, strict=True):
        assert torch.equal(_bits(d), _bits(w))
    h = ig.partial(msg, c)
    assert _whole(msg, got, c) == h
    s0 = pairs[0][0]  # a flipped bit in a byte the kernel hashes (the cached table, launched again)
    byte = s0.data_ptr() - msg.data_ptr() + 1
    msg[byte] ^= 0x10
    again = triton_copy.triton_copy_digest(pairs, [(msg, msg.numel())], 0, coef, key=("t", 0))
    assert _whole(msg, again, c) == ig.partial(msg, c) != h


def test_a_cast_on_the_pack_hashes_the_written_bytes():
    """fp32 sources cast into a bf16/fp16 message by the kernel: the digest is over the bytes written."""
    g = torch.Generator().manual_seed(3)
    msg, pairs = _message((torch.bfloat16, torch.float16, torch.float32), g, cast=True)
    assert pairs[0][0].dtype == torch.float32 and pairs[0][1].dtype == torch.bfloat16
    c = _coef()
    got = triton_copy.triton_copy_digest(pairs, [(msg, msg.numel())], 1, c.get(ig._entries(msg.numel()), msg.device))
    assert _whole(msg, got, c) == ig.partial(msg, c)


def test_pairs_the_kernel_leaves_to_torch_are_hashed_from_the_message():
    """An fp8 piece landed into float32 (a cast the kernel does not make: torch copies it) next to one the
    kernel copies: the torch-copied piece's bytes are a gap, hashed from the message; the total is the CPU
    digest, and the destinations hold what ``copy_`` writes."""
    g = torch.Generator().manual_seed(4)
    msg = torch.randint(0, 256, (3001,), dtype=torch.uint8, generator=g)
    fp8 = msg[8:8 + 600].view(torch.float8_e4m3fn).view(20, 30)
    f32 = msg[1000:1000 + 1600].view(torch.float32).view(20, 20)
    fp8.copy_(torch.randn(20, 30, generator=g).to(torch.float8_e4m3fn))
    d8, d32 = torch.full((20, 30), float("nan")), torch.full((20, 20), float("nan")).t()
    c = _coef()
    got = triton_copy.triton_copy_digest([(fp8, d8), (f32, d32)], [(msg, 3001)], 0, c.get(ig._entries(3001), msg.device))
    assert any(a <= 8 and z >= 608 for a, z in got[1][0])  # the torch-copied piece is in a gap
    assert _whole(msg, got, c) == ig.partial(msg, c)
    assert torch.equal(_bits(d8), _bits(fp8.to(torch.float32))) and torch.equal(_bits(d32), _bits(f32))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1023, 1025, 8 * ig.ROW_WORDS * 3 + 5, 70_001])
def test_several_messages_and_tiles_each_equal_their_cpu_digest(n, monkeypatch):
    """Three messages of odd sizes, one piece each cut in several tiles and several pieces sharing tiles."""
    monkeypatch.setattr(triton_copy, "INTERPRET_TILE", 4096)
    monkeypatch.setattr(triton_copy, "INTERPRET_MAX_REGIONS", 3)
    g = torch.Generator().manual_seed(n)
    bufs, pairs = [], []
    for k in range(3):
        m = n + 2 * k
        msg = torch.full((m,), 0xAB, dtype=torch.uint8)
        src = torch.randint(0, 256, (m + 9,), dtype=torch.uint8, generator=g)
        cut = sorted({0, m // 5, m // 5 + 1, m // 2, m})
        for a, z in zip(cut, cut[1:], strict=False):
            if z > a:
                pairs.append((src[a + 9:z + 9], msg[a:z]))
        bufs.append((msg, m))
    c = _coef()
    entries = max(ig._entries(m) for _b, m in bufs)
    got = triton_copy.triton_copy_digest(pairs, bufs, 1, c.get(entries, torch.device("cpu")))
    sums, gaps = got
    assert all(g_ == [] for g_ in gaps)
    for k, (msg, _m) in enumerate(bufs):
        assert int(sums[k]) & MASK == ig.partial(msg, c), k


@pytest.mark.parametrize("n", [0, 1, 5, 9, 17, 1023, 1031, 3077, 9001])
@pytest.mark.parametrize("start", [0, 1])
def test_the_gap_hash_of_any_split_adds_up_to_the_message_hash(n, start):
    """The bytes no kernel hashed are hashed by ranges (``ops.digest.span_torch``: whole words, then bytes):
    any three ranges that make up the message add up to its CPU digest, at any alignment of the buffer."""
    import random

    from triton_reshard.ops.digest import span_torch

    buf = torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    buf = buf[start:start + n]
    c = _coef()
    coef, whole, rnd = c.get(ig._entries(n) + 1, buf.device), ig.partial(buf, c), random.Random(n)
    for _ in range(20):
        a = rnd.randint(0, n)
        z = rnd.randint(a, n)
        parts = [span_torch(buf, x, y, n, coef) for x, y in ((0, a), (a, z), (z, n))]
        assert sum(int(p) for p in parts) & MASK == whole, (a, z)
        assert int(parts[1]) & MASK == _bytewise(buf, a, z, n, coef), (a, z)


def _bytewise(buf: torch.Tensor, a: int, z: int, n: int, coef: torch.Tensor) -> int:
    """The hash of bytes ``[a, z)`` of an ``n``-byte message, byte by byte in Python ints, as ``csrc/digest.c``
    states it: a byte of a whole word adds ``b << 8 (p % 8)`` times its 1 KiB row's coefficient, a tail byte
    (past the last whole word) its own coefficient, after the rows'."""
    lim, rows, c = n // 8 * 8, -(-(n // 8) // ig.ROW_WORDS), coef.tolist()
    total = 0
    for p in range(a, z):
        b = int(buf[p])
        total += c[p >> 10] * (b << 8 * (p & 7)) if p < lim else c[rows + p - lim] * b
    return total & MASK


def test_overlapping_message_bytes_are_refused_before_any_copy():
    msg = torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    pairs = [(msg[0:32], dst[0:32]), (msg[16:48], dst[32:64])]  # one message byte range unpacked twice
    assert triton_copy.triton_copy_digest(pairs, [(msg, 64)], 0, _coef().get(16, msg.device)) is None
    assert torch.equal(dst, torch.zeros(64, dtype=torch.uint8)) and src.numel() == 64


def test_the_ledger_takes_the_triton_path_for_the_triton_backend():
    """``Ledger.pack`` with backend triton copies through the digesting kernel; its value at ``on_post`` is
    the CPU digest of each send buffer."""
    g = torch.Generator().manual_seed(5)
    msg, pairs = _message((torch.bfloat16, torch.float32), g)
    c = _coef()
    work = type("W", (), {"steps": [(0, None)]})()
    led = ig.Ledger(b"k", c, 0, "p", work, ())
    assert led.pack(0, pairs, [(1, msg)], ("k", "pack", 0), "triton")
    led.on_post(0, [(1, msg)], [])
    led._values()
    assert led.sent[1][0][2] == ig.partial(msg, c)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_reshard.kernels import copy as kc

for cap in (90, 100):
    for view, e in (("*i16", 2), ("*u8", 1), ("*i32", 4)):
        for msg_dst in (True, False):
            sig = {"src_ptr": view, "dst_ptr": view, "regions_ptr": "*i64", "tiles_ptr": "*i64",
                   "coef_ptr": "*i64", "sums_ptr": "*i64", "num_tiles": "i64", "slots": "i64",
                   "tile_elems": "i64", "shape_class": "i64"}
            cx = {"SRC_VEC": 16 // e, "DST_VEC": 16 // e, "VEC": 16 // e, "SRC_BF16": False, "VIA_F32": False,
                  "DST_BF16": False, "BF16_NAN": 0x7FFF, "BLOCK": 2048, "TILES_PER_PROG": 1, "DIGEST": True,
                  "MSG_DST": msg_dst, "MSG_BYTES": e}
            sig.update(dict.fromkeys(cx, "constexpr"))
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # as the launcher's tables are
            ptx = triton.compile(ASTSource(fn=kc.copy_regions_kernel, signature=sig, constexprs=cx, attrs=aligned),
                                 target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
            assert "st.global.v4.b32" in ptx and "mul.lo.s64" in ptx, (cap, e)  # still 16-byte stores
print("compiled")
"""


def test_the_digesting_copy_kernel_compiles_for_hopper_and_blackwell(tmp_path):
    """The interpreter accepts code the compiler rejects: compile the copy kernel with the digest on (pack and
    unpack sides, 1/2/4-byte elements) for sm_90 and sm_100, in a fresh process with an empty Triton cache."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", list(DTYPE_SETS.values()), ids=list(DTYPE_SETS))
def test_on_the_device_the_kernel_digest_is_the_cpu_digest(dtypes):
    """Compiled on a CUDA device: pack and unpack sums equal the CPU digest of the same message bytes."""
    g = torch.Generator().manual_seed(20 + len(dtypes))
    msg, pairs = _message(dtypes, g, device="cuda")
    c = _coef()
    coef = c.get(ig._entries(msg.numel()), msg.device)
    got = triton_copy.triton_copy_digest(pairs, [(msg, msg.numel())], 1, coef)
    cpu = msg.cpu()
    assert _whole(msg, got, c) == ig.partial(cpu, c)
    back = [(m, torch.empty_like(s)) for s, m in pairs]
    got = triton_copy.triton_copy_digest(back, [(msg, msg.numel())], 0, coef)
    assert _whole(msg, got, c) == ig.partial(cpu, c)
    for (s, _m), (_m2, d) in zip(pairs, back, strict=True):
        assert torch.equal(_bits(s), _bits(d))
