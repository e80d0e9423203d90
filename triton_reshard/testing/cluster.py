"""A small cluster on one machine: network namespaces as nodes behind shaped links (Linux, root, iproute2).

``Cluster(nodes=2, ranks_per_node=2, rate="1gbit", latency="50us")`` builds, as a context manager:

* one namespace per node (``<prefix><pid>-n<i>``) with a veth ``eth0`` at ``10.<a>.<b>.<i+1>/24`` (one private
  subnet per run, alive only inside these namespaces: nothing is routed from or to the root namespace), and a
  "switch" namespace (``<prefix><pid>-s``) whose bridge joins the other ends of the veths;
* per node a link shaped by ``tc``: a token bucket (``tbf``) at ``rate`` in both directions (the node's egress
  on ``eth0``, its ingress on the switch's port), and, when ``latency`` or ``loss`` is given, ``netem`` on the
  node's egress (every packet the node sends waits ``latency`` and is dropped with probability ``loss``: the
  one-way delay from node a to node b is ``latency[a]``, the round trip ``latency[a] + latency[b]``). On
  kernels without netem (:func:`capabilities`) a link with a latency is a TAP into the userspace link emulator
  (:mod:`triton_reshard.testing.netdelay`: the same semantics, delay and loss in a forwarder process); loss
  without a latency then uses nftables (``nft``: a random drop of packets from the node as they enter the
  switch).

:meth:`Cluster.run` starts ``world = nodes * ranks_per_node`` processes, ranks ``[i*R, (i+1)*R)`` inside node
``i`` (the planner's ``gpus_per_node = R``), each in a gloo process group with ``GLOO_SOCKET_IFNAME=eth0`` and a
``tcp://`` rendezvous on the first node. Ranks of one node talk over the node's loopback; everything between
nodes crosses two shaped links. Each rank runs ``fn(rank, world_size, *args)`` (``fn`` importable as
``"module:function"``, ``args`` JSON values) and returns a JSON value, which it writes to a file the harness
reads: nothing is pickled. The run's result also holds each node's interface byte counters (what crossed its
link) over the whole run; :func:`link_counters` reads them inside a rank around one operation.

Teardown always runs: on leaving the ``with`` block, on an exception, on Ctrl-C, on SIGTERM, and at exit; it
kills the rank processes and the link emulator and deletes the namespaces. Namespaces left by an earlier run
that crashed harder (``kill -9``) are recognised by the prefix and a dead creator pid, and removed before a new
cluster is built.

Without root or iproute2 :func:`available` says why in one line (``Cluster`` raises
:class:`ClusterUnavailable` with it); bad sizes, rates, latencies or losses raise ``ValueError`` naming the
value before anything is built. A rank that dies or raises is reported by node and rank
(:class:`ClusterRankError`); a run past its ``timeout`` is killed (``TimeoutError`` naming the ranks not done).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .cluster_rank import current_node, link_counters  # noqa: F401  (the rank side, importable from here too)
from .links import (  # noqa: F401  (the links' parsing, importable from here too)
    MAX_RATE_BPS,
    Link,
    LinkBytes,
    make_links,
    parse_loss,
    parse_rate,
    parse_seconds,
)

PREFIX = "trsh"
IFNAME = "eth0"
PORT = 29500
MAX_NODES = 200
MAX_RANKS_PER_NODE = 64
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-")
# "auto": veth + tc (netem for latency) where the kernel has netem, else the userspace emulator
# (testing.netdelay) for links with a latency; "veth": the kernel path only; "tap": the emulator always
EMULATORS = ("auto", "veth", "tap")


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (not root, no ``ip``/``tc``, no network namespaces)."""


class ClusterRankError(RuntimeError):
    """Ranks of a run failed: ``errors`` maps rank -> (node, text)."""

    def __init__(self, errors: dict[int, tuple[int, str]]):
        self.errors = errors
        first = min(errors)
        node, text = errors[first]
        where = ", ".join(f"node {n} rank {r}" for r, (n, _) in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed ({where}); node {node} rank {first}:\n{text}")


@dataclass(frozen=True)
class ClusterRun:
    """What :meth:`Cluster.run` gives back: ``results`` by rank (the JSON each rank returned, or None where it
    failed), ``errors`` {rank: (node, text)} (empty unless ``allow_errors``), ``link_bytes`` per node over the
    whole run (rendezvous and connection setup included), the wall ``seconds`` and, per node, the packets its
    link's ``loss`` ``dropped`` during the run (:meth:`Cluster.dropped`)."""

    results: list
    errors: dict[int, tuple[int, str]] = field(default_factory=dict)
    link_bytes: list[LinkBytes] = field(default_factory=list)
    seconds: float = 0.0
    dropped: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------
# parsing and checks


def _check_sizes(nodes, ranks_per_node) -> None:
    for name, v, hi in (("nodes", nodes, MAX_NODES), ("ranks_per_node", ranks_per_node, MAX_RANKS_PER_NODE)):
        if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v <= hi):
            raise ValueError(f"cluster: {name}={v!r} must be an int between 1 and {hi}")


def _ip(*args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return r


def available() -> tuple[bool, str]:
    """``(True, "")`` when this process can build clusters, else ``(False, one line saying why)``."""
    if not sys.platform.startswith("linux"):
        return False, f"cluster harness needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "cluster harness needs root (network namespaces and tc); running as uid " + str(os.geteuid())
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return False, f"cluster harness needs iproute2 ({' and '.join(missing)} not found on PATH)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return False, f"cluster harness cannot create a network namespace: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


_CAPS: dict[str, bool] = {}


def capabilities() -> dict[str, bool]:
    """What this kernel and machine can shape, probed once in a scratch namespace: ``netem`` (latency and
    loss as a qdisc), ``nft`` (loss with nftables when netem is missing)."""
    if not _CAPS:
        probe = f"{PREFIX}{os.getpid()}-caps"
        try:
            _ip("netns", "add", probe)
            r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                "delay", "1ms"], capture_output=True, text=True, timeout=30)
            _CAPS["netem"] = r.returncode == 0
            ok = shutil.which("nft") is not None
            if ok:
                r = subprocess.run(["ip", "netns", "exec", probe, "nft",
                                    "table netdev t { chain c { type filter hook ingress device \"lo\" priority 0; "
                                    "numgen random mod 100 < 1 drop ; } ; }"], capture_output=True, text=True, timeout=30)
                ok = r.returncode == 0
            _CAPS["nft"] = ok
        finally:
            _ip("netns", "del", probe, check=False)
    return dict(_CAPS)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_namespaces() -> list[str]:
    r = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def remove_stale() -> list[str]:
    """Delete the namespaces of this harness whose creator process is gone; returns their names."""
    gone = []
    for n in _our_namespaces():
        pid = int(_NAME_RE.match(n).group(1))
        if pid != os.getpid() and not _pid_alive(pid):
            _kill_inside(n)
            _ip("netns", "del", n, check=False)
            gone.append(n)
    return gone


def _kill_inside(ns: str) -> None:
    r = _ip("netns", "pids", ns, check=False)
    for tok in r.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(tok), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------------
# the cluster

_LIVE: set[Cluster] = set()
_LIVE_LOCK = threading.Lock()


def _teardown_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for c in live:
        c.close()


atexit.register(_teardown_all)


class Cluster:
    """``nodes`` network namespaces of ``ranks_per_node`` ranks each, behind shaped links (see the module doc).

    ``rate`` / ``latency`` / ``loss``: one value for every node or a list of one per node (see :class:`Link`
    and :func:`parse_rate`); ``mtu`` of every veth; ``subnet``: the ``a.b`` of ``10.a.b.0/24`` (default: from
    this process's pid); ``emulator``: see :data:`EMULATORS`; ``sysctls``: ``net.*`` settings for every node's
    namespace (e.g. ``{"net.ipv4.tcp_slow_start_after_idle": 0}``). Use as a context manager; :meth:`close` is
    idempotent."""

    def __init__(self, nodes: int, ranks_per_node: int = 1, *, rate=None, latency=0.0, loss=0.0, mtu: int = 1500,
                 subnet: tuple[int, int] | None = None, emulator: str = "auto",
                 sysctls: dict[str, int] | None = None) -> None:
        _check_sizes(nodes, ranks_per_node)
        if emulator not in EMULATORS:
            raise ValueError(f"cluster: emulator={emulator!r} must be one of {', '.join(EMULATORS)}")
        self.emulator = emulator
        for k, v in (sysctls or {}).items():
            if not re.fullmatch(r"net\.[a-z0-9_.]+", str(k)) or isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"cluster: sysctl {k!r}={v!r} must be a net.* name and an int")
        self.sysctls = dict(sysctls or {})
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not (576 <= mtu <= 65535):
            raise ValueError(f"cluster: mtu={mtu!r} must be an int between 576 and 65535")
        self.nodes, self.ranks_per_node, self.mtu = nodes, ranks_per_node, mtu
        self.links = make_links(nodes, rate, latency, loss)
        pid = os.getpid()
        self.subnet = subnet or (200 + (pid >> 8) % 50, pid % 256)
        self._tag = f"{PREFIX}{pid}-{id(self) % 100000}"
        self.switch = f"{self._tag}-s"
        self.node_ns = [f"{self._tag}-n{i}" for i in range(nodes)]
        self._built: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._port = PORT
        self._dir: str | None = None
        self._old_term = None
        self._fwd = None  # the userspace link emulator's forwarder (netdelay.Forwarder) when the links are TAPs

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def address(self, node: int) -> str:
        return f"10.{self.subnet[0]}.{self.subnet[1]}.{node + 1}"

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    # -- building and tearing down ------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        ok, why = available()
        if not ok:
            raise ClusterUnavailable(why)
        remove_stale()
        with _LIVE_LOCK:
            _LIVE.add(self)
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._dir = tempfile.mkdtemp(prefix=f"{self._tag}-")
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def forwarder(self):
        """The userspace link emulator's :class:`~triton_reshard.testing.netdelay.Forwarder` while the links are
        TAPs (its ``stats()``, ``cpu_seconds()``, ``pid``), else None."""
        return self._fwd

    def uses_tap(self) -> bool:
        """Whether the links are the userspace emulator's TAPs (:mod:`triton_reshard.testing.netdelay`): with
        ``emulator="tap"``, or ``"auto"`` where a link has a latency and the kernel has no netem."""
        if self.emulator != "auto":
            return self.emulator == "tap"
        return any(link.latency_s for link in self.links) and not capabilities()["netem"]

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._built.append(self.switch)
        sw = ("-n", self.switch)
        _ip(*sw, "link", "set", "lo", "up")
        tap = self.uses_tap()
        if tap:
            self._start_forwarder()
        else:
            _ip(*sw, "link", "add", "br0", "type", "bridge")
            _ip(*sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            _ip("netns", "add", ns)
            self._built.append(ns)
            if tap:
                self._fwd.attach(i, ns, IFNAME, self.mtu)
            else:
                port = f"p{i}"
                # created inside the node's namespace, its peer straight into the switch's: never in the root one
                _ip("-n", ns, "link", "add", IFNAME, "mtu", str(self.mtu), "type", "veth", "peer", "name", port,
                    "mtu", str(self.mtu), "netns", self.switch)
                _ip(*sw, "link", "set", port, "master", "br0")
                _ip(*sw, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for k, v in self.sysctls.items():  # per namespace: only this node's stack
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{k}={v}"], check=True, timeout=30,
                               capture_output=True)
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            self._shape(i)

    def _start_forwarder(self) -> None:
        from triton_reshard.testing import netdelay

        ok, why = netdelay.available()
        if not ok:
            raise ClusterUnavailable(why)
        self._fwd = netdelay.Forwarder(self.switch, [(x.latency_s, x.rate_bps, _burst(x.rate_bps) if x.rate_bps else 0,
                                                      x.loss) for x in self.links])
        self._fwd.start()

    def _shape(self, i: int) -> None:
        link = self.links[i]
        ns = self.node_ns[i]
        tc_node = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME]
        tc_port = ["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", f"p{i}"]
        cmds = []
        tbf = []
        if link.rate_bps is not None:
            tbf = ["tbf", "rate", f"{int(link.rate_bps)}bit", "burst", str(_burst(link.rate_bps)), "latency", "50ms"]
        if self._fwd is not None:  # TAP links: the uplink's tbf here, delay, loss and the downlink in the forwarder
            self._tc(i, [tc_node + ["root", "handle", "1:", *tbf]] if tbf else [])
            return
        use_netem = bool(link.latency_s) or (bool(link.loss) and capabilities()["netem"])
        if use_netem:
            if not capabilities()["netem"]:
                raise ValueError(f"cluster: node {i}'s link latency {link.latency_s:g} s needs tc's netem qdisc, "
                                 f"which this kernel lacks (CONFIG_NET_SCH_NETEM); use latency=0 here")
            netem = ["netem", "limit", "100000"]
            if link.latency_s:
                netem += ["delay", f"{link.latency_s * 1e6:.0f}us"]
            if link.loss:
                netem += ["loss", f"{link.loss * 100:g}%"]
            cmds.append(tc_node + ["root", "handle", "1:", *netem])
            if tbf:
                cmds.append(tc_node + ["parent", "1:1", "handle", "10:", *tbf])
        elif tbf:
            cmds.append(tc_node + ["root", "handle", "1:", *tbf])
        if tbf:
            cmds.append(tc_port + ["root", "handle", "1:", *tbf])
        if link.loss and not use_netem:
            if not capabilities()["nft"]:
                raise ValueError(f"cluster: node {i}'s link loss {link.loss:g} needs tc's netem qdisc or nftables' "
                                 f"`nft` (numgen random), neither of which is here")
            # dropped on the wire: at the switch's port, as packets from the node arrive (the sender's stack
            # does not see it, as with a lossy cable)
            per_10k = max(1, round(link.loss * 10000))
            rules = (f'table netdev trsh_loss {{ chain p{i} {{ type filter hook ingress device "p{i}" priority 0; '
                     f'policy accept; numgen random mod 10000 < {per_10k} counter drop ; }} ; }}')
            cmds.append(["ip", "netns", "exec", self.switch, "nft", rules])
        self._tc(i, cmds)

    def _tc(self, i: int, cmds: list[list[str]]) -> None:
        link = self.links[i]
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).strip().splitlines()
                raise ValueError(f"cluster: node {i}'s link (rate {link.rate_bps!r} bit/s, latency "
                                 f"{link.latency_s:g} s, loss {link.loss:g}) cannot be set up: "
                                 f"{msg[-1] if msg else 'tc failed'}")

    def close(self) -> None:
        """Kill the rank processes and the link emulator, delete every namespace this cluster made (idempotent)."""
        for p in self._procs:
            _kill_group(p)
        self._procs = []
        fwd, self._fwd = self._fwd, None
        if fwd is not None:
            fwd.stop()
        for ns in reversed(self._built):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        self._built = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._old_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # -- counters -----------------------------------------------------------------------------------------

    def dropped(self) -> list[int]:
        """Per node, the packets its link's ``loss`` has dropped so far (0 for a node without loss): netem's
        drop count on the node's egress, or the nftables rule's counter at the switch port. The interface
        counters cannot show this loss: netem drops before the node's ``eth0`` counts a packet as sent."""
        if self._fwd is not None:
            return [p.lost for p in self._fwd.stats()]
        out = []
        for i, ns in enumerate(self.node_ns):
            n = 0
            if self.links[i].loss:
                if capabilities()["netem"]:
                    r = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", IFNAME],
                                       capture_output=True, text=True, timeout=30, check=True)
                    n = sum(int(q.get("drops", 0)) for q in json.loads(r.stdout) if q.get("kind") == "netem")
                else:
                    r = subprocess.run(["ip", "netns", "exec", self.switch, "nft", "-j", "list", "chain", "netdev",
                                        "trsh_loss", f"p{i}"], capture_output=True, text=True, timeout=30, check=True)
                    n = sum(int(x["counter"]["packets"]) for item in json.loads(r.stdout)["nftables"]
                            for x in item.get("rule", {}).get("expr", []) if "counter" in x)
            out.append(n)
        return out

    def link_bytes(self) -> list[LinkBytes]:
        """Per node, the byte and packet counters of its ``eth0`` now (since the cluster was built)."""
        out = []
        for ns in self.node_ns:
            r = _ip("-n", ns, "-s", "-j", "link", "show", IFNAME)
            st = json.loads(r.stdout)[0]["stats64"]
            out.append(LinkBytes(st["tx"]["bytes"], st["rx"]["bytes"], st["tx"]["packets"], st["rx"]["packets"]))
        return out

    # -- running ranks ------------------------------------------------------------------------------------

    def run(self, fn: str | Callable, *args, timeout: float = 300.0, pg_timeout: float = 120.0,
            env: dict[str, str] | None = None, allow_errors: bool = False,
            node_env: dict[int, dict[str, str]] | None = None) -> ClusterRun:
        """Run ``fn(rank, world_size, *args)`` on every rank, each inside its node; return a :class:`ClusterRun`.

        ``fn``: ``"module:function"`` or a module-level function (its module must be importable by the
        ranks, e.g. on ``PYTHONPATH``); ``args`` and the return value: JSON values. ``pg_timeout``: the gloo
        group's timeout. ``env``: added to every rank's environment; ``node_env``: ``{node: {name: value}}``,
        added to that node's ranks only (e.g. the trainer node's allocator setup). A rank that raises or exits
        without a result: :class:`ClusterRankError` naming node and rank (with ``allow_errors``, in ``errors``
        instead). Past ``timeout``: every rank is killed and ``TimeoutError`` names the ranks not done."""
        if not self._built:
            raise RuntimeError("cluster: run() outside the with block (the cluster is not built)")
        target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        if ":" not in target or "<" in target:
            raise ValueError(f"cluster: fn {target!r} must be importable as 'module:function'")
        json.dumps(list(args))  # raises TypeError for arguments that are not JSON values
        bad = sorted(set(node_env or {}) - set(range(self.nodes)))
        if bad:
            raise ValueError(f"cluster: node_env names nodes {bad}, but the cluster has nodes 0..{self.nodes - 1}")
        self._port += 1
        run_dir = tempfile.mkdtemp(dir=self._dir)
        base_env = {**os.environ, **(env or {})}
        base_env.setdefault("OMP_NUM_THREADS", "1")
        before = self.link_bytes()
        dropped_before = self.dropped()
        t0 = time.perf_counter()
        procs, logs = [], []
        for rank in range(self.world_size):
            own = {**base_env, **(node_env or {}).get(self.node_of(rank), {})}
            p, log = self._spawn(rank, target, list(args), run_dir, own, pg_timeout)
            procs.append(p)
            logs.append(log)
        try:
            self._wait(procs, time.monotonic() + timeout, target, timeout)
        finally:
            for p in procs:
                _kill_group(p)
            for log in logs:
                log.close()
            self._procs = [p for p in self._procs if p not in procs]
        seconds = time.perf_counter() - t0
        after = self.link_bytes()
        dropped = [a - b for a, b in zip(self.dropped(), dropped_before, strict=True)]
        results, errors = self._collect(procs, run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        if errors and not allow_errors:
            raise ClusterRankError(errors)
        return ClusterRun(results, errors, [a - b for a, b in zip(after, before, strict=True)], seconds, dropped)

    def _spawn(self, rank: int, target: str, args: list, run_dir: str, base_env: dict, pg_timeout: float):
        """Start ``rank`` inside its node's namespace (``cluster_rank`` reads its JSON spec); returns the process
        and its open log file."""
        node = self.node_of(rank)
        spec = {"fn": target, "args": args, "rank": rank, "world_size": self.world_size, "node": node,
                "ranks_per_node": self.ranks_per_node, "nodes": self.nodes,
                "init_method": f"tcp://{self.address(0)}:{self._port}", "pg_timeout": pg_timeout,
                "result": os.path.join(run_dir, f"rank{rank}.json")}
        spec_path = os.path.join(run_dir, f"rank{rank}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "wb")  # noqa: SIM115 (closed by run)
        e = {**base_env, "GLOO_SOCKET_IFNAME": IFNAME, "TRITON_RESHARD_CLUSTER_NODE": str(node),
             "TRITON_RESHARD_CLUSTER_IFNAME": IFNAME}
        p = subprocess.Popen(["ip", "netns", "exec", self.node_ns[node], sys.executable, "-m",
                              "triton_reshard.testing.cluster_rank", spec_path],
                             env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(p)
        return p, log

    def _wait(self, procs: list, deadline: float, target: str, timeout: float) -> None:
        """Until every rank has exited; past ``deadline`` a TimeoutError naming the ranks not done."""
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                left = [r for r, p in enumerate(procs) if p.poll() is None]
                raise TimeoutError(
                    f"cluster: run of {target} did not finish within {timeout:g}s; still running: "
                    + ", ".join(f"node {self.node_of(r)} rank {r}" for r in left))
            time.sleep(0.05)

    def _collect(self, procs: list, run_dir: str) -> tuple[list, dict[int, tuple[int, str]]]:
        """Each rank's result file: ``(results by rank, {rank: (node, error text)})``."""
        results: list = [None] * len(procs)
        errors: dict[int, tuple[int, str]] = {}
        for rank, p in enumerate(procs):
            node = self.node_of(rank)
            path = os.path.join(run_dir, f"rank{rank}.json")
            try:
                with open(path) as f:
                    out = json.load(f)
            except (OSError, ValueError):
                tail = _tail(os.path.join(run_dir, f"rank{rank}.log"))
                errors[rank] = (node, f"process exited with code {p.returncode} without a result\n{tail}")
                continue
            if out.get("ok"):
                results[rank] = out.get("result")
            else:
                errors[rank] = (node, str(out.get("error")))
        return results, errors


def _burst(rate_bps: float) -> int:
    """A link's token bucket: 2 ms of the rate, at least 64 KiB (one GSO super-packet)."""
    return max(64 << 10, int(rate_bps / 8 * 2e-3))


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
