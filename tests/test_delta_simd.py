"""The native delta codec's SIMD paths against each other (issue 44 item 1): the fastest paths this CPU has up
to AVX-512 (512), AVX2 (256: the 16-bit blocks' left-pack and expand through pshufb tables) and the portable C
(0), each picked in this process by ``delta_native.simd(use)``, write the numpy reference's bytes for every
case of ``test_delta_v2`` and ``test_delta_patch`` (every dtype, mode, width, patched blocks, short blocks and
chunk tails) and RL-like bf16 changes at several densities and spreads; the apply (into poisoned, unaligned
and row-view destinations) and the snapshot updates (fused, committed, undone) give the same bits. A level
this CPU lacks is skipped."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cpu
from triton_reshard.ops import delta_native as N
from triton_reshard.ops.delta_cached import pack_deferred

from .test_delta_patch import patched_cases
from .test_delta_v2 import DTYPES, adversarial, bits, roundtrip, ulp_steps

LEVELS = (512, 256, 0)


@pytest.fixture(params=LEVELS, ids=lambda v: f"simd{v}")
def simd(request, codec):
    """The native codec with the paths of one level (skipped where this CPU has not got it); the best
    restored after."""
    codec("native")
    have = N.simd()
    got = N.simd(request.param)
    if got != request.param:
        N.simd(have)
        pytest.skip(f"this CPU has no SIMD level {request.param} (best: {have})")
    yield request.param
    N.simd(have)


def reference(new: torch.Tensor, old: torch.Tensor, ce: int) -> torch.Tensor:
    """The numpy reference's message (the native codec on again after)."""
    prev = N.set_native(False)
    try:
        return D.pack_delta([(new, old.clone())], ce, backend="torch")
    finally:
        N.set_native(prev)


def rl_cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """bf16 weights moved by a few ulp at RL-like densities (1 %, 10 %) and denser ones (bitmask and "all"
    positions), with spreads that need 2, 4, 8 bits, an outlier per block (patched) or 16 bits (raw)."""
    old = (torch.randn(70_000, generator=g) * 0.02).to(torch.bfloat16)
    cases = []
    for frac in (0.01, 0.1, 0.3, 0.95):
        for spread in (1, 2, 8, 100, 1 << 14):
            cases.append((f"{frac}-{spread}", old, ulp_steps(old, frac, g, spread)))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ce", [1 << 15, 1000, 256])
def test_every_level_writes_the_reference_bytes(simd, dtype, ce):
    g = torch.Generator().manual_seed(5)
    cases = adversarial(dtype, 3000, g) + patched_cases(dtype, g)
    if dtype == torch.bfloat16:
        cases += rl_cases(g)
    for name, old, new in cases:
        want = reference(new, old, ce)
        for at in (32, 3):  # destinations aligned to a cache line, and not
            got = roundtrip([(new, old)], ce, at)
            assert torch.equal(got, want), f"{name} (simd {simd}, at {at}): bytes differ from the reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_level_deferred_update_commits_or_undoes(simd, dtype):
    """A pack whose snapshot update waits on the refit (update 2: the narrow blocks written in the pass) gives
    the reference bytes; commit makes the snapshot the source, undo restores the old one, bit for bit."""
    g = torch.Generator().manual_seed(6)
    cases = adversarial(dtype, 20_000, g) + patched_cases(dtype, g)
    if dtype == torch.bfloat16:
        cases += rl_cases(g)
    for name, old, new in cases:
        want = reference(new, old, 4096)
        for commit in (True, False):
            snap, updates = old.clone(), []
            msg = pack_deferred([(new, snap)], 4096, updates, cache={})
            assert torch.equal(msg, want), (name, simd)
            (delta_cpu.commit_updates if commit else delta_cpu.undo_updates)(updates)
            assert torch.equal(bits(snap), bits(new if commit else old)), (name, simd, commit)


def test_every_level_applies_into_row_views(simd):
    """Row views (a column block of a row-major tensor, rows of 600 or 512 elements): blocks inside a row
    take the vector apply, those across a row end go element by element; the padding columns untouched."""
    g = torch.Generator().manual_seed(7)
    for cols in (600, 512):
        old = (torch.randn(40, cols, generator=g) * 0.02).to(torch.bfloat16)
        for frac, spread in ((0.1, 2), (0.5, 8), (0.02, 1)):
            new = ulp_steps(old, frac, g, spread)
            msg = reference(new, old, 4096)
            big = torch.empty(40, cols + 77, dtype=torch.bfloat16)
            bits(big).fill_(-1)
            dst = big[:, 5 : 5 + cols]
            dst.copy_(old)
            D.unpack_delta(msg, [dst], backend="torch")
            assert torch.equal(bits(dst), bits(new)), (cols, frac, simd)
            assert bool((bits(big[:, :5]) == -1).all()) and bool((bits(big[:, 5 + cols :]) == -1).all())
