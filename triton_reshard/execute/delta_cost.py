"""The delta refit's cost model (issue 32; split from ``execute/delta.py``, whose module doc and docs/delta.md
describe it): what each rank's last delta measured (:class:`DeltaCost`), the predicted times it puts in the
handshake row (:func:`cost_row`) and the choice every rank makes from all rows alike (:func:`cost_choice`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DeltaCost:
    """What this rank's last delta refit measured: seconds diffing its delta-able sends (``pack_s``) and
    applying its delta receives (``unpack_s``), and the delta bytes over the dense bytes of those sends and
    receives (None: no delta measured yet). ``asked``: cost predictions made from it since (after
    ``PROBE_EVERY`` the rank says "unknown" and the next refit goes as a delta again, measuring afresh: the
    changed fraction moves as training goes on)."""

    pack_s: float | None = None
    unpack_s: float | None = None
    send_ratio: float = 0.0
    recv_ratio: float = 0.0
    asked: int = 0
    # the last few deltas' (diff, apply) seconds: pack_s / unpack_s are their medians (one refit slowed by a
    # busy machine must not turn the next PROBE_EVERY refits dense)
    history: tuple[tuple[float, float], ...] = ()


PROBE_EVERY = 8
COST_WHY = "predicted faster dense"  # how a cost fallback's reason starts (the run then captures no snapshot)
COST_FIELDS = 4  # the cost columns of the fence row, in microseconds (-1: unknown)


def cost_row(elig, cost: DeltaCost, topo) -> list[int]:
    """This rank's predicted times, microseconds: (its dense wire time, its delta wire time, its delta diff
    time, its delta apply time) for its delta-able messages (``elig``: its ``execute.delta.Eligible``), from the ``topo`` (a
    :class:`~triton_reshard.tools.topology.Topology`) and what its last delta measured (:class:`DeltaCost`);
    -1 each when there is no topology or no fresh measurement. A port's time is its bytes over its bandwidth:
    network bytes (peer on another node) over ``net_GBps`` (divided among the node's ranks with
    ``shared_nic``), NVLink bytes over ``nvlink_GBps``; the rank's wire time is its busiest port's."""
    if topo is None or cost.pack_s is None or cost.asked >= PROBE_EVERY:
        return [-1] * COST_FIELDS
    cost.asked += 1
    net = topo.net_GBps * 1e9 / (topo.gpus_per_node if topo.shared_nic else 1)
    nvl = topo.nvlink_GBps * 1e9

    def ports(peers, ratio: float) -> tuple[float, float]:
        x = sum(n for p, n in peers if not topo.same_node(p, elig.rank)) * ratio
        v = sum(n for p, n in peers if topo.same_node(p, elig.rank)) * ratio
        return x / net, v / nvl

    dense = max(*ports(elig.send_peers, 1.0), *ports(elig.recv_peers, 1.0))
    delta = max(*ports(elig.send_peers, cost.send_ratio), *ports(elig.recv_peers, cost.recv_ratio))
    return [round(x * 1e6) for x in (dense, delta, cost.pack_s, cost.unpack_s)]


def cost_choice(rows: list[list[int]]) -> str | None:
    """From every rank's :func:`cost_row` columns: why the refit goes dense (predicted faster), or None
    (a delta; also when any rank's prediction is unknown). Dense: the slowest rank's dense wire time; delta:
    the slowest diff, then the slowest delta wire, then the slowest apply (each waits for the one before)."""
    if not rows or any(min(r) < 0 for r in rows):
        return None
    cols = list(zip(*rows, strict=True))  # (dense wire, delta wire, diff, apply) columns, as cost_row makes them
    dense, wire, pack, unpack = (max(c) for c in cols)
    if pack + wire + unpack <= dense:
        return None
    return (f"{COST_WHY}: {dense / 1e3:.2f} ms on the wire against a delta's {pack / 1e3:.2f} ms diff + "
            f"{wire / 1e3:.2f} ms wire + {unpack / 1e3:.2f} ms apply (the topology's link rates, the last delta "
            f"refit's measured costs and changed bytes); sent dense without a snapshot (after {PROBE_EVERY} "
            f"such refits one captures it and the next delta measures again)")
