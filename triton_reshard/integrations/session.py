"""A trainer rank's update sessions with an engine (integration kit): what a plug-in's trainer side does the same way
whatever the engine, around this rank's sends.

One update (:meth:`TrainerSession.update`): pause the engine's scheduler, open its update session, run the engine's
part beside this rank's sends (:func:`~.stage.beside`), the update's vote, close the session, resume. A staged update
(stage, then commit) runs the same without the pause, and its :meth:`~TrainerSession.commit` later under it; a
background send (:class:`~.inflight.BackgroundSender`) stages from a snapshot and is joined at the commit. Failures
are told the same way for every engine: a failed update leaves the engine paused with torn weights, a failed staged
one leaves it serving its weights as before; both raise naming the version, the reason and who left the group
(:func:`~.engine.lost_text`). The plug-in gives :class:`EngineCalls` (how trainer rank 0 reaches its engine) and
the send. Used by the vLLM plug-in's trainer engine (:mod:`.vllm_trainer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..comm.group import RefitGroup
from ..comm.secret import SECRET_ENV
from ..execute.options import DEFAULT_BUCKET_BYTES
from ..layout import Layout
from .engine import ControlCall, broadcast_receive, check_room, delta_options, lost_text
from .inflight import BackgroundSender
from .stage import Receiver, Staging, TornState, beside, log_warning, voted

__all__ = ["MODES", "PHASES", "EngineCalls", "GroupFields", "TrainerSession", "UpdateFields", "WorkerSession"]


@dataclass
class EngineCalls:
    """How trainer rank 0 drives its engine's update session (the other trainer ranks have none): ``start()`` opens
    it, ``update(info)`` is the engine's part (run beside this rank's sends, :class:`~.engine.ControlCall`),
    ``finish(version)`` closes it (``version``: the new weights' tag as a string; None: nothing committed);
    ``pause()`` / ``resume()``: the engine's scheduler, None where it is not paused. ``engine`` and
    ``finish_name`` name the engine and its closing call in errors."""

    start: Callable[[], object]
    update: Callable[[dict], object]
    finish: Callable[[str | None], object]
    pause: Callable[[], object] | None = None
    resume: Callable[[], object] | None = None
    engine: str = "the engine"
    finish_name: str = "finish"


MODES = ("auto", "inplace", "reload")  # an engine rank's receive modes (WorkerSession)
PHASES = ("full", "stage", "commit")  # UpdateFields.phase


@dataclass(kw_only=True)
class GroupFields:
    """What an engine rank is told at init beside where the refit group is: how to join it, and its
    :class:`WorkerSession`'s options (a plug-in's typed init info derives from this)."""

    timeout: float = 300.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    group_backend: str | None = None  # gloo / nccl (default: nccl with CUDA)
    # where this worker reads the refit group's secret (the secret itself never travels in init info)
    secret_env: str | None = SECRET_ENV
    secret_file: str | None = None
    insecure: bool | None = None  # no secret on a routable host: accept any process (see init_refit_group)
    mode: str = "auto"  # "auto" | "inplace" | "reload" (see the plug-in's choose_mode)
    staging_bytes: int = 64 << 20  # reload mode: layer groups merged up to this many checkpoint bytes per refit
    # reload mode: receive the next layer group while the loader processes this one (off by default: on a 2-core
    # machine it made refits slower, 0.75x; it pays where the wire waits on a network and a core is free)
    prefetch: bool = False
    # reload mode, stage then commit: build the new weights (the engine's loader + re-pack) on shadow modules while
    # the engine serves, so the commit only swaps them in (costs ~1x the worker's packed weights until the commit);
    # False: the commit runs the engine's reload from staging under the pause (no shadow memory)
    shadow: bool = True


@dataclass
class UpdateFields:
    """One update (the plan is fixed at init), checked where it is built: on the trainer before any engine call,
    again on each engine rank. ``version``: a tag (an int such as the step for delta refits); ``delta``:
    ``refit``'s ``delta`` (False, True, "strict" or "auto"; docs/delta.md); ``method``: ``"reshard"`` or the baseline
    ``"broadcast"``; ``phase``: "full", "stage" or "commit" (:class:`WorkerSession`)."""

    version: int | str | None = None
    delta: bool | str = False
    method: str = "reshard"
    prefetch: bool | None = None  # reload mode: this update's prefetch (None: the init info's)
    shadow: bool | None = None  # reload mode, phase "stage": build on a shadow (None: the init info's)
    phase: str = "full"

    def __post_init__(self) -> None:
        if self.method not in ("reshard", "broadcast"):
            raise ValueError(f"triton_reshard update: method must be 'reshard' or 'broadcast', got {self.method!r}")
        if self.phase not in PHASES:
            raise ValueError(f"triton_reshard update: phase must be one of {PHASES}, got {self.phase!r}")
        if self.phase != "full" and self.method != "reshard":
            raise ValueError(f"triton_reshard update: phase {self.phase!r} needs method 'reshard', got {self.method!r}")
        delta_options(self.version, self.delta)


class TrainerSession:
    """A trainer rank's updates of one engine over the refit ``group`` (``calls``: trainer rank 0's
    :class:`EngineCalls`, else None). ``mode``: the engine's receive mode (in ``last_update``); ``staged``: a
    completed staged update not yet committed; ``sender``: the background send; ``last_update``: what the last
    update did (its phases' seconds, bytes sent, or why it failed)."""

    def __init__(self, group: RefitGroup, rank: int, num_trainer_ranks: int, timeout: float,
                 calls: EngineCalls | None, mode: str):
        self.group, self.rank, self.num_trainer_ranks, self.timeout = group, rank, num_trainer_ranks, timeout
        self.calls, self.mode = calls, mode
        self.where = f"triton_reshard trainer rank {rank}"
        self.staged: dict | None = None
        self.sender = BackgroundSender(self.where)
        self.last_update: dict = {}

    def check(self, *, overlap: bool, background: bool) -> None:
        """Before an update, before any engine call: refused while a background send is in flight (it uses the
        refit group until :meth:`commit` joins it), and ``background`` without ``overlap``."""
        if background and not overlap:
            raise ValueError(f"{self.where}: background=True needs overlap=True "
                             "(a background send stages; commit() joins it and swaps)")
        self.sender.check_idle("send_weights")

    def run(self, info: dict, send: Callable[[dict], int], background: bool = False) -> None:
        """One update (:meth:`update`), or with ``background`` the same in a background thread (joined by
        :meth:`commit`). A new update supersedes a staged one not committed."""
        self.staged = None
        if background:
            self.sender.run(lambda: self.update(info, send))
        else:
            self.update(info, send)

    def commit(self) -> None:
        """Swap in what a completed staged update staged: join a background send first (bounded by 3x the group's
        timeout; its error raised: nothing was committed), then the commit's update session under the pause.
        Refused, before any engine call, without a complete staged update."""
        stage = None
        if self.sender.in_flight:
            self.sender.join(3 * self.timeout)
            stage = {**self.last_update, **self.sender.last}
        if self.staged is None:
            raise RuntimeError(f"{self.where}: commit refused: no complete staged "
                               "update (send_weights(overlap=True) first; a failed one cannot be committed)")
        version, self.staged = self.staged["version"], None
        self.update({"version": version, "phase": "commit"}, lambda phases: 0)
        if stage is not None:
            self.last_update["stage"] = stage

    @staticmethod
    def tally(phases: dict, report) -> int:
        """Count one refit of a send into the update's ``phases``; its bytes sent."""
        phases["refits"] = phases.get("refits", 0) + 1
        phases["pack_s"] = phases.get("pack_s", 0.0) + report.pack_seconds
        phases["wire_s"] = phases.get("wire_s", 0.0) + report.wire_seconds
        return report.sent_bytes

    def update(self, info: dict, send: Callable[[dict], int]) -> None:
        """One engine update session around this rank's ``send(phases)`` (its bytes sent): pause (not for a staged
        receive), start and the engine's part ``calls.update(info)`` (rank 0, run beside ours), the sends, the
        update's vote, the engine's answer, finish, resume. Fills ``last_update``."""
        phase, version, method = info["phase"], info["version"], info.get("method", "reshard")
        t = [time.perf_counter()]
        phases: dict = {}

        def lap(key: str) -> None:
            t.append(time.perf_counter())
            phases[key] = t[-1] - t[-2]

        calls = self.calls
        pause = phase != "stage" and calls is not None and calls.pause is not None
        if pause:
            calls.pause()
        lap("pause_s")
        rpc = None
        if calls is not None:
            calls.start()
            rpc = ControlCall(calls.update, info)
        lap("start_s")
        sent, err, bad = beside(self.group, lambda: send(phases), rpc, self.timeout, f"trainer rank {self.rank}", lap)
        sent = sent or 0
        if phase == "stage":
            return self._staged_done(version, err, bad, sent, t[0], phases)
        if err is not None:
            self._failed(version, method, f"{type(err).__name__}: {err}{self._lost(err)}", err)
        if bad:  # an engine rank failed on its own (e.g. in the engine's loader) while our sends completed
            self._failed(version, method, f"rank(s) {bad} of the refit group failed their part (see their log)", None)
        if calls is not None:
            calls.finish(None if version is None else str(version))
        lap("finish_s")
        if pause:
            calls.resume()
        lap("resume_s")
        self.last_update = {"mode": self.mode, "method": method, "sent_bytes": sent, "seconds": t[-1] - t[0], **phases}
        if phase == "commit":
            self.last_update.update(phase="commit", version=version, commit_s=t[-2] - t[1],
                                    paused_s=t[-1] - t[0] if pause else 0.0)

    def _staged_done(self, version, err, bad, sent: int, t0: float, phases: dict) -> None:
        """A staged receive's end: the engine's update session closes (its weight version stays: nothing
        committed); a failure is raised saying the engine serves its weights as before."""
        # who left, asked before the engine's finish: an engine that lost a worker may be stopped by it, and its
        # other workers leave too (asked after, the first gone may no longer be told apart)
        lost = self._lost(err) if err is not None or bad else ""
        engine_err = self._finish() if self.calls is not None else None
        if err is None and not bad and engine_err is not None:
            raise engine_err
        if err is not None or bad:
            reason = f"{type(err).__name__}: {err}" if err is not None else f"rank(s) {bad} failed their part"
            self.last_update = {"mode": self.mode, "phase": "stage", "failed": reason[:400]}
            state = ("the engine was not paused and serves its weights as before (staging is private)"
                     if engine_err is None else f"the engine was not paused, but {self._finish_failed(engine_err, 'its')}")
            raise RuntimeError(
                f"{self.where}: the staged update to version {version!r} failed ({reason}){lost}; nothing was "
                f"committed: {state}; re-init the trainer engine if its refit group broke, then send_weights "
                "again") from err
        self.staged = {"version": version}
        s = time.perf_counter() - t0
        self.last_update = {"mode": self.mode, "method": "reshard", "phase": "stage", "sent_bytes": sent,
                            "transfer_s": s, "seconds": s, **phases}

    def _finish(self) -> BaseException | None:
        """The engine's finish with nothing committed, bounded by the group's timeout (an engine that lost a worker
        may answer late or never): its error, None once it returned."""
        try:
            ControlCall(self.calls.finish, None).join(self.timeout)
        except BaseException as e:  # noqa: BLE001 (the caller says what it means)
            return e
        return None

    def _finish_failed(self, e: BaseException, whose: str, too: str = "") -> str:
        c = self.calls
        return (f"{whose} {c.finish_name} failed{too} ({type(e).__name__}: {str(e)[:200]}): an engine that lost a "
                f"worker is stopped by {c.engine}: restart it")

    def _lost(self, err: BaseException | None) -> str:
        return lost_text(self.group, err, self.num_trainer_ranks, self.timeout)

    def _failed(self, version, method: str, reason: str, cause: BaseException | None):
        """A failed update: close the engine's update session (its ranks keep their torn state: nothing is
        finalized, the forward stays refused) and raise, leaving the engine paused."""
        self.last_update = {"mode": self.mode, "method": method, "failed": reason[:400]}
        engine_err = self._finish() if self.calls is not None else None
        if engine_err is not None:
            reason += "; " + self._finish_failed(engine_err, "the engine's", " too")
        if cause is not None and not (self.calls is not None and self.calls.pause is not None):
            raise cause
        raise RuntimeError(
            f"{self.where}: the weight update to version {version!r} failed ({reason}); the engine's workers hold "
            "torn weights and refuse a forward, and the engine stays paused (queued requests wait, none is served "
            "from torn weights) until a repair update completes: re-init the trainer engine if its refit group "
            "broke, then send_weights again") from cause

    def close(self) -> None:
        """A shutdown: a background send in flight joined within the group's timeout (its error dropped)."""
        self.sender.close(self.timeout)


class WorkerSession:
    """An engine rank's part of every update over the refit ``group`` (the kit's side of a plug-in's worker): the
    phases ``"full"`` (receive and swap in), ``"stage"`` (receive into the private :class:`~.stage.Staging` mirror
    in a background thread while the engine serves; in ``"reload"`` mode also build the new weights on a shadow
    of the model) and ``"commit"`` (swap them in: the shadow's swap, the engine's reload from staging, or the
    mirror's copy). Receive modes: ``"inplace"`` writes the live parameters of ``model()``; ``"reload"`` hands the
    checkpoint's tensors to the engine's loader, ``load(items, stats)``, one layer group at a time (``groups``;
    ``stats["load_s"]``: the loader's time between the items).
    The plug-in gives ``build(items, stats)``: the staged version built on a :class:`~.engine.ModuleShadow` (None:
    the commit reloads). ``torn``: the rank's :class:`~.stage.TornState` (kept across sessions). ``who`` heads the
    texts; ``engine`` names the engine's reload in them. Errors are not raised: voted, logged and recorded
    (``last_update``), the trainer learns of them from its refit or the vote."""

    phase: str | None = None  # the phase of the update in progress (None: none received since the engine's start)
    start_s = 0.0  # the engine's start of this update (its repair of a failed one), in the stats

    def __init__(self, group: RefitGroup, src: Layout, dst: Layout, mode: str, groups: list, torn: TornState, *,
                 model, load: Callable, build: Callable | None, timeout: float, bucket_bytes: int, rank_offset: int,
                 prefetch: bool, shadow: bool, device, who: str, engine: str = "the engine"):
        self.group, self.src, self.dst, self.mode, self.groups, self.torn = group, src, dst, mode, groups, torn
        self.model, self.load, self.build, self.device, self.who, self.engine = model, load, build, device, who, engine
        self.timeout, self.rank_offset, self.prefetch, self.shadow = timeout, rank_offset, prefetch, shadow
        self.rx = Receiver(group, bucket_bytes=bucket_bytes, timeout=timeout)
        self.staging = Staging(dst, group.rank, parts=[dst, *(d for _names, _src, d in groups if d is not dst)])
        self.last_update: dict = {"mode": mode, "torn": torn.state}
        self.built = None  # reload mode: the staged version built on a shadow of the model, swapped in at the commit
        self.drop()

    def drop(self) -> None:
        self.built = None
        self.staging.drop()

    def started(self, seconds: float) -> None:
        """The engine's start of an update (``seconds``: its repair of a failed one)."""
        self.phase, self.start_s = None, seconds

    def receive(self, info) -> None:
        """One update's part on this rank, then the update's vote. Phase "stage" runs in a background thread and
        returns at once (its vote tells the trainer it is complete)."""
        self.phase = info.phase
        if info.phase == "stage":
            return self.staging.start(self.voted, info, who=self.who, name="triton_reshard_stage")
        self.staging.join(self.timeout)  # the trainer sends this only after the staged receive's vote
        self.voted(info, self.staging.busy())

    def voted(self, info, busy: bool = False) -> None:
        t0, stage, rank = time.perf_counter(), info.phase == "stage", self.group.rank

        def part() -> None:
            if busy:
                raise RuntimeError(f"{self.who}: update to version {info.version!r} refused: "
                                   "a staged receive is still running")
            stats = self.apply(info)  # recorded before the vote: a staged update's trainer may ask right after
            self.last_update = {**stats, "seconds": time.perf_counter() - t0}

        err = voted(self.group, part, self.timeout, f"worker {rank}", staged=stage)
        if err is not None and stage:
            self.drop()  # and the staged version with it; the engine keeps its weights
            self.last_update = {"mode": self.mode, "phase": "stage", "version": info.version,
                                "failed": f"{type(err).__name__}: {err}"[:400]}
            log_warning(f"{self.who}: the staged update to version {info.version!r} failed; "
                        f"the engine keeps its weights: {err}")
        elif err is not None:
            self.torn.mark(info.version, self.mode, err, self.who, self.model())
            self.last_update = {"mode": self.mode, "method": info.method, "torn": self.torn.state}
            if info.delta or self.staging.tensors is not None:
                self.drop()
            log_warning(f"{self.who}: the update to version {info.version!r} failed, weights "
                        f"torn, generation refused until a repair update completes: {self.torn.state['reason']}")

    def apply(self, info) -> dict:
        """This rank's part of one update (class docstring); returns its ``last_update``."""
        kw, reload, st, rx = delta_options(info.version, info.delta), self.mode == "reload", self.staging, self.rx
        stats = rx.stats = {"mode": self.mode, "method": info.method, "phase": info.phase, "recv_bytes": 0,
                            "staging_bytes": 0, "refit_s": 0.0, "alloc_s": 0.0, "unpack_s": 0.0, "load_s": 0.0,
                            "start_s": self.start_s}
        if info.phase == "stage":  # the mirror is written one layer group per refit, as a full delta writes it
            for _item in rx.into(st.mirror(stats), self.groups, prefetch=False, **kw):
                pass
            shadow = self.shadow if info.shadow is None else info.shadow
            self.built = self._build(stats) if reload and shadow and self.build is not None else None
            st.staged = {"version": info.version}  # before the vote: the trainer commits after it
            return {**stats, "version": info.version, "staging_bytes": st.nbytes()}
        if info.phase == "commit":
            return self._commit(info, stats)
        # a full update supersedes a staged one; in place it writes the live parameters, not the mirror
        if st.tensors is not None and (st.staged is not None or not reload or info.method == "broadcast"
                                       or not info.delta):
            self.drop()
        if info.method == "broadcast":
            stats["mode"] = "reload"  # the baseline always goes through the engine's loader
            self._load(broadcast_receive(self.group, self.src, self.rank_offset, self.timeout, stats), stats)
        elif not reload:
            rx.refit(dict(self.model().named_parameters()), self.src, self.dst, **kw)
        elif info.delta and not info.prefetch:  # one refit patches the staged checkpoint, then one load
            rx.refit(st.mirror(stats), self.src, self.dst, **kw)
            stats["staging_bytes"] = st.nbytes()
            self._load(list(st.tensors.items()), stats)
        elif info.delta:  # prefetch=True: the delta patches the staged checkpoint boxes one layer group per
            # refit, the engine re-packing group k while group k+1 is on the wire
            self._load(rx.into(st.mirror(stats), self.groups, prefetch=True, **kw), stats)
            stats["staging_bytes"] = st.nbytes()
        else:
            self._load(rx.groups(self.groups, self.prefetch if info.prefetch is None else info.prefetch, **kw), stats)
        return stats

    def finishing(self) -> bool:
        """Whether the engine's finish of this update has work: not after a staged receive (the engine serves its
        weights as before), not after a failed update (it stays torn)."""
        return self.phase != "stage" and not (self.torn.state is not None and self.last_update.get("torn"))

    def finished(self, **stats) -> None:
        """The update completed: ``stats`` recorded, a torn state repaired (the forward allowed again)."""
        self.last_update.update(stats)
        repaired = self.torn.repaired()
        if repaired is not None:
            self.last_update["repaired"] = repaired

    def _load(self, items, stats: dict) -> None:
        """The engine's loader on ``(name, tensor)`` items; ``load_s``: its time (between our yields)."""

        def timed():
            for item in items:
                t0 = time.perf_counter()
                yield item
                stats["load_s"] += time.perf_counter() - t0

        self.load(timed(), stats)

    def _commit(self, info, stats: dict) -> dict:
        st = self.staging
        if st.staged is None:
            raise RuntimeError(f"{self.who}: commit of version {info.version!r} "
                               "refused: no complete staged update (the receive failed or never ran)")
        stats.update(version=st.staged["version"], staging_bytes=st.nbytes(),
                     commit_path="reload" if self.mode == "reload" else "copy")
        t0, sh, self.built = time.perf_counter(), self.built, None
        if sh is not None:
            sh.swap()
            stats.update(load_s=time.perf_counter() - t0, commit_path="shadow", **sh.stats)
        elif self.mode == "reload":
            self._load(list(st.tensors.items()), stats)
        else:
            st.commit(dict(self.model().named_parameters()))
            stats["load_s"] = time.perf_counter() - t0
        st.staged = None  # committed: the mirror stays (it holds the live version; a delta patches it)
        return stats

    def _build(self, stats: dict):
        """The staged version's weights built on a shadow of the model (in the staging thread, the engine
        serving); a failure is named in ``stats["shadow_failed"]`` and the commit reloads instead."""
        try:  # the shadow costs about 1x this rank's shard (the packed weights): skipped without the room
            check_room(self.staging.nbytes(), self.device, "the shadow build")
            sh = self.build(list(self.staging.tensors.items()), stats)
        except Exception as e:  # noqa: BLE001 (named; the engine keeps its weights, the commit falls back)
            stats["shadow_failed"] = f"{type(e).__name__}: {e}"[:400]
            log_warning(f"{self.who}: {stats['shadow_failed']}; the engine keeps "
                        f"its weights, the commit runs {self.engine}'s reload from staging instead")
            return None
        sh.stats = {k: stats[k] for k in ("shadow_s", "shadow_process_s", "shadow_bytes") if k in stats}
        return sh
