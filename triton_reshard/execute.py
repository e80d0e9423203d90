"""Execute: buffers, transport, kernels.

A :class:`Resharder` runs one :class:`~triton_reshard.plan.Plan` on one rank. Per step it packs the strided
source slices into one contiguous send buffer per peer, exchanges all buffers with one
``torch.distributed.batch_isend_irecv`` call, and scatters each receive buffer into the destination views.
Staging buffers are allocated once and reused; every wait has a timeout; before any byte moves all ranks
check they run the same plan and that every rank's input is valid.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import ops
from .layout import box_slices
from .plan import DIRECT_MIN_BYTES, Plan

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT = timedelta(seconds=300)


class ReshardError(RuntimeError):
    """A reshard could not run (ranks disagree, a peer rejected its input)."""


class ReshardTimeoutError(ReshardError, TimeoutError):
    """A peer did not arrive within the timeout. The process group is unusable afterwards: destroy it."""


@dataclass(frozen=True, slots=True)
class RunReport:
    """What one ``run()`` did on this rank."""

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


def _to_timedelta(timeout) -> timedelta:
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and timeout > 0:
        return timedelta(seconds=float(timeout))
    raise TypeError(f"timeout must be a timedelta or a positive number of seconds, got {timeout!r}")


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
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float | timedelta = DEFAULT_TIMEOUT,
        backend: str | None = None,
        overlap: bool = False,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
    ) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"Resharder needs a Plan, got {type(plan).__name__}")
        self.plan = plan
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
        self.timeout = _to_timedelta(timeout)
        self.backend = backend
        self.overlap = bool(overlap)
        self.direct_min_bytes = int(direct_min_bytes)
        self.slots = 2 if self.overlap else 1
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size())
            )
        else:
            self.rank, self.group_ranks = 0, (0,)
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
        self._send_area: torch.Tensor | None = None
        self._recv_area: torch.Tensor | None = None
        self._bound_sig: tuple | None = None
        self._bound: tuple | None = None

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
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(
                    f"rank {self.rank}: {side} tensor {name!r} is on {t.device}, other tensors are on {device}"
                )
        return device

    def _check_inputs(self, src_tensors, dst_tensors) -> torch.device:
        sdev = self._check_side("source", src_tensors, self._src_specs)
        ddev = self._check_side("destination", dst_tensors, self._dst_specs)
        if sdev is not None and ddev is not None and sdev != ddev:
            raise ValueError(f"rank {self.rank}: source tensors are on {sdev}, destination tensors on {ddev}")
        device = sdev or ddev or self._comm_device()
        if self._uses_wire() and self._is_nccl() and device.type != "cuda":
            raise ValueError(f"rank {self.rank}: NCCL needs CUDA tensors, got tensors on {device}")
        return device

    # -- transport helpers --------------------------------------------------------------------------

    def _uses_wire(self) -> bool:
        return len(self.group_ranks) > 1 and dist.is_initialized()

    def _is_nccl(self) -> bool:
        return dist.is_initialized() and dist.get_backend(self.group) == "nccl"

    def _comm_device(self) -> torch.device:
        if self._is_nccl():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wait(self, works, what: str, peers) -> None:
        def timed_out(detail: str) -> ReshardTimeoutError:
            return ReshardTimeoutError(
                f"rank {self.rank}: {what} with peers {sorted(peers)} did not complete within "
                f"{self.timeout.total_seconds():g}s{detail}; the process group is unusable now: destroy it"
            )

        for w in works:
            try:
                ok = w.wait(timeout=self.timeout)
            except RuntimeError as e:
                msg = str(e)
                if "imed out" in msg or "timeout" in msg.lower() or "Connection closed" in msg:
                    raise timed_out(f" ({msg.splitlines()[0] if msg else 'timeout'})") from e
                raise
            if ok is False:
                raise timed_out("")

    def _handshake(self, error: Exception | None) -> None:
        """All ranks: same plan digest? everyone's input valid? Raises on every rank otherwise."""
        if not self._uses_wire():
            if error is not None:
                raise error
            return
        dev = self._comm_device()
        d = int(self.plan.digest, 16)
        mine = torch.tensor(
            [d >> 32, d & 0xFFFFFFFF, self.bucket_bytes, 0 if error is None else 1, self.direct_min_bytes,
             int(self.overlap)],
            dtype=torch.int64, device=dev,
        )
        out = [torch.empty_like(mine) for _ in self.group_ranks]
        work = dist.all_gather(out, mine, group=self.group, async_op=True)
        self._wait([work], "the plan handshake", self.group_ranks)
        rows = [o.tolist() for o in out]
        if error is not None:
            raise error
        digests = {r: f"{(row[0] << 32) | row[1]:016x}" for r, row in zip(self.group_ranks, rows, strict=True)}
        if len(set(digests.values())) > 1 or len({(row[2], row[4], row[5]) for row in rows}) > 1:
            raise ReshardError(
                f"rank {self.rank}: ranks run different plans (plan digest by rank: {digests}; (bucket_bytes, "
                f"direct_min_bytes, overlap) by rank: {[(row[2], row[4], bool(row[5])) for row in rows]}); "
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

    def _bind(self, src_tensors, dst_tensors, device: torch.device):
        """Views for every copy and buffers for every message of this rank, built once per set of tensors.

        A direct message whose view is contiguous (and already in the wire dtype) goes straight from the
        source tensor or into the destination tensor; every other message is staged. The staging areas are
        sized for the staged messages only (their offsets are a prefix of the schedule's areas).
        """
        sig = (self._signature(src_tensors), self._signature(dst_tensors))
        if sig == self._bound_sig:
            return self._bound
        transfers = self.plan.transfers

        def view(base: torch.Tensor, start, off, size):
            """The sub-box ``off``+``size`` (logical dims) of the box starting at ``start`` in ``base``."""
            extra = base.dim() - len(size)
            o = start[:extra] + tuple(a + b for a, b in zip(start[extra:], off, strict=True))
            return base[box_slices(o, (1,) * extra + tuple(size))].reshape(size)

        def src_view(t, off, size):  # a relay reads what this rank received as destination
            return view((dst_tensors if t.relay else src_tensors)[t.src_local], t.src_offsets, off, size)

        def dst_view(t, off, size):
            return view(dst_tensors[t.dst_local], t.dst_offsets, off, size)

        def in_place(m, t, v):
            """The bytes of view ``v`` of direct message ``m`` as a flat buffer, or None if it must be staged."""
            if m.direct and v.dtype == t.wire_dtype and v.is_contiguous():
                return v.reshape(-1).view(torch.uint8)
            return None

        local = [
            (src_view(t, (0,) * len(t.sizes), t.sizes), dst_view(t, (0,) * len(t.sizes), t.sizes)) for t in self._local
        ]
        # first pass: which messages go in place, and how much staging the others need per slot
        plans = []  # per step: (sends, recvs) of (peer, at, message, view of each chunk, in-place buffer or None)
        need = [0, 0]  # staging bytes per slot: send, receive

        def side(entries, view_of, k):
            out = []
            for peer, at, m in entries:
                views = [view_of(transfers[c.transfer], c.offsets, c.sizes) for c in m.chunks]
                buf = in_place(m, transfers[m.chunks[0].transfer], views[0])
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
            self._send_area = torch.empty(self.send_area_bytes, dtype=torch.uint8, device=device)
            self._recv_area = torch.empty(self.recv_area_bytes, dtype=torch.uint8, device=device)

        def buf_view(area, at, chunk, t):
            n = math.prod(chunk.sizes)
            start = at + chunk.buffer_offset
            return area[start:start + chunk.nbytes].view(t.wire_dtype).view(chunk.sizes) if n else area[:0]

        packs, unpacks, ops_per_step = [], [], []
        for pos, (sends, recvs) in enumerate(plans):
            pk, up, wire_s, wire_r = [], [], [], []
            s_base, r_base = (pos % self.slots) * need_s, (pos % self.slots) * need_r
            for peer, at, m, views, buf in sends:
                if buf is None:
                    at += s_base
                    for c, v in zip(m.chunks, views, strict=True):
                        pk.append((v, buf_view(self._send_area, at, c, transfers[c.transfer])))
                    buf = self._send_area[at:at + m.payload]
                wire_s.append((peer, buf))
            for peer, at, m, views, buf in recvs:
                if buf is None:
                    at += r_base
                    for c, v in zip(m.chunks, views, strict=True):
                        up.append((buf_view(self._recv_area, at, c, transfers[c.transfer]), v))
                    buf = self._recv_area[at:at + m.payload]
                wire_r.append((peer, buf))
            packs.append(pk)
            unpacks.append(up)
            ops_per_step.append((wire_s, wire_r))
        self._bound_sig = sig
        self._bound = (local, packs, unpacks, ops_per_step)
        self._in_place_bytes = sum(m.payload for sends, recvs in plans for _p, _a, m, _v, buf in sends + recvs
                                   if buf is not None)
        return self._bound

    # -- run ------------------------------------------------------------------------------------------

    def run(self, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor]) -> RunReport:
        """Reshard: read ``src_tensors`` (this rank's source local tensors), write ``dst_tensors`` in place.

        Pass an empty dict for a side this rank has no part in. Raises before any byte moves if any rank's
        input is invalid or ranks run different plans; raises :class:`ReshardTimeoutError` if a peer does
        not arrive within the timeout.
        """
        t0 = time.perf_counter()
        error: Exception | None = None
        device = None
        try:
            device = self._check_inputs(src_tensors, dst_tensors)
        except (ValueError, TypeError) as e:
            error = e
        self._handshake(error)
        backend = ops.resolve_backend(device, self.backend)
        local, packs, unpacks, wire = self._bind(src_tensors, dst_tensors, device)
        key = (id(self), hash(self._bound_sig))
        clock = time.perf_counter
        t_pack = t_wire = t_unpack = 0.0
        t_local = None

        def local_copies() -> float:
            t = clock()
            ops.copy_views(local, backend, key=(key, "local"))
            return clock() - t

        with torch.no_grad():
            sent = recvd = 0
            pending: tuple | None = None  # (position, works, peers) of the step on the wire
            for pos, ((i, _st), pk, _up, (sends, recvs)) in enumerate(
                zip(self.steps, packs, unpacks, wire, strict=True)
            ):
                if pending is not None and (self.slots == 1 or self._phase[pending[0]] != self._phase[pos]):
                    # one slot: the previous step's buffers are reused; a new phase: relays read what the
                    # previous phase received
                    t_wire, t_unpack = self._finish(pending, unpacks, key, backend, t_wire, t_unpack)
                    pending = None
                if t_local is None and self._phase[pos]:  # relays may read what the local copies write
                    t_local = local_copies()
                t0_ = clock()
                ops.copy_views(pk, backend, key=(key, "pack", i))
                t_pack += clock() - t0_
                works = self._post(sends, recvs)
                if t_local is None:  # the local copies run while the first step is on the wire
                    t_local = local_copies()
                if pending is not None:  # step pos-1 was on the wire while we packed and posted step pos
                    t_wire, t_unpack = self._finish(pending, unpacks, key, backend, t_wire, t_unpack)
                pending = (pos, works, {p for p, _ in sends} | {p for p, _ in recvs})
                sent += sum(b.numel() for _, b in sends)
                recvd += sum(b.numel() for _, b in recvs)
            if pending is not None:
                t_wire, t_unpack = self._finish(pending, unpacks, key, backend, t_wire, t_unpack)
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
            staging_bytes=self.send_area_bytes + self.recv_area_bytes,
            seconds=time.perf_counter() - t0,
            pack_seconds=t_pack,
            wire_seconds=t_wire,
            unpack_seconds=t_unpack,
            local_seconds=t_local,
            in_place_bytes=self._in_place_bytes,
        )

    def _post(self, sends, recvs) -> list:
        p2p = [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recvs]
        p2p += [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sends]
        return dist.batch_isend_irecv(p2p)  # never called with an empty list: steps without ops are dropped

    def _finish(self, pending, unpacks, key, backend, t_wire, t_unpack):
        pos, works, peers = pending
        t0 = time.perf_counter()
        self._wait(works, f"step {pos + 1}/{len(self.steps)}", peers)
        t1 = time.perf_counter()
        ops.copy_views(unpacks[pos], backend, key=(key, "unpack", self.steps[pos][0]))
        return t_wire + (t1 - t0), t_unpack + (time.perf_counter() - t1)
