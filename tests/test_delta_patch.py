"""Patched blocks of delta format v2 (issue 44 item 3, ``ops/delta_patch.py``): a block's values at a narrow base
width plus 1..4 full-width exceptions. Both CPU codecs (numpy reference, native) write the same bytes; unpack
into destinations holding the snapshot, inside poisoned buffers, gives the source's bits and leaves the poison;
the snapshot update (fused, and deferred: commit / undo) equals the source or the old snapshot. Cases: one far
outlier per block among one-ulp changes (positions as offsets, bitmask and all), 4 and 5 outliers (the cap),
sign flips, NaN payloads, subnormals and +-0 as the outliers, a block whose every difference needs 16 bits, for
every dtype the delta takes. Bad exception lists are refused before any write."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cpu
from triton_reshard.ops import delta_patch as P
from triton_reshard.ops import delta_v2 as V
from triton_reshard.ops.delta_cached import pack_deferred

from .test_delta_v2 import CODECS, DTYPES, INT, bits, refused_by_both_codecs, roundtrip

N = 4000  # 15 full blocks and a short one


def moved(old: torch.Tensor, frac: float, g: torch.Generator, far: int, outlier) -> torch.Tensor:
    """``old`` with about ``frac`` of its elements moved by one ulp (-1 or +1) and, per 256-element block,
    ``far`` elements changed by ``outlier(bits)`` (at positions apart from each other)."""
    new = old.clone()
    b = bits(new)
    m = torch.rand(old.shape, generator=g) < frac
    step = (torch.randint(0, 2, old.shape, generator=g) * 2 - 1).to(b.dtype)
    b[m] += step[m]
    for k in range(far):
        at = torch.arange(17 + 61 * k, old.numel(), V.BLOCK)
        b[at] = outlier(b[at])
    return new


def patched_cases(dtype: torch.dtype, g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    e = torch.empty(0, dtype=dtype).element_size()
    top = torch.tensor(-(1 << (8 * e - 1)), dtype=INT[e])
    old = (torch.randn(N, generator=g) * 3).to(dtype)
    far = min(100, (1 << (8 * e - 2)) - 1)  # needs 8 bits (int8: 64, 8 bits too)

    def plus(x):
        return x + far

    cases = [
        (f"{frac}-{k}far", old, moved(old, frac, g, k, plus)) for frac in (0.05, 0.3, 1.0) for k in (1, 4, 5)
    ]
    cases.append(("sign", old, moved(old, 0.1, g, 2, lambda x: x ^ top)))
    if dtype.is_floating_point:
        nan = bits(torch.full((1,), float("nan"), dtype=dtype))[0] | 3
        cases.append(("nan", old, moved(old, 0.1, g, 1, lambda x: torch.full_like(x, int(nan)))))
        sub = torch.full((N,), torch.finfo(dtype).tiny, dtype=dtype) / 4
        cases.append(("subnormal", sub, moved(sub, 0.2, g, 3, lambda x: x + far)))
        z = torch.zeros(N, dtype=dtype)
        zb = bits(z.clone())
        zb[::5] += 1
        cases.append(("zeros", z, moved(zb.view(dtype), 0.0, g, 1, lambda x: x ^ top)))  # -0 outliers
    wide = old.clone()
    wb = bits(wide)
    wb[256:512] += (1 << 14) if e > 1 else 64  # every difference of block 1 needs 16 bits (int8: raw)
    wb[1000] += 1
    wb[1001] += (1 << 14) if e > 1 else 64
    cases.append(("wide", old, wide))
    return cases


def descriptors(msg: torch.Tensor) -> list[int]:
    """The first descriptor byte of every block of every narrow chunk of a v2 message."""
    out = []
    nc = int(msg[8:12].view(torch.int32)[0])
    for off in msg[16 : 16 + 8 * nc].view(torch.int64).tolist():
        head = msg[off : off + 16].view(torch.int32).tolist()
        if head[0] & 0xFF == 3:  # KIND_NARROW
            out += msg[off + 16 : off + 16 + 2 * -(-head[1] // V.BLOCK) : 2].tolist()
    return out


def _modes(msg: torch.Tensor) -> set[tuple[int, int]]:
    """(positions mode, exceptions) of every patched block of a v2 message."""
    pm, nexc = P.split_mode(torch.tensor(descriptors(msg), dtype=torch.int64).numpy() >> 4)
    return {(int(a), int(b)) for a, b in zip(pm.tolist(), nexc.tolist(), strict=True) if b}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ce", [1 << 15, 1000, 256])
def test_patched_roundtrip_same_bytes(codec, dtype, ce):
    g = torch.Generator().manual_seed(11)
    seen = set()
    for name, old, new in patched_cases(dtype, g):
        msgs = []
        for c in CODECS:
            codec(c)
            msgs.append(roundtrip([(new, old)], ce, at=3))
        assert torch.equal(msgs[0], msgs[1]), f"{name}: the codecs' bytes differ"
        assert msgs[0].numel() <= D.max_message_bytes([new.numel()], [new.element_size()], ce)
        seen |= _modes(msgs[0])
        if name == "0.05-1far":  # the case patching is for: fewer bytes than without it
            plain = V.pack_v2_numpy([(new, old.clone())], ce, False, patch=False)
            assert msgs[0].numel() < plain.numel() and not _modes(plain), name
    assert {pm for pm, _ in seen} == {0, 1, 2}, seen  # offsets, bitmask and all, patched
    assert {x for _, x in seen} >= {1, 4}, seen


def test_histograms_count_patched_blocks_and_exceptions():
    g = torch.Generator().manual_seed(12)
    old = torch.randn(N, generator=g).to(torch.bfloat16)
    new = moved(old, 0.05, g, 1, lambda x: x + 100)
    msg = V.pack_v2_numpy([(new, old.clone())], 1 << 15, False).numpy()
    h = V.block_histogram([msg])
    assert h == {"2p": 16, "exceptions": 16}, h  # every block: 2-bit base, its one far element an exception
    assert V.chunk_histogram([msg]) == {"2": 1}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_patched_deferred_update_commits_or_undoes(codec, dtype):
    """The native pack with a deferred update writes a patched block's changes in the pass (it holds
    differences): undo subtracts them, exceptions included; commit completes the raw blocks."""
    g = torch.Generator().manual_seed(13)
    for case, old, new in patched_cases(dtype, g):
        for name in CODECS:
            codec(name)
            ref = D.pack_delta([(new, old.clone())], 1024, backend="torch")
            for commit in (True, False):
                snap, updates = old.clone(), []
                msg = pack_deferred([(new, snap)], 1024, updates, cache={})
                assert torch.equal(msg, ref), (case, name)
                (delta_cpu.commit_updates if commit else delta_cpu.undo_updates)(updates)
                assert torch.equal(bits(snap), bits(new if commit else old)), (case, name, commit)


def patched_block(msg: torch.Tensor) -> tuple[int, int, int]:
    """(descriptor offset, exception slots offset, exceptions) of the first patched block of a one-chunk
    message of bf16 offsets blocks."""
    body = int(msg[16:24].view(torch.int64)[0]) + 16
    nbk = -(-int(msg[body - 12 : body - 8].view(torch.int32)[0]) // V.BLOCK)
    at = body + 2 * nbk
    for b in range(nbk):
        d0, cnt = int(msg[body + 2 * b]), int(msg[body + 2 * b + 1]) + 1
        code, (pm, nexc) = d0 & 15, (int(x[0]) for x in P.split_mode(torch.tensor([d0 >> 4]).numpy()))
        if not code:
            continue
        w = 16 if code == V.RAW else 1 << code
        vb = P.vbytes(cnt, w)
        if nexc:
            assert pm == 0
            return body + 2 * b, at + cnt + vb, nexc
        at += cnt + vb
    raise AssertionError("no patched block")


def test_bad_exceptions_refused_before_any_write(codec):
    """Exception slots out of order or past the block's values, a patched raw block, more exceptions than
    values: ValueError naming the destination, nothing written, the same error from both codecs."""
    g = torch.Generator().manual_seed(14)
    old = torch.randn(1024, generator=g).to(torch.bfloat16)
    new = moved(old, 0.03, g, 2, lambda x: x + 100)
    codec("numpy")
    msg = D.pack_delta([(new, old.clone())], 1024, backend="torch")
    desc, xs, nexc = patched_block(msg)
    assert nexc == 2
    cnt = int(msg[desc + 1]) + 1
    bads = []
    for how in ("order", "past", "raw", "count"):
        bad = msg.clone()
        if how == "order":
            bad[xs], bad[xs + 1] = msg[xs + 1], msg[xs]
        elif how == "past":
            bad[xs + 1] = cnt
        elif how == "raw":
            bad[desc] = (int(msg[desc]) & 0xF0) | V.RAW
        else:  # 4 exceptions claimed in a block of 3 changes
            bad[desc] = (int(msg[desc]) & 0x0F) | ((P.FIRST_PATCHED + 3) << 4)
            bad[desc + 1] = 2
        bads.append(bad)
    for bad in bads:
        refused_by_both_codecs(codec, bad, old)
