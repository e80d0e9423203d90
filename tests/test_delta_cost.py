"""The delta refit's cost fallback (issue 32, ``execute/delta.py``: ``cost_row`` / ``cost_choice``): a delta
request that knows the cluster (``DeltaRequest(topology=...)``) goes dense when what the last delta measured
predicts it slower than a dense refit, on every rank alike (the prediction rides on the plan handshake: no
round of its own), without the snapshot copy (the snapshot is dropped), and after ``PROBE_EVERY`` such dense
refits captures a snapshot again and re-measures a delta. Every refit lands bit for bit in destinations poisoned once at the
start; without a topology (or with ``strict``) every refit whose fence passes is a delta, as before."""

from __future__ import annotations

import torch

from triton_reshard import Layout, Resharder, Shard, plan_reshard
from triton_reshard.execute import delta as D
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world
from triton_reshard.tools.topology import Topology

SHAPES = {"a": (1024, 1024), "b": (512, 768)}
SMALL = {f"t{i}": (64, 96) for i in range(8)}  # packed into one staged message (a receive that can be pre-posted)
# links so fast that any measured diff time loses, and so slow that any delta that saves bytes wins
FAST = Topology(gpus_per_node=1, nvlink_GBps=1e9, net_GBps=1e9)
SLOW = Topology(gpus_per_node=1, nvlink_GBps=1e-3, net_GBps=1e-3)


def _pub(version: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    """The global tensors of ``version``: seeded; each version flips the low bit of ~2 % of the elements."""
    g = torch.Generator().manual_seed(0)
    out = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for t in out.values():
            m = torch.rand(t.shape, generator=g) < 0.02
            t.view(torch.int16)[m] ^= 1
    return out


def cost_world(rank: int, world: int) -> list[dict]:
    """Rank 0 holds the source (rows), rank 1 the destination (columns, a transpose of the split)."""
    src_l = Layout.from_placements(SHAPES, [0], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(SHAPES, [1], [Shard(1)], torch.bfloat16)
    r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60)
    real_prepack, prepacks = r._prepack, [0]

    def counted(*a):  # step 0 packed during the handshake, as a dense run does
        prepacks[0] += 1
        return real_prepack(*a)

    r._prepack = counted
    src = src_l.shard(_pub(0), rank) if rank == 0 else {}
    dst = dst_l.allocate(rank) if rank == 1 else {}
    for t in dst.values():
        t.view(torch.int16).fill_(-1)  # poisoned: all bits set
    # (version, topology, strict) in order: first dense (no snapshot), then a delta (nothing measured yet),
    # then the fast link: dense (predicted faster, no snapshot kept); the slow link: dense again (capturing
    # the snapshot), then delta; the fast link: PROBE_EVERY dense, then a capture and a delta re-measure; no
    # topology: delta; strict on the fast link: delta; the slow link: delta
    plan = [(0, FAST, False), (1, FAST, False), (2, FAST, False), (3, SLOW, False), (4, SLOW, False)]
    plan += [(5 + k, FAST, False) for k in range(D.PROBE_EVERY + 2)]
    v = plan[-1][0]
    plan += [(v + 1, None, False), (v + 2, FAST, True), (v + 3, SLOW, False)]
    rows = []
    for version, topo, strict in plan:
        before = prepacks[0]
        if rank == 0:
            for n, t in src_l.shard(_pub(version), rank).items():
                src[n].copy_(t)
        rep = r.run(src, dst, delta=DeltaRequest(version, held=None if version == 0 else version - 1,
                                                  strict=strict, topology=topo))
        ok = all(torch.equal(dst[n].view(torch.int16), t.view(torch.int16))
                 for n, t in dst_l.shard(_pub(version), rank).items()) if rank == 1 else True
        rows.append({"version": version, "mode": rep.mode, "why": rep.fallback, "exact": ok,
                     "sent": rep.sent_bytes, "dense": rep.dense_sent_bytes, "snap": r.snapshot_version,
                     "prepacked": prepacks[0] - before})
    return rows


def test_cost_fallback_bit_exact_and_agreed():
    res = run_world(cost_world, 2, backend="gloo", timeout=300)
    for rank, rows in enumerate(res):
        modes = [row["mode"] for row in rows]
        assert all(row["exact"] for row in rows), (rank, rows)
        assert modes[0] == "dense-fallback" and "no snapshot" in rows[0]["why"]
        assert modes[1] == "delta"  # nothing measured yet: a delta, which measures
        cost = [k for k, row in enumerate(rows) if (row["why"] or "").startswith(D.COST_WHY)]
        assert cost == [2] + list(range(5, 5 + D.PROBE_EVERY)), [(row["mode"], row["why"]) for row in rows]
        # the slow link: the first dense (no snapshot after the cost fallback), then a delta
        assert modes[3:5] == ["dense-fallback", "delta"] and "no snapshot" in rows[3]["why"], rows[3:5]
        probe = modes[5 + D.PROBE_EVERY:7 + D.PROBE_EVERY]  # after PROBE_EVERY: capture, then a delta re-measures
        assert probe == ["dense-fallback", "delta"], rows[5 + D.PROBE_EVERY:7 + D.PROBE_EVERY]
        assert modes[-3:] == ["delta", "delta", "delta"], rows[-3:]  # no topology; strict; slow link
        # a cost fallback keeps no snapshot (it copied none); every other refit does
        assert all(row["snap"] == (None if k in cost else row["version"]) for k, row in enumerate(rows)), rows
        # a cost fallback packs step 0 while the handshake travels, as a plain dense refit does; a delta
        # (strict too, whatever its cost columns say) diffs instead
        assert all(row["prepacked"] == 1 for k, row in enumerate(rows) if k in cost), rows
        assert all(row["prepacked"] == 0 for row in rows if row["mode"] == "delta"), rows
    # the same choice on both ranks, and a delta sent far less than dense
    assert [row["mode"] for row in res[0]] == [row["mode"] for row in res[1]]
    assert all(row["sent"] < row["dense"] / 4 for row in res[0] if row["mode"] == "delta")


def _elig(rank, sends, recvs):
    return D.Eligible((), (), {}, {}, rank=rank, send_peers=tuple(sends), recv_peers=tuple(recvs))


def test_cost_row_and_choice():
    topo = Topology(gpus_per_node=2, nvlink_GBps=10.0, net_GBps=1.0, shared_nic=True)
    cost = D.DeltaCost(pack_s=0.002, unpack_s=0.001, send_ratio=0.05, recv_ratio=0.1)
    # rank 0 sends 1 MB to rank 2 (other node: half of 1 GB/s) and 1 MB to rank 1 (same node: 10 GB/s)
    row = D.cost_row(_elig(0, [(2, 10**6), (1, 10**6)], []), cost, topo)
    assert row == [2000, 100, 2000, 1000, D.TOPOLOGY] and cost.asked == 1
    assert D.cost_row(_elig(0, [], []), D.DeltaCost(), topo) == [-1] * D.COST_FIELDS  # nothing measured
    assert D.cost_row(_elig(0, [], []), cost, None) == [-1] * D.COST_FIELDS  # no topology
    cost.asked = D.PROBE_EVERY
    assert D.cost_row(_elig(0, [], []), cost, topo) == [-1] * D.COST_FIELDS  # stale: probe again
    # the slowest diff, wire and apply add up (each waits for the one before) against the slowest dense wire
    assert D.cost_choice([[5000, 100, 2000, 0], [0, 0, 0, 2000]]) is None  # 4.1 ms <= 5 ms: delta
    why = D.cost_choice([[3000, 100, 2000, 0], [0, 0, 0, 2000]])
    assert why.startswith("predicted faster dense: 3.00 ms") and "4.00 ms diff" not in why
    assert D.cost_choice([[3000, 100, 2000, 0], [-1, -1, -1, -1]]) is None  # a rank unsure: delta


def refit_world(rank: int, world: int) -> list:
    """The same choice through ``refit(..., delta=True, topology=)``: the public entry point passes the topology
    into the delta request (first dense, then a delta that measures, then the fast link's cost fallback)."""
    from triton_reshard import clear_cache, refit

    src_l = Layout.from_placements(SHAPES, [0], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(SHAPES, [1], [Shard(1)], torch.bfloat16)
    src = src_l.shard(_pub(0), rank) if rank == 0 else {}
    dst = dst_l.allocate(rank) if rank == 1 else {}
    for t in dst.values():
        t.view(torch.int16).fill_(-1)
    out = []
    try:
        try:
            refit(src, dst, src_l, dst_l, delta=True, version=0, topology="fast", timeout=60)
        except TypeError as e:
            out.append(str(e))
        for version in range(3):
            if rank == 0:
                for n, t in src_l.shard(_pub(version), rank).items():
                    src[n].copy_(t)
            rep = refit(src, dst, src_l, dst_l, delta=True, version=version, topology=FAST, timeout=60)
            ok = all(torch.equal(dst[n].view(torch.int16), t.view(torch.int16))
                     for n, t in dst_l.shard(_pub(version), rank).items()) if rank == 1 else True
            out.append([rep.mode, rep.fallback or "", ok])
    finally:
        clear_cache()
    return out


def test_refit_passes_the_topology_to_the_delta_request():
    res = run_world(refit_world, 2, backend="gloo", timeout=300)
    for rows in res:
        assert "topology='fast'" in rows[0], rows[0]
        assert all(ok for _, _, ok in rows[1:]), rows
        assert [m for m, _, _ in rows[1:]] == ["dense-fallback", "delta", "dense-fallback"], rows
        assert rows[3][1].startswith(D.COST_WHY), rows[3]


def prepost_world(rank: int, world: int) -> list[dict]:
    """After a cost fallback, the next delta request predicted dense again posts its first receives with the
    handshake (as a plain dense refit does) and its fence row makes the refit dense on every rank; a strict
    request on the other rank then refuses on both after closing those receives (the group stays usable);
    a slower link afterwards: dense with a capture (the snapshot was dropped), then a delta again."""
    src_l = Layout.from_placements(SMALL, [0], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(SMALL, [1], [Shard(1)], torch.bfloat16)
    r = Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=60)
    real_prepost, preposts = r._prepost, [0]

    def counted(b):
        out = real_prepost(b)
        preposts[0] += bool(out)
        return out

    r._prepost = counted
    src = src_l.shard(_pub(0, SMALL), rank) if rank == 0 else {}
    dst = dst_l.allocate(rank) if rank == 1 else {}
    for t in dst.values():
        t.view(torch.int16).fill_(-1)  # poisoned: all bits set
    # (version, topology, strict on rank 0): capture, a delta that measures, cost fallbacks (the second
    # preposted), a strict one on rank 0 (refused on both), cost fallbacks again, the slow link
    steps = [(0, FAST, False), (1, FAST, False), (2, FAST, False), (3, FAST, False), (4, FAST, True),
             (4, FAST, False), (5, FAST, False), (6, SLOW, False), (7, SLOW, False)]
    rows, held = [], None
    for version, topo, strict in steps:
        before = preposts[0]
        if rank == 0:
            for n, t in src_l.shard(_pub(version, SMALL), rank).items():
                src[n].copy_(t)
        row: dict = {"version": version}
        try:
            rep = r.run(src, dst, delta=DeltaRequest(version, held=held, strict=strict and rank == 0,
                                                      topology=topo))
            row.update(mode=rep.mode, why=rep.fallback or "")
            held = version
        except D.DeltaRefusedError as e:
            row.update(mode="refused", why=str(e))
        row["preposted"] = preposts[0] - before
        row["exact"] = all(torch.equal(dst[n].view(torch.int16), t.view(torch.int16))
                           for n, t in dst_l.shard(_pub(held, SMALL), rank).items()) if rank == 1 else True
        rows.append(row)
    return rows


def test_cost_fallback_posts_receives_like_dense():
    res = run_world(prepost_world, 2, backend="gloo", timeout=300)
    for rank, rows in enumerate(res):
        modes = [row["mode"] for row in rows]
        assert all(row["exact"] for row in rows), (rank, rows)  # a refused refit left the last version
        assert modes == ["dense-fallback", "delta", "dense-fallback", "dense-fallback", "refused",
                         "dense-fallback", "dense-fallback", "dense-fallback", "delta"], (rank, rows)
        assert all(rows[k]["why"].startswith(D.COST_WHY) for k in (2, 3, 5, 6)), rows
        # (strict after a cost fallback: the dropped snapshot refuses it; rank 1's receives were closed first)
        assert "no snapshot" in rows[4]["why"] and "nothing was moved" in rows[4]["why"], rows[4]
        assert "no snapshot" in rows[7]["why"], rows[7]  # the slow link: dense with a capture, then a delta
    # the receiver posted step 0 with the handshake in the refits after a cost fallback (none before)
    assert [row["preposted"] for row in res[1]] == [0, 0, 0, 1, 1, 0, 1, 1, 0], res[1]
