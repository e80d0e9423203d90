"""Issue 46 item 2 for the quantizers: the Triton block-FP8 / MXFP8 / NVFP4 kernels hash the bytes they write into
a message (values and scales, a per-program partial added up per message: ``ops/quant_digest.py``), and the sum
plus the bytes they did not write (padding, torch-quantized items) EQUALS the CPU digest of the message
(``execute.integrity.partial``). Interpreted on CPU (``TRITON_INTERPRET=1``); the ``gpu`` test runs the kernels
compiled; a subprocess compiles them with the digest on for sm_90 and sm_100 without a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.ops import quant_digest as qd
from triton_reshard.ops import quantize as Q
from triton_reshard.ops.digest import span_torch

MASK = (1 << 64) - 1
FP8 = torch.float8_e4m3fn

pytestmark = pytest.mark.usefixtures("triton_mode")  # tests/conftest.py

# (format, block, ue8m0, source column counts: whole blocks for the 1 x B formats)
FORMATS = {
    "fp8-block": ("fp8-block", (16, 32), False, (70, 33, 64)),
    "fp8-block-ue8m0": ("fp8-block", (16, 32), True, (70, 33, 64)),
    "mxfp8": ("mxfp8", (1, 32), False, (64, 96, 32)),
    "nvfp4": ("nvfp4", (1, 16), False, (48, 32, 96)),
}
SCALE_DTYPE = {"fp8-block": torch.float32, "mxfp8": torch.uint8, "nvfp4": FP8}


def _coef() -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": b"q" * 32})()))


def _sources(cols, dtype, g, rows=(37, 1, 7)) -> list[torch.Tensor]:
    """A transposed (column-major) view, a slice at a storage offset, a plain tensor."""
    out = []
    for k, (r, c) in enumerate(zip(rows, cols, strict=True)):
        if k % 3 == 0:
            out.append(torch.randn(c + 3, r, generator=g).to(dtype).t()[:, :c])
        elif k % 3 == 1:
            out.append(torch.randn(r + 4, c + 16, generator=g).to(dtype)[3:3 + r, 8:8 + c])
        else:
            out.append(torch.randn(r, c, generator=g).to(dtype))
    return out


def _messages(srcs, fmt_name, block, g, nmsg=2, lead=13):
    """Items whose values and scales lie in ``nmsg`` messages of random bytes (item k in message k % nmsg):
    values at an odd offset, scales at the next 16 bytes, 5 bytes no item takes between items, odd lengths (a
    tail). Returns the message buffers and the items (``(src, q, s[, global scale])``)."""
    fmt = Q.quant_format(fmt_name)
    lay: list[list] = [[] for _ in range(nmsg)]
    at = [lead] * nmsg
    for k, x in enumerate(srcs):
        m = k % nmsg
        qshape = tuple(x.shape[:-1]) + (x.shape[-1] // fmt.pack,)
        sshape = Q.scale_shape(x.shape, Q.normalize_block(block, x.dim()))
        q0 = at[m]
        s0 = -(-(q0 + math.prod(qshape)) // 16) * 16
        lay[m].append((k, q0, qshape, s0, sshape))
        at[m] = s0 + math.prod(sshape) * fmt.scale_bytes + 5
    bufs = [torch.randint(0, 256, (at[m] + 3,), dtype=torch.uint8, generator=g) for m in range(nmsg)]
    items = [None] * len(srcs)
    for m, entries in enumerate(lay):
        for k, q0, qshape, s0, sshape in entries:
            q = bufs[m][q0:q0 + math.prod(qshape)].view(qshape)
            s = bufs[m][s0:s0 + math.prod(sshape) * fmt.scale_bytes].view(SCALE_DTYPE[fmt.name]).view(sshape)
            item = (srcs[k], q.view(FP8) if fmt.pack == 1 else q, s)
            items[k] = item + (torch.tensor([2.5 + k]),) if fmt.global_scale else item
    return bufs, items


def _whole(sums, covered, bufs, c: ig.Coefficients) -> list[int]:
    """Per message the kernels' sum plus the hash of the bytes they did not write, as the ledger adds them."""
    out = []
    for j, b in enumerate(bufs):
        n = b.numel()
        coef = c.get(_entries([b]), b.device)
        h, at = sums[j], 0
        for a, z in covered[j] + [(n, n)]:
            if a > at:
                h = h + span_torch(b, at, a, n, coef)
            at = max(at, z)
        out.append(int(h) & MASK)
    return out


def _reference(items, fmt_name, block, ue8m0):
    """What torch's reference writes for every item (values as bytes, scales as bytes)."""
    out = []
    for x, q, _s, *gs in items:
        rq, rs = Q.reference(Q.quant_format(fmt_name), x, block, ue8m0, global_scale=gs[0] if gs else None)
        out.append((rq.view(torch.uint8).reshape(q.shape), rs.contiguous().view(torch.uint8)))
    return out


def _entries(bufs) -> int:
    return max(-(-(b.numel() // 8) // ig.ROW_WORDS) + b.numel() % 8 for b in bufs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", list(FORMATS), ids=list(FORMATS))
def test_the_triton_quantize_digest_is_the_cpu_digest_of_the_messages(case, dtype):
    fmt, block, ue8m0, cols = FORMATS[case]
    g = torch.Generator().manual_seed(len(case) + dtype.itemsize)
    bufs, items = _messages(_sources(cols, dtype, g), fmt, block, g)
    c = _coef()
    got = qd.quantize_digest(items, block, ue8m0, [(b, b.numel()) for b in bufs],
                             c.get(_entries(bufs), bufs[0].device), fmt=fmt)
    assert got is not None
    sums, covered = got
    for (_x, q, s, *_g), (rq, rs) in zip(items, _reference(items, fmt, block, ue8m0), strict=True):
        assert torch.equal(q.view(torch.uint8), rq), case  # the kernels write what torch's reference writes
        assert torch.equal(s.contiguous().view(torch.uint8), rs), case
    assert all(covered[j] for j in range(len(bufs)))
    whole = _whole(sums, covered, bufs, c)
    assert whole == [ig.partial(b, c) for b in bufs]
    q0 = items[0][1].view(torch.uint8)  # a bit flipped in a written value byte: the message hash moves away
    bufs[0][q0.data_ptr() - bufs[0].data_ptr() + 2] ^= 0x04
    assert ig.partial(bufs[0], c) != whole[0]


@pytest.mark.parametrize("max_slots", [8, 1], ids=["slots-per-message", "slot-per-row"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_program_of_rows_reaching_several_messages_sums_each_apart(fmt, max_slots, monkeypatch):
    """Many small items, each in its own of 5 messages, share a program of the rows kernel: a partial per
    message of its rows (or, past ``MAX_SLOTS`` messages, one per row) lands in the right message."""
    monkeypatch.setattr(qd, "MAX_SLOTS", max_slots)
    block = (1, 32) if fmt == "mxfp8" else (1, 16)
    g = torch.Generator().manual_seed(max_slots)
    srcs = _sources((64, 32, 96, 64, 32), torch.bfloat16, g, rows=(3, 1, 2, 5, 1))
    bufs, items = _messages(srcs, fmt, block, g, nmsg=5, lead=7)
    c = _coef()
    sums, covered = qd.quantize_digest(items, block, False, [(b, b.numel()) for b in bufs],
                                       c.get(_entries(bufs), bufs[0].device), key=("k", fmt), fmt=fmt)
    assert _whole(sums, covered, bufs, c) == [ig.partial(b, c) for b in bufs]
    per = Q.rows_per_program(block[1])[0]  # every row of the items in one program (the interpreter's G)
    msg_of = torch.arange(5).repeat_interleave(torch.tensor([3, 1, 2, 5, 1])).numpy()
    slots, rel, slot_msg = qd.program_slots(msg_of, per, 5)
    if max_slots == 8:  # one partial per message
        assert (slots, rel.tolist(), slot_msg.tolist()) == (5, msg_of.tolist(), [0, 1, 2, 3, 4])
    else:  # one per row; the program's other slots add to none
        assert (slots, rel.tolist()) == (per, list(range(12)))
        assert slot_msg.tolist() == msg_of.tolist() + [5] * (per - 12)


def test_program_slots_split_rows_by_program_and_message():
    msg = torch.tensor([0, 0, 1, 1, 1, 2, 4, 4]).numpy()
    slots, rel, slot_msg = qd.program_slots(msg, 5, 5)  # programs [0 0 1 1 1] [2 4 4]: spans 2 and 3
    assert slots == 3 and rel.tolist() == [0, 0, 1, 1, 1, 0, 2, 2]
    assert slot_msg.tolist() == [0, 1, 5, 2, 3, 4]  # (message 3's slot adds nothing: no row of it)
    slots, rel, slot_msg = qd.program_slots(msg, 4, 5)  # [0 0 1 1] [1 2 4 4]: a span of 4 = a slot per row
    assert slots == 4 and rel.tolist() == [0, 1, 2, 3] * 2 and slot_msg.tolist() == msg.tolist()


def test_items_writing_the_same_message_bytes_are_refused_before_any_write():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, generator=g)
    msg = torch.zeros(256, dtype=torch.uint8)
    q, s = msg[0:64].view(FP8).view(2, 32), msg[64:66].view(2, 1)
    q2 = msg[32:96].view(FP8).view(2, 32)  # overlaps q and s
    got = qd.quantize_digest([(x, q, s), (x, q2, msg[128:130].view(2, 1))], (1, 32), False, [(msg, 256)],
                             _coef().get(8, msg.device), fmt="mxfp8")
    assert got is None and not bool(msg.any())


def test_the_ledger_adds_the_quantizers_sums_to_the_fused_copys():
    """The quantizers' sums handed to the ledger (``Ledger.add_hashed``) after ``Ledger.pack`` (a step with plain
    pieces copied by the digesting copy kernel and quantized pieces): the value taken at ``on_post`` is the CPU
    digest of each send buffer; and alone (no fused copy: the rest of the message is hashed from the buffer)."""
    g = torch.Generator().manual_seed(9)
    srcs = _sources((64, 32, 96), torch.bfloat16, g)
    bufs, items = _messages(srcs, "mxfp8", (1, 32), g, nmsg=2, lead=64)
    plain = [(torch.randn(7, 2, generator=g).t(), b[8:64].view(torch.float32).view(2, 7)) for b in bufs]
    c = _coef()
    work = type("W", (), {"steps": [(0, None), (1, None)]})()
    led = ig.Ledger(b"k", c, 0, "p", work, ())
    sends = [(1, bufs[0]), (2, bufs[1])]
    lens = [b.numel() for b in bufs]
    coef = c.get(_entries(bufs), bufs[0].device)
    assert led.pack(0, plain, sends, ("k", "pack", 0), "triton")
    led.add_hashed(0, lens, *qd.quantize_digest(items, (1, 32), False, list(zip(bufs, lens, strict=True)), coef, "q", "mxfp8"))
    led.on_post(0, sends, [])
    led.add_hashed(1, lens, *qd.quantize_digest(items, (1, 32), False, list(zip(bufs, lens, strict=True)), coef, "q", "mxfp8"))
    led.on_post(1, sends, [])
    led._values()
    assert [e[2] for p in (1, 2) for e in led.sent[p]] == [ig.partial(bufs[0], c)] * 2 + [ig.partial(bufs[1], c)] * 2
    for s, m in plain:
        assert torch.equal(s.contiguous().view(torch.int32), m.view(torch.int32))


def test_ranges_less_covered_ranges():
    assert qd.minus_ranges([(0, 100)], [(10, 20), (30, 40)]) == [(0, 10), (20, 30), (40, 100)]
    assert qd.minus_ranges([(0, 10), (50, 60)], [(0, 10), (55, 70)]) == [(50, 55)]
    assert qd.minus_ranges([], [(0, 5)]) == [] and qd.minus_ranges([(3, 9)], []) == [(3, 9)]


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_reshard.kernels import quant as kq

for cap in (90, 100):
    sig = {"src_ptr": "*i16", "q_ptr": "*u8", "s_ptr": "*fp32", "table_ptr": "*i64", "thr_ptr": "*i32",
           "num_blocks": "i64", "coef_ptr": "*i64", "sums_ptr": "*i64"}
    cx = {"SRC_BF16": True, "UE8M0": True, "BM": 128, "BN": 128, "RB": 16, "CONTIG": True, "SRC_ALIGN": 8,
          "Q_ALIGN": 16, "DIGEST": True}
    sig.update(dict.fromkeys(cx, "constexpr"))
    ptx = triton.compile(ASTSource(fn=kq.quant_blocks_kernel, signature=sig, constexprs=cx),
                         target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
    assert "mul.lo.s64" in ptx, cap
    for fmt, bn, g, slots in ((1, 32, 64, 2), (1, 32, 64, 64), (2, 16, 128, 3)):
        sig = {"src_ptr": "*i16", "q_ptr": "*u8", "s_ptr": "*u8", "table_ptr": "*i64", "thr_ptr": "*i32",
               "num_blocks": "i64", "g_ptr": "*fp32" if fmt == 2 else "constexpr", "coef_ptr": "*i64",
               "sums_ptr": "*i64"}
        cx = {"SRC_BF16": True, "BN": bn, "G": g, "CONTIG": True, "FMT": fmt, "DIGEST": True, "SLOTS": slots,
              **({} if fmt == 2 else {"g_ptr": None})}
        sig.update(dict.fromkeys([k for k in cx if k != "g_ptr"], "constexpr"))
        ptx = triton.compile(ASTSource(fn=kq.quant_rows_kernel, signature=sig, constexprs=cx),
                             target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
        assert "mul.lo.s64" in ptx, (cap, fmt, slots)
print("compiled")
"""


def test_the_digesting_quant_kernels_compile_for_hopper_and_blackwell(tmp_path):
    """The interpreter accepts code the compiler rejects: compile both quant kernels with the digest on (block
    FP8 with UE8M0; MXFP8 and NVFP4 with a few slots per program and with a slot per row) for sm_90 and
    sm_100, in a fresh process with an empty Triton cache."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(FORMATS), ids=list(FORMATS))
def test_on_the_device_the_quantize_digest_is_the_cpu_digest(case):
    fmt, block, ue8m0, cols = FORMATS[case]
    g = torch.Generator().manual_seed(7)
    bufs_cpu, items = _messages(_sources(cols, torch.bfloat16, g), fmt, block, g)
    dev_bufs = [b.cuda() for b in bufs_cpu]
    moved = []
    for x, q, s, *gs in items:
        b = next(k for k, m in enumerate(bufs_cpu) if m.data_ptr() <= q.data_ptr() < m.data_ptr() + m.numel())
        base = dev_bufs[b]
        qo, so = q.data_ptr() - bufs_cpu[b].data_ptr(), s.data_ptr() - bufs_cpu[b].data_ptr()
        qd_ = base[qo:qo + q.numel()].view(q.dtype).view(q.shape)
        sd = base[so:so + s.numel() * s.element_size()].view(s.dtype).view(s.shape)
        moved.append((x.cuda(), qd_, sd, *[t.cuda() for t in gs]))
    c = _coef()
    sums, covered = qd.quantize_digest(moved, block, ue8m0, [(b, b.numel()) for b in dev_bufs],
                                       c.get(_entries(dev_bufs), dev_bufs[0].device), fmt=fmt)
    assert _whole(sums, covered, dev_bufs, c) == [ig.partial(b.cpu(), c) for b in dev_bufs]
