"""Execute: buffers, transport, kernels.

A :class:`Resharder` runs one :class:`~triton_reshard.plan.Plan` on one rank. Per step it packs the strided
source slices into one contiguous send buffer per peer, exchanges all buffers with one
``torch.distributed.batch_isend_irecv`` call, and scatters each receive buffer into the destination views.
Staging buffers are allocated once and reused; every wait has a timeout; before any byte moves all ranks
check they run the same plan and that every rank's input is valid.

:meth:`Resharder.verify` runs the same steps in *verify mode*: every received message is staged, and the unpack
and local copies become bit-exact compares against what the destination tensors already hold. It writes
nothing.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import ops
from ..group import RefitGroup, as_transport
from ..layout import box_slices
from ..plan import ALIGN, DIRECT_MIN_BYTES, Plan
from ..plan.local import RankPlan, _rank_fragments
from ..plan.quant import QUANT_DST, QUANT_SRC, SCALE_BYTES, quant_regions, split_src_chunks
from ..plan.schedule import _split_box

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT = timedelta(seconds=300)
_MAX_CHUNKS = 1 << 22  # a plan cut into more chunks than this is refused (scheduling it would not finish)


class ReshardError(RuntimeError):
    """A reshard could not run (ranks disagree, a peer rejected its input) or failed part way.

    ``torn``: the destination local tensors on this rank that may be partly written (sorted; empty when the
    run failed before writing any destination byte, e.g. every rejected input)."""

    torn: tuple[str, ...] = ()


class ReshardTransportError(ReshardError):
    """The transport failed during a run: a timeout, a lost connection, or another backend error. The process
    group is unusable afterwards: destroy it and build a new one (and new Resharders) before retrying.

    Attributes (None when unknown): ``rank``, ``what`` (e.g. ``"step 2/5"``, ``"the plan handshake"``),
    ``peers`` (the ranks of that step), ``peer`` (the rank of the failing operation, where the backend
    tells), ``kind`` (``"timeout"``, ``"connection"`` or ``"error"``), ``elapsed`` (seconds from posting to
    the failure), ``timeout`` (seconds), ``torn`` (see :class:`ReshardError`)."""

    kind = "error"

    def __init__(self, message: str, *, rank: int | None = None, what: str | None = None,
                 peers: tuple[int, ...] | None = None, peer: int | None = None, elapsed: float | None = None,
                 timeout: float | None = None) -> None:
        super().__init__(message)
        self.rank, self.what, self.peers, self.peer = rank, what, peers, peer
        self.elapsed, self.timeout = elapsed, timeout


class ReshardTimeoutError(ReshardTransportError, TimeoutError):
    """A peer did not arrive within the timeout. The process group is unusable afterwards: destroy it."""

    kind = "timeout"


class ReshardConnectionError(ReshardTransportError, ConnectionError):
    """The connection to a peer was lost (it died, or the group broke earlier). Destroy the group."""

    kind = "connection"


class ReshardAbortedError(ReshardError):
    """This rank failed part way through a run (a copy raised after the handshake); its peers are left
    waiting and will fail too. The process group is unusable afterwards: destroy it. ``__cause__``: the
    original exception."""


# how a backend's message says what went wrong (gloo, NCCL, our RefitGroup)
_TIMEOUT_WORDS = ("timed out", "timeout")
_CONNECTION_WORDS = ("connection", "reset by peer", "broken pipe", "read error", "write error", "eof",
                     "closed", "socket", "unreachable", "destroyed", "aborted")


def _classify(msg: str) -> type[ReshardTransportError]:
    low = msg.lower()
    if any(w in low for w in _TIMEOUT_WORDS):
        return ReshardTimeoutError
    if any(w in low for w in _CONNECTION_WORDS):
        return ReshardConnectionError
    return ReshardTransportError


_BACKEND_CODES = {None: 0, "torch": 1, "triton": 2}  # the copy backend a rank asked for (None: by device)
_GROUP_DEAD = ("the process group is unusable now: destroy it and build a new one (and new Resharders; "
               "refit does that for a new group) before retrying")

# one run or verify at a time per process group in this process: two would match each other's messages
_RUNNING: dict[int, tuple[object, str]] = {}
_RUNNING_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class RunReport:
    """What one ``run()`` did on this rank (in verify mode: ``unpack_seconds`` / ``local_seconds`` are compares).

    ``steps``: schedule steps this run went through. ``sent_bytes`` / ``recv_bytes``: bytes of the messages
    this rank sent / received, as they went on the wire: packed messages include the alignment padding between
    their chunks (each chunk starts at a multiple of ``plan.ALIGN`` = 16 bytes), so they can exceed the payload
    that ``Plan.stats().sent_bytes[rank]`` counts (e.g. 240 vs 224). ``local_bytes``: bytes copied from this
    rank's own source tensors into its destination tensors (no wire). ``staging_bytes``: the send + receive
    staging areas this rank holds (allocated once, reused; at most ``bucket_bytes``), plus, for block-quantized
    destinations, the regions of straddling blocks it stages to quantize (not bounded by the bucket). ``seconds``: the whole
    run on this rank, handshake included; the ``*_seconds`` below are parts of it. ``ignored``: destination
    tensors ``refit`` was given that the destination layout does not cover on this rank (sorted;
    ``Resharder.run`` itself takes none)."""

    rank: int
    steps: int
    sent_bytes: int
    recv_bytes: int
    local_bytes: int
    staging_bytes: int
    seconds: float
    pack_seconds: float = 0.0  # time in pack copies (host-side; on CUDA: launch time only)
    wire_seconds: float = 0.0  # time from posting a step's sends/receives until they completed
    unpack_seconds: float = 0.0
    local_seconds: float = 0.0
    in_place_bytes: int = 0  # of sent_bytes + recv_bytes: moved straight from/into the tensors, not staged
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Difference:
    """The first element of one destination local tensor that differs from what the reshard would write.

    ``tensor`` + ``offsets``/``sizes``: the logical box (one chunk of one transfer) it was found in; ``index``:
    the element's index in the logical tensor; ``local_index``: in the local tensor ``local``. ``expected``:
    the value the reshard would write, ``actual``: the value held (Python scalars of the destination dtype),
    with their raw bits (unsigned)."""

    local: str
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    index: tuple[int, ...]
    local_index: tuple[int, ...]
    expected: object
    actual: object
    expected_bits: int
    actual_bits: int

    def __str__(self) -> str:
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.sizes, strict=True))
        width = max(len(f"{self.expected_bits:x}"), len(f"{self.actual_bits:x}"))
        return (
            f"first in {self.tensor}[{box}] at {self.tensor}{list(self.index)} ({self.local}{list(self.local_index)}): "
            f"the reshard would write {self.expected!r} (bits 0x{self.expected_bits:0{width}x}), it holds "
            f"{self.actual!r} (bits 0x{self.actual_bits:0{width}x})"
        )


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What one ``verify()`` found on this rank. Nothing was written.

    ``ok``, ``total_mismatches`` and ``mismatches_by_rank`` are the same on every rank of the group.
    ``mismatches``: {destination local tensor: number of elements that differ bit for bit} on this rank (only
    tensors with differences; empty when ok). ``differences``: the first differing element of each of those
    tensors. ``compared_elements``: destination elements this rank compared (every element the destination
    layout covers on it). ``stats``: the run statistics of the verify pass. ``ignored``: as in
    :class:`RunReport`. ``message`` / ``str()``: a readable summary.
    """

    ok: bool
    rank: int
    mismatches: dict[str, int]
    total_mismatches: int
    mismatches_by_rank: dict[int, int]
    compared_elements: int
    differences: dict[str, Difference]
    stats: RunReport
    ignored: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        bad = {r: n for r, n in self.mismatches_by_rank.items() if n}
        if self.ok:
            head = (f"verify: OK, rank {self.rank}: all {self.compared_elements} destination elements match bit for "
                    f"bit; so do the other ranks ({len(self.mismatches_by_rank)} in all)")
        else:
            mine = sum(self.mismatches.values())
            head = (f"verify: MISMATCH, {self.total_mismatches} elements differ over ranks {sorted(bad)} "
                    f"(by rank: {bad}); rank {self.rank}: {mine} of {self.compared_elements} compared elements differ")
        lines = [head]
        for local, n in sorted(self.mismatches.items()):
            lines.append(f"  {local!r}: {n} elements differ; {self.differences[local]}")
        if self.ignored:
            lines.append(f"  ignored (not in the destination layout on rank {self.rank}): {list(self.ignored)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True)
class _Bound:
    """The views and buffers of one set of tensors in one mode (see ``Resharder._bind``)."""

    local: list  # (source view, destination view) of each local copy (verify: split to the bucket)
    local_meta: list | None  # verify: per local pair, (dst local, tensor, logical offsets, local offsets)
    packs: list  # per step: (source view, send buffer view) pairs
    unpacks: list  # per step: (receive buffer view, destination view) pairs
    unpack_meta: list | None  # verify: per step, per unpack pair, as local_meta
    wire: list  # per step: (sends, recvs) of (peer, flat buffer)
    send_area_bytes: int
    recv_area_bytes: int
    in_place_bytes: int
    writes: list = field(default_factory=list)  # per step: names of the destination tensors it writes
    local_writes: frozenset = frozenset()  # destination tensors the local copies write
    # block-quantized destinations (see plan/quant.py); quantize items are (source, fp8 out, scale out)
    qpacks: list = field(default_factory=list)  # per step: {(block, ue8m0): items} the pack quantizes
    stage_unpacks: list = field(default_factory=list)  # per step: (receive buffer, staging view) pairs
    local_q: dict = field(default_factory=dict)  # {(block, ue8m0): items} local copies quantized in place
    local_q_meta: list = field(default_factory=list)  # verify: per local_q item, (weight meta, scale meta)
    local_stage: list = field(default_factory=list)  # (source view, staging view) of local pieces of regions
    regions_due: dict = field(default_factory=dict)  # step position (-1: after the local copies) -> region ids
    region_items: list = field(default_factory=list)  # per region: (block, ue8m0, item, weight meta, scale meta)


@dataclass
class _Tally:
    """Verify mode's sink: counts differing elements per destination local tensor, keeps the first of each."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, Difference] = field(default_factory=dict)
    compared: int = 0

    def compare(self, pairs, meta) -> None:
        for n, (got, have), (local, tensor, off, loc_off) in zip(ops.compare_views(pairs), pairs, meta, strict=True):
            self.compared += have.numel()
            if not n:
                continue
            self.counts[local] = self.counts.get(local, 0) + n
            idx, want, held, want_bits, held_bits = ops.first_difference(got, have)
            extra = len(loc_off) - len(idx)
            lidx = loc_off[:extra] + tuple(a + b for a, b in zip(loc_off[extra:], idx, strict=True))
            old = self.first.get(local)
            if old is None or lidx < old.local_index:
                self.first[local] = Difference(
                    local, tensor, off, tuple(have.shape), tuple(a + b for a, b in zip(off, idx, strict=True)),
                    lidx, want, held, want_bits, held_bits,
                )


def _to_timedelta(timeout) -> timedelta:
    if isinstance(timeout, timedelta):
        if timeout.total_seconds() > 0:
            return timeout
    elif (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout)
          and timeout > 0):
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be a timedelta or a finite positive number of seconds, got {timeout!r}")


def _as_int(v, what: str, low: int) -> int:
    """``v`` as an int >= ``low`` (ints and integer-like objects only: no floats, strings or bools)."""
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int, got {v!r}")
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {v!r}") from None
    if n < low:
        raise ValueError(f"{what} must be >= {low}, got {n}")
    return n


# -- memory checks (before any byte moves) ---------------------------------------------------------------

_EXACT_MAX = 1 << 22  # elements: above this, an exact memory check would cost too much; be conservative


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last element of ``t`` in its storage (0 when empty)."""
    if t.numel() == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1


def _storage_problem(t: torch.Tensor) -> str | None:
    """Why ``t`` has no valid memory to read or write (None when it has)."""
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor (only dense strided tensors can be resharded)"
    if t.numel() == 0:
        return None
    try:
        have = t.untyped_storage().nbytes()
    except Exception as e:  # e.g. a tensor subclass without real storage
        return f"has no accessible storage ({type(e).__name__}: {e})"
    need = (t.storage_offset() + _extent(t)) * t.element_size()
    if have < need:
        return (f"has no valid storage: it holds {have} bytes, the view needs {need} (freed, e.g. with "
                f"untyped_storage().resize_(0) as FSDP does between steps? re-materialize it first)")
    return None


def _addresses(t: torch.Tensor) -> torch.Tensor:
    """The start address (bytes) of every element of ``t`` (flat, int64)."""
    offs = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride(), strict=True):
        offs = (offs.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return offs.reshape(-1) * t.element_size() + t.data_ptr()


def _self_overlap(t: torch.Tensor) -> bool | None:
    """Does ``t`` have two elements at one address (e.g. ``expand``)? None: too large to tell exactly."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            break
        reach += (n - 1) * st
    else:
        return False  # each dim steps past everything the smaller ones reach: no two elements meet
    if any(st == 0 for st, _n in dims):
        return True
    if t.numel() > _EXACT_MAX:
        return None
    return bool(_addresses(t).unique().numel() < t.numel())


def _bytes_meet(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Do any bytes of ``a`` and ``b`` coincide (exactly, element by element)? None: too large to tell."""
    if a.numel() > _EXACT_MAX or b.numel() > _EXACT_MAX:
        return None
    aa = _addresses(a).sort().values
    bb = _addresses(b)
    idx = torch.searchsorted(aa, bb + (b.element_size() - 1), right=True) - 1
    ok = idx >= 0
    return bool((ok & (aa[idx.clamp(min=0)] + a.element_size() > bb)).any())


def _sub_box_shift(outer: torch.Tensor, inner: torch.Tensor) -> tuple[int, ...] | None:
    """``c`` with ``inner`` the box ``outer[c0:c0+n0, c1:c1+n1, ...]`` (same dtype, dims and strides; ``outer``
    without internal overlap), else None."""
    if inner.dtype != outer.dtype or inner.dim() != outer.dim() or not inner.numel() or not outer.numel():
        return None
    if any(n > 1 and si != so for n, si, so in zip(inner.shape, inner.stride(), outer.stride(), strict=True)):
        return None
    es = outer.element_size()
    delta, rem = divmod(inner.data_ptr() - outer.data_ptr(), es)
    if rem or delta < 0:
        return None
    shift = [0] * outer.dim()
    for d in sorted(range(outer.dim()), key=lambda d: -outer.stride(d)):  # the largest stride first
        if outer.shape[d] > 1 and outer.stride(d) > 0:
            shift[d], delta = divmod(delta, outer.stride(d))
    if delta or any(c + n > m for c, n, m in zip(shift, inner.shape, outer.shape, strict=True)):
        return None
    return tuple(shift)


def refuse(group, error: Exception, *, verify: bool = False, timeout=timedelta(minutes=5)) -> None:
    """Raise ``error`` (a planning or input error found on this rank before its ``Resharder`` exists) after
    taking part in the plan handshake its peers are in, so that they raise at once ("rank(s) [r] could not
    plan this refit") instead of waiting for the timeout. With rank plans an error in one tensor is found only
    by the ranks that touch it."""
    comm = as_transport(group)
    if comm.wire:
        dev = torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([0, 0, 0, 2, 0, 0, int(verify), 0, 0], dtype=torch.int64, device=dev)
        out = [torch.empty_like(mine) for _ in comm.ranks]
        try:
            work = comm.all_gather(out, mine)
            work.wait(timeout=_to_timedelta(timeout))
        except Exception:  # the peers' view of it is theirs to report; ours is the original error
            pass
    raise error


class Resharder:
    """Runs ``plan`` on this rank. Call :meth:`run` on every rank of ``group`` (default: the world).

    ``bucket_bytes`` bounds this rank's staging memory (send + receive buffers) whatever the model size;
    a tensor larger than a bucket is split across steps. ``timeout`` (seconds or timedelta) bounds every
    wait. ``backend`` forces the copy backend (``"torch"`` or ``"triton"``; default by device / the
    ``TRITON_RESHARD_BACKEND`` variable). ``overlap=True`` splits the bucket into two staging slots
    and packs step k+1 (and posts it) while step k is on the wire; staging memory stays within
    ``bucket_bytes`` either way. ``direct_min_bytes``: chunks at least this big that are contiguous in the
    source or destination tensor are sent from / received into it in place, with no staging copy on that
    side (see ``Plan.schedule``); every rank must pass the same value.
    """

    def __init__(
        self,
        plan: Plan,
        group: dist.ProcessGroup | RefitGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        backend: str | None = None,
        overlap: bool = False,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
    ) -> None:
        if not isinstance(plan, (Plan, RankPlan)):
            raise TypeError(f"Resharder needs a Plan or a RankPlan, got {type(plan).__name__}")
        self.plan = plan
        self.group = group
        self.bucket_bytes = _as_int(bucket_bytes, "Resharder: bucket_bytes", 1)
        self.timeout = _to_timedelta(timeout)
        if backend is not None and backend not in ops.BACKENDS:
            raise ValueError(f"Resharder: unknown copy backend {backend!r}; expected None or one of {ops.BACKENDS}")
        self.backend = backend
        self.overlap = bool(overlap)
        self.direct_min_bytes = _as_int(direct_min_bytes, "Resharder: direct_min_bytes", 0)
        self.slots = 2 if self.overlap else 1
        per_slot = self.bucket_bytes // self.slots
        if per_slot < ALIGN:
            raise ValueError(f"Resharder: bucket_bytes={self.bucket_bytes} leaves {per_slot} B per staging slot, "
                             f"less than one {ALIGN}-byte chunk")
        chunks = sum(t.nbytes for t in plan.transfers) // per_slot
        if chunks > _MAX_CHUNKS:  # scheduling would take hours; no real refit needs this many steps
            raise ValueError(f"Resharder: {sum(t.nbytes for t in plan.transfers)} wire bytes in buckets of "
                             f"{per_slot} B would need ~{chunks} chunks (more than {_MAX_CHUNKS}): raise bucket_bytes")
        self._broken: str | None = None  # set by a failure part way: the group is unusable then
        self._alias_ok: dict[tuple[str, str, tuple[int, ...]], str | None] = {}
        self._memory_ok: tuple | None = None  # the tensor signature that last passed _check_memory
        self._comm = as_transport(group)  # a torch.distributed group (global ranks) or a RefitGroup (its own)
        self.rank, self.group_ranks = self._comm.rank, tuple(self._comm.ranks)
        if isinstance(plan, RankPlan) and plan.rank != self.rank:
            raise ValueError(f"rank {self.rank}: got the rank plan of rank {plan.rank}; each rank runs its own share "
                             f"(plan_reshard(..., rank={self.rank}))")
        missing = sorted(set(plan.ranks) - set(self.group_ranks))
        if missing:
            raise ValueError(
                f"rank {self.rank}: the plan uses ranks {missing} that are not in the process group "
                f"{list(self.group_ranks)}"
            )
        self.schedule = plan.schedule(self.bucket_bytes // self.slots, self.direct_min_bytes)
        steps, _send_area, _recv_area = self.schedule.for_rank(self.rank)
        # only the steps this rank takes part in; step i of those uses staging slot i % slots
        self.steps = tuple((i, st) for i, st in enumerate(steps) if st.sends or st.recvs)
        self._phase = tuple(self.schedule.steps[i].phase for i, _st in self.steps)
        # set by _bind: only the staged messages need staging (direct ones of contiguous tensors go in place)
        self.send_area_bytes = self.recv_area_bytes = 0
        self._src_specs = plan.src.local_specs(self.rank)
        self._dst_specs = plan.dst.local_specs(self.rank)
        self._local = tuple(t for t in plan.local_copies if t.dst_rank == self.rank)
        self._local_bytes = sum(t.nbytes for t in self._local)
        # block-quantized destinations: the regions this rank stages in the source dtype and quantizes itself
        # once their pieces are in (plan/quant.py), and the transfer -> region map of its "dst" pieces
        self._regions = quant_regions(plan).get(self.rank, ()) if plan.dst.quantized else ()
        self._region_of: dict[int, int] = {}
        for k, g in enumerate(self._regions):
            for i in g.wire:
                self._region_of[id(plan.transfers[i])] = k
            for i in g.local:
                self._region_of[id(plan.local_copies[i])] = k
        self._stage: list[torch.Tensor] = []  # one staging tensor per region (allocated once, reused)
        self._ue8m0 = {n: s.quant.ue8m0 for n, s in plan.dst.quantized.items()}
        self._scale_name = {n: s.quant.scale for n, s in plan.dst.quantized.items()}
        self._send_area: torch.Tensor | None = None
        self._recv_area: torch.Tensor | None = None
        self._bound_sig: tuple | None = None
        self._bound: _Bound | None = None

    # -- checks -------------------------------------------------------------------------------------

    def _check_side(self, side: str, tensors: Mapping[str, torch.Tensor], specs) -> torch.device | None:
        if not isinstance(tensors, Mapping):
            raise TypeError(f"rank {self.rank}: {side} tensors must be a dict name -> Tensor, got {type(tensors).__name__}")
        unknown = sorted(set(tensors) - set(specs))
        missing = sorted(set(specs) - set(tensors))
        if missing:
            raise ValueError(f"rank {self.rank}: {side} tensor {missing[0]!r} is missing (expected {sorted(specs)})")
        if unknown:
            raise ValueError(f"rank {self.rank}: unknown {side} tensor {unknown[0]!r} (expected {sorted(specs)})")
        device = None
        for name, spec in specs.items():
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"rank {self.rank}: {side} tensor {name!r} is a {type(t).__name__}, not a Tensor")
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"rank {self.rank}: {side} tensor {name!r} has shape {tuple(t.shape)}, the layout says {spec.shape}"
                )
            if t.dtype != spec.dtype:
                raise ValueError(
                    f"rank {self.rank}: {side} tensor {name!r} has dtype {t.dtype}, the layout says {spec.dtype}"
                )
            if t.device.type == "meta":  # no data: would fail after the handshake and leave the peers waiting
                raise ValueError(f"rank {self.rank}: {side} tensor {name!r} is on the meta device (it holds no data)")
            problem = _storage_problem(t)  # e.g. freed storage: a copy from it would read freed memory
            if problem:
                raise ValueError(f"rank {self.rank}: {side} tensor {name!r} {problem}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(
                    f"rank {self.rank}: {side} tensor {name!r} is on {t.device}, other tensors are on {device}"
                )
        return device

    def _check_inputs(self, src_tensors, dst_tensors, verify: bool = False) -> torch.device:
        sdev = self._check_side("source", src_tensors, self._src_specs)
        ddev = self._check_side("destination", dst_tensors, self._dst_specs)
        if sdev is not None and ddev is not None and sdev != ddev:
            raise ValueError(f"rank {self.rank}: source tensors are on {sdev}, destination tensors on {ddev}")
        device = sdev or ddev or self._comm_device()
        if self._uses_wire() and self._is_nccl() and device.type != "cuda":
            raise ValueError(f"rank {self.rank}: NCCL needs CUDA tensors, got tensors on {device}")
        if not verify:  # verify writes nothing: sharing memory is harmless there
            # overlap depends only on addresses, shapes, strides and dtypes: checked once per set of tensors,
            # not on every step of an RL loop that passes the same ones
            sig = (self._signature(src_tensors), self._signature(dst_tensors))
            if sig != self._memory_ok:
                self._check_memory(src_tensors, dst_tensors)
                self._memory_ok = sig
        return device

    def _check_memory(self, src_tensors, dst_tensors) -> None:
        """A run reads the source while it writes the destination, in several steps: a destination byte that is
        also a source byte could be overwritten before a later step sends it. Raise for every destination that
        overlaps itself, and for every destination/source pair that shares bytes, unless the pair is provably
        safe (see ``_alias_problem``)."""
        for name, t in dst_tensors.items():
            hit = _self_overlap(t)
            if hit is not False:
                raise ValueError(
                    f"rank {self.rank}: destination tensor {name!r} (shape {tuple(t.shape)}, strides {t.stride()}) "
                    + ("overlaps itself (several elements at one address, e.g. an expand()ed view)" if hit else
                       "may overlap itself (its strides are too irregular to prove it does not)")
                    + ": writing it is ill-defined; pass a tensor with its own memory")
        spans = []  # (start, end, is_destination, name) of every non-empty tensor's byte range
        for is_dst, tensors in ((False, src_tensors), (True, dst_tensors)):
            for name, t in tensors.items():
                if t.numel():
                    start = t.data_ptr()
                    spans.append((start, start + _extent(t) * t.element_size(), is_dst, name))
        spans.sort()
        active: list[tuple] = []
        for span in spans:
            active = [a for a in active if a[1] > span[0]]
            for other in active:
                if other[2] != span[2]:
                    s_name, d_name = (other[3], span[3]) if span[2] else (span[3], other[3])
                    self._check_pair(s_name, src_tensors[s_name], d_name, dst_tensors[d_name])
            active.append(span)

    def _check_pair(self, s_name: str, s: torch.Tensor, d_name: str, d: torch.Tensor) -> None:
        """Source ``s`` and destination ``d`` have overlapping byte ranges: allowed if no byte is shared, or if
        ``d`` is a box of ``s`` (the same view, say) and every write into it is provably a no-op."""
        shift = _sub_box_shift(s, d)
        if shift is not None:
            key = (s_name, d_name, shift)
            if key not in self._alias_ok:
                self._alias_ok[key] = self._alias_problem(s_name, d_name, shift)
            problem = self._alias_ok[key]
            if problem is None:
                return
        else:
            meet = _bytes_meet(s, d)
            if meet is False:
                return
            problem = "shares bytes with it" if meet else "may share bytes with it (too large to check exactly)"
        raise ValueError(
            f"rank {self.rank}: destination tensor {d_name!r} and source tensor {s_name!r} share memory: the "
            f"destination {problem}; a run reads the source while it writes the destination, in several "
            f"steps, so a write can change what a later step sends; pass separate tensors (e.g. clone the "
            f"source); nothing was moved")

    def _alias_problem(self, s_name: str, d_name: str, shift: tuple[int, ...]) -> str | None:
        """Destination ``d_name`` is the box at ``shift`` of source ``s_name``. None (safe) if every element the
        plan writes into it lands where the source layout says that very element already is (same tensor, same
        index): the write stores what is there (replicas of an element are equal; same dtype, no cast), so
        every read, before or after it, sees the same value. Else a description of the first unsafe write."""
        extra_d = None
        sfr = [f for f in _rank_fragments(self.plan.src, self.rank) if f.local == s_name]
        for t in self.plan.transfers + self.plan.local_copies:
            if t.dst_rank != self.rank or t.dst_local != d_name or not t.numel:
                continue
            extra_d = len(t.dst_offsets) - len(t.offsets)
            w_off = tuple(o + c for o, c in zip(t.dst_offsets, shift, strict=True))  # in source coordinates
            w_size = (1,) * extra_d + t.sizes
            for f in sfr:
                f_off, f_size = f.local_offsets, f.local_sizes
                if not f.numel or len(f_off) != len(w_off) or not all(
                        a < b + m and b < a + n for a, n, b, m in zip(w_off, w_size, f_off, f_size, strict=True)):
                    continue
                ex = len(f.local_offsets) - len(f.offsets)
                same = (f.tensor == t.tensor and ex == extra_d and f.local_offsets[:ex] == w_off[:ex] and all(
                    lf - of == lw - ow for lf, of, lw, ow in zip(f.local_offsets[ex:], f.offsets, w_off[ex:],
                                                                  t.offsets, strict=True)))
                if not same:
                    box = ", ".join(f"{o}:{o + n}" for o, n in zip(t.offsets, t.sizes, strict=True))
                    return (f"is the same memory as a box of it, and the reshard writes {t.tensor}[{box}] (from rank "
                            f"{t.src_rank}) where the source holds {f.tensor!r} box {f.offsets}+{f.sizes} at other "
                            f"indices")
        return None

    # -- transport helpers --------------------------------------------------------------------------

    def _uses_wire(self) -> bool:
        return self._comm.wire

    def _is_nccl(self) -> bool:
        return self._comm.backend == "nccl"

    def _comm_device(self) -> torch.device:
        if self._is_nccl():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _transport_error(self, what: str, peers, started: float, cause: BaseException | None,
                         peer: int | None = None, op: str | None = None) -> ReshardTransportError:
        """The named error for a failure of ``what`` (with ``peers``) that began at ``started``."""
        elapsed = time.perf_counter() - started
        limit = self.timeout.total_seconds()
        msg = str(cause).strip() if cause is not None else ""
        first = msg.splitlines()[0] if msg else (type(cause).__name__ if cause is not None else "")
        cls = ReshardTimeoutError if cause is None else _classify(f"{type(cause).__name__} {msg}")
        where = f" ({op} rank {peer})" if op is not None else ""
        if cls is ReshardTimeoutError:
            how = f"timed out: it did not complete within the {limit:g}s timeout (after {elapsed:.2f}s)"
        elif cls is ReshardConnectionError:
            how = (f"lost the connection after {elapsed:.2f}s (timeout {limit:g}s): a peer died or closed, or "
                   f"the group broke earlier")
        else:
            how = f"failed after {elapsed:.2f}s (timeout {limit:g}s)"
        backend = getattr(self._comm, "backend", "?")
        detail = f" [{backend}: {type(cause).__name__}: {first}]" if cause is not None else ""
        return cls(
            f"rank {self.rank}: {what}{where} with peers {sorted(peers)} {how}{detail}; {_GROUP_DEAD}",
            rank=self.rank, what=what, peers=tuple(sorted(peers)), peer=peer, elapsed=elapsed, timeout=limit,
        )

    def _call(self, fn, what: str, peers, *args):
        """``fn(*args)`` on the transport; any failure becomes a named :class:`ReshardTransportError`."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:
            raise self._transport_error(what, peers, t0, e) from e

    def _wait(self, works, what: str, peers, started: float | None = None, ops_desc=None) -> None:
        """Wait for ``works`` (posted at ``started``) within the timeout, counted from ``started``.
        ``ops_desc``: per work, ``(operation, peer)`` when each work is one operation."""
        started = time.perf_counter() if started is None else started
        deadline = started + self.timeout.total_seconds()
        if ops_desc is not None and len(ops_desc) != len(works):
            ops_desc = None  # one work for several operations (NCCL coalescing): no peer to name
        for k, w in enumerate(works):
            op, peer = ops_desc[k] if ops_desc else (None, None)
            left = max(deadline - time.perf_counter(), 0.001)
            try:
                ok = w.wait(timeout=timedelta(seconds=left))
            except Exception as e:
                raise self._transport_error(what, peers, started, e, peer, op) from e
            if ok is False:
                raise self._transport_error(what, peers, started, None, peer, op)

    def _handshake(self, error: Exception | None, verify: bool = False) -> None:
        """All ranks: same plan digest and options? all running or all verifying? everyone's input valid?
        Raises on every rank otherwise."""
        if not self._uses_wire():
            if error is not None:
                raise error
            return
        dev = self._comm_device()
        d = int(self.plan.digest, 16)
        requested = self.backend or os.environ.get(ops.ENV_VAR) or None
        bcode = _BACKEND_CODES.get(requested, len(_BACKEND_CODES))
        mine = torch.tensor(
            [d >> 32, d & 0xFFFFFFFF, self.bucket_bytes, 0 if error is None else 1, self.direct_min_bytes,
             int(self.overlap), int(verify), bcode,
             sum(t.relay for t in self.plan.transfers) if verify else 0],
            dtype=torch.int64, device=dev,
        )
        out = [torch.empty_like(mine) for _ in self.group_ranks]
        t0 = time.perf_counter()
        work = self._call(self._comm.all_gather, "the plan handshake", self.group_ranks, out, mine)
        self._wait([work], "the plan handshake", self.group_ranks, t0)
        rows = [o.tolist() for o in out]
        if error is not None:
            raise error
        refused = [r for r, row in zip(self.group_ranks, rows, strict=True) if row[3] == 2]
        if refused:  # ranks that could not even plan (refuse()): no digest to compare
            raise ReshardError(
                f"rank {self.rank}: rank(s) {refused} could not plan this refit (see the error on those ranks); "
                f"nothing was moved"
            )
        digests = {r: f"{(row[0] << 32) | row[1]:016x}" for r, row in zip(self.group_ranks, rows, strict=True)}
        if len(set(digests.values())) > 1 or len({tuple(row[2:3] + row[4:8]) for row in rows}) > 1:
            names = {v: k or "auto" for k, v in _BACKEND_CODES.items()}
            opts = [(row[2], row[4], bool(row[5]), "verify" if row[6] else "run", names.get(row[7], "invalid"))
                    for row in rows]
            raise ReshardError(
                f"rank {self.rank}: ranks run different plans or options (plan digest by rank: {digests}; "
                f"(bucket_bytes, direct_min_bytes, overlap, mode, backend) by rank: {opts}); they must agree; "
                f"nothing was moved"
            )
        relays = {r: row[8] for r, row in zip(self.group_ranks, rows, strict=True) if row[8]}
        if relays:
            raise ValueError(
                f"rank {self.rank}: verify needs a plan without relays (relay transfers by rank: {relays}; they read "
                f"the relaying rank's destination tensors, which verify must not trust): plan it with relay=False; "
                f"nothing was moved"
            )
        bad = [r for r, row in zip(self.group_ranks, rows, strict=True) if row[3]]
        if bad:
            raise ReshardError(
                f"rank {self.rank}: rank(s) {bad} rejected their input (see the error on those ranks); "
                f"nothing was moved"
            )

    # -- binding views --------------------------------------------------------------------------------

    @staticmethod
    def _signature(tensors: Mapping[str, torch.Tensor]) -> tuple:
        return tuple(
            (n, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for n, t in sorted(tensors.items())
        )

    def _bind(self, src_tensors, dst_tensors, device: torch.device, verify: bool = False) -> _Bound:
        """Views for every copy and buffers for every message of this rank, built once per set of tensors
        and mode (the last one is cached).

        A direct message whose view is contiguous (and already in the wire dtype) goes straight from the
        source tensor or into the destination tensor; every other message is staged. The staging areas are
        sized for the staged messages only (their offsets are a prefix of the schedule's areas). ``verify``:
        every received message is staged (the destination is compared, never written), and the local copies
        are split into sub-boxes within half a bucket, so the compares' temporaries stay bounded too.
        """
        sig = (self._signature(src_tensors), self._signature(dst_tensors), verify)
        if sig == self._bound_sig:
            return self._bound
        transfers = self.plan.transfers
        if self._regions and (not self._stage or self._stage[0].device != device):
            self._stage = [torch.empty(g.sizes, dtype=g.dtype, device=device) for g in self._regions]

        def start_of(base: torch.Tensor, start, off, size) -> tuple[int, ...]:
            """Local coordinates (extra leading dims included) of sub-box ``off`` of the box at ``start``."""
            extra = base.dim() - len(size)
            return start[:extra] + tuple(a + b for a, b in zip(start[extra:], off, strict=True))

        def view(base: torch.Tensor, start, off, size):
            """The sub-box ``off``+``size`` (logical dims) of the box starting at ``start`` in ``base``."""
            extra = base.dim() - len(size)
            return base[box_slices(start_of(base, start, off, size), (1,) * extra + tuple(size))].reshape(size)

        def src_view(t, off, size):  # a relay reads what this rank received as destination
            return view((dst_tensors if t.relay else src_tensors)[t.src_local], t.src_offsets, off, size)

        def stage_view(t, off, size):
            """A destination-quantized piece lands in the staging tensor of its region."""
            k = self._region_of[id(t)]
            g = self._regions[k]
            start = tuple(a + b - c for a, b, c in zip(t.offsets, off, g.offsets, strict=True))
            return self._stage[k][box_slices(start, size)]

        def scale_box(t, off, size):
            """(offsets in the transfer's scale box, sizes) of the blocks of sub-box ``off``+``size``."""
            return (tuple(o // b for o, b in zip(off, t.block, strict=True)),
                    tuple(-(-n // b) for n, b in zip(size, t.block, strict=True)))

        def dst_view(t, off, size):
            """The destination view; (fp8 view, scale view) for a source-quantized transfer; the staging view
            for a destination-quantized one."""
            if t.quant == QUANT_DST:
                return stage_view(t, off, size)
            v = view(dst_tensors[t.dst_local], t.dst_offsets, off, size)
            if t.quant == QUANT_SRC:
                return v, view(dst_tensors[t.scale_local], t.scale_offsets, *scale_box(t, off, size))
            return v

        def dst_meta(t, off, size):  # what verify reports about a compared box
            return (t.dst_local, t.tensor, tuple(a + b for a, b in zip(t.offsets, off, strict=True)),
                    start_of(dst_tensors[t.dst_local], t.dst_offsets, off, size))

        def scale_meta(t, off, size):  # the same for the scales of a source-quantized sub-box
            s_off, s_size = scale_box(t, off, size)
            base = tuple(o // b for o, b in zip(t.offsets, t.block, strict=True))
            return (t.scale_local, self._scale_name[t.tensor], tuple(a + b for a, b in zip(base, s_off, strict=True)),
                    start_of(dst_tensors[t.scale_local], t.scale_offsets, s_off, s_size))

        def qbufs(area, at, c, t):
            """A source-quantized chunk in a message: its fp8 bytes (uint8), then at the next ALIGN its scales."""
            n = math.prod(c.sizes)
            start = at + c.buffer_offset
            q = area[start:start + n].view(c.sizes)
            s_size = scale_box(t, (0,) * len(c.sizes), c.sizes)[1]
            s0 = start + (n + ALIGN - 1) // ALIGN * ALIGN
            return q, area[s0:s0 + math.prod(s_size) * SCALE_BYTES].view(torch.float32).view(s_size)

        def in_place(m, t, v, receiving: bool):
            """The bytes of view ``v`` of direct message ``m`` as a flat buffer, or None if it must be staged."""
            if m.direct and not (verify and receiving) and v.dtype == t.wire_dtype and v.is_contiguous():
                # contiguous, so its elements are consecutive; as_strided, not reshape: a view whose dims are
                # all size 1 may keep a stride != 1, which view(uint8) refuses
                return v.as_strided((v.numel(),), (1,)).view(torch.uint8)
            return None

        local, local_meta = [], [] if verify else None
        local_q: dict = {}  # {(block, ue8m0): [(source view, fp8 view, scale view)]}
        local_q_meta: dict = {}  # verify: {(block, ue8m0): [(weight meta, scale meta)]}
        local_stage = []
        cap = max(ALIGN, self.bucket_bytes // 2 // ALIGN * ALIGN)
        for t in self._local:
            if t.quant == QUANT_DST:
                z = (0,) * len(t.sizes)
                local_stage.append((src_view(t, z, t.sizes), stage_view(t, z, t.sizes)))
            elif t.quant == QUANT_SRC:  # verify: within half a bucket, like the plain local copies below
                group = (t.block, self._ue8m0[t.tensor])
                for off, size, _n in split_src_chunks(t, cap) if verify else [((0,) * len(t.sizes), t.sizes, 0)]:
                    q, sc = dst_view(t, off, size)
                    local_q.setdefault(group, []).append((src_view(t, off, size), q, sc))
                    if verify:
                        local_q_meta.setdefault(group, []).append((dst_meta(t, off, size), scale_meta(t, off, size)))
        plain_local = [t for t in self._local if not t.quant]
        if verify:
            for t in plain_local:
                isz = max(src_tensors[t.src_local].element_size(), dst_tensors[t.dst_local].element_size())
                for off, size in _split_box(t.sizes, isz, cap):
                    local.append((src_view(t, off, size), dst_view(t, off, size)))
                    local_meta.append(dst_meta(t, off, size))
        else:
            local = [(src_view(t, (0,) * len(t.sizes), t.sizes), dst_view(t, (0,) * len(t.sizes), t.sizes))
                     for t in plain_local]
        # first pass: which messages go in place, and how much staging the others need per slot
        plans = []  # per step: (sends, recvs) of (peer, at, message, view of each chunk, in-place buffer or None)
        need = [0, 0]  # staging bytes per slot: send, receive

        def side(entries, view_of, k):
            out = []
            for peer, at, m in entries:
                views = [view_of(transfers[c.transfer], c.offsets, c.sizes) for c in m.chunks]
                buf = in_place(m, transfers[m.chunks[0].transfer], views[0], k == 1)
                out.append((peer, at, m, views, buf))
                if buf is None:
                    need[k] = max(need[k], at + m.nbytes)
            return out

        for _i, step in self.steps:
            plans.append((side(step.sends, src_view, 0), side(step.recvs, dst_view, 1)))
        need_s, need_r = need
        n_slots = min(self.slots, len(self.steps))
        self.send_area_bytes, self.recv_area_bytes = need_s * n_slots, need_r * n_slots
        if (self._send_area is None or self._send_area.device != device
                or self._send_area.numel() < self.send_area_bytes or self._recv_area.numel() < self.recv_area_bytes):
            self._bound_sig = self._bound = None  # the old views must not keep the old areas alive
            self._send_area = self._recv_area = None
            self._send_area = torch.empty(self.send_area_bytes, dtype=torch.uint8, device=device)
            self._recv_area = torch.empty(self.recv_area_bytes, dtype=torch.uint8, device=device)

        def buf_view(area, at, chunk, t):
            n = math.prod(chunk.sizes)
            start = at + chunk.buffer_offset
            return area[start:start + chunk.nbytes].view(t.wire_dtype).view(chunk.sizes) if n else area[:0]

        packs, unpacks, unpack_meta, ops_per_step = [], [], [] if verify else None, []
        qpacks, stage_unpacks = [], []
        last = [-1] * len(self._regions)  # per region: the step position of its last received piece
        for pos, (sends, recvs) in enumerate(plans):
            pk, up, um, wire_s, wire_r, qp, su = [], [], [], [], [], {}, []
            s_base, r_base = (pos % self.slots) * need_s, (pos % self.slots) * need_r
            for peer, at, m, views, buf in sends:
                if buf is None:
                    at += s_base
                    for c, v in zip(m.chunks, views, strict=True):
                        t = transfers[c.transfer]
                        if t.quant == QUANT_SRC:  # the pack quantizes: fp8 values and scales into the buffer
                            qb, sb = qbufs(self._send_area, at, c, t)
                            qp.setdefault((t.block, self._ue8m0[t.tensor]), []).append((v, qb, sb))
                        else:
                            pk.append((v, buf_view(self._send_area, at, c, t)))
                    buf = self._send_area[at:at + m.payload]
                wire_s.append((peer, buf))
            for peer, at, m, views, buf in recvs:
                for c in m.chunks:
                    k = self._region_of.get(id(transfers[c.transfer]))
                    if k is not None:
                        last[k] = max(last[k], pos)
                if buf is None:
                    at += r_base
                    for c, v in zip(m.chunks, views, strict=True):
                        t = transfers[c.transfer]
                        if t.quant == QUANT_SRC:  # fp8 bytes and scales, plain copies (verify: compares)
                            qb, sb = qbufs(self._recv_area, at, c, t)
                            qv, sv = v
                            up += [(qb.view(qv.dtype), qv) if verify else (qb, qv.view(torch.uint8)), (sb, sv)]
                            if verify:
                                um += [dst_meta(t, c.offsets, c.sizes), scale_meta(t, c.offsets, c.sizes)]
                        elif t.quant == QUANT_DST:  # into the region's staging, in verify mode too
                            su.append((buf_view(self._recv_area, at, c, t), v))
                        else:
                            up.append((buf_view(self._recv_area, at, c, t), v))
                            if verify:
                                um.append(dst_meta(t, c.offsets, c.sizes))
                    buf = self._recv_area[at:at + m.payload]
                wire_r.append((peer, buf))
            packs.append(pk)
            qpacks.append(qp)
            stage_unpacks.append(su)
            unpacks.append(up)
            if verify:
                unpack_meta.append(um)
            ops_per_step.append((wire_s, wire_r))
        in_place_bytes = sum(m.payload for sends, recvs in plans for _p, _a, m, _v, buf in sends + recvs
                             if buf is not None)
        self._bound_sig = sig
        writes = [frozenset() if verify else frozenset(transfers[c.transfer].dst_local for _p, _a, m, _v, _b in recvs
                                                       for c in m.chunks) for _sends, recvs in plans]
        local_writes = frozenset() if verify else frozenset(
            [t.dst_local for t in self._local] + [t.scale_local for t in self._local if t.quant == QUANT_SRC])
        regions_due: dict[int, list[int]] = {}
        region_items = []
        for k, g in enumerate(self._regions):
            regions_due.setdefault(last[k], []).append(k)
            z = (0,) * len(g.sizes)
            q = view(dst_tensors[g.dst_local], g.dst_offsets, z, g.sizes)
            sc = view(dst_tensors[g.scale_local], g.scale_offsets, z, g.scale_sizes)
            meta = ((g.dst_local, g.tensor, g.offsets, start_of(dst_tensors[g.dst_local], g.dst_offsets, z, g.sizes)),
                    (g.scale_local, g.scale_tensor, tuple(o // b for o, b in zip(g.offsets, g.block, strict=True)),
                     start_of(dst_tensors[g.scale_local], g.scale_offsets, z, g.scale_sizes)))
            region_items.append((g.block, g.ue8m0, (self._stage[k], q, sc), meta))
        self._bound = _Bound(local, local_meta, packs, unpacks, unpack_meta, ops_per_step, self.send_area_bytes,
                             self.recv_area_bytes, in_place_bytes, writes, local_writes, qpacks, stage_unpacks,
                             local_q, local_q_meta, local_stage, regions_due, region_items)
        return self._bound

    # -- run and verify -------------------------------------------------------------------------------

    def run(self, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor]) -> RunReport:
        """Reshard: read ``src_tensors`` (this rank's source local tensors), write ``dst_tensors`` in place.

        Pass an empty dict for a side this rank has no part in. Raises before any byte moves if any rank's
        input is invalid or ranks run different plans; raises :class:`ReshardTimeoutError` if a peer does
        not arrive within the timeout.
        """
        with self._exclusive("run"):
            return self._execute(src_tensors, dst_tensors, None)

    def verify(self, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor]) -> VerifyReport:
        """Like :meth:`run`, but compare instead of write: how many destination elements differ, bit for bit,
        from what ``run`` would write into them (after the cast to the destination dtype). Writes nothing.

        The same steps, messages and checks as ``run`` (every rank of the group calls it; all ranks must be
        verifying, the handshake checks that), with every received message staged (never received in place),
        unpacks and local copies turned into compares, and one exchange of the counts at the end, so the
        report's ``ok`` is the same on every rank. Memory: the staging areas of ``run`` with every receive
        staged (within ``bucket_bytes``), plus a mask (and a cast copy) of one chunk of at most half a bucket.
        A plan with relays cannot be verified: a relay forwards the relaying rank's *destination* tensor,
        which is what verify checks, not trusts (plan with ``relay=False``, as ``verify_refit`` does).
        Block-quantized destinations: what the source holds is quantized again (received fp8 and scales as
        sent, local and staged blocks into temporaries) and compared bit for bit with the fp8 values and the
        scales held (temporaries: a local transfer's chunk of at most half a bucket, or one staged region).
        """
        relays = sum(t.relay for t in self.plan.transfers)
        if relays and not self._uses_wire():
            raise ValueError(
                f"rank {self.rank}: verify needs a plan without relays ({relays} relay transfers read the relaying "
                f"rank's destination tensors, which verify must not trust): plan it with relay=False"
            )
        # with a group the relay check is part of the handshake: a rank plan knows only its own relays, and
        # every rank must refuse together (a rank that raised alone would leave its peers in the handshake)
        tally = _Tally()
        with self._exclusive("verify"):
            stats = self._execute(src_tensors, dst_tensors, tally)
            by_rank = self._all_counts(sum(tally.counts.values()))
        total = sum(by_rank.values())
        return VerifyReport(
            ok=total == 0,
            rank=self.rank,
            mismatches=dict(sorted(tally.counts.items())),
            total_mismatches=total,
            mismatches_by_rank=by_rank,
            compared_elements=tally.compared,
            differences=dict(sorted(tally.first.items())),
            stats=stats,
        )

    def _all_counts(self, mine: int) -> dict[int, int]:
        """Every rank's mismatch count (one all-gather over the group, with the timeout)."""
        if not self._uses_wire():
            return {self.rank: mine}
        t = torch.tensor([mine], dtype=torch.int64, device=self._comm_device())
        out = [torch.empty_like(t) for _ in self.group_ranks]
        t0 = time.perf_counter()
        work = self._call(self._comm.all_gather, "the verify result exchange", self.group_ranks, out, t)
        self._wait([work], "the verify result exchange", self.group_ranks, t0)
        return {r: int(o.item()) for r, o in zip(self.group_ranks, out, strict=True)}

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Refuse a second run or verify on the same process group while one is in progress in this process
        (another thread): their messages would match each other's. Raises before anything is sent."""
        if not self._uses_wire():  # nothing on the wire: concurrent runs cannot meet
            yield
            return
        key_obj = self._comm if isinstance(self._comm, RefitGroup) else self._comm.key
        me = f"{what} of plan {self.plan.digest} in thread {threading.current_thread().name!r}"
        with _RUNNING_LOCK:
            busy = _RUNNING.get(id(key_obj))
            if busy is None:
                _RUNNING[id(key_obj)] = (key_obj, me)
        if busy is not None:
            raise ReshardError(
                f"rank {self.rank}: refused {me}: {busy[1]} is in progress on the same process group in this "
                f"process; two at once would match each other's messages: run them one after the other (or on "
                f"separate groups); nothing was sent")
        try:
            yield
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(id(key_obj), None)

    def _execute(self, src_tensors, dst_tensors, tally: _Tally | None) -> RunReport:
        """The loop ``run`` and ``verify`` share. ``tally``: None to write the destination (unpack and local
        copies), or verify mode's sink, which compares those same pairs instead.

        Every check runs before the handshake, so a bad input on any rank stops every rank before a byte
        moves. After it, any failure marks this Resharder broken and raises a :class:`ReshardError` subclass
        whose ``torn`` lists the destination tensors that may be partly written."""
        t0 = time.perf_counter()
        verify = tally is not None
        if self._broken is not None:
            raise ReshardError(f"rank {self.rank}: this Resharder failed part way before ({self._broken}); "
                               f"{_GROUP_DEAD}; nothing was moved")
        error: Exception | None = None
        device = backend = b = None
        try:
            device = self._check_inputs(src_tensors, dst_tensors, verify)
            backend = ops.resolve_backend(device, self.backend)
            if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"rank {self.rank}: copy backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), "
                                 f"the tensors are on {device}")
            if isinstance(self._comm, RefitGroup) and self._comm.wire:
                self._comm._live()
            b = self._bind(src_tensors, dst_tensors, device, verify)
        except (ValueError, TypeError) as e:
            error = e
        except RuntimeError as e:  # e.g. a destroyed refit group: named, before anything moved
            error = ReshardError(f"rank {self.rank}: {e}; nothing was moved")
        try:
            self._handshake(error, verify)
        except ReshardTransportError as e:
            e.args = (f"{e}; no destination tensor on rank {self.rank} was written",)
            self._broken = f"{type(e).__name__} in {e.what}"
            raise
        touched: set[str] = set()  # destination tensors this run may have written so far
        try:
            return self._steps(b, backend, device, tally, touched, t0)
        except Exception as e:
            torn = tuple(sorted(touched))
            if isinstance(e, ReshardError):
                err = e
            else:
                err = ReshardAbortedError(
                    f"rank {self.rank}: the run failed on this rank after the handshake ({type(e).__name__}: {e}); "
                    f"its peers are left waiting and will fail too; {_GROUP_DEAD}")
            err.torn = torn
            note = (f"; destination tensors on rank {self.rank} possibly partly written: {list(torn)}" if torn
                    else f"; no destination tensor on rank {self.rank} was written")
            if torn and not verify:
                note += " (in-place receives already posted may still land until the group is destroyed)"
            err.args = (str(err) + note,)
            self._broken = f"{type(err).__name__} in {getattr(err, 'what', None) or 'a run'}"
            if err is e:
                raise
            raise err from e

    def _steps(self, b: _Bound, backend: str, device, tally: _Tally | None, touched: set[str], t0: float) -> RunReport:
        verify = tally is not None
        key = (id(self), hash(self._bound_sig))
        clock = time.perf_counter

        def land(pairs, meta, list_key) -> None:
            """Unpack or local copies: write them, or in verify mode compare them."""
            if tally is None:
                ops.copy_views(pairs, backend, key=list_key)
            else:
                tally.compare(pairs, meta)

        def quantize(groups: dict, metas: dict | None, list_key) -> None:
            """Quantize ``{(block, ue8m0): [(source, fp8 out, scale out)]}`` into the outputs; in verify mode
            (``metas`` given) into temporaries compared with the outputs instead."""
            from ..ops import quantize as quant

            for (block, ue8m0), items in groups.items():
                if metas is None:
                    quant.quantize_views(items, block, ue8m0, backend=backend, key=(list_key, block, ue8m0))
                    continue
                temps = [(x, torch.empty(q.shape, dtype=q.dtype, device=q.device),
                          torch.empty(sc.shape, dtype=sc.dtype, device=sc.device)) for x, q, sc in items]
                quant.quantize_views(temps, block, ue8m0, backend=backend)
                pairs, meta = [], []
                for (_x, tq, ts), (_y, q, sc), (mq, ms) in zip(temps, items, metas[(block, ue8m0)], strict=True):
                    pairs += [(tq, q), (ts, sc)]
                    meta += [mq, ms]
                tally.compare(pairs, meta)

        def regions(pos: int) -> None:
            """Quantize the staged regions whose last piece arrived in step ``pos`` (-1: the local copies)."""
            ks = b.regions_due.get(pos)
            if not ks:
                return
            groups: dict = {}
            metas: dict = {}
            for k in ks:
                block, ue8m0, item, meta = b.region_items[k]
                groups.setdefault((block, ue8m0), []).append(item)
                metas.setdefault((block, ue8m0), []).append(meta)
                if not verify:
                    touched.update((meta[0][0], meta[1][0]))
            quantize(groups, metas if verify else None, (key, "regions", pos))

        def local_copies() -> float:
            t = clock()
            touched.update(b.local_writes)
            land(b.local, b.local_meta, (key, "local"))
            if b.local_stage:
                ops.copy_views(b.local_stage, backend, key=(key, "local-stage"))
            if b.local_q:
                quantize(b.local_q, b.local_q_meta if verify else None, (key, "local-quant"))
            regions(-1)
            return clock() - t

        def what(pos: int) -> str:
            return f"step {pos + 1}/{len(self.steps)}"

        def finish(pending) -> None:
            nonlocal t_wire, t_unpack
            pos, works, peers, posted, desc = pending
            t1 = clock()
            self._wait(works, what(pos), peers, posted, desc)
            t2 = clock()
            land(b.unpacks[pos], b.unpack_meta[pos] if verify else None, (key, "unpack", self.steps[pos][0]))
            if b.stage_unpacks[pos]:
                ops.copy_views(b.stage_unpacks[pos], backend, key=(key, "stage", self.steps[pos][0]))
            regions(pos)
            t_wire += t2 - t1
            t_unpack += clock() - t2

        t_pack = t_wire = t_unpack = 0.0
        t_local = None
        with torch.no_grad():
            sent = recvd = 0
            pending: tuple | None = None  # (position, works, peers, posted at, ops) of the step on the wire
            for pos, ((i, _st), pk, (sends, recvs)) in enumerate(zip(self.steps, b.packs, b.wire, strict=True)):
                if pending is not None and (self.slots == 1 or self._phase[pending[0]] != self._phase[pos]):
                    # one slot: the previous step's buffers are reused; a new phase: relays read what the
                    # previous phase received
                    finish(pending)
                    pending = None
                if t_local is None and self._phase[pos]:  # relays may read what the local copies write
                    t_local = local_copies()
                t0_ = clock()
                ops.copy_views(pk, backend, key=(key, "pack", i))
                if b.qpacks[pos]:  # source-quantized chunks: quantized straight into the send buffer
                    quantize(b.qpacks[pos], None, (key, "pack-quant", i))
                t_pack += clock() - t0_
                peers = {p for p, _ in sends} | {p for p, _ in recvs}
                touched.update(b.writes[pos])  # in-place receives may land as soon as they are posted
                posted = clock()
                works = self._call(self._post, what(pos), peers, sends, recvs)
                desc = [("receiving from", p) for p, _ in recvs] + [("sending to", p) for p, _ in sends]
                if t_local is None:  # the local copies run while the first step is on the wire
                    t_local = local_copies()
                if pending is not None:  # step pos-1 was on the wire while we packed and posted step pos
                    finish(pending)
                pending = (pos, works, peers, posted, desc)
                sent += sum(buf.numel() for _, buf in sends)
                recvd += sum(buf.numel() for _, buf in recvs)
            if pending is not None:
                finish(pending)
            if t_local is None:  # no steps on this rank
                t_local = local_copies()
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        return RunReport(
            rank=self.rank,
            steps=len(self.steps),
            sent_bytes=sent,
            recv_bytes=recvd,
            local_bytes=self._local_bytes,
            staging_bytes=b.send_area_bytes + b.recv_area_bytes + sum(t.numel() * t.element_size() for t in self._stage),
            seconds=time.perf_counter() - t0,
            pack_seconds=t_pack,
            wire_seconds=t_wire,
            unpack_seconds=t_unpack,
            local_seconds=t_local,
            in_place_bytes=b.in_place_bytes,
        )

    def _post(self, sends, recvs) -> list:
        return self._comm.post(sends, recvs)  # never called with nothing to post: steps without ops are dropped
