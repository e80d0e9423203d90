"""Issue 46 item 2 for the delta codec: the Triton version-2 encode kernel hashes every byte it writes into the
zeroed message (values of dense chunks, block descriptors, positions, narrow values, the OR-ed 2- and 4-bit ones
by their bits), a partial per program; the launcher adds the hash of the headers it writes. The sum EQUALS the
CPU digest of the message (``execute.integrity.partial``) for the CPU codec's exact bytes, so a GPU sender's
digest is what a CPU or GPU receiver computes over the message as it arrived. Interpreted on CPU
(``TRITON_INTERPRET=1``); the ``gpu`` test runs the kernel compiled; a subprocess compiles it with the digest on
for sm_90 and sm_100 without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.ops import delta_triton as T
from triton_reshard.ops import delta_v2 as V

from .test_delta_v2 import adversarial, bits, ulp_steps

MASK = (1 << 64) - 1
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32)

pytestmark = pytest.mark.usefixtures("triton_mode")  # tests/conftest.py


def _coef() -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": b"d" * 32})()))


def _digest_pack(pairs, ce: int, c: ig.Coefficients, cache=None):
    """Pack with the digesting encode pass (snapshots updated), and check the bytes against the CPU codec's."""
    ref = V.pack_v2_numpy([(s, p.clone()) for s, p in pairs], ce, False)  # patched blocks too (as the Triton pack)
    dev = pairs[0][0].device
    msg, h = T.triton_pack_digest(pairs, lambda n: c.get(-(-n // (8 * ig.ROW_WORDS)), dev), ce, True, cache=cache)
    assert torch.equal(msg.cpu(), ref), "the digesting pack writes the CPU codec's bytes"
    for s, p in pairs:
        assert torch.equal(bits(s), bits(p)), "the snapshot update"
    return msg, int(h) & MASK


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_delta_encode_digest_is_the_cpu_digest_of_the_message(dtype):
    """Adversarial differences (all changed, sign flips, +-0, NaN payloads, a 16-bit difference in a block of
    small ones, nothing changed) of every element size: the kernels' digest is the message's CPU digest."""
    g = torch.Generator().manual_seed(3)
    c = _coef()
    if dtype == torch.int32:
        old = torch.randint(-(1 << 30), 1 << 30, (1200,), generator=g, dtype=torch.int32)
        cases = [("small", old, old + torch.randint(-3, 4, (1200,), generator=g, dtype=torch.int32)),
                 ("none", old, old.clone())]
    else:
        cases = list(adversarial(dtype, 1200, g))
    for ce in (4096, 1000):
        for name, old, new in cases:
            msg, h = _digest_pack([(new, old.clone())], ce, c)
            assert h == ig.partial(msg, c), (dtype, name, ce)


def test_every_width_mode_and_kind_hashes_to_the_cpu_digest():
    """2-, 4-, 8-, 16-bit and raw values; offsets, bitmask and all positions; narrow, dense and unchanged
    chunks; views of mixed element sizes (a launch each), an empty one, transposed and strided ones, chunks
    shorter than a block; a bit flipped anywhere in a written byte moves the message's hash off the kernels'."""
    g = torch.Generator().manual_seed(5)
    old = torch.randn(6 * 256, generator=g)
    new = old.clone()
    b = bits(new)
    b[0:3] += 1
    b[256 : 256 + 128 : 2] -= 2
    b[512:768] += 5
    b[768] += 1
    b[769] += 1 << 14
    b[1024:1030] += 100
    b[1280] ^= -(1 << 31)
    a = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    q = torch.randint(-128, 128, (77,), generator=g, dtype=torch.int8)
    e = torch.zeros(0, dtype=torch.float16)
    c = _coef()
    for ce in (1 << 15, 300, 7):
        pairs = [(new, old.clone()), (-old[:300], old[:300].clone()), (old[:50], old[:50].clone()),
                 (ulp_steps(a, 0.05, g).t(), a.t().clone()), (e, e), (q ^ 1, q.clone())]
        msg, h = _digest_pack(pairs, ce, c)
        assert h == ig.partial(msg, c), ce
        for at in (msg.numel() // 3, msg.numel() - 17):  # a flipped bit on the wire: the receiver's hash moves
            wrong = msg.clone()
            wrong[at] ^= 0x08
            assert ig.partial(wrong, c) != h, (ce, at)


def test_a_cached_plan_hashes_each_message_it_makes():
    """A refit's send keeps its plan (``cache``): each version's message is hashed by its own encode pass."""
    g = torch.Generator().manual_seed(7)
    src = torch.randn(40, 70, generator=g)
    snap = src.clone()
    cache: dict = {}
    c = _coef()
    for v in range(3):
        src.view(-1)[v::5] += 1.0 + v
        msg, h = _digest_pack([(src[:, 3:60], snap[:, 3:60])], 1000, c, cache=cache)
        assert "triton2" in cache and h == ig.partial(msg, c), v


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_reshard.kernels import delta as kd

INT = {1: "*i8", 2: "*i16", 4: "*i32", 8: "*i64"}
for cap in (90, 100):
    for e in (1, 2, 4, 8):
        sig = {"src_ptr": INT[e], "snap_ptr": INT[e], "val_ptr": INT[e], "msg_ptr": "*u8", "m32_ptr": "*i32",
               "table_ptr": "*i64", "blocks_ptr": "*i64", "num_blocks": "i64", "coef_ptr": "*i64",
               "sums_ptr": "*i64"}
        cx = {"ESIZE": e, "STATS": False, "UPDATE": True, "BPT": 4, "DIGEST": True}
        sig.update(dict.fromkeys(cx, "constexpr"))
        ptx = triton.compile(ASTSource(fn=kd.delta2_pack_kernel, signature=sig, constexprs=cx),
                             target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
        assert "mul.lo.s64" in ptx and ("atom.global" in ptx or "red.global" in ptx), (cap, e)
print("compiled")
"""


def test_the_digesting_delta_encode_compiles_for_hopper_and_blackwell(tmp_path):
    """The interpreter accepts code the compiler rejects: compile the encode pass with the digest on for every
    element size, sm_90 and sm_100, in a fresh process with an empty Triton cache."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES[:5], ids=str)
def test_on_the_device_the_delta_encode_digest_is_the_cpu_digest(dtype):
    g = torch.Generator().manual_seed(11)
    c = _coef()
    for name, old, new in adversarial(dtype, 5000, g):
        msg, h = _digest_pack([(new.cuda(), old.cuda())], 4096, c)
        assert h == ig.partial(msg.cpu(), c), (dtype, name)
