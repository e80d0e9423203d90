"""Execute: buffers, transport, kernels.

A :class:`Resharder` runs one :class:`~triton_reshard.plan.Plan` on one rank. Per step it packs the strided
source slices into one contiguous send buffer per peer, exchanges all buffers with one
``torch.distributed.batch_isend_irecv`` call, and scatters each receive buffer into the destination views.
Staging buffers are allocated once and reused; every wait has a timeout; before any byte moves all ranks
check they run the same plan and that every rank's input is valid.

:meth:`Resharder.verify` runs the same steps in *verify mode*: every received message is staged, and the unpack
and local copies become bit-exact compares against what the destination tensors already hold. It writes
nothing.

The jobs live beside this module: ``options`` (validated once), ``checks`` (inputs and memory), ``transport``
(handshake, waits, named errors), ``bind`` (views and buffers), ``steps`` (the loop), ``reports``, ``errors``;
the plan side hands over the rank's work (``plan.work.rank_work``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .. import ops
from ..comm.group import RefitGroup, as_transport
from ..plan import Plan
from ..plan.work import check_chunk_count, rank_work
from . import checks
from .bind import Bound, Staging, bind
from .delta import (
    COST_WHY,
    PREPOSTED,
    CaptureLoop,
    DeltaLoop,
    DeltaRefusedError,
    DeltaRequest,
    MessageSnapshot,
    Prediff,
    dense_expected,
    dense_next,
    eligible,
    fence,
    fence_row,
    prediff,
)
from .errors import GROUP_DEAD, ReshardAbortedError, ReshardError, ReshardTransportError
from .handshake import Fence, PendingHandshake, close_preposted, handshake_finish, handshake_post
from .options import EXECUTOR_OPTIONS, RefitOptions, takes_options
from .reports import RunReport, Tally, VerifyReport
from .steps import StepLoop, prepack
from .transport import DIRECT_ROWS_MAX_RANKS, Link

# post the first step's staged receives with the plan handshake (Resharder._prepost); perf/bench_call.py --ab
# turns it off on alternate calls to measure what it saves under the same load
PREPOST = True


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

    These five parameters (after ``group``, by position or by name) are derived from the executor fields of
    :class:`~triton_reshard.execute.options.RefitOptions` (``EXECUTOR_OPTIONS``), checked once there;
    ``options=`` passes them validated already (a refit session's), instead.
    """

    @takes_options(names=EXECUTOR_OPTIONS, positional=True)
    def __init__(self, plan: Plan, group: dist.ProcessGroup | RefitGroup | None = None, *,
                 options: RefitOptions | None = None, snapshot: MessageSnapshot | None = None, **given) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"Resharder needs a Plan (the whole plan or this rank's share), got {type(plan).__name__}")
        if options is None:
            options = RefitOptions.of(**given)
        elif given:
            raise TypeError(f"Resharder: pass options= or {', '.join(sorted(given))}, not both")
        self.options = options
        self.plan = plan
        self.group = group
        budget = options.budget  # the step budget, checked once (RefitOptions.of)
        check_chunk_count(plan, budget.slot_bytes)
        self.link = Link(as_transport(group), options.timeout)  # a torch.distributed group (global ranks) or a RefitGroup
        self.rank, self.group_ranks = self.link.rank, self.link.ranks
        if plan.rank is not None and plan.rank != self.rank:
            raise ValueError(f"rank {self.rank}: got the share of rank {plan.rank}; each rank runs its own share "
                             f"(plan_reshard(..., rank={self.rank}))")
        missing = sorted(set(plan.ranks) - set(self.group_ranks))
        if missing:
            raise ValueError(
                f"rank {self.rank}: the plan uses ranks {missing} that are not in the process group "
                f"{list(self.group_ranks)}"
            )
        self.work = rank_work(plan, self.rank, budget)
        self.schedule = self.work.schedule
        self.steps = self.work.steps  # only the steps this rank takes part in; step i uses slot i % slots
        self._broken: str | None = None  # set by a failure part way: the group is unusable then
        self._alias_ok: dict[tuple[str, str, tuple[int, ...]], str | None] = {}
        self._memory_ok: tuple | None = None  # the tensor signature that last passed check_memory
        self._src_specs = plan.src.local_specs(self.rank)
        self._dst_specs = plan.dst.local_specs(self.rank)
        self._staging = Staging()
        # set by binding: only the staged messages need staging (direct ones of contiguous tensors go in place)
        self.send_area_bytes = self.recv_area_bytes = 0
        self._bound_sig: tuple | None = None
        self._bound: Bound | None = None
        self._prepost_for: Bound | None = None  # the binding _prepost_recvs was chosen for
        self._prepost_recvs: list | None = None
        self._elig = None  # delta refits: which messages can go as deltas (execute/delta.py), when first asked
        # what this rank last sent in its delta-able messages (a refit session owns it and hands it over)
        self._snap = MessageSnapshot() if snapshot is None else snapshot
        # the last refit was a cost fallback: the next delta request with a topology posts its first receives
        # with the handshake, as a dense refit does (execute/delta.py dense_next)
        self._dense_next = False

    # the options, as attributes (read-only)
    bucket_bytes = property(lambda self: self.options.bucket_bytes)
    timeout = property(lambda self: self.options.timeout)
    backend = property(lambda self: self.options.backend)
    overlap = property(lambda self: self.options.overlap)
    direct_min_bytes = property(lambda self: self.options.direct_min_bytes)
    slots = property(lambda self: self.options.slots)

    @property
    def broken(self) -> str | None:
        """Why this Resharder failed part way (its group is unusable then), or None."""
        return self._broken

    @property
    def snapshot_bytes(self) -> int:
        """Device bytes of the delta snapshot (what this rank last sent in its delta-able messages; 0 until
        a run with ``delta=`` captured it)."""
        return self._snap.nbytes

    @property
    def snapshot_version(self) -> int | None:
        """The version the delta snapshot holds (None: no delta refit can start from it)."""
        return self._snap.version

    @property
    def transport(self):
        """The executor's view of the group (``.key``: the torch.distributed group, or the RefitGroup)."""
        return self.link.comm

    @property
    def staging_bytes(self) -> int:
        """Bytes this rank holds for the refit beyond the user's tensors: the send and receive areas of the
        last bind plus the region staging tensors (0 before the first run)."""
        return self.send_area_bytes + self.recv_area_bytes + self._staging.region_bytes

    # -- checks -------------------------------------------------------------------------------------

    def _check_inputs(self, src_tensors, dst_tensors, verify: bool = False) -> torch.device:
        return self._checked(src_tensors, dst_tensors, verify)[0]

    def _checked(self, src_tensors, dst_tensors, verify: bool) -> tuple[torch.device, tuple]:
        """:meth:`_check_inputs`, and the tensors' signature (``checks.signature`` of each side; taken once per
        run, after the checks proved they are tensors, for the memory check and the binding)."""
        sdev = checks.check_side(self.rank, "source", src_tensors, self._src_specs)
        ddev = checks.check_side(self.rank, "destination", dst_tensors, self._dst_specs)
        if sdev is not None and ddev is not None and sdev != ddev:
            raise ValueError(f"rank {self.rank}: source tensors are on {sdev}, destination tensors on {ddev}")
        device = sdev or ddev or self.link.device()
        if self.link.wire and self.link.is_nccl and device.type != "cuda":
            raise ValueError(f"rank {self.rank}: NCCL needs CUDA tensors, got tensors on {device}")
        sig = (checks.signature(src_tensors), checks.signature(dst_tensors))
        # verify writes nothing: sharing memory is harmless there. Overlap depends only on addresses, shapes,
        # strides and dtypes: checked once per set of tensors, not on every step of an RL loop that passes the
        # same ones
        if not verify and sig != self._memory_ok:
            checks.check_memory(self.rank, src_tensors, dst_tensors, self._alias_problem)
            self._memory_ok = sig
        return device, sig

    def _alias_problem(self, s_name: str, d_name: str, shift: tuple[int, ...]) -> str | None:
        key = (s_name, d_name, shift)
        if key not in self._alias_ok:
            self._alias_ok[key] = checks.alias_problem(self.plan, self.rank, s_name, d_name, shift)
        return self._alias_ok[key]

    def _bind(self, src_tensors, dst_tensors, device: torch.device, verify: bool = False,
              sides: tuple | None = None) -> Bound:
        """The bound views and buffers for this set of tensors and mode (the last one is cached). ``sides``:
        the tensors' signature when the caller took it already (:meth:`_checked`)."""
        if sides is None:
            sides = (checks.signature(src_tensors), checks.signature(dst_tensors))
        sig = (*sides, verify)
        if sig == self._bound_sig:
            return self._bound
        self._bound_sig = self._bound = None  # the old views must not keep old staging areas alive
        self._bound = bind(self.work, self.plan.transfers, src_tensors, dst_tensors, device, verify, self._staging)
        self._bound_sig = sig
        self.send_area_bytes, self.recv_area_bytes = self._bound.send_area_bytes, self._bound.recv_area_bytes
        return self._bound

    # -- run and verify -------------------------------------------------------------------------------

    def run(self, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor], *,
            delta: DeltaRequest | None = None) -> RunReport:
        """Reshard: read ``src_tensors`` (this rank's source local tensors), write ``dst_tensors`` in place.

        Pass an empty dict for a side this rank has no part in. Raises before any byte moves if any rank's
        input is invalid or ranks run different plans; raises :class:`ReshardTimeoutError` if a peer does
        not arrive within the timeout.

        ``delta``: every rank passes one (or none does): send only the changed elements when the fence
        passes (``execute/delta.py``), else run dense and say why (``RunReport.mode`` / ``fallback``), or
        raise :class:`DeltaRefusedError` on every rank with ``delta.strict``. A run with ``delta`` keeps
        the snapshot the next delta diffs against; a run without one drops it.
        """
        with self.link.exclusive("run", self.plan.digest):
            return self._execute(src_tensors, dst_tensors, None, delta)

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
        if relays and not self.link.wire:
            raise ValueError(
                f"rank {self.rank}: verify needs a plan without relays ({relays} relay transfers read the relaying "
                f"rank's destination tensors, which verify must not trust): plan it with relay=False"
            )
        # with a group the relay check is part of the handshake: a rank plan knows only its own relays, and
        # every rank must refuse together (a rank that raised alone would leave its peers in the handshake)
        tally = Tally()
        with self.link.exclusive("verify", self.plan.digest):
            stats = self._execute(src_tensors, dst_tensors, tally)
            by_rank = self.link.all_counts(sum(tally.counts.values()))
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

    def _fence_row(self, delta: DeltaRequest | None, device, verify: bool) -> Fence:
        """Before the handshake: this rank's delta fence columns (they ride on the handshake's all-gather);
        allocates the snapshot buffers on the first delta request."""
        if verify or delta is None:
            return fence_row(self.plan, None, self._snap, None, False)
        if self._elig is None:
            self._elig = eligible(self.plan, self.work)
        if not self._elig.dense and device is not None:
            self._snap.ensure(self.plan, self.work, self._elig, device)
        row = fence_row(self.plan, self._elig, self._snap, delta, bool(self._dst_specs))
        if self._dense_next and delta.topology is not None and not delta.strict:
            # predicted dense again: step 0's receives go with the handshake (_handshake)
            row = dataclasses.replace(row, reasons=row.reasons | PREPOSTED)
        return row

    def _fence(self, delta: DeltaRequest | None, rows: list[Fence], hs: PendingHandshake
               ) -> tuple[int | None, str | None]:
        """After the handshake, before any byte moves: may this run go as a delta? (base, None) or (None,
        why), from every rank's fence columns; without ``delta`` the snapshot is dropped (the destinations
        move past it)."""
        self._dense_next = False
        if delta is None:
            self._snap.version = None
            return None, None
        base, why, strict = fence(self.plan, self.link.ranks if self.link.wire else (self.rank,), rows)
        # otherwise a dense refit now, captured afresh (a failure drops the snapshot); a strict refusal moves
        # nothing, so the snapshot still holds what the destinations at its version hold
        if why is not None and strict:
            if any(r.reasons & PREPOSTED for r in rows):  # close the receives posted with the handshake first
                close_preposted(self.link, hs, "the delta fence")
            raise DeltaRefusedError(f"rank {self.rank}: delta refit to version {delta.version} refused: {why}; "
                                    f"nothing was moved (delta=True falls back to a dense refit)")
        self._dense_next = dense_next(delta, why)
        return base, why

    def _handshake(self, error, verify: bool, delta: DeltaRequest | None, frow: Fence, b: Bound | None,
                   backend, key) -> tuple[list[Fence], float | None, Prediff | None, PendingHandshake]:
        """The plan handshake (every rank's fence columns), and while its rows travel a dense run packs its
        first step and a delta run diffs it (nothing moves; both dropped if the handshake raises); a dense run
        or verify posts its first step's staged receives with it (:meth:`_prepost`)."""
        # a dense run posts step 0's receives with the handshake; so does a delta request predicted dense again
        # (its row says so: PREPOSTED makes the refit dense on every rank)
        prepost = self._prepost(b) if error is None and (delta is None or frow.reasons & PREPOSTED) else None
        hs = handshake_post(self.link, self.plan, self.options, error, verify, delta is not None, frow, prepost)
        work = error is None and not verify
        # a dense run packs step 0 while the rows travel; so does a delta request this rank expects to go dense
        # (its own fence or cost columns say so: a cost fallback must cost what a dense refit costs)
        packed = self._prepack(b, backend, key) if work and (delta is None or dense_expected(frow)) else None
        pre = self._prediff(delta, b, backend, frow) if work else None
        return handshake_finish(self.link, hs, error), packed, pre, hs

    def _prepost(self, b: Bound) -> list | None:
        """The receives of this rank's first step that may be posted with the plan handshake
        (``transport.handshake_post``): on gloo (whose sends wait for the receiver's notice; NCCL's would queue
        behind them on the stream), from each peer whose only message to this rank in that step lands in
        staging (an in-place receive could be written by a refused handshake's filler), and not before an
        exchange of global scales (its rows would meet the pre-posted receives first)."""
        if not PREPOST:
            return None
        if self._prepost_for is b:
            return self._prepost_recvs
        recvs = None
        link = self.link
        if (link.wire and link.comm.backend == "gloo" and len(link.ranks) <= DIRECT_ROWS_MAX_RANKS
                and self.work.steps and not self.work.global_groups and self._staging.recv is not None):
            area = self._staging.recv.untyped_storage().data_ptr()
            step0 = b.wire[0][1]
            count: dict[int, int] = {}
            for p, _buf in step0:
                count[p] = count.get(p, 0) + 1
            recvs = [(p, buf) for p, buf in step0 if count[p] == 1 and buf.numel()
                     and buf.untyped_storage().data_ptr() == area] or None
        self._prepost_for, self._prepost_recvs = b, recvs
        return recvs

    def _prepack(self, b: Bound, backend: str, key) -> float | None:
        """While the handshake is in flight: a dense run's step 0 staging copies (``steps.prepack``). A copy that
        fails here is dropped: the loop packs again and raises in its place, as it would have."""
        try:
            return prepack(self.work, b, backend, key)
        except Exception:
            return None

    def _prediff(self, delta: DeltaRequest | None, b: Bound, backend: str, frow: Fence) -> Prediff | None:
        """While the handshake is in flight: step 0's delta messages, if this rank expects the refit to go as a
        delta (it holds a snapshot, its own fence columns raise nothing, its own cost columns do not predict
        dense); the snapshot is left as it is until the fence passed (a refused refit moves nothing and keeps
        it). A diff that fails here is dropped: the loop diffs again and raises in its place."""
        if delta is None or self._elig is None or self._elig.dense or not self._elig.any_send \
                or self._snap.version is None or dense_expected(frow):
            return None
        try:
            return prediff(self.work, b, self._elig, self._snap, backend)
        except Exception:
            return None

    def _execute(self, src_tensors, dst_tensors, tally: Tally | None, delta: DeltaRequest | None = None
                 ) -> RunReport:
        """The loop ``run`` and ``verify`` share. ``tally``: None to write the destination (unpack and local
        copies), or verify mode's sink, which compares those same pairs instead.

        Every check runs before the handshake, so a bad input on any rank stops every rank before a byte
        moves. After it, any failure marks this Resharder broken and raises a :class:`ReshardError` subclass
        whose ``torn`` lists the destination tensors that may be partly written."""
        t0 = time.perf_counter()
        verify = tally is not None
        if self._broken is not None:
            raise ReshardError(f"rank {self.rank}: this Resharder failed part way before ({self._broken}); "
                               f"{GROUP_DEAD}; nothing was moved")
        error: Exception | None = None
        device = backend = b = None
        frow = fence_row(self.plan, None, self._snap, None, False)  # this rank's delta fence columns
        try:
            device, sides = self._checked(src_tensors, dst_tensors, verify)
            backend = ops.resolve_backend(device, self.backend)
            if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"rank {self.rank}: copy backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), "
                                 f"the tensors are on {device}")
            if isinstance(self.link.comm, RefitGroup) and self.link.wire:
                self.link.comm.check_live()
            b = self._bind(src_tensors, dst_tensors, device, verify, sides)
            frow = self._fence_row(delta, device, verify)
        except (ValueError, TypeError) as e:
            error = e
        except RuntimeError as e:  # e.g. a destroyed refit group: named, before anything moved
            error = ReshardError(f"rank {self.rank}: {e}; nothing was moved")
        key = (id(self), hash(self._bound_sig))
        try:
            rows, packed, pre, hs = self._handshake(error, verify, delta, frow, b, backend, key)
        except ReshardTransportError as e:
            e.args = (f"{e}; no destination tensor on rank {self.rank} was written",)
            self._broken = f"{type(e).__name__} in {e.what}"
            if delta is not None:
                self._snap.version = None
            raise
        if not verify:
            base, why = self._fence(delta, rows, hs)
        preposted = hs.pre
        touched: set[str] = set()  # destination tensors this run may have written so far
        try:
            args = (self.work, b, self.link, backend, tally, touched, key)
            if verify or delta is None:
                loop = StepLoop(*args, prepacked=packed, preposted=preposted)
            elif base is not None:
                loop = DeltaLoop(*args, elig=self._elig, snap=self._snap, pre=pre)
            elif self._snap.device is not None:  # a cost fallback (predicted faster dense) captures nothing
                loop = CaptureLoop(*args, elig=self._elig, snap=self._snap,
                                   capture=not (why or "").startswith(COST_WHY), prepacked=packed,
                                   preposted=preposted)
            else:  # no snapshot: the plan goes dense (Eligible.dense: block-FP8 destinations)
                loop = StepLoop(*args, prepacked=packed, preposted=preposted)
            loop.run()
            if device is not None and device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            report = loop.report(t0, b.send_area_bytes + b.recv_area_bytes + self._staging.region_bytes)
            if verify or delta is None:
                return report
            if self._snap.device is not None:
                self._snap.version = delta.version if getattr(loop, "capture", True) else None
            dense = sum(buf.numel() for sends, _r in b.wire for _p, buf in sends)
            return dataclasses.replace(report, mode="delta" if base is not None else "dense-fallback",
                                       fallback=why, delta_base=base, dense_sent_bytes=dense,
                                       rescaled=getattr(loop, "rescaled", ()))
        except Exception as e:
            if not verify:  # the destinations hold neither version: only a dense refit makes a base again
                self._snap.version = None
            torn = tuple(sorted(touched))
            if isinstance(e, ReshardError):
                err = e
            else:
                err = ReshardAbortedError(
                    f"rank {self.rank}: the run failed on this rank after the handshake ({type(e).__name__}: {e}); "
                    f"its peers are left waiting and will fail too; {GROUP_DEAD}")
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
