"""``refit(..., delta="auto")`` (issue 44: a delta never slower than dense, on any link and any CPU): without a
topology every rank compares what its own runs took (``execute.delta_cost.MEASURED``), the last dense refits'
step loops against the last deltas'. The choice rides on the plan handshake as the topology's does, so every
rank makes the same one; the refit after 8 deltas in a row goes dense to measure dense again.

The world tests fix what the runs "took" (``strategies.run_seconds`` patched in each rank: a dense run 1 us and a
delta 1 s, or the other way round) so the sequence of modes is deterministic; the diffs and applies are real,
and every refit lands bit for bit in destinations poisoned once at the start."""

from __future__ import annotations

import pytest
import torch

from tests.test_delta_cost import _pub as published
from triton_reshard import Layout, Shard, clear_cache, refit
from triton_reshard.execute import delta as D
from triton_reshard.execute import strategies
from triton_reshard.execute.delta_cost import (
    MEASURED,
    PROBE_DENSE,
    PROBE_WHY,
    RUNS,
    DeltaCost,
    cost_choice,
    cost_row,
)
from triton_reshard.refit import delta_request
from triton_reshard.testing.launch import run_world

SHAPES = {"a": (256, 384), "b": (128, 192)}


def _pub(version: int) -> dict[str, torch.Tensor]:
    return published(version, SHAPES)  # seeded; each version flips the low bit of ~2 % of the elements


def _elig(rank=0):
    return D.Eligible((), (), {}, {}, rank=rank, send_peers=((1, 10**6),), recv_peers=())


def test_delta_request_auto():
    assert delta_request("auto", 3).topology is MEASURED
    assert not delta_request("auto", 3).strict
    assert delta_request(True, 3).topology is None  # a plain delta: no cost model, as before
    with pytest.raises(ValueError, match="'auto'"):
        delta_request("sometimes", 3)
    with pytest.raises(TypeError, match="int version"):
        delta_request("auto", None)


def test_measured_row_and_probe():
    cost = DeltaCost()
    assert cost_row(_elig(), cost, MEASURED) == [-1] * D.COST_FIELDS  # nothing measured
    cost = cost.after_dense(0.010)
    assert cost_row(_elig(), cost, MEASURED) == [-1] * D.COST_FIELDS  # no delta measured yet
    cost = cost.after_delta(0.004, 0.003, 0.020, (5, 100), (0, 0))  # a cold first delta
    assert (cost.send_ratio, cost.since_dense, cost.runs, cost.dense_runs) == (0.05, 1, (0.020,), (0.010,))
    assert cost_row(_elig(), cost, MEASURED) == [-1] * D.COST_FIELDS  # one delta does not decide alone
    cost = cost.after_delta(0.002, 0.001, 0.006, (5, 100), (0, 0))
    # (the fastest dense run, the fastest delta run, the diff and apply medians) in us, then the kind
    assert cost_row(_elig(), cost, MEASURED) == [10000, 6000, 3000, 2000, RUNS] and cost.asked == 1
    assert cost_choice([[10000, 6000, 3000, 2000, RUNS]]) is None  # 6 ms <= 10 ms: a delta
    # whole runs, the slowest rank's each way (not the topology's sum of the slowest phases: a rank's run
    # already waited for the others' diffs and applies)
    assert cost_choice([[10000, 6000, 6000, 0, RUNS], [4000, 9000, 0, 6000, RUNS]]) is None
    why = cost_choice([[5000, 6000, 3000, 2000, RUNS]])
    assert why.startswith(D.COST_WHY + ": 5.00 ms dense against a delta's 6.00 ms"), why
    # the fastest of the last three: a run slowed by a busy machine does not decide
    cost = cost.after_delta(0.002, 0.001, 0.500, (5, 100), (0, 0))
    assert cost.runs == (0.020, 0.006, 0.500) and cost_row(_elig(), cost, MEASURED)[1] == 6000
    # dense_probe_after() deltas since the last dense run: measure dense again (a capture, not a cost fallback)
    for _ in range(D.PROBE_EVERY):
        cost = cost.after_delta(0.002, 0.001, 0.006, (5, 100), (0, 0))
    assert cost_row(_elig(), cost, MEASURED) == [PROBE_DENSE] + [-1] * (D.COST_FIELDS - 1)
    why = cost_choice([[PROBE_DENSE, -1, -1, -1, -1], [-1] * D.COST_FIELDS])
    assert why.startswith(PROBE_WHY) and not why.startswith(D.COST_WHY)
    assert cost.after_dense(0.010).since_dense == 0
    assert cost.after_dense(0.010, why).dense_probed  # the next delta predicted faster confirms it: backoff
    confirmed = cost.after_dense(0.010, why)
    confirmed.asked = 1
    assert confirmed.after_delta(0.002, 0.001, 0.006, (5, 100), (0, 0)).dense_probe_after() == 2 * D.PROBE_EVERY
    # stale predictions: unknown after PROBE_EVERY asks, as with a topology
    cost = DeltaCost().after_dense(0.010).after_delta(0.002, 0.001, 0.006, (5, 100), (0, 0))
    cost = cost.after_delta(0.002, 0.001, 0.006, (5, 100), (0, 0))
    cost.asked = D.PROBE_EVERY
    assert cost_row(_elig(), cost, MEASURED) == [-1] * D.COST_FIELDS


def auto_world(rank: int, world: int, dense_s: float, delta_s: float, versions: int, plain: int = -1) -> list:
    """Rank 0 holds the source (rows), rank 1 the destination (columns); ``delta="auto"`` refits through the
    public ``refit``, with the runs' measured seconds fixed (dense ``dense_s``, delta ``delta_s``); version
    ``plain`` goes as a plain dense refit (no ``delta``)."""
    strategies.run_seconds = lambda loop: delta_s if isinstance(loop.strategy, strategies.Delta) else dense_s
    src_l = Layout.from_placements(SHAPES, [0], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(SHAPES, [1], [Shard(1)], torch.bfloat16)
    src = src_l.shard(_pub(0), rank) if rank == 0 else {}
    dst = dst_l.allocate(rank) if rank == 1 else {}
    for t in dst.values():
        t.view(torch.int16).fill_(-1)  # poisoned: all bits set
    out = []
    try:
        for version in range(versions):
            if rank == 0:
                for n, t in src_l.shard(_pub(version), rank).items():
                    src[n].copy_(t)
            rep = refit(src, dst, src_l, dst_l, delta="auto" if version != plain else False, version=version,
                        timeout=60)
            ok = all(torch.equal(dst[n].view(torch.int16), t.view(torch.int16))
                     for n, t in dst_l.shard(_pub(version), rank).items()) if rank == 1 else True
            out.append((rep.mode, rep.fallback or "", ok, rep.sent_bytes))
    finally:
        clear_cache()
    return out


def test_auto_goes_dense_where_dense_measured_faster():
    p = D.PROBE_EVERY
    res = run_world(auto_world, 2, 1e-6, 1.0, 3 * p + 8, backend="gloo", timeout=300)
    fb, cap = "dense-fallback", "dense-fallback"
    for rows in res:
        assert all(ok for _, _, ok, _ in rows), rows
        modes = [m for m, _, _, _ in rows]
        # dense (no snapshot), two deltas that measure, then dense predicted faster (no snapshot kept) until the
        # predictions go stale; dense with a capture (no snapshot), a probe delta that loses again: twice as
        # many cost fallbacks before the next capture and probe
        assert modes == [cap, "delta", "delta"] + [fb] * p + [cap, "delta"] + [fb] * (2 * p) + [cap, "delta", fb], rows
        costs = [k for k, r in enumerate(rows) if r[1].startswith(D.COST_WHY)]
        assert costs == [*range(3, p + 3), *range(p + 5, 3 * p + 5), 3 * p + 7], [r[1][:40] for r in rows]
        assert all("no snapshot" in rows[k][1] for k in (p + 3, 3 * p + 5)), rows
    sent = [s for _, _, _, s in res[0]]
    assert sent[1] < sent[0] / 4 and sent[p + 4] < sent[0] / 4 and sent[3] == sent[0], sent  # deltas are small


def test_auto_stays_delta_where_delta_measured_faster_and_probes_dense():
    p = D.PROBE_EVERY
    res = run_world(auto_world, 2, 1.0, 1e-6, 3 * p + 4, backend="gloo", timeout=300)
    for rows in res:
        assert all(ok for _, _, ok, _ in rows), rows
        modes = [m for m, _, _, _ in rows]
        # dense (no snapshot), PROBE_EVERY deltas, one dense run capturing the snapshot to measure dense again,
        # then deltas again; the probe confirmed the delta, so the next one waits twice as long
        assert modes == ["dense-fallback"] + ["delta"] * p + ["dense-fallback"] + ["delta"] * (2 * p) + [
            "dense-fallback", "delta"], rows
        assert rows[p + 1][1].startswith(PROBE_WHY) and rows[3 * p + 2][1].startswith(PROBE_WHY), rows


def test_a_plain_refit_starts_the_measurements_afresh():
    """A refit without ``delta`` drops the snapshot and what the cost model measured: the next ``"auto"``
    sequence measures dense and two deltas again before it chooses (without the reset it would choose at once
    from the earlier sequence's runs, e.g. another workload's on the same Resharder)."""
    res = run_world(auto_world, 2, 1e-6, 1.0, 9, 4, backend="gloo", timeout=300)
    for rows in res:
        assert all(ok for _, _, ok, _ in rows), rows
        modes = [m for m, _, _, _ in rows]
        assert modes == ["dense-fallback", "delta", "delta", "dense-fallback", "dense", "dense-fallback", "delta",
                         "delta", "dense-fallback"], rows
        assert rows[3][1].startswith(D.COST_WHY) and rows[8][1].startswith(D.COST_WHY), rows
        assert "no snapshot" in rows[5][1] and not rows[5][1].startswith(D.COST_WHY), rows[5]
