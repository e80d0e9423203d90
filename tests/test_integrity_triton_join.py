"""Issue 46 item 2 for joined delta messages on the Triton backend (interpreted on CPU): sends that share a
snapshot (a replicated tensor: the same box to both receivers) are packed each alone and joined
(``ops.delta.join_messages``); the join's bodies are written by the digesting copy kernel, so the joined message
is hashed in the join's own pass (its header and directory, a few words, at ``on_post``), not read again. Over a
spawned gloo world of 3 (rank 0 holds every tensor, ranks 1-2 receive): every join hashed by the kernel, clean
delta refits bit-exact with equal digests on every rank, and a bit flipped in a joined message in flight caught
on every rank, then repaired by the next refit (dense).

Fails without the fused join: the count of joins hashed by the copy kernel is 0."""

from __future__ import annotations

import os

import pytest
import torch

from tests.integrity_cases import RecvFault, flip_delta_value
from triton_reshard import Layout, Replicate, Resharder, Shard, plan_reshard
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world

SHAPES = {"a": (24, 16), "b": (20, 16), "c": (16, 12)}


def _layouts():
    src = Layout.from_placements(SHAPES, [0], [Replicate()])
    place = {"a": [Replicate()], "b": [Shard(0)], "c": [Shard(1)]}  # "a": one snapshot, joined into both messages
    return src, Layout.from_placements(SHAPES, [1, 2], place)


def _data(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4646)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    for v in range(1, version + 1):
        for t in out.values():
            t.view(-1)[v::7] += 0.25
    return out


def joined_world(rank: int, world: int) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton_reshard.execute.strategies as xs

    joins, fused, real_join, real_copy = [0], [0], xs.join_messages, xs.triton_copy_digest

    def join(msgs, copy=None):
        joins[0] += 1
        return real_join(msgs, copy)

    def copy_digest(*a, **k):  # the digesting copy kernel writing a join's bodies
        got = real_copy(*a, **k)
        fused[0] += got is not None
        return got

    xs.join_messages, xs.triton_copy_digest = join, copy_digest
    src_l, dst_l = _layouts()
    r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60, backend="triton", direct_min_bytes=256)
    src = {n: t.clone() for n, t in _data(0).items()} if rank == 0 else {}
    dst = {n: torch.full(s.shape, float("nan")) for n, s in dst_l.local_specs(rank).items()} if rank else {}
    out: dict = {"modes": [], "exact": []}

    def go(v, held):
        if rank == 0:
            for n, t in _data(v).items():
                src[n].copy_(t)
        try:
            out["modes"].append(r.run(src, dst, delta=DeltaRequest(v, held=held)).mode)
        except Exception as e:
            out["modes"].append(type(e).__name__)
        want = dst_l.shard(_data(v), rank) if rank else {}
        out["exact"].append(all(torch.equal(dst[n].view(torch.int32), want[n].view(torch.int32)) for n in want))

    go(0, None)
    go(1, 0)
    fault = RecvFault(flip_delta_value) if rank == 1 else None
    with fault if fault is not None else _Nothing():
        go(2, 1)
    out["fired"] = fault.fired if fault is not None else None
    go(3, None)
    out["joins"], out["fused"] = joins[0], fused[0]
    return out


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_joined_delta_messages_are_hashed_by_the_copy_that_joins_them():
    res = run_world(joined_world, 3, backend="gloo", timeout=400)
    assert res[0]["joins"] > 0 and res[0]["fused"] == res[0]["joins"], res[0]  # every join hashed in its pass
    for rank, out in enumerate(res):
        assert out["modes"] == ["dense-fallback", "delta", "ReshardIntegrityError", "dense-fallback"], (rank, out)
        assert out["exact"][0] and out["exact"][1] and out["exact"][3], (rank, out["exact"])
    assert res[1]["fired"] and not res[1]["exact"][2]
