"""The trainer side of the vLLM backend: :class:`TritonReshardTrainerEngine` (vLLM's weight-transfer API) on the kit's
:class:`~.session.TrainerSession`. See :mod:`.vllm_transfer` for the whole backend (and
:func:`~.vllm_transfer.trainer_refit_group` for vLLMs without the API)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import ClassVar

from ..layout import Layout
from ..refit import refit
from .engine import ControlCall, broadcast_send, join_group, plugin_secret
from .session import EngineCalls, GroupFields, TrainerSession
from .vllm_transfer import (
    BACKEND,
    MODES,
    ReshardUpdateInfo,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    delta_kwargs,
    group_layouts,
    rendezvous,
)

if TrainerWeightTransferEngine is not None:

    @dataclass
    class ReshardTrainerInitInfo(TrainerInitInfo, GroupFields):
        """Trainer-side init info (one per trainer rank; ``rank`` is this trainer rank, 0 the sender); the fields
        it shares with the workers' :class:`~.vllm_transfer.ReshardInitInfo` are the kit's :class:`~.session.GroupFields`."""

        backend: ClassVar[str] = BACKEND
        host: str = "127.0.0.1"
        port: int = 0
        world_size: int = 0  # trainer ranks + all workers
        num_trainer_ranks: int = 1
        layout: Layout | None = None  # the trainer's layout on refit ranks 0..num_trainer_ranks-1
        extra: dict = field(default_factory=dict)
        # the refit group's secret: ``secret`` itself (kept out of repr), else read from ``secret_file`` or the
        # environment variable ``secret_env``; the workers are told only ``secret_env`` / ``secret_file``
        secret: bytes | str | None = field(default=None, repr=False)
        # pause the engine's scheduler from before each update until it completed, through the client's
        # pause_generation(mode) / resume_generation: no engine step runs between the update's RPCs, and an
        # update that fails leaves the engine paused, not serving torn weights. False: the caller guarantees no
        # request runs during an update. ``pause_mode`` (vLLM's): "wait" (requests in flight finish on the old
        # weights first: every request sees one version), "keep" (held, continued on the new weights), "abort".
        pause: bool = True
        pause_mode: str = "wait"

    # what the workers are told (ReshardInitInfo): the trainer's init info less what stays here
    _WORKER_FIELDS = ("host", "port", "world_size", *(f.name for f in fields(GroupFields)))

    class TritonReshardTrainerEngine(TrainerWeightTransferEngine):
        """The trainer side: every trainer rank sends the boxes it holds, straight from its local tensors.

        ``source``: a ``WeightSource`` whose ``iter_local()`` yields this rank's local tensors under the
        trainer layout's local names (:class:`~.vllm_transfer.TensorsSource` wraps a dict). ``mode``: the
        workers' receive mode, agreed at init. ``session``: the kit's update sessions (``last_update``)."""

        init_info_cls = ReshardTrainerInitInfo
        group = session = None
        last_update = property(lambda self: self.session.last_update)

        @classmethod
        def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None):
            import inspect

            if init_info.layout is None:
                raise ValueError("ReshardTrainerInitInfo.layout: the trainer's Layout is required")
            if init_info.mode not in MODES:
                raise ValueError(f"ReshardTrainerInitInfo.mode must be one of {MODES}, got {init_info.mode!r}")
            kw = {"is_sender": init_info.rank == 0}  # vLLM 0.33's __init__ takes rank=; 0.32's does not
            if "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters:
                kw["rank"] = init_info.rank
            eng = cls(client=client, source=source, **kw)
            eng.rank, eng.info = init_info.rank, init_info
            worker_info = {k: getattr(init_info, k) for k in _WORKER_FIELDS}
            worker_info["rank_offset"] = init_info.num_trainer_ranks
            secret = plugin_secret(init_info.secret, init_info.secret_env, init_info.secret_file,
                                   where=f"triton_reshard trainer rank {init_info.rank}")
            rpc = ControlCall(client.init_weight_transfer_engine, worker_info) if eng.is_sender else None
            eng.group = join_group(init_info.host, init_info.port, init_info.rank, init_info.world_size,
                                   backend=init_info.group_backend, timeout=init_info.timeout,
                                   secret=secret, insecure=init_info.insecure)
            part = (init_info.layout,) if eng.is_sender else None
            try:
                eng.src_layout, eng.dst_layout, eng.mode = rendezvous(eng.group, part, None, init_info.rank)
            except BaseException:
                if rpc is not None:  # the workers fail the same init: let their answer arrive, then raise ours
                    with contextlib.suppress(BaseException):
                        rpc.join(min(init_info.timeout, 30.0))
                eng.shutdown()
                raise
            eng.groups = group_layouts(eng.src_layout, eng.dst_layout, eng.mode, init_info.staging_bytes)
            eng.session = TrainerSession(eng.group, eng.rank, init_info.num_trainer_ranks, init_info.timeout,
                                         eng._calls() if eng.is_sender else None, eng.mode)
            if rpc is not None:
                rpc.join(init_info.timeout)
            return eng

        def _calls(self) -> EngineCalls:
            """vLLM's update session through the client (``pause_generation`` where the client has it)."""
            c = self.client
            pause = getattr(c, "pause_generation", None) if self.info.pause else None
            return EngineCalls(c.start_weight_update, c.update_weights, c.finish_weight_update,
                               pause and (lambda: pause(self.info.pause_mode)), pause and c.resume_generation,
                               engine="vLLM", finish_name="finish_weight_update")

        def send_weights(self, version: int | str | None = None, delta: bool | str = False,
                         method: str = "reshard", prefetch: bool | None = None, overlap: bool = False,
                         shadow: bool | None = None, background: bool = False, tensors=None) -> None:
            """One update. ``delta=True`` (with an int ``version``, e.g. the step): only the changed elements
            travel after the first update (docs/delta.md). In reload mode an update is one refit per layer
            group; a delta is one refit patching the workers' staged checkpoint, then vLLM's reload of all of it
            (``prefetch=True`` with a delta: one refit per layer group into it, vLLM re-packing a group while the
            next one moves: slower where the engine's re-pack is short, docs/integrations.md).
            ``method="broadcast"``: the baseline (:class:`ReshardUpdateInfo`); needs every full tensor on one
            trainer rank. ``overlap=True``: stage, then commit: the workers receive into a private staging
            mirror in a background thread while the engine keeps serving; this returns once every worker has
            staged (the engine is not paused) and, in reload mode, built the new weights on a shadow of the model
            (``shadow``, default the init info's); :meth:`commit` later swaps them in under the pause.
            A failed staged update leaves the engine serving its weights untouched (raised here, not torn).

            ``background=True`` (with ``overlap=True``): this rank's local tensors are copied into a snapshot
            (1x its local weights, buffers reused across updates) and the whole staged update runs in a
            background thread; this returns after the copy, so the trainer may change its weights (its next
            training step) while the bytes move. :meth:`commit` joins it (raising its error: the engine then
            serves its old weights, untouched) and swaps as above. A send while one is in flight is refused
            (commit first); :meth:`shutdown` joins it within the group's timeout. ``tensors``: this rank's
            local tensors for this update instead of the source's; with ``background=True`` they are sent as
            given, without the snapshot copy (the caller's own copies: not to be changed until commit)."""
            s, copied = self.session, tensors is not None
            s.check(overlap=overlap, background=background)
            info = {"version": version, "delta": delta, "method": method, "prefetch": prefetch,
                    "phase": "stage" if overlap else "full", "shadow": shadow}
            # refused here, before any engine call: the engine keeps serving its old weights (issue 42)
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **delta_kwargs(ReshardUpdateInfo(**info)))
            if tensors is None:
                tensors = dict(self.source.iter_local()) if self.source is not None else {}
            if background:  # the copy the send reads while the trainer goes on
                tensors = s.sender.take(tensors, version, copied=copied)

            def send(phases: dict) -> int:
                if method == "broadcast":
                    return broadcast_send(self.group, self.src_layout, tensors, self.info.num_trainer_ranks,
                                          self.info.timeout)
                sent = 0
                whole = delta and not prefetch and not overlap  # a delta in one refit, then the whole load
                for _names, src, dst in [(None, self.src_layout, self.dst_layout)] if whole else self.groups:
                    # one refit per layer group in reload mode, as the workers receive
                    mine = {f.local or f.tensor for f in src.fragments if f.rank == self.group.rank}
                    part = {n: t for n, t in tensors.items() if n in mine}
                    self.last_report = rep = refit(part, {}, src, dst, **kw)
                    sent += s.tally(phases, rep)
                return sent

            s.run(info, send, background)

        def commit(self) -> None:
            """Swap the weights a completed ``send_weights(overlap=True)`` staged into the engine: pause (the
            configured ``pause_mode``), each worker's commit (in place: copy staging into the live parameters;
            reload mode: vLLM's layerwise reload fed from staging), resume. Every trainer rank calls it (the
            commit ends with the update's vote). Refused, before any engine call, without a complete staged
            update; a commit that fails part way leaves the weights torn and the engine paused, as a failed
            update does, and raises naming it. After ``send_weights(background=True)`` it first joins that send
            (bounded by 3x the group's timeout, each of its steps by the timeout itself) and raises its error
            (the engine untouched, serving its old weights); ``last_update["stage"]`` is then the send's."""
            self.session.commit()

        def shutdown(self) -> None:
            if self.session is not None:  # a background send in flight: joined within the group's timeout
                self.session.close()
            if self.group is not None:
                group, self.group = self.group, None
                group.destroy()
