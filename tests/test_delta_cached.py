"""The per-message plans of the numpy delta op (``triton_reshard/ops/delta_cached.py``): a ``PackPlan`` writes
the bytes of the torch-ops reference (``ops.delta._tensor_pack``) for every kind, element size, chunk size and
view layout, across versions of the same views; an ``UnpackPlan`` lands exactly what the reference unpack lands
in poisoned destinations and refuses bad messages with the same errors before any write; a plan is rebuilt
for other view objects; a delta refit whose tensors are rebound (new tensors, a new Resharder) stays exact."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cached as C
from triton_reshard.ops import delta_cpu

# These tests pin format version 1 (the v1 kinds, the bytes of the Triton kernels and the torch reference);
# the CPU default, version 2 (narrow values), is tested in tests/test_delta_v2.py.
torch_pack_v1 = functools.partial(D.torch_pack, version=1)
pack_delta_v1 = functools.partial(D.pack_delta, version=1)
pack_deferred_v1 = functools.partial(C.pack_deferred, version=1)

INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def flip(t: torch.Tensor, frac: float, g: torch.Generator) -> None:
    """Flip one low bit of about ``frac`` of ``t``'s elements, in place (any strides)."""
    m = torch.rand(t.shape, generator=g) < frac
    b = bits(t)
    b[m] ^= 1


def make_pairs(shapes, dtype, g, src_kind="contig"):
    """(source, snapshot) views: sources separate tensors (``strided``: every other column), snapshots views of
    one buffer back to back, like a refit's message snapshot."""
    total = sum(math.prod(s) for s in shapes)
    sbuf = torch.empty(total + 3, dtype=dtype)
    bits(sbuf).fill_(-1)
    pairs, at = [], 1
    for s in shapes:
        n = math.prod(s)
        if src_kind == "strided" and len(s) == 2:
            src = torch.empty(s[0], 2 * s[1], dtype=dtype)[:, ::2]
        else:
            src = torch.empty(s, dtype=dtype)
        bits(src).copy_(torch.randint(-100, 100, s, generator=g).to(INT[src.element_size()]))
        snap = sbuf[at:at + n].view(s)
        snap.copy_(src)
        pairs.append((src, snap))
        at += n
    return pairs


SHAPES = [(64, 96), (7,), (0, 5), (3, 1000), (300,), (1,)]


def check_pack(plan: C.PackPlan, pairs, ce: int, update) -> torch.Tensor:
    ref = D._tensor_pack([(s, p.clone()) for s, p in pairs], ce, update=False)
    before = [bits(p).clone() for _s, p in pairs]
    got = plan.pack(update)
    assert torch.equal(got, ref), "message differs from the reference's bytes"
    for (s, p), b in zip(pairs, before, strict=True):
        assert torch.equal(bits(p), bits(s) if update is True else b)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64], ids=str)
@pytest.mark.parametrize("ce", [32768, 4096, 1000, 3], ids=lambda c: f"ce{c}")
def test_pack_plan_bytes_over_versions(dtype, ce):
    """One plan, many versions of the same views: densities from none to all (offsets, bitmask and dense
    chunks), with the snapshot written now, deferred, or left."""
    g = torch.Generator().manual_seed(ce)
    pairs = make_pairs(SHAPES, dtype, g)
    plan = C.PackPlan(pairs, ce)
    assert plan.fast
    for frac, update in [(0.0, True), (0.005, True), (0.02, []), (0.07, True), (0.5, False), (1.0, True),
                         (0.02, True)]:
        for s, _p in pairs:
            flip(s, frac, g)
        msg = check_pack(plan, pairs, ce, update)
        if isinstance(update, list):
            delta_cpu.commit_updates(update)
            assert all(torch.equal(bits(p), bits(s)) for s, p in pairs)
        if frac in (0.07, 0.5) and ce >= 1000:  # (tiny chunks: offsets tie with the rest)
            kinds = {c["kind"] for c in D.describe(msg)}
            assert len(kinds) > 1, kinds


def test_pack_plan_falls_back_for_strided_or_mixed():
    """Strided sources or mixed element sizes: the plan packs with ``numpy_pack`` (same bytes)."""
    g = torch.Generator().manual_seed(3)
    strided = make_pairs([(40, 50), (9,)], torch.bfloat16, g, "strided")
    mixed = make_pairs([(40, 50)], torch.bfloat16, g) + make_pairs([(33,)], torch.float32, g)
    for pairs in (strided, mixed):
        plan = C.PackPlan(pairs, 512)
        assert not plan.fast
        for s, _p in pairs:
            flip(s, 0.03, g)
        check_pack(plan, pairs, 512, True)


def test_pack_plan_blocks(monkeypatch):
    """A message above ``MASK_CAP`` is compared and searched in blocks (gaps between views re-zeroed each
    block): the same bytes."""
    monkeypatch.setattr(C, "MASK_CAP", 2000)
    monkeypatch.setattr(C, "BLOCK", 1500)
    g = torch.Generator().manual_seed(5)
    pairs = make_pairs([(50, 61), (700,), (13, 17), (4000,)], torch.float16, g)
    plan = C.PackPlan(pairs, 256)
    assert not plan.reuse and len(plan.blocks) > 3
    for frac in (0.01, 0.2, 0.0, 0.9):
        for s, _p in pairs:
            flip(s, frac, g)
        check_pack(plan, pairs, 256, True)


def test_pack_cache_rebuilds_for_other_views():
    """``pack_plan``/``pack_delta(cache=)`` keep the plan while the views are the same objects; other tensors
    (or another chunk size) get a new plan: a stale one would diff the old tensors and miss every change."""
    g = torch.Generator().manual_seed(7)
    pairs = make_pairs([(30, 40), (100,)], torch.bfloat16, g)
    cache: dict = {}
    pack_delta_v1(pairs, 1024, update=True, backend="torch", cache=cache)
    first = cache["pack"]
    pack_delta_v1(list(pairs), 1024, update=True, backend="torch", cache=cache)
    assert cache["pack"] is first  # same view objects (a new list of them)
    new = [(s.clone(), p) for s, p in pairs]
    for s, _p in new:
        flip(s, 0.1, g)
    ref = D._tensor_pack([(s, p.clone()) for s, p in new], 1024, update=False)
    assert torch.equal(pack_delta_v1(new, 1024, update=True, backend="torch", cache=cache), ref)
    assert cache["pack"] is not first
    ref = D._tensor_pack([(s, p.clone()) for s, p in new], 512, update=False)
    assert torch.equal(pack_delta_v1(new, 512, update=True, backend="torch", cache=cache), ref)
    upd: list = []
    for s, _p in new:
        flip(s, 0.1, g)
    ref = D._tensor_pack([(s, p.clone()) for s, p in new], 512, update=False)
    assert torch.equal(pack_deferred_v1(new, 512, upd, cache), ref)
    delta_cpu.commit_updates(upd)
    assert all(torch.equal(bits(p), bits(s)) for s, p in new)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 65537])
def test_flatnonzero_sparse(n):
    rng = np.random.default_rng(n)
    for p in (0.0, 0.001, 0.02, 0.1, 0.3, 1.0):
        m = rng.random(n) < p
        assert np.array_equal(C.flatnonzero_sparse(m), np.flatnonzero(m))


def _dsts(shapes, dtype, kind="contig"):
    """(buffer, view) per shape: the buffers poisoned (all bits set) around and under each view."""
    out = []
    for s in shapes:
        n = math.prod(s)
        if kind == "transposed" and len(s) == 2:
            buf = torch.empty(s[1], s[0], dtype=dtype)
            view = buf.t()
        else:
            buf = torch.empty(n + 9, dtype=dtype)
            view = buf[5:5 + n].view(s)
        bits(buf).fill_(-1)
        out.append((buf, view))
    return out


@pytest.mark.parametrize("kind", ["contig", "transposed"])
def test_unpack_plan_poisoned(kind):
    """Into poisoned destinations (each holding the poison as its 'old version'): exactly what the reference
    unpack writes, over the whole buffers, version after version with one plan."""
    g = torch.Generator().manual_seed(11)
    shapes = [(64, 96), (7,), (0, 5), (3, 1000), (1,)]
    pairs = make_pairs(shapes, torch.bfloat16, g)
    for s, p in pairs:
        bits(s).fill_(-1)
        bits(p).fill_(-1)
    ours, ref = _dsts(shapes, torch.bfloat16, kind), _dsts(shapes, torch.bfloat16, kind)
    plan = C.UnpackPlan([v for _b, v in ours])
    assert plan.fast == (kind == "contig")
    for frac in (0.02, 0.0, 0.3, 1.0, 0.005):
        for s, _p in pairs:
            flip(s, frac, g)
        msg = torch_pack_v1(pairs, 1024, update=True)
        C.unpack_with(plan, msg, None)
        D._tensor_unpack(msg, [v for _b, v in ref])
        for (a, _va), (b, _vb) in zip(ours, ref, strict=True):
            assert torch.equal(bits(a), bits(b))
        for (_a, va), (s, _p) in zip(ours, pairs, strict=True):
            assert torch.equal(bits(va), bits(s))


def _corrupt_cases(msg: torch.Tensor) -> list[torch.Tensor]:
    """Messages with a bad body: an offset past its chunk, a bitmask with a bit too many, a bitmask bit past
    the chunk's end; and a bad header (a count too large)."""
    out = []
    for c in D.describe(msg):
        body = c["offset"] + 16
        if c["kind"] == "offsets" and c["count"]:
            m = msg.clone()
            m[body:body + 2].view(torch.int16)[0] = c["numel"] + 3 if c["numel"] + 3 < 32768 else -1
            out.append(m)
        if c["kind"] == "bitmask" and c["count"]:
            m = msg.clone()
            words = m[body:body + 4 * ((c["numel"] + 31) // 32)].view(torch.int32)
            words[0] = words[0] ^ (1 << 31)
            out.append(m)
            if c["numel"] % 32:
                m = msg.clone()
                words = m[body:body + 4 * ((c["numel"] + 31) // 32)].view(torch.int32)
                words[-1] = words[-1] | (1 << 31)
                out.append(m)
    m = msg.clone()
    first = D.describe(msg)[0]
    m[first["offset"] + 8:first["offset"] + 12].view(torch.int32)[0] = first["numel"] + 1
    out.append(m)
    return out


def test_unpack_plan_errors_match_and_write_nothing():
    """Every bad message: the same ValueError text as ``numpy_unpack``, nothing written."""
    g = torch.Generator().manual_seed(13)
    shapes = [(40, 100), (77,)]
    pairs = make_pairs(shapes, torch.bfloat16, g)
    for (s, _p), frac in zip(pairs, (0.08, 0.01), strict=True):
        flip(s, frac, g)
    msg = torch_pack_v1(pairs, 2048, update=False)
    assert {c["kind"] for c in D.describe(msg)} >= {"bitmask", "offsets"}
    bad = _corrupt_cases(msg)
    assert len(bad) >= 4
    names = ["w", "b"]
    for m in bad:
        ours, ref = _dsts(shapes, torch.bfloat16), _dsts(shapes, torch.bfloat16)
        plan = C.UnpackPlan([v for _b, v in ours])
        with pytest.raises(ValueError) as e_ref:
            delta_cpu.numpy_unpack(m, [v for _b, v in ref], names)
        with pytest.raises(ValueError) as e_ours:
            C.unpack_with(plan, m, names)
        assert str(e_ours.value) == str(e_ref.value)
        assert all(bool((bits(b) == -1).all()) for b, _v in ours)


def test_unpack_plan_directory_out_of_order():
    """Two chunks with equal headers and the directory entries swapped: a valid message (each body lands in the
    other's destination), as the reference unpack lands it."""
    g = torch.Generator().manual_seed(19)
    base = torch.randint(-1000, 1000, (4096,), generator=g, dtype=torch.int16)
    at = torch.rand(4096, generator=g) < 0.02
    s1, s2 = base.clone(), base.clone()
    s1[at] ^= 1
    s2[at] ^= 2
    msg = torch_pack_v1([(s1, base.clone()), (s2, base.clone())], 4096, update=False)
    d = msg[16:32].view(torch.int64)
    d[:] = d.flip(0).clone()
    ours = [base.clone(), base.clone()]
    ref = [base.clone(), base.clone()]
    C.unpack_with(C.UnpackPlan(ours), msg, None)
    delta_cpu.numpy_unpack(msg, ref, None)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1]) and torch.equal(ours[0], s2)


def test_unpack_cache_rebuilds_for_other_views():
    g = torch.Generator().manual_seed(17)
    shapes = [(30, 40), (100,)]
    pairs = make_pairs(shapes, torch.bfloat16, g)
    for s, _p in pairs:
        flip(s, 0.05, g)
    msg = torch_pack_v1(pairs, 1024, update=False)
    cache: dict = {}
    a = [v for _b, v in _dsts(shapes, torch.bfloat16)]
    D.unpack_delta(msg, a, backend="torch", cache=cache)
    first = cache["unpack"]
    b = [v for _b, v in _dsts(shapes, torch.bfloat16)]
    D.unpack_delta(msg, b, backend="torch", cache=cache)
    assert cache["unpack"] is not first
    for x, y in zip(a, b, strict=True):
        assert torch.equal(bits(x), bits(y))
    changed = [bits(s) != bits(p) for s, p in pairs]
    for y, s, m in zip(b, pairs, changed, strict=True):
        assert torch.equal(bits(y)[m], bits(s[0])[m]) and bool((bits(y)[~m] == -1).all())


def rebind_world(rank: int, world: int) -> list:
    """Rank 0 sends rows, rank 1 holds columns. Delta refits with the same tensors, then with new source and
    destination tensors (the Bound and its per-message plans rebuilt), then a new Resharder: every refit
    exact, every delta sent as one."""
    from triton_reshard import Layout, Resharder, Shard, plan_reshard
    from triton_reshard.execute.delta import DeltaRequest

    shapes = {"a": (256, 384), "b": (129, 64)}
    src_l = Layout.from_placements(shapes, [0], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(shapes, [1], [Shard(1)], torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    pub = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    src = src_l.shard(pub, rank) if rank == 0 else {}
    dst = dst_l.allocate(rank) if rank == 1 else {}
    for t in dst.values():
        bits(t).fill_(-1)
    r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60)
    out = []
    for v in range(8):
        if v:
            for t in pub.values():
                flip(t, 0.02, torch.Generator().manual_seed(v))
        if v == 4:  # new tensors on both sides: the destinations hold version 3 (copies)
            src = {n: t.clone() for n, t in src.items()}
            dst = {n: t.clone() for n, t in dst.items()}
        if v == 6:  # a new Resharder (its first refit captures: dense)
            r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60)
        if rank == 0:
            for n, t in src_l.shard(pub, rank).items():
                src[n].copy_(t)
        rep = r.run(src, dst, delta=DeltaRequest(v, held=None if v == 0 else v - 1))
        want = dst_l.shard(pub, rank) if rank == 1 else {}
        plans = [type(p).__name__ for c in r._bound.delta_cache.values() for p in c.values()]
        out.append((rep.mode, all(torch.equal(bits(dst[n]), bits(t)) for n, t in want.items()), plans))
    return out


def test_rebound_delta_refits_exact():
    from triton_reshard.testing.launch import run_world

    res = run_world(rebind_world, 2)
    for rank, rows in enumerate(res):
        modes = [m for m, _ok, _p in rows]
        assert modes == ["dense-fallback", "delta", "delta", "delta", "delta", "delta", "dense-fallback", "delta"], modes
        assert all(ok for _m, ok, _p in rows), rows
        want = "V2PackPlan" if rank == 0 else "UnpackPlan"  # the CPU default, format v2 (ops/delta_native.py)
        assert all(want in p for m, _ok, p in rows if m == "delta"), rows
