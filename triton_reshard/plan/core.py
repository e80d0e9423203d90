"""Plan: two layouts in, transfers out. Pure, deterministic, immutable, printable.

``plan_reshard(src, dst)`` decides, for every element of every destination fragment, which source rank
sends it (or that the destination rank copies it locally because it already holds it). ``Plan.schedule``
then cuts the wire transfers into memory-bounded steps, each step grouping the bytes of one
(source rank, destination rank) pair into one contiguous message at fixed buffer offsets.

Every rank computes the same plan and schedule with no communication; ``digest`` lets ranks check that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..layout import Layout, gc_paused
from ..layout.fragment_table import distinct
from . import quant as _quant
from .contiguity import Contiguity, contiguity
from .options import StepBudget
from .pair_schedule import build_pair_schedule, world_of
from .routing import check_gpus_per_node
from .rows import lower_bound_bytes
from .table import TransferTable
from .types import DIRECT_MIN_BYTES, PlanStats, Schedule
from .validate import validate_plan, validate_share

RULE_VERSION = "local-1"  # in the rank shares' digest: ranks running different rules must not agree


def identity_digest(src: Layout, dst: Layout, options: tuple) -> str:
    """What every rank of a rank-planned reshard computes alike: the two layouts (their content fingerprints),
    the planner options and the rule version (the plan is a pure function of them)."""
    h = hashlib.sha256()
    h.update(src.fingerprint.encode())
    h.update(dst.fingerprint.encode())
    h.update(repr((RULE_VERSION,) + options).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Plan:
    """Who sends which box to whom: the whole plan (``rank=None``: every rank's transfers) or one rank's share of
    it (``rank=r``: the wire transfers with rank ``r`` at one end, sends, receives and relays, in the whole plan's
    order, and its local copies; what ``plan_reshard(..., rank=r)`` returns, without planning anyone else's).
    The shares of all ranks are exactly the whole plan cut by rank, and their schedules the whole schedule's.

    Validated on construction. The whole plan: every destination element covered exactly once, every transfer
    read from a box its source rank really holds. A share, cheaply: every transfer has its rank at one end; what
    it sends lies inside its own source fragments (relays: its destination fragments); what it receives lies
    inside its own destination fragments and covers each of them exactly once.

    ``options``: the planner's options (``plan_reshard``'s local rules), None for a plan built otherwise (by
    hand, or by the greedy router). ``digest``: the whole plan's, a hash of the layouts and every transfer; a
    share's, the same on every rank of one reshard (``identity_digest``: the layouts, ``options`` and the rule
    version), what the executor's handshake compares. ``schedule``: the pair rule (``plan/pair_schedule.py``),
    for every plan; a share gets its own steps, numbered as in the whole plan's schedule.
    """

    src: Layout
    dst: Layout
    transfers: TransferTable  # over the wire (src_rank != dst_rank); given as Transfers or a table
    local_copies: TransferTable  # src_rank == dst_rank, never on the wire
    rank: int | None = None  # None: the whole plan; r: rank r's share
    options: tuple | None = None  # plan_reshard's options (local rules); None: built by hand or by the greedy
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def memo(self, key: str, compute):
        """A table derived from this (immutable) plan, computed once by ``compute()`` and kept with it: the
        plan's derived tables (quantized regions, the cover view, the lower bound) live with the plan that
        owns them, not in each caller."""
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = compute()
        return v

    def __post_init__(self) -> None:
        wire, local = TransferTable.of(self.transfers), TransferTable.of(self.local_copies)
        object.__setattr__(self, "transfers", wire)
        object.__setattr__(self, "local_copies", local)
        bad = np.flatnonzero(wire.src == wire.dst)
        if len(bad):
            raise ValueError(f"plan: wire transfer {wire[int(bad[0])]} stays on one rank")
        bad = np.flatnonzero(local.src != local.dst)
        if len(bad):
            raise ValueError(f"plan: local copy {local[int(bad[0])]} crosses ranks")
        if self.rank is not None:
            if self.options is None:
                raise ValueError(f"plan: the share of rank {self.rank} needs the planner's options (its digest)")
            validate_share(self)
            return
        validate_plan(self)  # (block-quantized destinations included: the scales' cover, the modes)

    @property
    def digest(self) -> str:
        if "digest" not in self._cache:
            if self.rank is not None:
                self._cache["digest"] = identity_digest(self.src, self.dst, self.options)
                return self._cache["digest"]
            h = hashlib.sha256()
            # the layouts by their content fingerprints (from their columns: 0.06 s at 128 ranks, where their
            # ``digest``, the repr of every fragment, took 0.8 s), as a share's identity digest takes them
            h.update(self.src.fingerprint.encode())
            h.update(self.dst.fingerprint.encode())
            # every transfer, from the columns in a canonical form (``TransferTable.keys_digest``)
            h.update(self.transfers.keys_digest().encode())
            h.update(self.local_copies.keys_digest().encode())
            self._cache["digest"] = h.hexdigest()[:16]
        return self._cache["digest"]

    @property
    def sent_bytes(self) -> int:
        """A share's: the bytes its rank sends (the whole plan's per rank: ``stats().sent_bytes``)."""
        return int(self.columns.nbytes[self.columns.src == self._share_rank("sent_bytes")].sum())

    @property
    def recv_bytes(self) -> int:
        """A share's: the bytes its rank receives (the whole plan's per rank: ``stats().recv_bytes``)."""
        return int(self.columns.nbytes[self.columns.dst == self._share_rank("recv_bytes")].sum())

    def _share_rank(self, what: str) -> int:
        if self.rank is None:
            raise ValueError(f"Plan.{what}: a share's (plan_reshard(..., rank=r)); the whole plan has it per rank "
                             f"in stats()")
        return self.rank

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def stats(self, gpus_per_node: int | None = None) -> PlanStats:
        """Bytes and counts (cached). ``gpus_per_node``: also split the wire bytes into network (between nodes
        of that many consecutive ranks) and NVLink (inside a node) bytes; relays are counted in both the
        totals and ``relay_bytes``."""
        check_gpus_per_node(gpus_per_node, "Plan.stats")
        if self.rank is not None:
            raise ValueError(f"Plan.stats: the whole plan's (this is rank {self.rank}'s share: sent_bytes, "
                             f"recv_bytes)")
        key = ("stats", gpus_per_node)
        if key not in self._cache:
            c = self.columns
            ranks = self.ranks
            world = max(ranks, default=-1) + 1
            sent = _sums(c.src, c.nbytes, world)
            recv = _sums(c.dst, c.nbytes, world)
            relay = c.nbytes[c.relay]
            net = 0
            if gpus_per_node:
                net = int(c.nbytes[c.src // gpus_per_node != c.dst // gpus_per_node].sum())
            if "lower_bound" not in self._cache:
                self._cache["lower_bound"] = lower_bound_bytes(self.src, self.dst)
            wire = int(c.nbytes.sum())
            self._cache[key] = PlanStats(
                wire_bytes=wire,
                local_bytes=int(self.local_copies.nbytes.sum()),
                lower_bound_bytes=self._cache["lower_bound"],
                sent_bytes={r: sent[r] for r in sorted(set(ranks) | set(distinct(c.src).tolist()))},
                recv_bytes={r: recv[r] for r in sorted(set(ranks) | set(distinct(c.dst).tolist()))},
                num_transfers=len(self.transfers),
                num_local_copies=len(self.local_copies),
                relay_bytes=int(relay.sum()),
                num_relays=len(relay),
                gpus_per_node=gpus_per_node,
                net_bytes=net if gpus_per_node else None,
                nvlink_bytes=wire - net if gpus_per_node else None,
                quant_src_bytes=int(c.nbytes[c.quant == c.QUANT_CODES[_quant.QUANT_SRC]].sum()),
                quant_dst_bytes=int(c.nbytes[c.quant == c.QUANT_CODES[_quant.QUANT_DST]].sum()),
            )
        return self._cache[key]

    @property
    def columns(self) -> TransferTable:
        """The wire transfers' columns (``transfers`` itself: ranks ``src`` / ``dst``, ``nbytes``, ``relay``,
        ``quant``, ...)."""
        return self.transfers

    def schedule(self, bucket_bytes: StepBudget | int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> Schedule:
        """The wire transfers in steps by the pair rule (``plan/pair_schedule.py``; cached): per step each rank
        sends to at most ``STEP_PEERS`` peers and receives from as many, each message within its share of
        the per-step cap, so a rank's staging stays within one bucket. Steps carry their rule number
        (``Step.number``); a share's steps (only those its rank takes part in) have the whole plan's numbers.

        ``bucket_bytes``: the per-step cap in bytes (with ``direct_min_bytes``), or a
        :class:`~triton_reshard.plan.options.StepBudget` (the executor's, checked once: the cap is its
        ``slot_bytes``, with its ``direct_min_bytes``); the same budget gives the same steps. Chunks of at least
        ``direct_min_bytes`` that are contiguous in their source or destination local tensor become direct
        messages (sent or received in place by the executor)."""
        if isinstance(bucket_bytes, StepBudget):
            cap, n = bucket_bytes.key
        else:
            cap, n = int(bucket_bytes), int(direct_min_bytes)
        key = ("schedule", cap, n)
        if key not in self._cache:
            cont = contiguity(self.transfers, self.src, self.dst, n, self.rank)
            with gc_paused():
                self._cache[key] = build_pair_schedule(self.transfers, cap, cont, n, world_of(self.src, self.dst))
        return self._cache[key]

    def _contiguity(self, min_bytes: int = 0) -> Contiguity:
        """Which chunks of this plan's wire transfers may travel in place (direct messages): see
        :class:`~triton_reshard.plan.pair_schedule.Contiguity` (the one answer for whole plans and shares)."""
        return contiguity(self.transfers, self.src, self.dst, min_bytes, self.rank)

    def __repr__(self) -> str:
        if self.rank is not None:
            return (f"Plan(rank={self.rank}, digest={self.digest}, {len(self.transfers)} wire transfers (sends "
                    f"{self.sent_bytes} B, receives {self.recv_bytes} B), {len(self.local_copies)} local copies)")
        s = self.stats()
        return (
            f"Plan(digest={self.digest}, {len(self.transfers)} wire transfers ({s.wire_bytes} B, lower bound "
            f"{s.lower_bound_bytes} B), {len(self.local_copies)} local copies ({s.local_bytes} B), ranks "
            f"{list(self.ranks)})"
        )

    def describe(self, max_rows: int = 40) -> str:
        """A readable listing of the plan, for debugging."""
        lines = [repr(self)]
        rows = [("wire", t) for t in self.transfers] + [("local", t) for t in self.local_copies]
        for kind, t in rows[:max_rows]:
            lines.append(f"  {kind:5s} {t}")
        if len(rows) > max_rows:
            lines.append(f"  ... {len(rows) - max_rows} more")
        return "\n".join(lines)

    __str__ = describe


def _sums(ranks: np.ndarray, nbytes: np.ndarray, world: int) -> list[int]:
    """Per rank ``0..world-1`` the exact int sum of ``nbytes`` over its rows (int64: a rank's bytes stay far
    below 2**63; ``np.bincount`` would sum in float64)."""
    out = np.zeros(max(world, int(ranks.max()) + 1 if len(ranks) else 0), np.int64)
    np.add.at(out, ranks, nbytes)
    return out.tolist()
