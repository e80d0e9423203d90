"""A first-order model of the cluster a reshard runs on, to predict refit time from a plan.

Ranks are grouped into nodes (NVLink domains) of ``gpus_per_node`` consecutive ranks. Every GPU has two ports,
each full duplex: NVLink to the GPUs of its node, and a network NIC to the other nodes. Bytes between two
ranks of one node use NVLink, bytes between nodes the network; a local copy uses neither. The time of a step
is set by its busiest port, ``max over ranks and directions (send, receive) of bytes / bandwidth`` on each
port class, plus a fixed latency per step; steps run one after another (each one waits for its slowest
rank), so a bucketed schedule takes the sum over its steps. Relay transfers (fan-out inside a node) forward
what the first phase delivered, so they form a second phase: later steps of a schedule, and a second term of
the unbucketed bound. The model ignores congestion inside the network and the copy kernels (pack/unpack
run at HBM speed, far above these links).

``shared_nic=True`` gives each node one network link instead, shared by its ranks: a node's network time is
the sum of its ranks' network bytes (each direction) over ``net_GBps``. That is the emulated cluster of
:mod:`triton_reshard.testing.cluster` (one shaped veth per node) and any node with one NIC.

``host_GBps`` (default None: off, so GPU predictions and :func:`choose_relay` stay as they are) adds, per step,
a host term for CPU refits (gloo on the host, as on the emulated cluster): a rank spends ``1 / host_GBps``
seconds on every byte it sends to or receives from another rank (packing before the wire, unpacking after
it, and what else of the host's work does not overlap the wire: serial with it), so a step takes its
busiest rank's host bytes over ``host_GBps`` after its busiest port. ``host_cores`` (None: every rank has
its own cores) is the number of cores all ranks share, which the model cannot see from the plan: the caller
states it, e.g. the emulated cluster of :mod:`triton_reshard.testing.cluster`, whose nodes all run on one
machine, passes that machine's cores (``len(os.sched_getaffinity(0))``); the host term is then at least all
ranks' host bytes over ``host_GBps * host_cores``. ``perf/bench_cluster.py`` measures ``host_GBps`` per
cluster: the time of a 16 MiB refit beyond a 64-byte refit's and beyond its wire time at the probed link rate.

Figures (per GPU, per direction, decimal GB/s):

* ``h100``: 8 GPUs per node, NVLink 4 at 450 GB/s, one 400 Gb/s NIC per GPU = 50 GB/s.
* ``gb200``: an NVL72 rack as one NVLink domain of 72 GPUs, NVLink 5 at 900 GB/s, 400 Gb/s NIC = 50 GB/s.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..plan.table import TransferTable
from ..plan.types import StepPairBytes

GB = 1e9


@dataclass(frozen=True, slots=True)
class Topology:
    """Nodes of ``gpus_per_node`` consecutive ranks; per-GPU NVLink and network bandwidth (GB/s, one direction)."""

    gpus_per_node: int = 72
    nvlink_GBps: float = 900.0
    net_GBps: float = 50.0
    step_latency_s: float = 50e-6  # per step: posting the sends/receives and waiting for the slowest peer
    # True: one network link per node, of net_GBps each way, shared by the node's ranks (a node with one NIC,
    # or an emulated node of testing.cluster); False: one NIC of net_GBps per GPU
    shared_nic: bool = False
    # once per refit, before its first step: the handshake (an all-gather over every rank) and what a caller
    # times around it; measured on an emulated cluster as a refit of 64 bytes less one step's latency
    refit_latency_s: float = 0.0
    # CPU refits (gloo on the host): every byte a rank sends to or receives from another rank costs that rank's
    # host 1 / host_GBps seconds (packing, unpacking, the transport's copies), serial with the wire; None: off
    # (GPUs: the copy kernels run at HBM speed, far above the links)
    host_GBps: float | None = None
    # the cores all ranks share (the nodes of an emulated cluster on one machine); None: each rank has its own
    host_cores: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node!r} must be an int >= 1")
        if not (self.nvlink_GBps > 0 and self.net_GBps > 0 and self.step_latency_s >= 0
                and self.refit_latency_s >= 0):
            raise ValueError(
                f"bandwidths must be > 0 and the latencies >= 0, got nvlink_GBps={self.nvlink_GBps}, "
                f"net_GBps={self.net_GBps}, step_latency_s={self.step_latency_s}, "
                f"refit_latency_s={self.refit_latency_s}"
            )
        if self.host_GBps is not None and not (isinstance(self.host_GBps, (int, float)) and self.host_GBps > 0
                                               and math.isfinite(self.host_GBps)):
            raise ValueError(f"host_GBps={self.host_GBps!r} must be a finite number > 0 or None (no host term)")
        if self.host_cores is not None:
            if not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool) or self.host_cores < 1:
                raise ValueError(f"host_cores={self.host_cores!r} must be an int >= 1 or None (a core per rank)")
            if self.host_GBps is None:
                raise ValueError(f"host_cores={self.host_cores} needs host_GBps (the host rate the cores share)")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node


PRESETS: dict[str, Topology] = {
    "h100": Topology(gpus_per_node=8, nvlink_GBps=450.0, net_GBps=50.0),
    "gb200": Topology(gpus_per_node=72, nvlink_GBps=900.0, net_GBps=50.0),
}


@dataclass(frozen=True, slots=True)
class PortLoad:
    """Bytes through each port of one rank."""

    nvlink_send: int = 0
    nvlink_recv: int = 0
    net_send: int = 0
    net_recv: int = 0

    def seconds(self, topo: Topology) -> float:
        nvl = max(self.nvlink_send, self.nvlink_recv) / (topo.nvlink_GBps * GB)
        net = max(self.net_send, self.net_recv) / (topo.net_GBps * GB)
        return max(nvl, net)


def port_loads(pair_bytes: Mapping[tuple[int, int], int], topo: Topology) -> dict[int, PortLoad]:
    """Per rank, the bytes through its NVLink and network ports, from ``{(src, dst): bytes}`` (src == dst: local)."""
    acc: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for (s, d), n in pair_bytes.items():
        if s == d or not n:
            continue
        k = 0 if topo.same_node(s, d) else 2
        acc[s][k] += n
        acc[d][k + 1] += n
    return {r: PortLoad(*v) for r, v in sorted(acc.items())}


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float  # predicted wall time of the whole reshard
    steps: int
    busiest_rank: int | None  # the rank whose port sets the time in the heaviest step
    busiest_port: str  # "nvlink" or "net" (the port class of the busiest rank)
    nvlink_bytes: int  # bytes over NVLink (all ranks, counted once)
    net_bytes: int  # bytes over the network


def predict_seconds(steps: Iterable[Mapping[tuple[int, int], int]], topo: Topology) -> Prediction:
    """Predicted time of a reshard that moves ``steps[i][(src, dst)]`` bytes in step ``i``.

    Pure: per step, the busiest port (``max over ranks of max(send, receive) / bandwidth`` for NVLink and the
    network separately), then with ``topo.host_GBps`` the step's host time (see the module docstring), plus
    ``topo.step_latency_s``; steps add up, after ``topo.refit_latency_s`` once. Pass one mapping with all bytes for the
    unbucketed bound (``plan_phase_pair_bytes(plan)``: one mapping, or two when the plan relays), or one per
    schedule step (``schedule_pair_bytes``; a schedule's relay steps come after all others, phase 1).
    """
    total, n_steps, worst, worst_rank, worst_port = topo.refit_latency_s, 0, -1.0, None, "nvlink"
    nvl_bytes = net_bytes = 0
    nvl_rate, net_rate = topo.nvlink_GBps * GB, topo.net_GBps * GB
    for step in steps:  # per step, the port loads of all ranks as arrays (what ``port_loads`` gives, by rank)
        n_steps += 1
        t_step = 0.0
        ports = _step_ports(step, topo.gpus_per_node, topo.shared_nic, topo.host_GBps is not None)
        if ports is not None:
            nvl, net, nvl_sent, net_sent, host = ports
            nvl_t, t = nvl / nvl_rate, np.maximum(nvl / nvl_rate, net / net_rate)
            r = int(t.argmax())  # the first busiest rank, as a scan over the ranks in order finds it
            t_step = float(t[r])
            if t_step > worst:
                worst, worst_rank, worst_port = t_step, r, "nvlink" if float(nvl_t[r]) >= t_step else "net"
            nvl_bytes += nvl_sent
            net_bytes += net_sent
            if host is not None:  # serial with the wire: packed before it, unpacked after it, on the same cores
                t_step += _host_seconds(host, topo)
        total += t_step + topo.step_latency_s
    return Prediction(total, n_steps, worst_rank, worst_port, nvl_bytes, net_bytes)


def _host_seconds(host, topo: Topology) -> float:
    """A step's host time from each rank's bytes sent plus received (``host``, by rank): the busiest rank's over
    ``host_GBps``, and with ``host_cores`` at least all ranks' over ``host_GBps * host_cores``."""
    rate = topo.host_GBps * GB
    t = float(host.max()) / rate
    if topo.host_cores is not None:
        t = max(t, float(host.sum()) / (rate * topo.host_cores))
    return t


def _step_ports(step: Mapping[tuple[int, int], int], gpus_per_node: int, shared_nic: bool = False,
                host: bool = False):
    """One step's ``{(src, dst): bytes}`` as per-rank port loads: ``(max(NVLink send, receive), max(network
    send, receive))`` arrays indexed by rank (exact: float64 sums of int64 bytes far below 2**53), the
    NVLink and network bytes sent, and (``host``; else None) per rank its bytes sent plus received over both
    ports; None when nothing leaves a rank. ``shared_nic``: a rank's network load is its node's (the sum over
    the node's ranks, each direction)."""
    if not step:
        return None
    if isinstance(step, StepPairBytes):  # a pair-rule schedule's step: already columns
        s, d, n = step.src, step.dst, step.nbytes
    else:
        pairs = np.array(list(step), dtype=np.int64).reshape(-1, 2)
        n = np.fromiter(step.values(), dtype=np.int64, count=len(step))
        s, d = pairs[:, 0], pairs[:, 1]
    keep = (s != d) & (n != 0)
    if not keep.all():
        s, d, n = s[keep], d[keep], n[keep]
    if not len(n):
        return None
    size = int(max(s.max(), d.max())) + 1
    net = (s // gpus_per_node) != (d // gpus_per_node)
    nv = ~net

    def port(ranks, sel):
        return np.bincount(ranks[sel], weights=n[sel], minlength=size)

    nvl = np.maximum(port(s, nv), port(d, nv))
    if shared_nic:
        nodes = size // gpus_per_node + 1
        sn, dn = s // gpus_per_node, d // gpus_per_node
        per_node = np.maximum(np.bincount(sn[net], weights=n[net], minlength=nodes),
                              np.bincount(dn[net], weights=n[net], minlength=nodes))
        netl = per_node[np.arange(size) // gpus_per_node]
    else:
        netl = np.maximum(port(s, net), port(d, net))
    hostl = None
    if host:
        hostl = np.bincount(s, weights=n, minlength=size) + np.bincount(d, weights=n, minlength=size)
    return nvl, netl, int(n[nv].sum()), int(n[net].sum()), hostl


def _pair_sums(table, sel=None) -> dict[tuple[int, int], int]:
    """``{(src, dst): bytes}`` of the rows ``sel`` (a mask; None: all) of a transfer table, pairs in order of
    first appearance (as a loop over the transfers adds them)."""
    s, d, n = table.src, table.dst, table.nbytes
    if sel is not None:
        s, d, n = s[sel], d[sel], n[sel]
    if not len(s):
        return {}
    w = int(max(s.max(), d.max())) + 1
    keys, first, inv = np.unique(s * w + d, return_index=True, return_inverse=True)
    sums = np.zeros(len(keys), np.int64)
    np.add.at(sums, inv.reshape(-1), n)
    order = np.argsort(first, kind="stable")
    return dict(zip(zip((keys[order] // w).tolist(), (keys[order] % w).tolist(), strict=True), sums[order].tolist(),
                    strict=True))


def plan_pair_bytes(plan) -> dict[tuple[int, int], int]:
    """``{(src, dst): bytes}`` of a plan's wire transfers (relays included): what each link carries in all."""
    return _pair_sums(TransferTable.of(plan.transfers))


def plan_phase_pair_bytes(plan) -> list[dict[tuple[int, int], int]]:
    """``[{(src, dst): bytes}]`` per phase of a plan: the transfers from the source layout, then (only when the
    plan has any) the relays, which forward what phase 0 delivered and so cannot start before it ends.

    ``predict_seconds(plan_phase_pair_bytes(plan), topo)`` is the unbucketed bound of a plan with relays: the
    phases add up like steps. (One mapping of all the bytes would let relays overlap the network phase.)
    """
    t = TransferTable.of(plan.transfers)
    first = _pair_sums(t, ~t.relay)
    return [first, _pair_sums(t, t.relay)] if t.relay.any() else [first]


def schedule_pair_bytes(schedule) -> list[dict[tuple[int, int], int]]:
    """Per step of a schedule, ``{(src, dst): bytes}`` (payload bytes, without alignment padding)."""
    return schedule.pair_bytes()  # (a pair-rule schedule answers from its columns)


def node_link_bytes(pair_bytes: Mapping[tuple[int, int], int], ranks_per_node: int,
                    nodes: int | None = None) -> list[tuple[int, int]]:
    """Per node, ``(bytes sent to other nodes, bytes received from other nodes)`` of ``{(src, dst): bytes}``
    with ranks ``[k*n, (k+1)*n)`` on node ``k``: what each node's link carries (payload, no protocol)."""
    n_nodes = nodes if nodes is not None else 1 + max((max(s, d) // ranks_per_node for s, d in pair_bytes), default=0)
    out = [[0, 0] for _ in range(n_nodes)]
    for (s, d), n in pair_bytes.items():
        a, b = s // ranks_per_node, d // ranks_per_node
        if a != b and n:
            out[a][0] += n
            out[b][1] += n
    return [(tx, rx) for tx, rx in out]


@dataclass(frozen=True, slots=True)
class RelayChoice:
    """What :func:`choose_relay` decided and why: the predicted seconds of the whole plan with and without
    relays under the same topology."""

    relay: bool
    with_relay_s: float
    without_relay_s: float
    margin: float


def choose_relay(src, dst, topo: Topology, instances: int = 1, allow_cast: bool = False,
                 margin: float = 0.05) -> RelayChoice:
    """Relay or not, by the time model: plan the whole refit of ``src`` -> ``instances`` copies of ``dst``
    (``gpus_per_node`` = ``topo.gpus_per_node``) with and without relays, predict both
    (``plan_phase_pair_bytes`` + :func:`predict_seconds`) and relay only when that is predicted faster by more
    than ``margin`` (a relay phase is one more round on the wire, and the model leaves out its CPU work).

    Why it is needed (issue 32, measured on the emulated cluster): with one trainer node feeding two engine
    nodes relays halve the trainer link's bytes (faster); with two trainer nodes feeding two engine nodes the
    engine nodes' links carry the whole model either way, so relays only add a phase (slower: 92 against 80
    ms for ``small_llama`` at 1 Gbit/s). Every rank gets the same answer (whole plans of the same layouts);
    the two whole plans cost what planning both costs (``perf/bench_planner.py``), so call it once per job and
    pass ``relay=`` to ``refit``.
    """
    from ..plan import PlanOptions, plan_reshard

    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be in [0, 1)")
    t = {}
    for relay in (True, False):
        full, opts = PlanOptions.for_instances(dst, instances, allow_cast, topo.gpus_per_node, relay)
        plan = plan_reshard(src, full, options=opts)
        t[relay] = predict_seconds(plan_phase_pair_bytes(plan), topo).seconds
    return RelayChoice(t[True] < (1 - margin) * t[False], t[True], t[False], margin)
