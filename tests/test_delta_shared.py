"""A box sent to several engine instances goes as one delta (issue 32, ``execute/delta.py``: ``same_sends``):
a trainer rank with two engine instances used to diff every box twice (one snapshot per message); now messages
with the same chunks of the same source boxes share one snapshot, are diffed once per refit and the later send
reuses the earlier one's message. Checked on real gloo worlds: the same bytes on the wire, every refit bit for
bit into destinations poisoned once at the start (each instance on its own), one diff per box, half the snapshot,
also when the repeated send is in a later step (small buckets), and through the cost model's dense fallbacks,
its capture and the next delta."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Resharder, Shard, plan_reshard
from triton_reshard.execute import delta as D
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world
from triton_reshard.tools.topology import Topology

SHAPES = {"a": (512, 256), "b": (256, 96)}
FAST = Topology(gpus_per_node=1, nvlink_GBps=1e9, net_GBps=1e9)  # any measured diff loses: dense fallbacks
SRC = Layout.from_placements(SHAPES, [0], [Shard(0)], torch.bfloat16)
ENGINE = Layout.from_placements(SHAPES, [1], [Shard(1)], torch.bfloat16)
DST = ENGINE.instances(2)  # ranks 1 and 2: two engine instances, each a full copy


def _pub(version: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``version``: seeded; each version flips the low bit of ~2 % of the elements."""
    g = torch.Generator().manual_seed(0)
    out = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in SHAPES.items()}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for t in out.values():
            t.view(torch.int16)[torch.rand(t.shape, generator=g) < 0.02] ^= 1
    return out


def shared_world(rank: int, world: int, bucket: int | None) -> dict:
    plan = plan_reshard(SRC, DST, relay=False, rank=rank)
    r = Resharder(plan, timeout=60, **({"bucket_bytes": bucket} if bucket else {}))
    diffs = [0]
    real_pack, real_deferred = D.ops.pack_delta, D.pack_deferred

    def pack(*a, **k):
        diffs[0] += 1
        return real_pack(*a, **k)

    def deferred(*a, **k):
        diffs[0] += 1
        return real_deferred(*a, **k)

    D.ops.pack_delta, D.pack_deferred = pack, deferred  # this process only (a spawned rank)
    src = SRC.shard(_pub(0), rank) if rank == 0 else {}
    dst = DST.allocate(rank) if rank in DST.ranks else {}
    for t in dst.values():
        t.view(torch.int16).fill_(-1)  # poisoned once: all bits set
    # (topology): dense (capture), deltas, then the fast link: PROBE_EVERY cost fallbacks (no diff, no
    # snapshot), the capture, and the next delta (then a plain delta request again)
    reqs = [None, None, None] + [FAST] * (D.PROBE_EVERY + 2) + [None]
    rows = []
    for v, topo in enumerate(reqs):
        pub = _pub(v)
        for n, t in (SRC.shard(pub, rank) if rank == 0 else {}).items():
            src[n].copy_(t)
        d0 = diffs[0]
        rep = r.run(src, dst, delta=DeltaRequest(v, held=v - 1 if v else None, topology=topo))
        want = DST.shard(pub, rank) if rank in DST.ranks else {}
        rows.append({"mode": rep.mode, "why": rep.fallback or "", "sent": rep.sent_bytes,
                     "dense": rep.dense_sent_bytes, "diffs": diffs[0] - d0,
                     "exact": all(torch.equal(dst[n].view(torch.int16), w.view(torch.int16)) for n, w in want.items())})
    el = r._delta.elig
    return {"rows": rows, "snapshot_bytes": r.snapshot_bytes, "steps": len(r.work.steps),
            "sends": sum(map(sum, el.sends)), "same": len(getattr(el, "same", {}))}


@pytest.mark.parametrize("bucket", [None, 64 << 10])
def test_one_diff_per_box_for_two_instances(bucket):
    res = run_world(shared_world, 3, bucket, backend="gloo", timeout=300)
    trainer = res[0]
    sends = trainer["rows"][0]["dense"]
    # both instances' messages are the same boxes: one snapshot of half the dense bytes sent
    assert trainer["snapshot_bytes"] * 2 == sends, (trainer["snapshot_bytes"], sends)
    assert trainer["sends"] == 2 * trainer["same"] > 0, trainer  # each box's message repeated once
    if bucket:  # small buckets: several steps, the repeated sends in later ones than the first
        assert trainer["steps"] > 2, trainer["steps"]
    for rank, o in enumerate(res):
        modes = [row["mode"] for row in o["rows"]]
        assert all(row["exact"] for row in o["rows"]), (rank, o["rows"])
        assert modes[:3] == ["dense-fallback", "delta", "delta"], modes
        # the fast link: PROBE_EVERY cost fallbacks (from what v2's delta measured), a capture, a delta again
        fb = o["rows"][3:3 + D.PROBE_EVERY]
        assert all(r["mode"] == "dense-fallback" and r["why"].startswith(D.COST_WHY) for r in fb), modes
        cap = o["rows"][3 + D.PROBE_EVERY]
        assert cap["mode"] == "dense-fallback" and "no snapshot" in cap["why"], cap
        assert modes[4 + D.PROBE_EVERY:] == ["delta", "delta"], modes
    rows = trainer["rows"]
    for row in rows:
        if row["mode"] == "delta":  # the same bytes on the wire as two diffs, from half the diffs
            assert row["sent"] < row["dense"] / 4
        else:  # a dense run diffs nothing
            assert row["diffs"] == 0, row
    # one diff per box for the two instances' messages (was one per message: twice as many)
    deltas = [row["diffs"] for row in rows if row["mode"] == "delta"]
    assert deltas and all(d == trainer["sends"] - trainer["same"] for d in deltas), (deltas, trainer["sends"])
