"""The ends of same-host lanes (``comm/lanes.py``): which ranks share a host, the rings in ``/dev/shm`` and
the doorbells (FIFOs), made and opened safely.

Security: a ring is created by its sender and a doorbell by its receiver, each with ``O_EXCL`` (mkfifo) and
mode 0600 under a name with the maker's random 63-bit token (a name someone else took is not used: that lane
stays on gloo); the other end opens it only if it is of its own user, mode 0600 (a ring: a regular file of
the announced size; a doorbell: a FIFO; no symlinks), then unlinks the name (its maker does too, at the latest
when its process exits): nothing stays in ``/dev/shm`` but what a killed process made. Trust boundary: the
user the ranks run as (a process of that user can read and write the ring, as it could ptrace the ranks); the
per-message digest (``execute/integrity.py``) covers the ring's bytes as it covers gloo's. ``/dev/shm`` is
checked for room first and the ring's pages are reserved when made (``posix_fallocate``): a full
``/dev/shm`` means no lane, never a SIGBUS later.

Two ranks are on the same host when boot, host name, ``/dev/shm`` and network namespace agree
(``testing/cluster.py``'s emulated nodes are namespaces). ``TRITON_RESHARD_LANES=0`` turns a rank's lanes off
(its peers then talk to it over gloo). ``TRITON_RESHARD_LANE_MB``: a rank's shared memory for its outgoing
lanes (default 64 MiB, split over its same-host peers, at most 32 MiB a lane).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import platform
import socket
import stat

import numpy as np
import torch

CTRL_BYTES = 64  # the segment's first cache line: the consumed position (int64), written by the receiver
MIN_LANE_BYTES = 1 << 20  # a lane smaller than this is not made (the budget split too thin)
MAX_LANE_BYTES = 32 << 20
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    """Lanes on: ``TRITON_RESHARD_LANES`` (default on) on an x86-64 CPU, whose stores become visible in program
    order (the ring's bytes before the consumed position that frees them, the header after the bytes);
    elsewhere (ARM: Grace) the ring would need fences Python cannot issue, so gloo carries everything."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return os.environ.get("TRITON_RESHARD_LANES", "1") not in ("0", "false", "off", "")


def budget_bytes() -> int:
    raw = os.environ.get("TRITON_RESHARD_LANE_MB", "64")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"TRITON_RESHARD_LANE_MB must be a number of MiB, got {raw!r}") from None
    if mb < 0:
        raise ValueError(f"TRITON_RESHARD_LANE_MB must be >= 0, got {raw!r}")
    return int(mb * (1 << 20))


def host_id() -> int:
    """A 63-bit identity of this machine's shared memory: the boot, the host name, ``/dev/shm``'s device (two
    containers of one host with their own ``/dev/shm`` differ) and the network namespace (processes in two
    namespaces are two nodes to us: ``testing/cluster.py`` emulates a cluster that way, and a lane would
    bypass its links)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return 0  # no /dev/shm: no lanes
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    raw = f"{boot}|{socket.gethostname()}|{dev}|{net}|{os.geteuid()}".encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "little") >> 1 or 1


class Segment:
    """A mapped segment: the control line and the ring's bytes (``data``: a uint8 tensor over the map)."""

    def __init__(self, fd: int, size: int, path: str) -> None:
        self.path, self.size = path, size
        # mapped now, page by page (MAP_POPULATE), not at each page's first touch by a message: ~0.5 us a page
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.ctrl = np.frombuffer(self.map, dtype=np.int64, count=CTRL_BYTES // 8)
        self.data = torch.frombuffer(self.map, dtype=torch.uint8, offset=CTRL_BYTES)
        self.cap = size - CTRL_BYTES

    def close(self) -> None:
        self.ctrl = self.data = None
        with contextlib.suppress(BufferError):  # a view still alive: the map goes when it does
            self.map.close()


def _name(token: int, sender: int, receiver: int) -> str:
    return os.path.join(SHM_DIR, f"triton_reshard-{token:016x}-{sender}-{receiver}")


def create(token: int, sender: int, receiver: int, size: int) -> Segment | None:
    path = _name(token, sender, receiver)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return None
    _MADE.add(path)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now: never a SIGBUS on a full /dev/shm later
        seg = Segment(fd, size, path)
    except OSError:
        os.close(fd)
        _unlink(path)
        return None
    os.close(fd)
    seg.ctrl[0] = 0
    return seg


def open_peer(token: int, sender: int, receiver: int, size: int) -> Segment | None:
    path = _name(token, sender, receiver)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                or st.st_size != size):
            return None
        seg = Segment(fd, size, path)
        _unlink(path)  # both ends hold it now: the name goes (its maker unlinks too, at the latest at exit)
        return seg
    except OSError:
        return None
    finally:
        os.close(fd)


_MADE: set[str] = set()  # names this process made and has not unlinked yet (unlinked at exit at the latest)


def _unlink(path: str) -> None:
    _MADE.discard(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


@atexit.register
def _unlink_made() -> None:
    for path in list(_MADE):
        _unlink(path)


def make_fifo(token: int, sender: int, receiver: int) -> int | None:
    """The receiver's doorbell of the lane ``sender -> receiver``: a FIFO it makes (mode 0600; a name taken
    is not used) and opens for reading, not blocking; its descriptor."""
    path = _name(token, sender, receiver) + ".fifo"
    try:
        os.mkfifo(path, 0o600)
    except OSError:
        return None
    _MADE.add(path)
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        _unlink(path)
        return None


def open_fifo(token: int, sender: int, receiver: int) -> int | None:
    """The sender's end of the receiver's doorbell: only a FIFO of its own user with mode 0600."""
    path = _name(token, sender, receiver) + ".fifo"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        return None
    _unlink(path)  # both ends hold it now
    return fd


def _lane_cap(budget: int, n_peers: int) -> int:
    """Each lane's ring: the budget split over the peers, at most :data:`MAX_LANE_BYTES`; 0 (no lanes) below
    :data:`MIN_LANE_BYTES` or where all same-host ranks' rings would take over half of ``/dev/shm`` free
    (a container's is often 64 MiB)."""
    cap = min(MAX_LANE_BYTES, budget // n_peers) & ~4095
    try:
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return 0
    if (cap + CTRL_BYTES) * n_peers * (n_peers + 1) > free // 2:
        return 0
    return cap if cap >= MIN_LANE_BYTES else 0
