"""Zero-copy sends and receives (issue 44 item 4) on a real gloo world of 3: a trainer rank holding full tensors
(views at storage offsets inside one buffer) refits an engine of TP2 (ranks 1-2: row-split tensors, contiguous in
both; a column-split one, strided in the source and contiguous in the destination; a 1-D one), every contiguous
box a direct message (``direct_min_bytes=0``). Destinations are views at offsets inside one poisoned buffer: the
bytes around them must stay poisoned. Dense runs (destinations poisoned before each) and delta runs land bit for
bit what slicing the global tensors gives; the engine receives everything in place, the trainer sends every box
contiguous in its source in place; a delta diffs the column-split (row-strided) sources where they lie with the
native codec, never its numpy fallback."""

from __future__ import annotations

import math

import torch

from triton_reshard import Layout, Replicate, Resharder, Shard, plan_reshard
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world

SHAPES = {"qkv": (96, 64), "o": (64, 96), "e": (1000,), "up": (160, 64)}
PLACE = {"qkv": [Shard(0)], "o": [Shard(1)], "e": [Shard(0)], "up": [Shard(0)]}
SRC = Layout.from_placements(SHAPES, [0], [Replicate()], torch.bfloat16)
DST = Layout.from_placements(SHAPES, [1, 2], PLACE, torch.bfloat16)
GUARD = 24  # elements of poison before, between and after the views
POISON = -1  # int16: all bits set (a NaN)


def _pub(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for t in out.values():
            t.view(torch.int16)[torch.rand(t.shape, generator=g) < 0.03] ^= 1
    return out


def _carve(specs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One bf16 buffer holding every tensor as a contiguous view at a storage offset, GUARD elements apart."""
    total = GUARD + sum(math.prod(s) + GUARD for s in specs.values())
    buf = torch.zeros(total, dtype=torch.bfloat16)
    views, at = {}, GUARD
    for n, shape in specs.items():
        k = math.prod(shape)
        views[n] = buf[at : at + k].view(shape)
        at += k + GUARD
    return buf, views


def _guards_ok(buf: torch.Tensor, views: dict) -> bool:
    mask = torch.ones(buf.numel(), dtype=torch.bool)
    for v in views.values():
        a = v.storage_offset()
        mask[a : a + v.numel()] = False
    return bool((buf.view(torch.int16)[mask] == POISON).all())


def zero_copy_world(rank: int, world: int) -> dict:
    from triton_reshard.ops import delta_native as DN

    fallbacks = [0]
    real = DN.pack_v2_numpy

    def counted(*a, **k):
        fallbacks[0] += 1
        return real(*a, **k)

    DN.pack_v2_numpy = counted  # this spawned rank only
    plan = plan_reshard(SRC, DST, rank=rank)
    r = Resharder(plan, timeout=60, direct_min_bytes=0)
    _sbuf, src = _carve({n: tuple(s.shape) for n, s in SRC.local_specs(rank).items()} if rank == 0 else {})
    dbuf, dst = _carve({n: tuple(s.shape) for n, s in DST.local_specs(rank).items()} if rank else {})
    dbuf.view(torch.int16).fill_(POISON)
    out: dict = {"native": DN.native() is not None, "runs": []}
    plan_ = [("dense", None), ("dense", None), ("capture", 0), ("delta", 1), ("delta", 2), ("dense", 3)]
    for kind, version in plan_:
        v = version if version is not None else 0
        pub = _pub(v)
        for n, t in src.items():
            t.copy_(pub[n])
        if kind == "dense":
            for t in dst.values():
                t.view(torch.int16).fill_(POISON)
        before = fallbacks[0]
        if kind == "dense":
            rep = r.run(src, dst)
        elif kind == "capture":
            rep = r.run(src, dst, delta=DeltaRequest(v))
        else:
            rep = r.run(src, dst, delta=DeltaRequest(v, held=v - 1))
        want = DST.shard(pub, rank) if rank else {}
        exact = all(torch.equal(dst[n].view(torch.int16), want[n].view(torch.int16)) for n in dst)
        out["runs"].append(
            {
                "kind": kind,
                "mode": rep.mode,
                "exact": exact,
                "guards": _guards_ok(dbuf, dst),
                "in_place": rep.in_place_bytes,
                "sent": rep.sent_bytes,
                "recv": rep.recv_bytes,
                "fallbacks": fallbacks[0] - before,
            }
        )
    return out


def test_zero_copy_sends_and_receives_land_bit_for_bit():
    res = run_world(zero_copy_world, 3, backend="gloo", timeout=240)
    strided = sum(math.prod(SHAPES[n]) * 2 for n, p in PLACE.items() if p[0].dim == 1)
    for rank, o in enumerate(res):
        for k, run in enumerate(o["runs"]):
            assert run["exact"] and run["guards"], (rank, k, run)
            assert (
                run["mode"] == {"dense": "dense", "capture": "dense-fallback", "delta": "delta"}[run["kind"]]
            )
            if run["kind"] == "delta" and o["native"]:
                assert run["fallbacks"] == 0, (rank, k, run)  # strided sources staged, diffed natively
        dense = o["runs"][0]
        if rank:  # every box lands in place in the engine's contiguous local tensors
            assert dense["recv"] > 0 and dense["in_place"] == dense["recv"], (rank, dense)
        else:  # the trainer sends every box in place but the column blocks (strided in its source)
            assert dense["in_place"] == dense["sent"] - strided, (dense, strided)


def test_row_strided_sources_pack_natively_to_the_reference_bytes():
    """Column blocks of row-major tensors (2-D views with a row stride; chunks that start and end inside rows)
    are diffed where they lie by the native codec: the same message bytes and the same snapshot update as the
    numpy reference on contiguous copies, for every element size; other strided views are not read in place."""
    import pytest

    from triton_reshard.ops import delta_native as DN
    from triton_reshard.ops.delta_v2 import pack_v2_numpy

    if DN.native() is None:
        pytest.skip("the native codec is not built")
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.int8, torch.bfloat16, torch.float32, torch.float64):
        base = [torch.randn(37, 300, generator=g).to(dtype), torch.randn(5, 1000, generator=g).to(dtype)]
        srcs = [base[0][:, 17:230], base[1][:, 500:], base[0][3:4, :]]  # strided, strided, contiguous
        snaps = [s.clone() for s in srcs]
        for s in srcs:
            flip = torch.rand(s.shape, generator=g) < 0.05
            bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[s.element_size()]
            s.view(bits)[flip] += 1
        ref_snaps = [p.clone() for p in snaps]
        ref = pack_v2_numpy([(s.contiguous(), p) for s, p in zip(srcs, ref_snaps, strict=True)], 1024, True)
        plan = DN.V2PackPlan(list(zip(srcs, snaps, strict=True)), 1024)
        assert plan.fast and plan.rows is not None
        msg = plan.pack(True)
        assert torch.equal(msg, ref), dtype
        assert all(torch.equal(a, b) for a, b in zip(snaps, ref_snaps, strict=True)), dtype
    t = torch.zeros(4, 6, 8)
    assert DN.reads_in_place(t.view(4, 48)[:, 16:32]) and not DN.reads_in_place(t[:, :, 2:4])
    assert not DN.reads_in_place(t.view(4, 48).t())
