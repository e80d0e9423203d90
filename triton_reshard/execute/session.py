"""Refit sessions: what ``refit`` keeps between calls, one :class:`RefitSession` per cached entry.

A session owns the :class:`~triton_reshard.execute.Resharder` of one (layouts, group, options) entry (its
plan share and staging buffers), the delta snapshot that Resharder diffs against (what this rank last sent),
and the destination's version / torn state (:class:`RefitState`). The one registry (:data:`SESSIONS`) keeps
the sessions, least recently used dropped, and the destinations' states: a destination is ``(dst_layout,
instances)`` on this rank, and its state outlives any one session, because a failed refit leaves the group
unusable and the repair comes through a new group, hence a new session: the state of the destination it
writes stays torn until a refit through any session succeeds.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..comm.group import RefitGroup, as_transport
from ..layout import Layout
from ..plan import plan_reshard
from .delta import DeltaRequest, MessageSnapshot
from .errors import ReshardError
from .options import RefitOptions
from .reports import RunReport, VerifyReport
from .resharder import Resharder


@dataclasses.dataclass(frozen=True)
class RefitState:
    """What ``refit`` wrote into one destination (``refit_state(dst_layout)``), on this rank.

    ``version``: the last version fully written (``refit(..., version=v)``; None before the first, or when
    refits pass no version). ``torn``: a refit failed after writing part of the destination: the tensors hold a
    mix of versions until a refit succeeds; do not sample from them. ``torn_tensors``: the destination local
    tensors that may be partly written. ``failed_version``: the version that failed. ``error``: its message.
    ``attempting``: a version whose refit is in progress (None when none is). Ranks are independent: a peer
    may be torn while this rank completed, so agree across the engine (e.g. all-reduce ``torn``) before use.
    """

    version: object = None
    torn: bool = False
    torn_tensors: tuple[str, ...] = ()
    failed_version: object = None
    error: str | None = None
    attempting: object = None


class Destination:
    """The :class:`RefitState` of one destination, shared by every session that writes it."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = RefitState()


class RefitSession:
    """One cached entry of ``refit``: its Resharder, the delta snapshot the Resharder diffs against, and the
    state of the destination it writes (with ``(dst_layout, instances)``: shared with the sessions of other
    groups that write the same destination)."""

    def __init__(self, resharder: Resharder, snapshot: MessageSnapshot, destination: Destination) -> None:
        self.resharder = resharder
        self.snapshot = snapshot
        self.destination = destination
        self._warned: set[tuple[str, ...]] = set()  # the sets of ignored destination names warned about

    @property
    def state(self) -> RefitState:
        return self.destination.state

    def usable(self) -> bool:
        """The Resharder can be reused: it never failed part way, and its group was not destroyed."""
        r = self.resharder
        if r.broken is not None:
            return False
        g = r.group
        if isinstance(g, RefitGroup):
            return g.pg is not None
        if g is None:
            g = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            return r.transport.key is g
        try:
            dist.get_process_group_ranks(g)
        except Exception:  # destroyed (torch forgets it)
            return False
        return True

    def covered(self, dst: dict[str, torch.Tensor], strict: bool, what: str):
        """The destination tensors the layout covers on this rank, and the sorted names of the others (ignored,
        with one warning per session and set of names). ``strict``: keep them all (``run`` then rejects them)."""
        if strict:
            return dst, ()
        r = self.resharder
        specs = r.plan.dst.local_specs(r.rank)
        ignored = tuple(sorted(n for n in dst if n not in specs))
        if not ignored:
            return dst, ()
        if ignored not in self._warned:
            self._warned.add(ignored)
            warnings.warn(
                f"{what}: rank {r.rank}: ignoring {len(ignored)} destination tensor(s) that the destination layout "
                f"does not cover on this rank: {list(ignored)} (strict=True makes this an error)",
                stacklevel=5,
            )
        return {n: t for n, t in dst.items() if n in specs}, ignored

    def run(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], version: object,
            delta: DeltaRequest | None) -> RunReport:
        """Refit ``dst`` to ``version``, recording the destination's state: a failure that may have written
        part of it (or an unknown one) leaves it torn, a rejected input leaves it as it was, a success makes
        ``version`` the one held. ``delta`` gets the destination's held version and torn flag (the fence)."""
        dest = self.destination
        state = dest.state
        dest.state = dataclasses.replace(state, attempting=version)
        if delta is not None:
            delta = dataclasses.replace(delta, held=state.version if isinstance(state.version, int) else None,
                                        torn=state.torn)
        try:
            report = self.resharder.run(src, dst, delta=delta)
        except BaseException as e:
            torn = tuple(getattr(e, "torn", ()))
            if torn or not isinstance(e, (ReshardError, ValueError, TypeError)):  # unknown: assume the worst
                torn = tuple(sorted(set(torn or dst) | set(state.torn_tensors)))
                dest.state = RefitState(state.version, True, torn, version, f"{type(e).__name__}: {e}")
            else:  # nothing written: the state stays what it was
                dest.state = dataclasses.replace(state, attempting=None)
            raise
        dest.state = RefitState(version if version is not None else state.version)
        return report

    def verify(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> VerifyReport:
        return self.resharder.verify(src, dst)


class _GroupKey:
    """A cache key for a group: equal only for the very same live object. It holds the group, so while the
    entry lives no other group can take the object's id."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __hash__(self) -> int:
        return id(self.group)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _GroupKey) and other.group is self.group


def _group_key(group) -> _GroupKey:
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD  # the default group of now, not of when a session was cached
    return _GroupKey(group)


class Sessions:
    """The registry: sessions by (src layout, dst layout, group, options), at most :attr:`size`, least
    recently used dropped, never one whose Resharder failed or whose group was destroyed; and the state of
    every destination refitted (by ``(dst_layout, instances)``), which outlives the sessions."""

    size = 8

    def __init__(self) -> None:
        self._lru: OrderedDict[tuple, RefitSession] = OrderedDict()
        self._destinations: dict[tuple[Layout, int], Destination] = {}

    def get(self, src_layout: Layout, dst_layout: Layout, group, opts: RefitOptions, *,
            verify: bool = False) -> RefitSession:
        """The session for these layouts, group and validated options (planned on a miss). ``verify``: for
        ``verify_refit``, which plans without relays (``plan.options.default_relay``)."""
        opts = opts.relay_decided(dst_layout, verify=verify)  # the options as planned: the key
        key = (src_layout, dst_layout, _group_key(group), opts)
        hit = self._lru.get(key)
        if hit is not None and hit.usable():
            self._lru.move_to_end(key)
            return hit
        self._lru.pop(key, None)
        # this rank's share only (plan/local.py): its transfers and steps, computed from the layouts without
        # planning the other ranks'; its peers compute the matching halves
        planned, plan_opts = opts.plan_options(dst_layout, verify=verify)  # the planner's options, resolved
        plan = plan_reshard(src_layout, planned, options=plan_opts, rank=as_transport(group).rank)
        snapshot = MessageSnapshot()
        r = Resharder(plan, group=group, options=opts, snapshot=snapshot)
        session = self._lru[key] = RefitSession(r, snapshot, self.destination(dst_layout, opts.instances))
        while len(self._lru) > self.size:
            self._lru.popitem(last=False)
        return session

    def destination(self, dst_layout: Layout, instances: int) -> Destination:
        """The destination ``(dst_layout, instances)`` on this rank (made on first use), whose ``state`` every
        session writing it shares."""
        return self._destinations.setdefault((dst_layout, instances), Destination())

    def state(self, dst_layout: Layout, instances: int) -> RefitState:
        dest = self._destinations.get((dst_layout, instances))
        return RefitState() if dest is None else dest.state

    def forget(self, dst_layout: Layout, instances: int) -> None:
        """Forget the destination's state (its tensors were replaced by unwritten ones)."""
        dest = self._destinations.get((dst_layout, instances))
        if dest is None:
            return
        dest.state = RefitState()  # the sessions writing it share the object
        if not any(s.destination is dest for s in self._lru.values()):
            del self._destinations[(dst_layout, instances)]

    def clear(self) -> None:
        """Drop the sessions (plans, buffers, snapshots); the destinations' states stay."""
        self._lru.clear()


SESSIONS = Sessions()  # the one registry of this process
