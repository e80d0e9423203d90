"""The Triton delta kernels' format version 2 (issue 44 item 6: narrow differences in blocks of 256,
``ops/delta_v2.py``), run under ``TRITON_INTERPRET=1`` on CPU (small shapes: the interpreter runs programs one
after another). Every case: ``triton_pack(..., version=2)`` writes the bytes of the CPU codec (numpy
reference, and the native one where it is built), so a GPU sender and a CPU receiver interoperate; its
snapshot update equals the source; ``triton_unpack`` of that message into destinations holding the snapshot,
inside poisoned buffers, gives the source's bits and leaves the poison. Adversarial differences (all
changed, sign flips, +-0, NaN payloads, subnormals, a block whose one difference needs 16 bits) for bf16,
fp16, fp32, fp64 and int8. Bad bodies are refused with the CPU codec's error before any byte is written.
And the kernels compile for sm_90 and sm_100 (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_native as N
from triton_reshard.ops import delta_triton as T
from triton_reshard.ops import delta_v2 as V

from .test_delta_patch import moved, patched_block, patched_cases
from .test_delta_v2 import adversarial, bits, ulp_steps

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8)


@pytest.fixture(autouse=True)
def _triton_mode(request, monkeypatch):
    """Interpreter for CPU tests, compiled kernels for ``gpu`` tests (skipped without a CUDA device)."""
    if request.node.get_closest_marker("gpu"):
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def cpu_pack(pairs, ce: int, patch: bool = True) -> list[torch.Tensor]:
    """The CPU codec's v2 messages of ``pairs`` (no update): numpy's, and the native codec's where built;
    ``patch`` as theirs (patched blocks, ``ops/delta_patch.py``: the Triton pack writes them too)."""
    snaps = [(s, p.clone()) for s, p in pairs]
    out = [V.pack_v2_numpy(snaps, ce, False, patch)]
    if N.native() is not None and all(s.is_contiguous() for s, _ in pairs):
        out.append(N.V2PackPlan(snaps, ce).pack(False, patch))
    return out


def poisoned(olds) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Destinations holding ``olds`` inside buffers of poison (32 elements on each side)."""
    bufs, dsts = [], []
    for old in olds:
        buf = torch.empty(old.numel() + 64, dtype=old.dtype)
        bits(buf).fill_(-1 if old.element_size() > 1 else 0x5A)
        d = buf[32 : 32 + old.numel()].view(old.shape)
        d.copy_(old)
        bufs.append(buf)
        dsts.append(d)
    return bufs, dsts


def check_landed(news, bufs, dsts, what: str) -> None:
    for new, buf, d in zip(news, bufs, dsts, strict=True):
        assert torch.equal(bits(d), bits(new)), f"{what}: the unpacked values"
        poison = -1 if new.element_size() > 1 else 0x5A
        n = new.numel()
        assert bool((bits(buf[:32]) == poison).all()) and bool((bits(buf[32 + n :]) == poison).all()), what


def roundtrip(pairs, ce: int, what: str) -> torch.Tensor:
    """Triton pack (update) == the CPU codec's bytes; Triton unpack and CPU unpack of it both land exactly."""
    refs = cpu_pack(pairs, ce)
    snaps = [old.clone() for _new, old in pairs]
    msg = T.triton_pack([(new, s) for (new, _o), s in zip(pairs, snaps, strict=True)], ce, True, version=2)
    for ref in refs:
        assert torch.equal(msg, ref), f"{what}: the Triton bytes differ from the CPU codec's"
    for (new, _old), s in zip(pairs, snaps, strict=True):
        assert torch.equal(bits(s), bits(new)), f"{what}: the snapshot update"
    news = [new for new, _ in pairs]
    bufs, dsts = poisoned([old for _, old in pairs])
    T.triton_unpack(msg, dsts)
    check_landed(news, bufs, dsts, what + " (Triton unpack)")
    bufs, dsts = poisoned([old for _, old in pairs])
    D.unpack_delta(msg, dsts, backend="torch")  # a CPU receiver of the GPU sender's message
    check_landed(news, bufs, dsts, what + " (CPU unpack)")
    return msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ce", [4096, 1000], ids=["ce4096", "ce1000"])
def test_adversarial_same_bytes_as_the_cpu_codec(dtype, ce):
    g = torch.Generator().manual_seed(1)
    for name, old, new in adversarial(dtype, 1200, g):
        msg = roundtrip([(new, old)], ce, f"{dtype} {name}")
        assert int(msg[4:8].view(torch.int32)[0]) == 2
        assert msg.numel() <= D.max_message_bytes([new.numel()], [new.element_size()], ce)


def test_every_width_and_mode_is_written():
    """The cases above reach every width and mode: 2, 4, 8, 16 bits and raw; offsets, bitmask and all; and
    chunks of every kind (narrow, dense, unchanged)."""
    g = torch.Generator().manual_seed(5)
    old = torch.randn(6 * 256, generator=g)
    new = old.clone()
    b = bits(new)
    b[0:3] += 1  # 2 bits, offsets
    b[256 : 256 + 128 : 2] -= 2  # 2 bits, bitmask
    b[512:768] += 5  # 4 bits, all
    b[768] += 1
    b[769] += 1 << 14  # 16 bits
    b[1024:1030] += 100  # 8 bits
    b[1280] ^= -(1 << 31)  # a sign flip: raw
    msg = roundtrip([(new, old), (-old[:300], old[:300]), (old[:50], old[:50].clone())], 1 << 15, "widths")
    assert V.block_histogram([msg.numpy()]) == {"2": 2, "4": 1, "8": 1, "16": 1, "raw": 1, "dense": 1}
    kinds = [c["kind"] for c in D.describe(msg)]
    assert kinds == ["narrow", "dense", "offsets"]
    desc = msg[D.describe(msg)[0]["offset"] + 16 :][:12].numpy()
    assert [int(x) >> 4 for x in desc[0::2]] == [0, 1, 2, 0, 0, 0]  # offsets, bitmask, all, offsets x3


def test_many_chunks_mixed_sizes_strided_and_empty():
    """Views of mixed element sizes (one launch per size), an empty one, transposed sources, snapshots and
    destinations, chunks shorter than a block (``chunk_elems`` 7 and 300)."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(900, generator=g)
    e = torch.zeros(0, dtype=torch.float16)
    c = torch.randn(333, generator=g).to(torch.float16)
    q = torch.randint(-128, 128, (77,), generator=g, dtype=torch.int8)
    pairs = [
        (ulp_steps(a, 0.05, g).t(), a.t()),
        (ulp_steps(b, 0.3, g, 9), b),
        (e, e),
        (ulp_steps(c, 1.0, g), c),
        (q ^ 1, q),
    ]
    for ce in (7, 300):
        strided = roundtrip(pairs, ce, f"strided ce={ce}")
        flat = roundtrip([(x.contiguous(), y.contiguous()) for x, y in pairs], ce, f"contiguous ce={ce}")
        assert torch.equal(strided, flat)


def test_pack_delta_dispatches_the_version():
    """``pack_delta`` with the Triton backend writes what its ``version`` says (the executor's default: 2), and
    ``unpack_delta`` with it reads both."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(2000, generator=g).to(torch.bfloat16)
    new = ulp_steps(old, 0.1, g)
    for version in (2, 1):  # as the executor calls it: update, a per-message cache dict
        msg = D.pack_delta([(new, old.clone())], 1024, backend="triton", version=version, cache={})
        assert int(msg[4:8].view(torch.int32)[0]) == version
        ref = D.pack_delta([(new, old.clone())], 1024, backend="torch", version=version)
        assert torch.equal(msg, ref)
        dst = old.clone()
        D.unpack_delta(msg, [dst], backend="triton", cache={})
        assert torch.equal(bits(dst), bits(new))
    with pytest.raises(ValueError, match="version 3"):
        T.triton_pack([(new, old.clone())], 1024, version=3)


def _narrow_message():
    g = torch.Generator().manual_seed(4)
    old = torch.randn(1024, generator=g)
    new = old.clone()
    bits(new)[0:3] += 1  # block 0: offsets
    bits(new)[256:384:2] += 1  # block 1: bitmask
    msg = T.triton_pack([(new, old.clone())], 1024, False, version=2)
    (c,) = D.describe(msg)
    assert c["kind"] == "narrow"
    return old, msg, c["offset"] + 16  # the descriptors' start


@pytest.mark.parametrize("how", ["code", "order", "past", "popcount", "count"])
def test_bad_bodies_refused_before_any_write(how):
    """A narrow body that disagrees with its header or descriptors: the Triton unpack raises the CPU codec's
    error, and the destination keeps every bit (the checks run before the first write)."""
    old, msg, at = _narrow_message()
    bad = msg.clone()
    nbk = 4
    pay = at + 2 * nbk  # block 0's payload: 3 offsets, then values
    if how == "code":
        bad[at] = 4 | (0 << 4)  # fp32 block claiming 16-bit values but sized for 2
    elif how == "order":
        bad[pay], bad[pay + 1] = bad[pay + 1].clone(), bad[pay].clone()  # offsets not ascending
    elif how == "past":
        bad[at + 2 * 3] = 1  # block 3 (256 elements, unchanged) claims a change: sizes and count disagree
        bad[at + 2 * 3 + 1] = 0
    elif how == "popcount":
        pay1 = pay + 3 + 1  # block 1's bitmask: after block 0's 3 offsets and 1 byte of values
        bad[pay1] ^= 0x02  # one more bit set than its count
    else:
        bad[at + 1] = 1  # block 0 claims 2 changes: the chunk's count disagrees
    errors = refused_by_both(bad, old)
    assert errors[0] == errors[1]
    assert "chunk 0 (destination #0, elements 0..1023): narrow body inconsistent with its header" in errors[1]


def refused_by_both(bad: torch.Tensor, old: torch.Tensor) -> list[str]:
    """The torch and the Triton unpack of ``bad`` onto a copy of ``old``: each raises ValueError having written
    nothing; their messages."""
    errors = []
    for backend in ("torch", "triton"):
        dst = old.clone()
        with pytest.raises(ValueError) as err:
            D.unpack_delta(bad, [dst], backend=backend)
        assert torch.equal(bits(dst), bits(old)), f"{backend}: written before the check"
        errors.append(str(err.value))
    return errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_reads_patched_blocks(dtype):
    """A CPU sender's message with patched blocks (``ops/delta_patch.py``: base width + exceptions): the Triton
    unpack lands it exactly into poisoned destinations, every positions mode (``test_delta_triton_patch.py``:
    the Triton pack writes the same bytes)."""
    g = torch.Generator().manual_seed(21)
    seen = set()
    for name, old, new in patched_cases(dtype, g):
        for msg in cpu_pack([(new, old)], 1000, patch=True):
            seen |= {k for k in V.block_histogram([msg.numpy()]) if k.endswith("p")}
            bufs, dsts = poisoned([old])
            T.triton_unpack(msg, dsts)
            check_landed([new], bufs, dsts, f"{dtype} {name} (Triton unpack of a patched message)")
    assert seen, "no patched block written"


@pytest.mark.parametrize("how", ["order", "past"])
def test_bad_exceptions_refused_before_any_write(how):
    """Exception slots out of order or past the block's values: the Triton unpack raises the CPU codec's error
    with nothing written."""
    g = torch.Generator().manual_seed(14)
    old = torch.randn(1024, generator=g).to(torch.bfloat16)
    new = moved(old, 0.03, g, 2, lambda x: x + 100)
    msg = V.pack_v2_numpy([(new, old.clone())], 1024, False)
    desc, xs, nexc = patched_block(msg)
    bad = msg.clone()
    if how == "order":
        bad[xs], bad[xs + 1] = msg[xs + 1], msg[xs]
    else:
        bad[xs + 1] = int(msg[desc + 1]) + 1  # the block's count: past its values
    errors = refused_by_both(bad, old)
    assert errors[0] == errors[1] and "narrow body inconsistent with its header" in errors[1]


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_reshard.kernels import delta as kd

INT = {1: "*i8", 2: "*i16", 4: "*i32", 8: "*i64"}
for cap in (90, 100):
    for e in (2, 4):
        for stats in (True, False):
            sig = {"src_ptr": INT[e], "snap_ptr": INT[e], "val_ptr": INT[e], "msg_ptr": "*u8", "m32_ptr": "*i32",
                   "table_ptr": "*i64", "blocks_ptr": "*i64", "num_blocks": "i64"}
            cx = {"ESIZE": e, "STATS": stats, "UPDATE": True, "BPT": 4, "coef_ptr": None, "sums_ptr": None,
                  "DIGEST": False}  # the digest off (its arguments unused)
            sig.update(dict.fromkeys(cx, "constexpr"))
            ptx = triton.compile(ASTSource(fn=kd.delta2_pack_kernel, signature=sig, constexprs=cx),
                                 target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
            assert "st.global" in ptx, (cap, e, stats)
            assert stats or "atom.global" in ptx or "red.global" in ptx, (cap, e)
        for check in (True, False):
            sig = {"dst_ptr": INT[e], "msg_ptr": "*u8", "table_ptr": "*i64", "blocks_ptr": "*i64",
                   "bad_ptr": "*i32", "num_blocks": "i64"}
            cx = {"ESIZE": e, "CHECK": check, "BPT": 4}
            sig.update(dict.fromkeys(cx, "constexpr"))
            ptx = triton.compile(ASTSource(fn=kd.delta2_unpack_kernel, signature=sig, constexprs=cx),
                                 target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
            assert "st.global" in ptx, (cap, e, check)
print("compiled")
"""


def test_v2_kernels_compile_for_hopper_and_blackwell(tmp_path):
    """The interpreter accepts code the compiler rejects: compile the v2 pack (stats and encode passes) and
    unpack (check and apply passes) kernels for bf16 and fp32 for sm_90 and sm_100 (no GPU needed), in a fresh
    process (triton.language imported in compiled mode) with an empty Triton cache (a hit compiles nothing)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def test_offset_past_a_short_block_refused():
    """The last block of a chunk of 1000 elements has 232: an offset of 250 (ascending, in a byte) is past it;
    the check launch finds it before any write, with the CPU codec's error."""
    old = torch.randn(1000)
    new = old.clone()
    bits(new)[768:771] += 1  # block 3 only: 3 offsets
    msg = T.triton_pack([(new, old.clone())], 1000, False, version=2)
    (c,) = D.describe(msg)
    pay = c["offset"] + 16 + 2 * 4
    assert msg[pay : pay + 3].tolist() == [0, 1, 2]
    bad = msg.clone()
    bad[pay + 2] = 250
    errors = []
    for backend in ("torch", "triton"):
        dst = old.clone()
        with pytest.raises(ValueError, match="narrow body inconsistent") as err:
            D.unpack_delta(bad, [dst], backend=backend)
        assert torch.equal(bits(dst), bits(old))
        errors.append(str(err.value))
    assert errors[0] == errors[1]


def test_fp8_moves_as_bytes():
    """fp8 (e4m3, e5m2) moves as its bytes: one-ulp steps (2 and 4 bits), any byte (raw: NaNs, -0, sign flips)."""
    g = torch.Generator().manual_seed(6)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        old = torch.randint(0, 256, (1500,), generator=g, dtype=torch.uint8).view(dtype)
        steps = ulp_steps(old, 0.1, g)
        anyb = old.clone()
        anyb.view(torch.uint8)[::9] = torch.randint(0, 256, (167,), generator=g, dtype=torch.uint8)
        for name, new in (("steps", steps), ("any", anyb), ("all", ulp_steps(old, 1.0, g, 6))):
            roundtrip([(new, old)], 1000, f"{dtype} {name}")


def test_cached_plan_follows_the_data():
    """A refit's send packs the same views every time: the plan kept in its cache dict (built once) gives the
    CPU codec's bytes for every version of the data, and is rebuilt for other views or another chunk size."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(40, 30, generator=g).to(torch.bfloat16), torch.randn(700, generator=g)
    snaps = [a.clone(), b.clone()]
    srcs = [a.clone(), b.clone()]
    pairs = [(srcs[0].t(), snaps[0].t()), (srcs[1], snaps[1])]
    cache: dict = {}
    first = None
    for _step in range(3):
        for s in srcs:
            s.copy_(ulp_steps(s, 0.2, g, 3))
        refs = cpu_pack(pairs, 512)
        msg = D.pack_delta(pairs, 512, backend="triton", cache=cache)
        plan = cache["triton2"]
        assert first is None or plan is first, "the plan was rebuilt for the same views"
        first = plan
        assert torch.equal(msg, refs[0])
        assert all(torch.equal(bits(s), bits(p)) for s, p in zip(srcs, snaps, strict=True))
    D.pack_delta(pairs, 256, backend="triton", cache=cache)
    assert cache["triton2"] is not first and cache["triton2"].ce == 256


# ---------------------------------------------------------------------------------------------------------
# GPU only: the compiled kernels (perf/gpu_check.sh runs these with -m gpu)

GPU = "cuda"


def device_roundtrip(pairs, ce: int, device: str, what: str) -> None:
    """The Triton pack of ``pairs`` moved to ``device``: the CPU codec's bytes, the snapshot updated, and its
    message lands exactly through the Triton unpack (on the device) and the CPU unpack."""
    refs = cpu_pack(pairs, ce)
    dev = [(new.to(device, copy=True), old.to(device, copy=True)) for new, old in pairs]
    msg = T.triton_pack(dev, ce, True, version=2)
    assert torch.equal(msg.cpu(), refs[0]), f"{what}: the device's bytes differ from the CPU codec's"
    for (new, _o), (_n, snap) in zip(pairs, dev, strict=True):
        assert torch.equal(bits(snap.cpu()), bits(new)), f"{what}: the snapshot update"
    bufs, dsts = poisoned([old for _, old in pairs])
    dbufs = [b.to(device, copy=True) for b in bufs]
    T.triton_unpack(msg, [db[32 : 32 + d.numel()].view(d.shape) for db, d in zip(dbufs, dsts, strict=True)])
    check_landed(
        [n for n, _ in pairs],
        [b.cpu() for b in dbufs],
        [b.cpu()[32 : 32 + d.numel()].view(d.shape) for b, d in zip(dbufs, dsts, strict=True)],
        what,
    )
    bufs, dsts = poisoned([old for _, old in pairs])
    D.unpack_delta(msg.cpu(), dsts, backend="torch")
    check_landed([n for n, _ in pairs], bufs, dsts, what + " (CPU unpack)")


@pytest.mark.gpu
def test_gpu_v2_matches_the_cpu_codec():
    g = torch.Generator().manual_seed(8)
    for dtype in DTYPES:
        for name, old, new in adversarial(dtype, 70_000, g):
            device_roundtrip([(new, old)], 1 << 15, GPU, f"{dtype} {name}")
    big = torch.randn(2048, 3000, generator=g).to(torch.bfloat16)  # 6M elements, 1 % and 10 % steps, strided
    for frac in (0.01, 0.1):
        device_roundtrip(
            [(ulp_steps(big, frac, g).t(), big.t()), (ulp_steps(big[:, :999], frac, g), big[:, :999])],
            1 << 15,
            GPU,
            f"big {frac}",
        )
