"""A userspace link emulator for :mod:`triton_reshard.testing.cluster` on kernels without ``netem``.

Each node's link is a TAP device: created by a forwarder process inside the cluster's switch namespace, then
moved into the node's namespace (where it is the node's ``eth0``). The forwarder is the switch: every frame a
node sends waits the one-way latency of that node's link (the semantics the cluster documents for netem: the
delay from node a to node b is ``latency[a]``, the round trip ``latency[a] + latency[b]``), keeps its order,
and goes to the port of its destination MAC (broadcast and unknown ones to every other port). A node's
``loss`` drops frames as they enter the switch. The node's uplink is shaped by ``tbf`` on its ``eth0`` as on
the veth path; its downlink, which has no qdisc on a TAP (the forwarder writes straight into the node's
stack), by a token bucket of the same rate and burst in the forwarder.

The forwarder is a small C program (:mod:`triton_reshard.testing._netdelay_c`), compiled with ``gcc`` on first
use into a cache folder. C, not Python: measured, the C forwarder spends 25-53 us of CPU per frame here (a frame
is copied out of one TAP and into another, with a ppoll, a read and a write) and carries 10 Gbit/s links at only 3-6 Gbit/s on this machine's
two loaded cores; a Python loop would add its interpreter's per-frame cost and timer jitter on top of that (a
Python forwarder was not built to measure it). The TAPs use ``IFF_VNET_HDR`` and ``TUNSETOFFLOAD`` (checksum and
TSO), so a node's TCP hands the forwarder GSO superframes of up to 64 KiB, as it hands a veth.

Lifetime: the forwarder is a child of the harness: it exits when its stdin (a pipe from the harness) closes
and is killed by the kernel when the harness dies (``PR_SET_PDEATHSIG``), also after ``kill -9``; it runs inside
the switch namespace, so :func:`cluster.remove_stale` kills a stale one with the namespaces; its TAPs vanish
with it (they are not persistent).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from triton_reshard.testing._netdelay_c import C_SOURCE

PORT_PREFIX = "tp"
_NST = 7  # counters per port in the forwarder's stats line


class EmulatorUnavailable(RuntimeError):
    """The userspace link emulator cannot run here (no ``/dev/net/tun`` or no ``gcc``)."""


@dataclass(frozen=True, slots=True)
class PortStats:
    """One port's counters in the forwarder: frames and bytes from the node (``rx``) and to it (``tx``),
    frames its link's loss dropped (``lost``), frames its downlink's queue dropped (``queue_drops``) and frames
    the port refused (``write_errors``: sent before the node's interface was up)."""

    rx_frames: int
    rx_bytes: int
    tx_frames: int
    tx_bytes: int
    lost: int
    queue_drops: int
    write_errors: int


def available() -> tuple[bool, str]:
    """``(True, "")`` when the emulator can run, else ``(False, one line why)``."""
    if not os.path.exists("/dev/net/tun"):
        return False, "the userspace link emulator needs /dev/net/tun (TAP devices), which this machine lacks"
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return False, "the userspace link emulator is compiled on first use and needs gcc (or $CC) on PATH"
    return True, ""


def _cache_dir() -> str:
    base = os.environ.get("TRITON_RESHARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "triton_reshard")
    return base


def binary() -> str:
    """The compiled forwarder (built once per source version; a concurrent build is harmless: the last atomic
    rename wins and every version is the same)."""
    ok, why = available()
    if not ok:
        raise EmulatorUnavailable(why)
    tag = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:16]
    folder = _cache_dir()
    path = os.path.join(folder, f"netdelay-{tag}")
    if os.path.exists(path):
        return path
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(folder)
    except OSError:  # a read-only home: the temporary folder (still one build per source version)
        folder = os.path.join(tempfile.gettempdir(), "triton_reshard")
        path = os.path.join(folder, f"netdelay-{tag}")
        if os.path.exists(path):
            return path
        os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, "netdelay.c")
        with open(src, "w") as f:
            f.write(C_SOURCE)
        out = os.path.join(tmp, "netdelay")
        r = subprocess.run([os.environ.get("CC", "gcc"), "-O2", "-Wall", "-o", out, src], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise EmulatorUnavailable(f"building the userspace link emulator failed: {msg[-1] if msg else r.returncode}")
        os.replace(out, path)
    return path


def port_name(i: int) -> str:
    return f"{PORT_PREFIX}{i}"


class Forwarder:
    """The forwarder of one cluster: ``ports`` = per node ``(latency_s, rate_bps or None, burst_bytes, loss)``.
    :meth:`start` runs it inside namespace ``netns`` and returns once every TAP ``tp<i>`` exists there."""

    def __init__(self, netns: str, ports: list[tuple[float, float | None, int, float]]) -> None:
        self.netns = netns
        self.ports = ports
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        specs = [f"{round(lat * 1e9)}:{rate or 0:.0f}:{burst}:{round(loss * 1e6)}" for lat, rate, burst, loss in
                 self.ports]
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.netns, binary(), PORT_PREFIX, *specs],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        line = self._line(timeout)
        if line != "ready":
            err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.poll() is not None else ""
            self.stop()
            raise EmulatorUnavailable(f"the userspace link emulator did not start: {err or line or 'no answer'}")

    def _line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        out = b""
        fd = self.proc.stdout.fileno()
        while not out.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return ""
            chunk = os.read(fd, 4096)
            if not chunk:
                return out.decode(errors="replace").strip()
            out += chunk
        return out.decode(errors="replace").strip()

    def attach(self, i: int, netns: str, ifname: str, mtu: int) -> None:
        """Move port ``i``'s TAP from the forwarder's namespace into ``netns`` as ``ifname`` (down; the caller
        adds the address and brings it up)."""
        for args in (("-n", self.netns, "link", "set", port_name(i), "netns", netns),
                     ("-n", netns, "link", "set", port_name(i), "name", ifname),
                     ("-n", netns, "link", "set", ifname, "mtu", str(mtu), "txqueuelen", "10000")):
            r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"`ip {' '.join(args)}` failed: {(r.stderr or r.stdout).strip()[-200:]}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> list[PortStats]:
        """Per port, the forwarder's counters now."""
        if not self.alive():
            raise RuntimeError("netdelay: the link emulator is not running")
        self.proc.stdin.write(b"s\n")
        self.proc.stdin.flush()
        words = self._line(10.0).split()
        if not words or words[0] != "stats" or len(words) != 1 + _NST * len(self.ports):
            raise RuntimeError(f"netdelay: the link emulator answered {' '.join(words)[:80]!r} to a stats request")
        vals = [int(w) for w in words[1:]]
        return [PortStats(*vals[_NST * i: _NST * (i + 1)]) for i in range(len(self.ports))]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the forwarder has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Close its stdin (it exits) and kill it if it has not; idempotent."""
        p, self.proc = self.proc, None
        if p is None:
            return
        with contextlib.suppress(OSError):
            p.stdin.close()
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, 9)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for s in (p.stdout, p.stderr):
            with contextlib.suppress(OSError):
                s.close()
