"""Plan values: transfers, the schedule's messages and steps, plan statistics, and the constants they share.

Pure values (frozen dataclasses); the planner (``routing``, ``relay``), the scheduler (``schedule``) and the
checks (``validate``) build on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..box import ALIGN, align_up  # noqa: F401  (ALIGN, align_up: part of the plan's API)
from ..layout import FP8_BLOCK, Layout, QuantFormat, dtype_name, gc_paused, itemsize_of

# A chunk at least this big that is contiguous in its source or destination local tensor travels as its own
# message, so the executor can send it straight from the source tensor or receive it straight into the
# destination (no pack or unpack copy on that side). Below it, one packed message per peer costs less than a
# message per chunk (each message has a fixed cost on the transport).
DIRECT_MIN_BYTES = 1 << 20
MIN_STEP_BYTES = 16 * ALIGN  # the smallest per-step cap (one staging slot) a schedule accepts


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one logical tensor from a source local tensor to a destination local tensor.

    ``offsets``/``sizes``: the box in the logical tensor. ``src_offsets``/``dst_offsets``: where it starts in
    the source/destination local tensor (local dims; extra leading dims have size 1). ``wire_dtype``: the
    dtype the bytes travel in (the smaller of the two when they differ; cast on the sender when it shrinks).
    ``relay``: the source is not the source layout but the *destination* local tensor ``src_local`` of
    ``src_rank``, which an earlier phase of the plan already wrote (fan-out inside a node: one network
    receive, then NVLink sends); relays run after every non-relay transfer and local copy.

    Block-quantized destinations (``plan/quant.py``; format ``fmt``, a ``QuantFormat``): ``quant="src"``:
    whole blocks (``block``), quantized by the sender into ``wire_dtype`` (the format's value dtype, e.g.
    float8_e4m3fn), their scales (one per block, the format's scale dtype) travelling with them into
    destination local tensor ``scale_local`` at ``scale_offsets``; ``quant="dst"``: a piece of blocks that
    straddle source fragments, in the source dtype, staged by the receiver, which quantizes its region (its
    scales start at ``scale_offsets``) once every piece of it is in. ``""``: a plain copy.
    """

    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_rank: int
    src_local: str
    src_offsets: tuple[int, ...]
    dst_rank: int
    dst_local: str
    dst_offsets: tuple[int, ...]
    wire_dtype: torch.dtype
    relay: bool = False
    quant: str = ""  # "", "src" or "dst" (see above)
    block: tuple[int, ...] = ()  # the quantization block (quant set)
    scale_local: str = ""  # the destination local tensor of the scales (quant set)
    scale_offsets: tuple[int, ...] = ()  # where the scales of its first block go in it ("dst": of its region's)
    fmt: QuantFormat = FP8_BLOCK  # the quantization format (quant set; ``layout.formats``)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        """Payload bytes: a source-quantized transfer carries its quantized values and one scale per block (its
        format's bytes: fp8 + fp32 for block FP8)."""
        if self.quant == "src":
            f = self.fmt
            return (f.value_bytes(self.numel) + f.scale_bytes
                    * math.prod(-(-s // b) for s, b in zip(self.sizes, self.block, strict=True)))
        return self.numel * itemsize_of(self.wire_dtype)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank

    def key(self) -> tuple:
        k = (
            self.tensor, self.offsets, self.sizes, self.src_rank, self.src_local, self.src_offsets,
            self.dst_rank, self.dst_local, self.dst_offsets, dtype_name(self.wire_dtype),
        )
        k = k + (True,) if self.relay else k  # plans without relays keep their digests
        if not self.quant:
            return k
        k = k + (self.quant, self.block, self.scale_local, self.scale_offsets)
        return k + self.fmt.tag  # the plan-format version rule: block-FP8 plans keep their digests

    def __str__(self) -> str:
        box = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True))
        return (
            f"{self.tensor}[{box}] {'relay ' if self.relay else ''}{f'quant={self.quant} ' if self.quant else ''}rank {self.src_rank}:{self.src_local}@{self.src_offsets} -> "
            f"rank {self.dst_rank}:{self.dst_local}@{self.dst_offsets} ({self.nbytes} B {dtype_name(self.wire_dtype)})"
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sub-box of a wire transfer placed at ``buffer_offset`` bytes inside its message."""

    transfer: int  # index into Plan.transfers
    offsets: tuple[int, ...]  # sub-box start, relative to the transfer's box
    sizes: tuple[int, ...]
    nbytes: int
    buffer_offset: int


@dataclass(frozen=True, slots=True)
class Message:
    """Bytes ``src`` sends ``dst`` in one step: one contiguous buffer on each side.

    Per step a pair exchanges at most one packed message (``direct=False``: many chunks at aligned offsets)
    and any number of direct ones (one big chunk that is contiguous in its source or destination local
    tensor: the executor sends or receives it in place when the real tensor is contiguous, and stages it
    otherwise). Messages of one pair are posted in the order they are listed, on both sides.
    """

    src: int
    dst: int
    nbytes: int  # aligned size of its place in the staging area
    chunks: tuple[Chunk, ...]
    direct: bool = False

    @property
    def payload(self) -> int:
        """Bytes on the wire: up to the end of the last chunk (no trailing alignment padding)."""
        cs = self.chunks
        if len(cs) == 1:  # every direct message, and many packed ones
            return cs[0].buffer_offset + cs[0].nbytes
        return max((c.buffer_offset + c.nbytes for c in cs), default=0)


@dataclass(frozen=True, slots=True)
class Step:
    messages: tuple[Message, ...]
    phase: int = 0  # 0: from the source layout; 1: relays from what phase 0 wrote (all phase-0 steps come first)


@dataclass(frozen=True, slots=True)
class RankStep:
    """What one rank does in one step: its sends and receives, at offsets in its staging areas."""

    sends: tuple[tuple[int, int, Message], ...]  # (peer, offset in the send area, message)
    recvs: tuple[tuple[int, int, Message], ...]  # (peer, offset in the receive area, message)


class StepPairBytes(Mapping):
    """One step's ``{(src, dst): payload bytes}`` held as three int64 columns (``src``, ``dst``, ``nbytes``; one row
    per pair, sorted by pair), what a pair-rule schedule's ``pair_bytes`` gives: ``topology.predict_seconds``
    reads the columns, other callers the mapping."""

    __slots__ = ("src", "dst", "nbytes", "_map")

    def __init__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        self.src, self.dst, self.nbytes, self._map = src, dst, nbytes, None

    def _as_dict(self) -> dict[tuple[int, int], int]:
        if self._map is None:
            self._map = dict(zip(zip(self.src.tolist(), self.dst.tolist(), strict=True), self.nbytes.tolist(),
                                 strict=True))
        return self._map

    def __getitem__(self, key: tuple[int, int]) -> int:
        return self._as_dict()[key]

    def __iter__(self):
        return iter(self._as_dict())

    def __len__(self) -> int:
        return len(self.nbytes)

    def __repr__(self) -> str:
        return repr(self._as_dict())


@dataclass(frozen=True)
class Schedule:
    """Wire transfers cut into steps; per step each rank sends at most ``bucket_bytes // 2`` bytes and
    receives at most ``bucket_bytes // 2`` bytes, so its staging memory stays within ``bucket_bytes``."""

    bucket_bytes: int
    steps: tuple[Step, ...]

    def for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        """This rank's steps, plus the sizes of the send and receive staging areas it needs.

        Per step the packed messages come first (by peer), then the direct ones (in step order): so the
        staging a rank really uses, when its direct messages go in place, is a prefix of its areas; and the
        messages of one pair are in the same order on the sending and the receiving side.
        """
        with gc_paused():
            return self._for_rank(rank)

    def _for_rank(self, rank: int) -> tuple[tuple[RankStep, ...], int, int]:
        out, send_area, recv_area = [], 0, 0
        for step in self.steps:
            sends, recvs, s_off, r_off = [], [], 0, 0
            mine_s = [m for m in step.messages if m.src == rank]  # sorted by (dst, direct)
            mine_r = sorted((m for m in step.messages if m.dst == rank), key=lambda m: m.src)
            for direct in (False, True):
                for m in mine_s:
                    if m.direct == direct:
                        sends.append((m.dst, s_off, m))
                        s_off += m.nbytes
                for m in mine_r:
                    if m.direct == direct:
                        recvs.append((m.src, r_off, m))
                        r_off += m.nbytes
            send_area, recv_area = max(send_area, s_off), max(recv_area, r_off)
            out.append(RankStep(tuple(sends), tuple(recvs)))
        return tuple(out), send_area, recv_area

    def step_phase(self, i: int) -> int:
        """The phase of step ``i`` (0: from the source layout; 1: relays)."""
        return self.steps[i].phase

    def pair_bytes(self) -> list[dict[tuple[int, int], int]]:
        """Per step, ``{(src, dst): payload bytes}`` (a pair may exchange several messages in one step)."""
        out = []
        for step in self.steps:
            pairs: dict[tuple[int, int], int] = {}
            for m in step.messages:
                k = (m.src, m.dst)
                pairs[k] = pairs.get(k, 0) + m.payload
            out.append(pairs)
        return out

    def peak_staging_bytes(self) -> int:
        """The largest staging memory (send + receive areas) any rank allocates."""
        ranks = {m.src for s in self.steps for m in s.messages} | {m.dst for s in self.steps for m in s.messages}
        return max((sum(self.for_rank(r)[1:]) for r in ranks), default=0)


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What a plan moves, from the transfers alone (``Plan.stats()``; payload bytes, before the schedule).

    ``wire_bytes``: bytes of all wire transfers (rank to another rank), relays included. ``local_bytes``: bytes
    a rank copies from its own source tensors into its own destination tensors (never on the wire).
    ``lower_bound_bytes``: the least any plan can send, from the layouts alone (every destination element whose
    rank holds no source copy of it must arrive once); a plan without relays to the same ranks has
    ``wire_bytes == lower_bound_bytes``. ``sent_bytes`` / ``recv_bytes``: {rank: bytes it sends / receives}, every
    rank of the plan present. ``num_transfers`` / ``num_local_copies``: how many of each (boxes, not messages).

    These are payload bytes. What ``Resharder.run`` reports (``RunReport.sent_bytes``) can be a little more:
    several chunks share one packed message per peer and step, each starting at a multiple of ``ALIGN`` (16)
    bytes, so the message carries the padding between chunks (e.g. 224 B of payload in 240 B). ``max_sent_bytes``
    / ``max_recv_bytes``: the busiest rank's. The node fields are filled by ``Plan.stats(gpus_per_node)`` only.
    """

    wire_bytes: int
    local_bytes: int
    lower_bound_bytes: int
    sent_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    num_transfers: int
    num_local_copies: int
    relay_bytes: int = 0  # of wire_bytes: sent by relays (forwarding what a rank received; a later phase)
    num_relays: int = 0  # of num_transfers
    gpus_per_node: int | None = None  # the node size below (``Plan.stats(gpus_per_node)``), None: not asked
    net_bytes: int | None = None  # of wire_bytes: between nodes (over the network)
    nvlink_bytes: int | None = None  # of wire_bytes: inside a node (over NVLink)
    # block-quantized destinations: of wire_bytes, what senders quantized (fp8 + scales) and what travelled in the
    # source dtype to be quantized by the receiver (blocks straddling source fragments); lower_bound_bytes then
    # counts each missing fp8 byte plus one fp32 scale per block with a missing element
    quant_src_bytes: int = 0
    quant_dst_bytes: int = 0

    @property
    def max_sent_bytes(self) -> int:
        return max(self.sent_bytes.values(), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max(self.recv_bytes.values(), default=0)

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {
            "wire_bytes": self.wire_bytes,
            "local_bytes": self.local_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "sent_bytes": dict(self.sent_bytes),
            "recv_bytes": dict(self.recv_bytes),
            "max_sent_bytes": self.max_sent_bytes,
            "max_recv_bytes": self.max_recv_bytes,
            "num_transfers": self.num_transfers,
            "num_local_copies": self.num_local_copies,
            "relay_bytes": self.relay_bytes,
            "num_relays": self.num_relays,
            "gpus_per_node": self.gpus_per_node,
            "net_bytes": self.net_bytes,
            "nvlink_bytes": self.nvlink_bytes,
            "quant_src_bytes": self.quant_src_bytes,
            "quant_dst_bytes": self.quant_dst_bytes,
        }


class PlanLike(Protocol):
    """What the plan's checks and derived tables read of a plan (a ``Plan``: the whole plan or one rank's share)."""

    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]
    local_copies: tuple[Transfer, ...]

    def memo(self, key: str, compute): ...
