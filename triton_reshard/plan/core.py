"""Plan: two layouts in, transfers out. Pure, deterministic, immutable, printable.

``plan_reshard(src, dst)`` decides, for every element of every destination fragment, which source rank
sends it (or that the destination rank copies it locally because it already holds it). ``Plan.schedule``
then cuts the wire transfers into memory-bounded steps, each step grouping the bytes of one
(source rank, destination rank) pair into one contiguous message at fixed buffer offsets.

Every rank computes the same plan and schedule with no communication; ``digest`` lets ranks check that.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field

from ..layout import Layout, gc_paused
from . import quant as _quant
from .routing import check_gpus_per_node, lower_bound_bytes
from .schedule import build_schedule
from .types import DIRECT_MIN_BYTES, PlanStats, Schedule, Transfer
from .validate import validate_plan


@dataclass(frozen=True, eq=False)
class Plan:
    """Who sends which box to whom. Validated on construction: every destination element covered exactly once,
    every transfer read from a box its source rank really holds."""

    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]  # over the wire (src_rank != dst_rank)
    local_copies: tuple[Transfer, ...]  # src_rank == dst_rank, never on the wire
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for t in self.transfers:
            if t.is_local:
                raise ValueError(f"plan: wire transfer {t} stays on one rank")
        for t in self.local_copies:
            if not t.is_local:
                raise ValueError(f"plan: local copy {t} crosses ranks")
        validate_plan(self)
        if self.dst.quantized:
            _quant.validate_quant(self)  # block-quantized destinations: the scales' cover, the modes

    @property
    def digest(self) -> str:
        if "digest" not in self._cache:
            h = hashlib.sha256()
            h.update(self.src.digest.encode())
            h.update(self.dst.digest.encode())
            with gc_paused():  # millions of short-lived tuples: collector passes would dominate
                for t in self.transfers + self.local_copies:
                    h.update(repr(t.key()).encode())
            self._cache["digest"] = h.hexdigest()[:16]
        return self._cache["digest"]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def stats(self, gpus_per_node: int | None = None) -> PlanStats:
        """Bytes and counts (cached). ``gpus_per_node``: also split the wire bytes into network (between nodes
        of that many consecutive ranks) and NVLink (inside a node) bytes; relays are counted in both the
        totals and ``relay_bytes``."""
        check_gpus_per_node(gpus_per_node, "Plan.stats")
        key = ("stats", gpus_per_node)
        if key not in self._cache:
            sent: dict[int, int] = defaultdict(int)
            recv: dict[int, int] = defaultdict(int)
            relay_bytes = num_relays = net = q_src = q_dst = 0
            for t in self.transfers:
                n = t.nbytes
                sent[t.src_rank] += n
                recv[t.dst_rank] += n
                if t.quant:
                    if t.quant == _quant.QUANT_SRC:
                        q_src += n
                    else:
                        q_dst += n
                if t.relay:
                    relay_bytes += n
                    num_relays += 1
                if gpus_per_node and t.src_rank // gpus_per_node != t.dst_rank // gpus_per_node:
                    net += n
            for r in self.ranks:
                sent.setdefault(r, 0)
                recv.setdefault(r, 0)
            if "lower_bound" not in self._cache:
                self._cache["lower_bound"] = lower_bound_bytes(self.src, self.dst)
            wire = sum(sent.values())
            self._cache[key] = PlanStats(
                wire_bytes=wire,
                local_bytes=sum(t.nbytes for t in self.local_copies),
                lower_bound_bytes=self._cache["lower_bound"],
                sent_bytes=dict(sorted(sent.items())),
                recv_bytes=dict(sorted(recv.items())),
                num_transfers=len(self.transfers),
                num_local_copies=len(self.local_copies),
                relay_bytes=relay_bytes,
                num_relays=num_relays,
                gpus_per_node=gpus_per_node,
                net_bytes=net if gpus_per_node else None,
                nvlink_bytes=wire - net if gpus_per_node else None,
                quant_src_bytes=q_src,
                quant_dst_bytes=q_dst,
            )
        return self._cache[key]

    def schedule(self, bucket_bytes: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> Schedule:
        """Cut the wire transfers into steps within ``bucket_bytes`` of staging per rank (cached).

        Chunks of at least ``direct_min_bytes`` that are contiguous in their source or destination local
        tensor become direct messages (sent or received in place by the executor)."""
        key = ("schedule", int(bucket_bytes), int(direct_min_bytes))
        if key not in self._cache:
            self._cache[key] = build_schedule(
                self.transfers, int(bucket_bytes), self._contiguity(int(direct_min_bytes)), int(direct_min_bytes)
            )
        return self._cache[key]

    def _contiguity(self, min_bytes: int = 0) -> _Contiguity:
        """Per wire transfer (a sequence, each entry looked up when first read: the schedule reads only the
        transfers with chunks of at least ``min_bytes``): (source local shape or None, destination local shape
        or None): the local tensor on the side where its bytes could move in place (wire dtype == local dtype),
        for direct messages. None for transfers under ``min_bytes`` (never direct)."""
        return _Contiguity(self.transfers, self.src._locals_by_rank, self.dst._locals_by_rank, min_bytes)

    def __repr__(self) -> str:
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


class _Contiguity:
    """``Plan._contiguity``: entry ``i`` computed (and kept) when first read."""

    __slots__ = ("_ts", "_src", "_dst", "_min", "_got", "_ranks")

    def __init__(self, transfers, src_locals, dst_locals, min_bytes: int) -> None:
        self._ts, self._src, self._dst, self._min, self._got = transfers, src_locals, dst_locals, min_bytes, {}
        self._ranks: dict[tuple[bool, int], dict] = {}  # (destination side?, rank) -> its local specs

    def _locals(self, dst_side: bool, rank: int) -> dict:
        got = self._ranks.get((dst_side, rank))
        if got is None:
            got = self._ranks[(dst_side, rank)] = (self._dst if dst_side else self._src).get(rank, {})
        return got

    def __len__(self) -> int:
        return len(self._ts)

    def __getitem__(self, i: int) -> tuple | None:
        got = self._got
        if i in got:
            return got[i]
        t = self._ts[i]
        if t.nbytes < self._min or t.quant == _quant.QUANT_SRC:  # the pack quantizes those: never direct
            out = None
        else:
            s = self._locals(t.relay, t.src_rank).get(t.src_local)
            d = self._locals(True, t.dst_rank).get(t.dst_local)
            w = t.wire_dtype
            out = (s.shape if s is not None and s.dtype == w else None,
                   d.shape if d is not None and d.dtype == w else None)
        got[i] = out
        return out
