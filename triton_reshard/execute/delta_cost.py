"""The delta refit's cost model (issue 32; split from ``execute/delta.py``, whose module doc and docs/delta.md
describe it): what each rank's last delta measured (:class:`DeltaCost`), the predicted times it puts in the
handshake row (:func:`cost_row`) and the choice every rank makes from all rows alike (:func:`cost_choice`).

Two ways to predict (``DeltaRequest.topology``): a :class:`~triton_reshard.tools.topology.Topology` (the dense
wire time from the link rates, the delta's from its measured changed bytes), or :data:`MEASURED` (``refit(...,
delta="auto")``: no model of the links at all; each rank compares what its own runs took, the last dense
refits' step loop against the last deltas'; right wherever the machine is, loopback or a slow link, a CPU with
or without SIMD, at the price of a dense refit now and then to measure it again)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass


@dataclass(slots=True)
class DeltaCost:
    """What this rank's last delta refit measured: seconds diffing its delta-able sends (``pack_s``) and
    applying its delta receives (``unpack_s``), and the delta bytes over the dense bytes of those sends and
    receives (None: no delta measured yet). ``asked``: cost predictions made from it since (after
    :meth:`probe_after` of them the rank says "unknown" and the next refit goes as a delta again, measuring
    afresh: the changed fraction moves as training goes on)."""

    pack_s: float | None = None
    unpack_s: float | None = None
    send_ratio: float = 0.0
    recv_ratio: float = 0.0
    asked: int = 0
    # the last few deltas' (diff, apply) seconds: pack_s / unpack_s are their medians (one refit slowed by a
    # busy machine must not turn the next PROBE_EVERY refits dense)
    history: tuple[tuple[float, float], ...] = ()
    # MEASURED: the last few delta runs' and dense runs' step-loop seconds on this rank (pack + wire + unpack +
    # local copies: what the refit's transfer took, without the handshake), and the delta runs since the last
    # dense one (after dense_probe_after() of them one refit goes dense with a capture, to measure dense again)
    runs: tuple[float, ...] = ()
    dense_runs: tuple[float, ...] = ()
    since_dense: int = 0
    # each probe that changed nothing doubles the wait for the next (PROBE_EVERY << backoff, at most
    # MAX_BACKOFF doublings): a probe delta that lost again / a dense probe after which the delta won again
    backoff: int = 0
    dense_backoff: int = 0
    probed: bool = False  # the last delta ran because the predictions had gone stale (a probe)
    dense_probed: bool = False  # the last dense run was a MEASURED probe of dense (PROBE_WHY)

    def probe_after(self) -> int:
        """Predictions made from one delta's measurement before the next refit probes a delta again."""
        return PROBE_EVERY << self.backoff

    def dense_probe_after(self) -> int:
        """Deltas in a row before a MEASURED rank asks to measure dense again."""
        return PROBE_EVERY << self.dense_backoff

    def after_delta(self, diff_s: float, apply_s: float, run_s: float, sent: tuple[int, int],
                    received: tuple[int, int]) -> DeltaCost:
        """What the next refit predicts from, after a delta run that measured these (the medians of the last
        three, so one run slowed by a busy machine does not decide alone; ``asked`` starts again). A delta this
        rank predicted faster (not a probe, not unmeasured) clears the probe backoff; one right after a dense
        probe that confirmed it doubles the wait for the next dense probe."""
        hist = (self.history + ((diff_s, apply_s),))[-3:]
        stale = self.asked >= self.probe_after()
        predicted = self.asked > 0 and not stale
        return DeltaCost(
            statistics.median(h[0] for h in hist),
            statistics.median(h[1] for h in hist),
            sent[0] / sent[1] if sent[1] else 0.0,
            received[0] / received[1] if received[1] else 0.0,
            history=hist,
            runs=(self.runs + (run_s,))[-3:],
            dense_runs=self.dense_runs,
            since_dense=self.since_dense + 1,
            backoff=0 if predicted else self.backoff,
            dense_backoff=min(self.dense_backoff + 1, MAX_BACKOFF) if predicted and self.dense_probed
            else self.dense_backoff,
            probed=stale,
        )

    def after_dense(self, run_s: float, why: str | None = None) -> DeltaCost:
        """The same after a dense run of a delta request (a fallback, a cost fallback, a probe; ``why``: its
        reason). A cost fallback right after a probe delta (the probe lost again) doubles the wait for the
        next probe."""
        lost = (why or "").startswith(COST_WHY) and self.probed and self.asked == 1
        return dataclasses.replace(
            self, dense_runs=(self.dense_runs + (run_s,))[-3:], since_dense=0,
            backoff=min(self.backoff + 1, MAX_BACKOFF) if lost else self.backoff,
            probed=self.probed and not lost,
            dense_probed=(why or "").startswith(PROBE_WHY),
        )


class _Measured:
    """The :data:`MEASURED` marker (a ``DeltaRequest.topology`` without links: compare measured runs)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MEASURED"


MEASURED = _Measured()
PROBE_DENSE = -2  # a MEASURED row's dense column: this rank's dense measurement is stale, measure it again
PROBE_WHY = "measuring dense again"  # how a probe's reason starts (a dense run that captures the snapshot)

PROBE_EVERY = 8
MAX_BACKOFF = 4  # the longest wait between probes: PROBE_EVERY << 4 = 128 refits
COST_WHY = "predicted faster dense"  # how a cost fallback's reason starts (the run then captures no snapshot)
COST_FIELDS = 5  # the cost columns of the fence row: 4 in microseconds (-1: unknown), then the kind of prediction
TOPOLOGY, RUNS = 0, 1  # the kind: from a Topology's link rates (phases add up), from MEASURED runs (whole runs)


def cost_row(elig, cost: DeltaCost, topo) -> list[int]:
    """This rank's predicted times, microseconds: (its dense wire time, its delta wire time, its delta diff
    time, its delta apply time, then ``TOPOLOGY``) for its delta-able messages (``elig``: its
    ``execute.delta.Eligible``), from the ``topo`` (a :class:`~triton_reshard.tools.topology.Topology`) and what
    its last delta measured (:class:`DeltaCost`); -1 each when there is no topology or no fresh measurement
    (with :data:`MEASURED`: :func:`_measured_row`). A port's time is its bytes over its bandwidth: network bytes
    (peer on another node) over ``net_GBps`` (divided among the node's ranks with ``shared_nic``), NVLink bytes
    over ``nvlink_GBps``; the rank's wire time is its busiest port's."""
    if topo is None or cost.pack_s is None or cost.asked >= cost.probe_after():
        return [-1] * COST_FIELDS
    if topo is MEASURED:
        return _measured_row(cost)
    cost.asked += 1
    net = topo.net_GBps * 1e9 / (topo.gpus_per_node if topo.shared_nic else 1)
    nvl = topo.nvlink_GBps * 1e9

    def ports(peers, ratio: float) -> tuple[float, float]:
        x = sum(n for p, n in peers if not topo.same_node(p, elig.rank)) * ratio
        v = sum(n for p, n in peers if topo.same_node(p, elig.rank)) * ratio
        return x / net, v / nvl

    dense = max(*ports(elig.send_peers, 1.0), *ports(elig.recv_peers, 1.0))
    delta = max(*ports(elig.send_peers, cost.send_ratio), *ports(elig.recv_peers, cost.recv_ratio))
    return [round(x * 1e6) for x in (dense, delta, cost.pack_s, cost.unpack_s)] + [TOPOLOGY]


def _measured_row(cost: DeltaCost) -> list[int]:
    """:func:`cost_row` with :data:`MEASURED`, microseconds: (this rank's fastest of its last three dense runs,
    the fastest of its last three delta runs, that delta's diff and apply medians, ``RUNS``); ``PROBE_DENSE``
    first when :meth:`DeltaCost.dense_probe_after` deltas ran since it last measured a dense run; unknown (-1)
    until it has measured a dense run and two deltas (the first delta of a Resharder pays its first-call
    allocations: it must not decide alone). The fastest, not the median: on a shared machine a run is only ever
    slowed by its neighbours, and a cold first run must not decide either way."""
    if not cost.dense_runs or len(cost.runs) < 2:
        return [-1] * COST_FIELDS
    if cost.since_dense >= cost.dense_probe_after():
        return [PROBE_DENSE] + [-1] * (COST_FIELDS - 1)
    cost.asked += 1
    return [round(x * 1e6) for x in (min(cost.dense_runs), min(cost.runs), cost.pack_s, cost.unpack_s)] + [RUNS]


def cost_choice(rows: list[list[int]]) -> str | None:
    """From every rank's :func:`cost_row` columns: why the refit goes dense (predicted faster, or a probe), or
    None (a delta; also when any rank's prediction is unknown). Dense: the slowest rank's dense wire time;
    delta: the slowest diff, then the slowest delta wire, then the slowest apply (each waits for the one
    before). With :data:`MEASURED` (every row ``RUNS``): the slowest rank's delta run against the slowest
    rank's dense run (a rank's run already holds its waits for the others' diffs and applies). A rank asking
    to measure dense again (``PROBE_DENSE``) makes the refit dense with a capture on every rank (the reason
    starts with ``PROBE_WHY``, not ``COST_WHY``)."""
    if any(r and r[0] == PROBE_DENSE for r in rows):
        return (f"{PROBE_WHY}: delta refits in a row since the last dense one (delta=\"auto\" compares measured "
                f"runs); sent dense, capturing the snapshot, and the next refit is a delta again")
    if not rows or any(min(r) < 0 for r in rows):
        return None
    if all(len(r) > 4 and r[4] == RUNS for r in rows):  # MEASURED: each rank's whole runs, which include the
        dense, run, pack, unpack = (max(c) for c in list(zip(*rows, strict=True))[:4])  # waits for the others'
        if run <= dense:
            return None
        return (f"{COST_WHY}: {dense / 1e3:.2f} ms dense against a delta's {run / 1e3:.2f} ms (the slowest rank's "
                f"fastest of its last runs each way; diff {pack / 1e3:.2f} ms, apply {unpack / 1e3:.2f} ms); sent "
                f"dense without a snapshot (after {PROBE_EVERY} such refits, twice as many each time a delta lost "
                f"again, one captures it and the next delta measures again)")
    cols = list(zip(*rows, strict=True))[:4]  # (dense wire, delta wire, diff, apply) columns, as cost_row makes them
    dense, wire, pack, unpack = (max(c) for c in cols)
    if pack + wire + unpack <= dense:
        return None
    return (f"{COST_WHY}: {dense / 1e3:.2f} ms dense against a delta's {pack / 1e3:.2f} ms diff + "
            f"{wire / 1e3:.2f} ms wire + {unpack / 1e3:.2f} ms apply (the topology's link rates, the "
            f"last delta refits' measured costs and changed bytes); sent dense "
            f"without a snapshot (after {PROBE_EVERY} such refits, twice as many each time a delta lost again, one "
            f"captures it and the next delta measures again)")
