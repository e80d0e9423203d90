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
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from .. import ops
from ..comm.group import RefitGroup, as_transport
from ..plan import DIRECT_MIN_BYTES, Plan
from ..plan.work import check_chunk_count, rank_work
from . import checks
from .bind import Bound, Staging, bind
from .delta import DeltaRequest, DeltaSide, MessageSnapshot, Prediff
from .errors import GROUP_DEAD, ReshardAbortedError, ReshardError, ReshardTransportError
from .handshake import NO_FENCE, Fence, PendingHandshake, close_preposted, handshake_finish, handshake_post
from .integrity import Digests, ReshardIntegrityError
from .integrity import enabled as integrity_enabled
from .options import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, DEFAULTS, RefitOptions
from .reports import RunReport, Tally, VerifyReport
from .steps import StepLoop, prepack
from .strategies import Dense, pick
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
    side (see ``Plan.schedule``); every rank must pass the same value. ``digest``: every message digested on
    both ends and compared at the end of the run (``execute/integrity.py``; every rank the same).

    These six parameters (after ``group``, by position or by name) are the executor fields of
    :class:`~triton_reshard.execute.options.RefitOptions` (``EXECUTOR_OPTIONS``), with its defaults, checked
    once there; ``options=`` passes them validated already (a refit session's), instead.
    """

    def __init__(self, plan: Plan, group: dist.ProcessGroup | RefitGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float | timedelta = DEFAULT_TIMEOUT,
                 backend: str | None = None, overlap: bool = False, direct_min_bytes: int = DIRECT_MIN_BYTES,
                 digest: bool = True, *, options: RefitOptions | None = None,
                 snapshot: MessageSnapshot | None = None) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"Resharder needs a Plan (the whole plan or this rank's share), got {type(plan).__name__}")
        given = {"bucket_bytes": bucket_bytes, "timeout": timeout, "backend": backend, "overlap": overlap,
                 "direct_min_bytes": direct_min_bytes, "digest": digest}
        if options is None:
            options = RefitOptions.of(**given)
        elif changed := sorted(n for n, v in given.items() if v != DEFAULTS[n]):
            raise TypeError(f"Resharder: pass options= or {', '.join(changed)}, not both")
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
        self._valid_sig: tuple | None = None  # ... that last passed the per-tensor checks (check_side), and its device
        self._valid_device: torch.device | None = None
        self._src_specs = plan.src.local_specs(self.rank)
        self._dst_specs = plan.dst.local_specs(self.rank)
        self._staging = Staging()
        # set by binding: only the staged messages need staging (direct ones of contiguous tensors go in place)
        self.send_area_bytes = self.recv_area_bytes = 0
        self._bound_sig: tuple | None = None
        self._bound: Bound | None = None
        self._prepost_for: Bound | None = None  # the binding _prepost_recvs was chosen for
        self._prepost_recvs: list | None = None
        # delta refits (execute/delta.py): eligibility, the snapshot (a refit session's, handed over), the fence
        self._delta = DeltaSide(plan, self.work, snapshot, bool(self._dst_specs))
        self._digests: Digests | None = None  # the message digests' key and coefficients, made on first use

    # the options, as attributes (read-only)
    bucket_bytes = property(lambda self: self.options.bucket_bytes)
    timeout = property(lambda self: self.options.timeout)
    backend = property(lambda self: self.options.backend)
    overlap = property(lambda self: self.options.overlap)
    direct_min_bytes = property(lambda self: self.options.direct_min_bytes)
    digest = property(lambda self: self.options.digest)
    slots = property(lambda self: self.options.slots)

    @property
    def broken(self) -> str | None:
        """Why this Resharder failed part way (its group is unusable then), or None."""
        return self._broken

    @property
    def snapshot_bytes(self) -> int:
        """Device bytes of the delta snapshot (what this rank last sent in its delta-able messages; 0 until
        a run with ``delta=`` captured it)."""
        return self._delta.snap.nbytes

    @property
    def snapshot_version(self) -> int | None:
        """The version the delta snapshot holds (None: no delta refit can start from it)."""
        return self._delta.snap.version

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
        """:meth:`_check_inputs`, and the tensors' signature (``checks.signature`` of each side, taken once per
        run, for the memory check and the binding). The per-tensor checks depend only on what the signature
        holds (names, addresses, shapes, strides, dtypes, devices, storage bytes): tensors with the signature
        of the last ones that passed pass again without them (an RL loop passes the same tensors each step)."""
        sig = checks.quick_signature(src_tensors, dst_tensors)
        if sig is not None and sig == self._valid_sig:
            device = self._valid_device
        else:
            sdev = checks.check_side(self.rank, "source", src_tensors, self._src_specs)
            ddev = checks.check_side(self.rank, "destination", dst_tensors, self._dst_specs)
            if sdev is not None and ddev is not None and sdev != ddev:
                raise ValueError(f"rank {self.rank}: source tensors are on {sdev}, destination tensors on {ddev}")
            device = sdev or ddev or self.link.device()
            if self.link.wire and self.link.is_nccl and device.type != "cuda":
                raise ValueError(f"rank {self.rank}: NCCL needs CUDA tensors, got tensors on {device}")
            if sig is None:
                sig = (checks.signature(src_tensors), checks.signature(dst_tensors))
            self._valid_sig, self._valid_device = sig, device
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

    def _prepare(self, src_tensors, dst_tensors, verify: bool, delta: DeltaRequest | None) -> _Ready:
        """Every check before the handshake (a bad input on any rank stops every rank before a byte moves), the
        binding and this rank's delta fence: a rejected input is carried in ``error`` to the handshake."""
        ready = _Ready()
        try:
            ready.device, sides = self._checked(src_tensors, dst_tensors, verify)
            device = ready.device
            ready.backend = ops.resolve_backend(device, self.backend)
            if ready.backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"rank {self.rank}: copy backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), "
                                 f"the tensors are on {device}")
            if isinstance(self.link.comm, RefitGroup) and self.link.wire:
                self.link.comm.check_live()
            ready.bound = self._bind(src_tensors, dst_tensors, device, verify, sides)
            ready.fence = self._delta.row(delta, device, verify)
        except (ValueError, TypeError) as e:
            ready.error = e
        except RuntimeError as e:  # e.g. a destroyed refit group: named, before anything moved
            ready.error = ReshardError(f"rank {self.rank}: {e}; nothing was moved")
        ready.key = (id(self), hash(self._bound_sig))
        return ready

    def _handshake(self, ready: _Ready, verify: bool, delta: DeltaRequest | None
                   ) -> tuple[list[Fence], PendingHandshake, float | None, Prediff | None]:
        """The plan handshake (every rank's fence), and while its rows travel a dense run packs its first step
        and a delta run diffs it (nothing moves; both dropped if the handshake raises); a dense run or verify
        posts its first step's staged receives with it (:meth:`_prepost`)."""
        error, b, frow = ready.error, ready.bound, ready.fence
        prepost = self._prepost(b) if error is None and self._delta.preposts(delta, frow) else None
        hs = handshake_post(self.link, self.plan, self.options, error, verify, delta is not None, frow, prepost)
        work = error is None and not verify
        packed = self._prepack(b, ready.backend, ready.key) if work and self._delta.packs_first(delta, frow) else None
        pre = self._delta.prediff(delta, b, ready.backend, frow) if work else None
        return handshake_finish(self.link, hs, error), hs, packed, pre

    def _prepost(self, b: Bound) -> list | None:
        """The receives of this rank's first step that may be posted with the plan handshake
        (``handshake.handshake_post``): on gloo (whose sends wait for the receiver's notice; NCCL's would queue
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
            return prepack(self.work, b, backend, key, self._digests_on())
        except Exception:
            return None

    def _strategy(self, delta: DeltaRequest | None, fences: list[Fence], hs: PendingHandshake,
                  packed: float | None, pre: Prediff | None) -> Dense:
        """What this run does to its messages (``execute/strategies.py``), from the delta fence's answer (a strict
        refusal raises here, before any byte moves)."""
        ranks = self.link.ranks if self.link.wire else (self.rank,)
        base, why = self._delta.decide(delta, ranks, fences,
                                       lambda: close_preposted(self.link, hs, "the delta fence"))
        return pick(self._delta, delta, base, why, packed, pre)

    def _failed(self, e: Exception, touched: set[str], verify: bool, drop: bool) -> NoReturn:
        """The one place a failure after the checks is handled: the error names the destination tensors on this
        rank that may be partly written (``torn``), this Resharder is marked broken (its group is unusable;
        not after a :class:`ReshardIntegrityError` or a ``group_ok`` abort: every message landed and the group is
        fine), and with
        ``drop`` the delta snapshot is dropped (the destinations hold neither version: only a dense
        refit makes a base again)."""
        if drop:
            self._delta.snap.version = None
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
        # every message landed (and, for group_ok, was proven): the group is fine
        landed = isinstance(err, ReshardIntegrityError) or getattr(err, "group_ok", False)
        if torn and not verify and not landed:
            note += " (in-place receives already posted may still land until the group is destroyed)"
        err.args = (str(err) + note,)
        if not landed:
            self._broken = f"{type(err).__name__} in {getattr(err, 'what', None) or 'a run'}"
        if err is e:
            raise e
        raise err from e

    def _execute(self, src_tensors, dst_tensors, tally: Tally | None, delta: DeltaRequest | None = None
                 ) -> RunReport:
        """The loop ``run`` and ``verify`` share. ``tally``: None to write the destination (unpack and local
        copies), or verify mode's sink, which compares those same pairs instead. Checks, handshake, the delta
        fence, then one :class:`~triton_reshard.execute.steps.StepLoop` with the run's strategy; a failure
        after the checks goes to :meth:`_failed` (``torn``: destinations that may be partly written)."""
        t0 = time.perf_counter()
        verify = tally is not None
        if self._broken is not None:
            raise ReshardError(f"rank {self.rank}: this Resharder failed part way before ({self._broken}); "
                               f"{GROUP_DEAD}; nothing was moved")
        ready = self._prepare(src_tensors, dst_tensors, verify, delta)
        try:
            fences, hs, packed, pre = self._handshake(ready, verify, delta)
        except ReshardTransportError as e:
            self._failed(e, set(), verify, drop=delta is not None)
        strategy = Dense(packed) if verify else self._strategy(delta, fences, hs, packed, pre)
        touched: set[str] = set()  # destination tensors this run may have written so far
        try:
            loop = StepLoop(self.work, ready.bound, self.link, ready.backend, tally, touched, ready.key, strategy,
                            hs.pre, self._ledger(verify))
            loop.run()
            if ready.device is not None and ready.device.type == "cuda":
                torch.cuda.current_stream(ready.device).synchronize()
            if loop.ledger is not None:  # every message's digests compared: raises on every rank alike
                loop.ledger.settle(self.link)
            return strategy.report(loop, loop.report(t0, self.staging_bytes))
        except Exception as e:
            self._failed(e, touched, verify, drop=not verify)


    def _digests_on(self) -> Digests | None:
        """The digest state when runs digest their messages (made on first use), else None."""
        if not self.options.digest or not self.link.wire or not integrity_enabled():
            return None
        if self._digests is None:
            self._digests = Digests(self.link.comm)
        return self._digests

    def _ledger(self, verify: bool):
        """This run's message digests (``execute/integrity.py``), or None: digest off, verify (which compares
        every element already) or no wire."""
        digests = None if verify else self._digests_on()
        return None if digests is None else digests.ledger(self.rank, self.plan, self.work)


@dataclasses.dataclass(slots=True)
class _Ready:
    """What :meth:`Resharder._prepare` found before the handshake: the device, copy backend, binding, this
    rank's delta fence and the copy lists' cache key, or the ``error`` that rejects the input."""

    error: Exception | None = None
    device: torch.device | None = None
    backend: str | None = None
    bound: Bound | None = None
    fence: Fence = NO_FENCE
    key: tuple = ()
