"""The Triton pack writes patched blocks (issue 44 items 3 and 6; the format: ``ops/delta_patch.py``): a block's
values at a narrow base width plus 1..4 full-width exceptions. ``triton_pack(..., version=2)`` and its digesting
variant ``triton_pack_digest`` write the CPU codec's bytes with ``patch=True`` (the numpy reference, and the
native codec where it is built), byte for byte, and with ``patch=False`` its unpatched bytes; the snapshot
update equals the source; the Triton unpack and the CPU apply (numpy and native) of the Triton-packed message
into destinations holding the snapshot, inside poisoned buffers, give the source's bits and leave the poison.
Cases: one far outlier per block among one-ulp changes (positions as offsets, bitmask and all), exactly 4 and
5 outliers per block (the cap), sign flips, NaN payloads, subnormals and +-0 as the outliers, a block whose
every difference needs 16 bits, strided views, random steps, and real AdamW steps of a small model (fp32
masters, bf16 weights, lr 1e-5), for bf16, fp16, fp32 (and fp64, int8). Interpreted (``TRITON_INTERPRET=1``,
small shapes); the compile checks for sm_90 / sm_100 are in ``test_delta_triton_v2.py`` and
``test_integrity_triton_delta.py``. Before this, the Triton pack wrote no patched block: every test here
failed on a byte mismatch."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.execute import integrity as ig
from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_native as N
from triton_reshard.ops import delta_patch as P
from triton_reshard.ops import delta_triton as T
from triton_reshard.ops import delta_v2 as V

from .test_delta_patch import descriptors, moved, patched_cases
from .test_delta_triton_v2 import check_landed, cpu_pack, poisoned
from .test_delta_v2 import bits, ulp_steps

pytestmark = pytest.mark.usefixtures("triton_mode")  # tests/conftest.py

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8)
MASK = (1 << 64) - 1


@pytest.fixture
def cpu_codecs():
    """The CPU codecs to apply with: numpy, and native where built; the process's setting restored after."""
    prev = N.set_native(True)
    yield ["numpy"] + (["native"] if N.native() is not None else [])
    N.set_native(prev)


def patched_modes(msg: torch.Tensor) -> set[tuple[int, int]]:
    """(positions mode, exceptions) of every patched block of a v2 message."""
    pm, nexc = P.split_mode(torch.tensor(descriptors(msg), dtype=torch.int64).numpy() >> 4)
    return {(int(a), int(b)) for a, b in zip(pm.tolist(), nexc.tolist(), strict=True) if b}


def roundtrip(pairs, ce: int, what: str, codecs: list[str]) -> torch.Tensor:
    """Triton pack (update) == the CPU codecs' bytes with patched blocks; the snapshot update; the Triton unpack
    and every CPU codec's apply of the message land exactly in poisoned buffers."""
    N.set_native(True)
    refs = cpu_pack(pairs, ce, patch=True)
    snaps = [old.clone() for _new, old in pairs]
    msg = T.triton_pack([(new, s) for (new, _o), s in zip(pairs, snaps, strict=True)], ce, True, version=2)
    for ref in refs:
        assert torch.equal(msg, ref), f"{what}: the Triton bytes differ from the CPU codec's (patch=True)"
    for (new, _old), s in zip(pairs, snaps, strict=True):
        assert torch.equal(bits(s), bits(new)), f"{what}: the snapshot update"
    news, olds = [new for new, _ in pairs], [old for _, old in pairs]
    bufs, dsts = poisoned(olds)
    T.triton_unpack(msg, dsts)
    check_landed(news, bufs, dsts, what + " (Triton unpack)")
    for name in codecs:
        N.set_native(name == "native")
        bufs, dsts = poisoned(olds)
        D.unpack_delta(msg, dsts, backend="torch")
        check_landed(news, bufs, dsts, f"{what} ({name} apply)")
    N.set_native(True)
    return msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_patched_blocks_same_bytes_as_the_cpu_codec(dtype, cpu_codecs):
    """Every case of ``test_delta_patch.patched_cases``: the CPU codec's patched bytes; together they reach
    patched blocks of every positions mode and with 1 and 4 exceptions (5 outliers: not patched at 2 bits)."""
    g = torch.Generator().manual_seed(21)
    seen = set()
    for name, old, new in patched_cases(dtype, g):
        msg = roundtrip([(new, old)], 1000, f"{dtype} {name}", cpu_codecs)
        seen |= patched_modes(msg)
        assert msg.numel() <= D.max_message_bytes([new.numel()], [new.element_size()], 1000)
    assert {pm for pm, _ in seen} == {0, 1, 2}, seen
    assert {x for _, x in seen} >= {1, 4}, seen


def test_patched_only_when_strictly_smaller_and_the_unpatched_path_kept(cpu_codecs):
    """``patch=False`` writes the CPU codec's unpatched bytes (no patched block); with patches the message of
    one far outlier per block among one-ulp changes is smaller, and that of a case that gains nothing is the
    same bytes either way."""
    g = torch.Generator().manual_seed(22)
    old = torch.randn(2000, generator=g).to(torch.bfloat16)
    far = moved(old, 0.05, g, 1, lambda x: x + 100)
    plain = ulp_steps(old, 0.1, g)  # 2-bit differences only: nothing to patch
    for new, gains in ((far, True), (plain, False)):
        ref = V.pack_v2_numpy([(new, old.clone())], 1000, False, patch=False)
        unp = T.triton_pack([(new, old.clone())], 1000, False, version=2, patch=False)
        assert torch.equal(unp, ref) and not patched_modes(unp)
        pat = roundtrip([(new, old)], 1000, f"gains {gains}", cpu_codecs)
        assert (pat.numel() < unp.numel()) == gains and bool(patched_modes(pat)) == gains
        if not gains:
            assert torch.equal(pat, unp)
    cache: dict = {}  # the plan kept in a refit's cache dict packs either way
    for patch in (True, False, True):
        msg = T.triton_pack([(far, old.clone())], 1000, False, version=2, cache=cache, patch=patch)
        assert torch.equal(msg, cpu_pack([(far, old)], 1000, patch=patch)[0]), patch


def test_strided_views_mixed_sizes_and_short_chunks(cpu_codecs):
    """Patched blocks in transposed sources and snapshots, views of three element sizes in one message (a
    launch each), chunks shorter than a block."""
    g = torch.Generator().manual_seed(23)
    a = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    b = (torch.randn(1100, generator=g) * 3).to(torch.float32)
    c = torch.randn(600, generator=g).to(torch.float16)
    na = moved(a.reshape(-1), 0.1, g, 2, lambda x: x + 60).view(40, 48)
    pairs = [
        (na.t(), a.t()),
        (moved(b, 0.3, g, 1, lambda x: x ^ torch.tensor(-(1 << 31), dtype=torch.int32)), b),
        (moved(c, 0.05, g, 4, lambda x: x + 3000), c),
    ]
    for ce in (1 << 15, 300, 100):
        strided = roundtrip(pairs, ce, f"strided ce={ce}", cpu_codecs)
        flat = roundtrip([(x.contiguous(), y.contiguous()) for x, y in pairs], ce, f"flat ce={ce}", cpu_codecs)
        assert torch.equal(strided, flat) and patched_modes(strided), ce


def test_random_steps_with_random_outliers(cpu_codecs):
    """Random one- and few-ulp steps with random far outliers (0..6 per block, anywhere): the CPU bytes."""
    g = torch.Generator().manual_seed(24)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        old = (torch.randn(3000, generator=g) * 2).to(dtype)
        for frac in (0.02, 0.2, 0.6):
            new = ulp_steps(old, frac, g, 3)
            b = bits(new)
            at = torch.randperm(3000, generator=g)[: int(torch.randint(0, 70, (), generator=g))]
            b[at] += torch.randint(9, 2000, (at.numel(),), generator=g).to(b.dtype)
            roundtrip([(new, old)], 1024, f"{dtype} {frac}", cpu_codecs)


def _coef() -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": b"p" * 32})()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_the_digesting_pack_writes_and_hashes_patched_blocks(dtype):
    """``triton_pack_digest``: the CPU codec's patched bytes, and its digest (the exceptions' slot and value
    bytes hashed by the kernel) is the CPU digest of the message; a flipped bit in an exception moves it."""
    g = torch.Generator().manual_seed(25)
    c = _coef()

    def coef_for(n: int) -> torch.Tensor:
        return c.get(-(-n // (8 * ig.ROW_WORDS)), torch.device("cpu"))

    for name, old, new in patched_cases(dtype, g):
        ref = V.pack_v2_numpy([(new, old.clone())], 1000, False)
        snap = old.clone()
        msg, h = T.triton_pack_digest([(new, snap)], coef_for, 1000)
        assert torch.equal(msg, ref), f"{dtype} {name}: the digesting pack's bytes"
        assert torch.equal(bits(snap), bits(new)), f"{dtype} {name}: the snapshot update"
        assert int(h) & MASK == ig.partial(msg, c), f"{dtype} {name}: the digest"
        if name == "0.05-1far":
            wrong = msg.clone()
            wrong[_first_exception(msg)] ^= 0x01
            assert ig.partial(wrong, c) != int(h) & MASK


def _first_exception(msg: torch.Tensor) -> int:
    """The byte offset of the first exception slot of a message whose first block is patched, with offsets
    positions (the ``far`` element of block 0 of ``moved``)."""
    ch = D.describe(msg)[0]
    body = ch["offset"] + 16
    nbk = -(-ch["numel"] // V.BLOCK)
    d0, cnt = int(msg[body]), int(msg[body + 1]) + 1
    pm, nexc = (int(x[0]) for x in P.split_mode(torch.tensor([d0 >> 4]).numpy()))
    assert nexc and pm == 0, "block 0 is patched, offsets"
    return body + 2 * nbk + cnt + P.vbytes(cnt, 1 << (d0 & 15))


def adamw_steps(steps: int, lr: float) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Real AdamW steps of a small MLP (fp32 master weights, std 0.02 like a Llama's, a regression task; three
    warm-up steps at lr 1e-3, then ``steps`` at ``lr``): per step, per parameter, (bf16 after, bf16 before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 160), torch.nn.GELU(), torch.nn.Linear(160, 64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    target = torch.randn(64, 64) / 8
    out, before = [], None
    for step, rate in enumerate([1e-3] * 3 + [lr] * steps):
        if step in (0, 3):
            opt = torch.optim.AdamW(model.parameters(), lr=rate)
        x = torch.randn(32, 64)
        loss = ((model(x) - torch.tanh(x @ target)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        if before is not None and step >= 3:
            out.append(list(zip(now, before, strict=True)))
        before = now
    return out


def test_real_adamw_steps(cpu_codecs):
    """Three AdamW steps at lr 1e-5 of a small model, bf16 weights published: every step's message of all its
    parameters is the CPU codec's (patched blocks among them), lands exactly, and is smaller than unpatched."""
    hist: dict[str, int] = {}
    for s, pairs in enumerate(adamw_steps(3, 1e-5)):
        changed = sum(int((bits(a) != bits(b)).sum()) for a, b in pairs)
        assert 0 < changed < sum(a.numel() for a, _ in pairs)
        msg = roundtrip(pairs, 4096, f"AdamW step {s}", cpu_codecs)
        for k, v in V.block_histogram([msg.numpy()]).items():
            hist[k] = hist.get(k, 0) + v
        plain = T.triton_pack([(a, b.clone()) for a, b in pairs], 4096, False, version=2, patch=False)
        assert msg.numel() < plain.numel(), (msg.numel(), plain.numel())
    assert hist.get("exceptions", 0) > 0, hist
