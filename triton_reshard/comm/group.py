"""Transport groups: what the executor sends through.

* A torch.distributed group (the default world, or a ``new_group`` of it): ranks are global ranks; messages go
  through ``batch_isend_irecv``.
* A :class:`RefitGroup` from :func:`init_refit_group`: a process group for refit only, made from its own TCP
  rendezvous, that spans processes of *different* torch.distributed worlds (a trainer job and an engine job,
  each with its own default group) or of none. It is never registered with torch.distributed, so it never
  touches the jobs' default groups; its ranks are its own ``0..world_size-1`` (the plan's ranks), and each job
  joins with its rank offset (trainer ranks ``0..T-1``, engine ranks ``T..T+E-1``, say).

Every wait is bounded by a timeout; a rendezvous that cannot complete says which ranks never arrived.

Security (``docs/security.md``): the rendezvous is an authenticated store (:mod:`.auth`) that rank 0 serves;
every member proves the group's secret before it can read or write a key, and rank 0 proves it back. The
gloo/NCCL rendezvous, the rank claims and :meth:`RefitGroup.all_gather_object` (data-only JSON, :mod:`.wire`)
all ride it. The tensors themselves travel over gloo/NCCL, which neither encrypt nor authenticate them.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from . import lanes as _lanes
from . import wire
from .auth import AuthError, AuthStore, AuthStoreServer
from .secret import ResolvedSecret, group_key, resolve_secret

CLOSE_LINGER_S = 2.0  # rank 0's destroy waits at most this long for the other members to hang up
# a torch.distributed gloo group's same-host lanes (comm/lanes.py), while the group lives
_TORCH_LANES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class RefitGroupError(RuntimeError):
    """The refit group could not be formed (port taken, a rank never arrived, ranks disagree)."""


def _td(timeout: float | timedelta) -> timedelta:
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and 0 < timeout < float("inf"):
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be a timedelta or a finite positive number of seconds, got {timeout!r}")


class TorchGroup:
    """A torch.distributed group (``None``: the default world). Ranks are global ranks."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            try:
                self.ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                    range(dist.get_world_size()))
            except KeyError:  # torch forgets a group when it is destroyed
                raise ValueError("the torch.distributed process group was destroyed (or belongs to an earlier "
                                 "default group): pass a live group") from None
            self.backend = str(dist.get_backend(group))
        else:
            self.rank, self.ranks, self.backend = 0, (0,), "none"
        # the group object itself (the default group for None): what identifies it while it lives
        self.key = group if group is not None else (dist.group.WORLD if dist.is_available() and dist.is_initialized()
                                                    else None)
        # gloo: messages are posted on the group's own send / recv (group ranks), without batch_isend_irecv's
        # per-operation Python (~15 us each: issue 32, a cached refit's fixed cost); gloo does not coalesce
        self._peer = None
        if self.backend == "gloo" and self.key is not None:
            self._peer = {r: r for r in self.ranks} if group is None else {
                r: dist.get_group_rank(group, r) for r in self.ranks}

    @property
    def wire(self) -> bool:
        return len(self.ranks) > 1

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor):
        return dist.all_gather(out, t, group=self.group, async_op=True)

    @property
    def lanes(self) -> _lanes.Lanes:
        setup = _TORCH_LANES.get(self.key) if self._peer is not None else None
        return setup.lanes or _lanes.NONE if setup is not None else _lanes.NONE

    def lane_setup(self, timeout: timedelta):
        """This group's same-host lanes' setup (``comm/lanes.Setup``: a handshake takes a step of it before it
        posts, and posts the next round once its rows came back); None where the group has none (not gloo)."""
        if self._peer is None or not self.wire:
            return None
        setup = _TORCH_LANES.get(self.key)
        if setup is None:
            setup = _TORCH_LANES[self.key] = _lanes.Setup(self.key, self.rank, self.ranks, timeout)
        return setup

    def post(self, sends, recvs) -> list:
        peer_of = self._peer
        if peer_of is not None:  # gloo: the receives first, then the sends, as batch_isend_irecv posts them
            pg = self.key
            lanes = self.lanes
            if lanes:
                works = [lanes.recv(pg, peer, peer_of[peer], buf) for peer, buf in recvs]
                works += [lanes.send(pg, peer, peer_of[peer], buf) for peer, buf in sends]
                return works
            works = [pg.recv([buf], peer_of[peer], 0) for peer, buf in recvs]
            works += [pg.send([buf], peer_of[peer], 0) for peer, buf in sends]
            return works
        p2p = [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recvs]
        p2p += [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sends]
        return dist.batch_isend_irecv(p2p)  # never called with an empty list: steps without ops are dropped


@dataclass(eq=False)
class RefitGroup:
    """A process group for refit only (see :func:`init_refit_group`). Pass it as ``group=`` to ``refit``,
    ``verify_refit`` or ``Resharder``; the plan's ranks are this group's ranks."""

    rank: int
    size: int
    backend: str
    host: str
    port: int
    timeout: timedelta
    pg: object = field(repr=False)
    _store: object = field(repr=False)
    _gen: int = field(default=0, repr=False)
    _server: object = field(default=None, repr=False)  # rank 0: the rendezvous it serves
    digest_key: bytes = field(default=b"", repr=False)  # integrity: the key digests are keyed with
    _lane_setup: object = field(default=None, repr=False)  # same-host lanes (gloo): comm/lanes.Setup

    @property
    def lanes(self) -> _lanes.Lanes:
        setup = self._lane_setup
        return setup.lanes or _lanes.NONE if setup is not None else _lanes.NONE

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size))

    @property
    def wire(self) -> bool:
        return self.size > 1

    def check_live(self) -> None:
        """Raise :class:`RefitGroupError` naming this rank if the group was destroyed (nothing is sent)."""
        self._live()

    def _live(self):
        if self.pg is None:
            raise RefitGroupError(f"rank {self.rank}: the refit group {self.host}:{self.port} was destroyed")
        return self.pg

    def lost_members(self) -> list[int] | None:
        """On rank 0 (it serves the rendezvous every member stays connected to while in the group): the other
        ranks whose connection to it is closed now (their process died or left the group), in the order they
        left (the first is the first to fail: a dead member's peers often follow it down). None on the other
        ranks, or once destroyed: they cannot tell."""
        server = self._server
        if server is None:
            return None
        alive, left = server.member_ranks(), server.left_at()
        gone = [r for r in range(self.size) if r != self.rank and r not in alive]
        return sorted(gone, key=lambda r: (left.get(r, float("inf")), r))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor):
        return self._live().allgather([out], [t])

    def post(self, sends, recvs) -> list:
        pg = self._live()
        if self.backend == "nccl":  # one coalesced NCCL group call, as batch_isend_irecv makes
            dev = (sends or recvs)[0][1].device
            pg._start_coalescing(dev)
            for peer, buf in recvs:
                pg.recv([buf], peer, 0)
            for peer, buf in sends:
                pg.send([buf], peer, 0)
            return [pg._end_coalescing(dev)]
        lanes = self.lanes
        if lanes:
            works = [lanes.recv(pg, peer, peer, buf) for peer, buf in recvs]
            works += [lanes.send(pg, peer, peer, buf) for peer, buf in sends]
            return works
        works = [pg.recv([buf], peer, 0) for peer, buf in recvs]
        works += [pg.send([buf], peer, 0) for peer, buf in sends]
        return works

    def lane_setup(self, timeout: timedelta):
        """The group's same-host lanes' setup (``comm/lanes.Setup``); None where it has none (not gloo)."""
        if self.backend != "gloo" or self.size < 2:
            return None
        if self._lane_setup is None:
            self._lane_setup = _lanes.Setup(self._live(), self.rank, self.ranks, timeout)
        return self._lane_setup

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order, through the group's authenticated rendezvous store (for small
        control data such as layouts and load records; bounded by the group's timeout). Data only: JSON
        values, tuples, dtypes, Layouts, load records (:mod:`triton_reshard.comm.wire`); nothing is unpickled. A
        message that does not match its schema raises :class:`RefitGroupError` naming the rank and field."""
        if self._store is None:
            raise RefitGroupError(f"rank {self.rank}: the refit group {self.host}:{self.port} was destroyed")
        self._gen += 1
        prefix = f"tr/obj/{self._gen}/"
        self._store.set(prefix + str(self.rank), wire.dumps(obj))
        keys = [prefix + str(r) for r in range(self.size)]
        try:
            raw = self._store.multi_get(keys)
        except (RuntimeError, OSError, dist.DistStoreError) as e:
            try:
                missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            except (RuntimeError, OSError):
                missing = "unknown: the rendezvous is lost"
            raise RefitGroupError(f"rank {self.rank}: ranks {missing} of the refit group did not contribute to "
                                  f"exchange {self._gen} within {self.timeout.total_seconds():g}s ({e})") from e
        try:
            return [wire.loads(b, f"rank {r}'s object in exchange {self._gen}") for r, b in enumerate(raw)]
        except wire.WireError as e:
            raise RefitGroupError(f"rank {self.rank}: {e}") from None

    def barrier(self) -> None:
        """All ranks of the group, bounded by the group's timeout."""
        t = torch.zeros(1, device=self._device())
        out = [torch.empty_like(t) for _ in range(self.size)]
        if not self.all_gather(out, t).wait(timeout=self.timeout):
            raise RefitGroupError(f"rank {self.rank}: barrier of the refit group timed out")

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def destroy(self) -> None:
        """Drop the group (idempotent). Do this after a timeout: the group is unusable then. On rank 0 this
        also closes the rendezvous every rank's store rides, after waiting up to :data:`CLOSE_LINGER_S` for
        the other members to hang up (when every rank raises the same refusal right after an exchange, a
        member still reading that exchange's reply then gets it, not a lost connection); a rank still waiting
        inside :meth:`all_gather_object` after that fails, so let the ranks meet (:meth:`barrier`) before rank
        0 destroys a healthy group."""
        pg, self.pg = self.pg, None
        setup, self._lane_setup = self._lane_setup, None
        if setup is not None:
            setup.close()
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):  # best effort: a broken group may refuse
                pg.shutdown()
        store, self._store = self._store, None
        if isinstance(store, AuthStore):
            store.close()
        server, self._server = self._server, None
        if server is not None:
            server.close(linger=min(CLOSE_LINGER_S, self.timeout.total_seconds()))


def as_transport(group) -> TorchGroup | RefitGroup:
    """The executor's view of ``group`` (a RefitGroup, a torch.distributed group, or None)."""
    if isinstance(group, RefitGroup):
        return group
    if group is None or isinstance(group, dist.ProcessGroup):
        return TorchGroup(group)
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a RefitGroup or None, got {type(group).__name__}")


def init_refit_group(host: str, port: int, rank: int, world_size: int, *, backend: str | None = None,
                     timeout: float | timedelta = 300.0, secret: bytes | str | ResolvedSecret | None = None,
                     insecure: bool | None = None) -> RefitGroup:
    """Join (rank 0: open) the refit group at ``host:port`` as ``rank`` of ``world_size``.

    Works in any process, inside a torch.distributed world or outside any; never touches the default group.
    ``backend``: ``"gloo"`` or ``"nccl"`` (default: NCCL when CUDA is available, else gloo). Every rank must
    pass the same ``world_size``; each rank number is taken once. Raises :class:`RefitGroupError` within
    ``timeout`` if rank 0 cannot listen on the port, a rank cannot reach rank 0, some rank never arrives (it
    names them), or the ranks disagree on the world size.

    ``secret`` (bytes or str, at least 16 bytes; default: the environment's ``TRITON_RESHARD_SECRET``, or
    the file named by ``TRITON_RESHARD_SECRET_FILE``): every member proves it holds the same secret before
    it takes a rank, and rank 0 proves it to every member (a member never joins a stranger's group); it
    never crosses the wire. A process without it is refused at the handshake: it reads and writes nothing
    and takes no rank. Without a secret the group runs only on a loopback ``host`` (127.0.0.0/8, ``::1``,
    ``localhost``: only this machine's processes reach it), because on a routable address anyone who reaches
    the port could take a rank, read the layouts and send or receive weights; ``insecure=True`` (or
    ``TRITON_RESHARD_INSECURE=1``) accepts that risk explicitly. What the secret does not protect (the
    tensors on gloo/NCCL's wire): ``docs/security.md``. A :class:`~triton_reshard.comm.secret.ResolvedSecret`
    (what a plug-in looked up already, ``integrations.engine.plugin_secret``) is used as it is.
    """
    td = _td(timeout)
    for name, v in (("rank", rank), ("world_size", world_size), ("port", port)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"init_refit_group: {name} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_refit_group: rank {rank} is not in [0, world_size={world_size})")
    if not 0 < port < 65536:
        raise ValueError(f"init_refit_group: port {port} is not in 1..65535")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_refit_group: backend {backend!r} is not 'gloo' or 'nccl'")
    key = group_key(host, resolve_secret(secret), insecure, where=f"init_refit_group (rank {rank})")
    where = f"{host}:{port}"
    deadline = time.monotonic() + td.total_seconds()
    server = None
    if rank == 0:
        try:
            server = AuthStoreServer(host, port, key, world_size)
        except OSError as e:
            raise RefitGroupError(f"rank 0 cannot open the refit group's rendezvous on {where}: "
                                  f"{e.strerror or e} (is the port taken?)") from e
    try:
        store = connect_member(host, port, key, td, rank, world_size, deadline, where)
        try:
            g = _join(store, host, port, rank, world_size, backend, td, deadline, where)
        except BaseException:
            store.close()
            raise
    except BaseException:
        if server is not None:  # let the members read why (e.g. the sizes they disagree on) before it goes
            server.close(linger=min(CLOSE_LINGER_S, td.total_seconds()))
        raise
    g._server = server
    g.digest_key = key  # integrity: execute/integrity.py keys the per-message digests with the group's secret
    return g


def connect_member(host, port, key, td, rank, world_size, deadline, where) -> AuthStore:
    try:
        return AuthStore(host, port, key, td, rank=rank, world_size=world_size, connect_deadline=deadline)
    except AuthError as e:
        raise RefitGroupError(f"rank {rank} refused to join the refit group at {where}: {e}") from None
    except (TimeoutError, OSError) as e:
        raise RefitGroupError(f"rank {rank} could not reach the refit group's rendezvous at {where} within "
                              f"{td.total_seconds():g}s: {e}") from None


def _join(store, host, port, rank, world_size, backend, td, deadline, where) -> RefitGroup:
    if store.add(f"tr/rank/{rank}", 1) != 1:
        raise RefitGroupError(f"rank {rank} of the refit group at {where} was taken twice: two processes passed "
                              f"rank={rank}")
    store.append("tr/sizes", f"{rank}:{world_size};")
    store.set(f"tr/ws/{rank}", str(world_size))
    keys = [f"tr/ws/{r}" for r in range(world_size)]
    while True:  # every rank's size is checked while waiting (a rank with another size may wait forever)
        arrived = store.check(keys)
        other = {r: n for r, n in _sizes(store).items() if n != world_size}
        if other:
            raise RefitGroupError(
                f"rank {rank}: the refit group at {where} disagrees on its size: rank {rank} says world_size="
                f"{world_size}, but " + ", ".join(f"rank {r} says {n}" for r, n in sorted(other.items())))
        if arrived:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"tr/ws/{r}"])]
            raise RefitGroupError(
                f"rank {rank}: ranks {missing} of the refit group at {where} (world_size={world_size}) did not "
                f"arrive within {td.total_seconds():g}s")
        time.sleep(0.02)
    prefix = dist.PrefixStore("tr/pg/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefix, rank, world_size, td)
    else:
        pg = dist.ProcessGroupNCCL(prefix, rank, world_size, timeout=td)
    g = RefitGroup(rank, world_size, backend, host, port, td, pg, store)
    g.barrier()
    return g


def _sizes(store) -> dict[int, int]:
    raw = store.get("tr/sizes").decode() if store.check(["tr/sizes"]) else ""
    out = {}
    for item in raw.split(";"):
        if item:
            r, n = item.split(":")
            out[int(r)] = int(n)
    return out


_GIVEN: set[int] = set()  # ports free_port handed out in this process (not handed out twice)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 65535  # Linux's default start; IANA's range (49152-) lies inside


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (for tests, examples and a rank 0 that picks its own port),
    taken from below the kernel's ephemeral range: a port in that range, free now, can be handed by the
    kernel to any outgoing connection before it is bound (which then holds it: rank 0's bind fails), and a
    member retrying it while nobody listens can connect to itself."""
    lo = 20000
    hi = min(_ephemeral_range()[0], 65536)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    rng = random.Random()
    for _ in range(200) if hi - lo > 100 else ():
        p = rng.randrange(lo, hi)
        if p in _GIVEN:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host.strip("[]"), p))
            except OSError:
                continue
        _GIVEN.add(p)
        return p
    with socket.socket(family, socket.SOCK_STREAM) as s:  # no room below the ephemeral range: the kernel's pick
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]
