"""SGLang: layouts read off its own loader, and a refit plug-in that needs no fork of SGLang.

:func:`layout_from_sglang` records the live model's ``load_weights`` (see :mod:`.record`): the layout of
whatever SGLang release and architecture the engine runs, preset or not.

**The plug-in.** SGLang (0.5.23) has no weight-transfer registry like vLLM's, but it has two extension points,
and the plug-in uses both:

* ``--custom-weight-loader triton_reshard.integrations.sglang.receive_weights`` (the one setting): SGLang's
  ``update_weights_from_tensor(named_tensors, load_format=LOAD_FORMAT)`` then calls
  :func:`receive_weights` ``(model, named_tensors)`` on every engine rank, inside the weight-update session
  the trainer opened with ``begin_weight_update()`` (closed by ``end_weight_update()``);
* our ``sglang.srt.plugins`` entry point (:func:`register`, run by SGLang's ``load_plugins()`` in every
  process) adds an AROUND hook on SGLang's ``WeightUpdater.update_weights_from_tensor`` through its
  ``HookRegistry``, so that ``load_format=LOAD_FORMAT`` reaches :func:`receive_weights` even where
  ``--custom-weight-loader`` was not given (with the plug-in installed, no setting at all).

The ``named_tensors`` SGLang passes carry no weights: one small uint8 tensor named :data:`CONTROL` holding a
JSON message from the trainer (never a pickle): ``{"op": "init", "group": {...}}`` once, then ``{"op":
"refit", "version": v}`` every step (``"verify"`` and ``"close"`` too). On ``init`` each engine rank joins the
refit group as ``rank_offset + tp_rank`` (:func:`~triton_reshard.init_refit_group`, every option through
:func:`group_options`), records its own loader and plans with the trainer's layout; on ``refit`` it receives
exactly its own boxes straight into ``model.named_parameters()`` (in place, no staging copy of the model),
from the trainer ranks that hold them. :class:`SGLangTrainer` is the trainer side: a layout, the local
tensors, ``send_weights(version=...)``, as for vLLM.

Refused, with one line naming what, before any byte moves: attention data parallelism, pipeline parallelism,
quantized models (their kernels may repack weights after loading), and a layout the trainer expects
(``expect=``, e.g. :func:`~triton_reshard.presets.sglang_layout`) that differs from what this SGLang's loader
does (naming the first tensor that differs). Versions: ``refit(..., version=v)`` on every rank, so
:func:`sglang_refit_state` gives the last version fully written and whether a failed refit left the weights
torn (see :class:`~triton_reshard.RefitState`).

:func:`load_sglang_model` builds SGLang's model class for a checkpoint and loads it with SGLang's own loader
on this rank of a torch.distributed world (one process per TP rank, gloo works): SGLang's ``Engine`` does not
run on CPU, its model classes, loaders and ``WeightUpdater`` do (../shared/FACTS.md).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import wire
from ..comm.group import RefitGroup
from ..comm.secret import ResolvedSecret, secret_from
from ..execute.options import DEFAULT_BUCKET_BYTES
from ..layout import Layout
from ..refit import RefitState, refit, refit_state, verify_refit
from .engine import delta_options, exchange_layouts, join_group, message_tensors, plan_pair, tensor_message
from .record import LoadRecord, checkpoint_shapes, layout_from_records, record_load
from .sglang_stage import before_full_refit, commit, stage
from .stage import Staging, beside

LOAD_FORMAT = "triton_reshard.integrations.sglang.receive_weights"  # --custom-weight-loader / load_format
CONTROL = "triton_reshard.control"  # the name of the one tensor SGLang passes to receive_weights
OPS = ("init", "refit", "verify", "close", "stage", "commit")  # the control messages' ops
HOOK_TARGET = ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
               "update_weights_from_tensor")


# ---------------------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------------------

def record_sglang(model, checkpoint: str | Mapping[str, Sequence[int]], rank: int) -> LoadRecord:
    """This rank's :class:`LoadRecord` of SGLang's ``model.load_weights`` (``checkpoint``: a safetensors
    directory or ``{name: shape}``); nothing is written into the model."""
    shapes = checkpoint_shapes(checkpoint) if isinstance(checkpoint, str) else checkpoint
    return record_load(dict(model.named_parameters()), model.load_weights, shapes, rank)


def layout_from_sglang(model, checkpoint: str | Mapping[str, Sequence[int]], *,
                       group: dist.ProcessGroup | None = None, rank: int | None = None) -> Layout:
    """The destination layout of an SGLang deployment, read off every TP rank's live ``model``.

    Call on every rank of ``group`` (default: the world; ranks with no model pass ``None``). Each rank records
    its own loader, the records are all-gathered, so every rank returns the same Layout. Raises, naming the
    parameter and rank, if a loader write is not a box copy of a checkpoint tensor (fail closed)."""
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    rec = None if model is None else record_sglang(model, checkpoint, rank)
    if rec is not None:
        rec.raise_on_problems()
    recs = wire.all_gather_data(rec, group, "load record")  # data only: nothing a peer sends is unpickled
    return layout_from_records(r for r in recs if r is not None)


def layout_difference(expected: Layout, actual: Layout) -> str | None:
    """None when the layouts are equal, else one line naming the first local tensor (or logical tensor)
    whose placement differs."""
    if expected.digest == actual.digest:
        return None
    ea, aa = {(s.rank, s.name): s for s in expected.locals}, {(s.rank, s.name): s for s in actual.locals}
    for key in sorted(set(ea) | set(aa)):
        if key not in aa:
            return f"rank {key[0]}: {key[1]!r} is in the expected layout, but this SGLang's loader has no such parameter"
        if key not in ea:
            return f"rank {key[0]}: this SGLang's loader writes {key[1]!r}, which the expected layout does not have"
        if (ea[key].shape, ea[key].dtype) != (aa[key].shape, aa[key].dtype):
            return (f"rank {key[0]}: {key[1]!r} is {tuple(aa[key].shape)} {aa[key].dtype} in this SGLang, "
                    f"{tuple(ea[key].shape)} {ea[key].dtype} in the expected layout")
    fe, fa = set(expected.fragments), set(actual.fragments)
    diff = sorted(fe ^ fa, key=lambda f: (f.local, f.rank, f.tensor))
    if diff:
        f = diff[0]
        return (f"rank {f.rank}: {f.local!r} holds a different box of {f.tensor!r} in this SGLang than in the "
                f"expected layout")
    te, ta = {t.name: t for t in expected.tensors}, {t.name: t for t in actual.tensors}
    for n in sorted(set(te) | set(ta)):
        if te.get(n) != ta.get(n):
            return f"logical tensor {n!r} differs (shape or dtype) between the expected layout and this SGLang"
    return "the layouts differ (digest)"


# ---------------------------------------------------------------------------------------------------------
# SGLang's own components on this rank
# ---------------------------------------------------------------------------------------------------------

def _cpu_setup() -> None:
    """What SGLang 0.5.23 needs on a CPU-only host (FACTS.md): no pynccl on the CUDA torch wheel's libnccl,
    and the torch-native rotary embedding."""
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    if not torch.cuda.is_available():
        import sglang.srt.layers.rotary_embedding.base as rope

        rope._is_cpu = True


def init_sglang_parallel(tp: int, ep: int = 1, **server_args):
    """Initialise SGLang's parallel groups for TP ``tp`` / EP ``ep`` on this rank of the initialised
    torch.distributed world (of ``tp`` ranks); callable again to switch sizes (the old groups are destroyed).
    Returns the published ``ServerArgs`` fields (``server_args`` go to ``ServerArgs``)."""
    _cpu_setup()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    rank, world = dist.get_rank(), dist.get_world_size()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    world_group = ps._WORLD
    reset_context()
    sa = ServerArgs(model_path=server_args.pop("model_path", "dummy"), tp_size=tp, ep_size=ep, device="cpu",
                    **server_args)
    publish(sa, role="test", ranks=SpawnRanks(world_rank=rank))
    if world_group is None:
        ps.init_distributed_environment(world, rank, "env://", rank, backend="gloo")
    else:
        get_parallel().override_permanently(world_group=world_group)
    ps.set_custom_all_reduce(False)
    ps.initialize_model_parallel(backend="gloo")
    initialize_dp_attention(server_args=sa)
    return sa


def load_sglang_model(checkpoint_dir: str, *, tp: int, ep: int = 1, dtype: str = "float32", **server_args):
    """SGLang's model for ``checkpoint_dir``, built and loaded by SGLang's own ``get_model`` (its
    ``DefaultModelLoader`` runs ``load_weights`` on the checkpoint) on this rank. Returns ``(model,
    model_config, server_args)``."""
    sa = init_sglang_parallel(tp, ep, model_path=checkpoint_dir, dtype=dtype, **server_args)
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    mc = ModelConfig.from_server_args(sa)
    model = get_model(model_config=mc, load_config=LoadConfig(load_format="auto"), device_config=DeviceConfig("cpu"))
    return model, mc, sa


def sglang_weight_updater(model, model_config, *, custom_weight_loaders: Sequence[str] = (LOAD_FORMAT,)):
    """SGLang's own ``WeightUpdater`` (what its ``ModelRunner`` holds) over ``model`` on this rank, with
    ``--custom-weight-loader`` = ``custom_weight_loaders``."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_parallel

    def nothing(*_a, **_k):
        return None

    return WeightUpdater(tp_rank=get_parallel().tp_rank, device="cpu", gpu_id=0, model_config=model_config,
                         custom_weight_loaders=list(custom_weight_loaders), get_model=lambda: model,
                         update_model_fields=nothing, recapture_cuda_graph=nothing, get_model_runner=nothing)


def unsupported(model) -> str | None:
    """One line naming a configuration of this rank the plug-in does not cover, or None."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    for what, size in (("attention data parallelism (enable_dp_attention, dp_size > 1)", "attn_dp_size"),
                       ("pipeline parallelism (pp_size > 1)", "pp_size"),
                       ("attention context parallelism", "attn_cp_size")):
        n = getattr(par, size, 1) or 1
        if n > 1:
            return f"triton_reshard SGLang plug-in: {what} is not supported ({size}={n})"
    quant = getattr(model, "quant_config", None)
    if quant is None:
        quant = getattr(getattr(model, "config", None), "quantization_config", None)
    if quant is not None:
        name = quant.get_name() if hasattr(quant, "get_name") else (
            quant.get("quant_method") if isinstance(quant, Mapping) else type(quant).__name__)
        return (f"triton_reshard SGLang plug-in: quantized model ({name}) is not supported: its kernels may repack "
                f"the weights after loading")
    return None


# ---------------------------------------------------------------------------------------------------------
# the engine side: SGLang calls receive_weights(model, named_tensors)
# ---------------------------------------------------------------------------------------------------------

def encode_control(msg: Mapping) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` to pass to SGLang's ``update_weights_from_tensor`` for one control message."""
    return message_tensors(CONTROL, msg)


def decode_control(named_tensors) -> dict:
    _, msg = tensor_message(named_tensors, CONTROL, what=f"load_format={LOAD_FORMAT!r}")
    if not isinstance(msg, dict) or msg.get("op") not in OPS:
        raise ValueError(f"{CONTROL!r}: unknown control message {str(msg)[:120]!r}")
    return msg


def group_options(g: Mapping) -> dict:
    """The keyword arguments of :func:`~triton_reshard.init_refit_group` from the ``group`` part of an init
    message: every group option passes through here (host, port, world size, backend, timeout, and how to
    find the group's secret: ``secret_env`` names an environment variable, ``secret_file`` a file)."""
    opts = dict(host=str(g["host"]), port=int(g["port"]), world_size=int(g["world_size"]),
                backend=g.get("backend"), timeout=float(g.get("timeout", 300.0)))
    env, file = g.get("secret_env"), g.get("secret_file")
    if env and file is None and os.environ.get(str(env)) is None:
        raise ValueError(f"refit group: the secret's environment variable {env!r} is not set")
    secret = secret_from(str(env) if env else None, file, where="SGLang refit group")
    if secret is not None:  # else init_refit_group's own default: TRITON_RESHARD_SECRET(_FILE), or loopback only
        opts["secret"] = ResolvedSecret(secret)  # looked up here, not again by the group
    if g.get("insecure") is not None:
        opts["insecure"] = bool(g["insecure"])
    return opts


def _join(opts: dict, rank: int) -> RefitGroup:
    o = dict(opts)
    return join_group(o.pop("host"), o.pop("port"), rank, o.pop("world_size"), secret_env=None, **o)


@dataclass
class _EngineState:
    group: RefitGroup
    src_layout: Layout
    dst_layout: Layout
    timeout: float
    bucket_bytes: int
    last_report: object = None
    reports: list = field(default_factory=list)
    # stage, then commit (issue 45): this rank's private staging mirror (the kit's Staging: 1x its shard, kept
    # between updates so a delta patches it; the staged version once every rank staged it; the background
    # receive), and what the live parameters hold while the mirror runs ahead of them (refit_state describes the
    # mirror then)
    staging: Staging | None = None
    live: RefitState | None = None


_ENGINES: dict[int, _EngineState] = {}  # id(model) -> state, in this engine process


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def receive_weights(model, named_tensors) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader`` :data:`LOAD_FORMAT`): runs the trainer's
    control message on this engine rank (see the module docstring)."""
    msg = decode_control(named_tensors)
    op = msg["op"]
    st = _ENGINES.get(id(model))
    if op == "init":
        if st is not None:
            st.group.destroy()
            del _ENGINES[id(model)]
        g = msg["group"]
        opts = group_options(g)
        rank = int(g["rank_offset"]) + _tp_rank()
        group = _join(opts, rank)  # joined even to refuse: the trainer ranks then hear why, instead of timing out
        try:
            src, dst = _rendezvous(group, None, model, rank, refusal=unsupported(model))
        except BaseException:
            group.destroy()
            raise
        _ENGINES[id(model)] = _EngineState(group, src, dst, opts["timeout"], int(g.get("bucket_bytes", DEFAULT_BUCKET_BYTES)))
        return
    if st is None:
        raise RuntimeError(f"triton_reshard SGLang plug-in: {op!r} before 'init' on TP rank {_tp_rank()}")
    if op == "close":
        st.group.destroy()
        del _ENGINES[id(model)]
        return
    if op == "stage":
        return stage(st, msg)
    params = dict(model.named_parameters())
    if op == "commit":
        return commit(st, model, params, msg)
    if op == "refit":
        from sglang.srt.model_loader.loader import post_load_weights

        before_full_refit(st)
        st.last_report = refit({}, params, st.src_layout, st.dst_layout, group=st.group, timeout=st.timeout,
                               bucket_bytes=st.bucket_bytes, version=msg.get("version"), delta=msg.get("delta", False))
        # what the model's own load_weights does after loading (e.g. DeepSeek's MLA w_kc / w_vc from kv_b_proj);
        # SGLang's end_weight_update skips it once a load ran
        post_load_weights(model)
    else:  # verify: nothing written
        st.last_report = verify_refit({}, params, st.src_layout, st.dst_layout, group=st.group, timeout=st.timeout,
                                      bucket_bytes=st.bucket_bytes)
    st.reports.append(st.last_report)


def engine_state(model) -> _EngineState | None:
    """The plug-in's state for ``model`` in this process (its refit group, layouts, last report), or None."""
    return _ENGINES.get(id(model))


def sglang_refit_state(model) -> RefitState:
    """The last version fully written into ``model`` on this rank, and whether a failed refit left it torn
    (:func:`~triton_reshard.refit_state` of the plug-in's destination layout)."""
    st = _ENGINES.get(id(model))
    if st is None:
        return RefitState()
    return st.live if st.live is not None else refit_state(st.dst_layout)


def _rendezvous(group: RefitGroup, trainer_part: tuple | None, model, rank: int,
                refusal: str | None = None) -> tuple[Layout, Layout]:
    """The kit's rendezvous (:func:`~.engine.exchange_layouts`): trainer rank 0 shares its layout (and the
    engine layout it expects, if any); the engine ranks share their load records (or why they refuse:
    ``refusal``, one line); every rank plans the same reshard, or raises the same refusal, before any weight
    byte moves."""

    def engine_part(first: tuple) -> object:
        if refusal is not None:
            return ("refused", refusal)
        if model is None:
            return None
        rec = record_sglang(model, {t.name: t.shape for t in first[0].tensors}, rank)
        return ("problems", f"rank {rank}: " + "; ".join(rec.problems[:4])) if rec.problems else rec

    (src_layout, expected), gathered = exchange_layouts(group, trainer_part, engine_part)
    for kind, why in (e for e in gathered if isinstance(e, tuple)):
        if kind == "refused":
            raise NotImplementedError(why)
        raise ValueError(f"SGLang's loader wrote parameters in ways that are not box copies of checkpoint "
                         f"tensors, so no layout is derived: {why}")
    dst_layout = layout_from_records(gathered)
    if expected is not None:
        why = layout_difference(expected, dst_layout)
        if why is not None:
            raise ValueError(f"rank {group.rank}: this SGLang's layout differs from the expected one "
                             f"(digest {dst_layout.digest} != {expected.digest}): {why}")
    return plan_pair(group, src_layout, dst_layout)


# ---------------------------------------------------------------------------------------------------------
# the trainer side
# ---------------------------------------------------------------------------------------------------------

class SGLangTrainer:
    """The trainer side of the plug-in, on every trainer rank (refit-group ranks ``0..num_trainer_ranks-1``).

    ``engine``: on trainer rank 0, a handle with SGLang's weight-update API (``sglang.Engine``, its
    ``HttpServerEngineAdapter``, or any client with ``begin_weight_update()``,
    ``update_weights_from_tensor(named_tensors, load_format=...)``, ``end_weight_update()``); None on the
    other trainer ranks. ``layout``: the trainer's layout (the same on every trainer rank). ``expect``: an
    engine layout to insist on, on the refit group's ranks (e.g. ``sglang_layout(cfg, tp=4,
    ranks=num_trainer_ranks)``): every rank refuses, naming the tensor, if the engine's loader differs. ``secret_env`` / ``secret_file``: where every rank finds the refit group's secret."""

    def __init__(self, layout: Layout, *, rank: int, num_trainer_ranks: int, num_engine_ranks: int, host: str,
                 port: int, engine=None, timeout: float = 300.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 backend: str | None = None, expect: Layout | None = None, secret_env: str | None = None,
                 secret_file: str | None = None):
        if (engine is None) == (rank == 0):
            raise ValueError("SGLangTrainer: trainer rank 0 (and only it) passes the engine handle")
        self.rank, self.engine, self.timeout, self.bucket_bytes = rank, engine, timeout, bucket_bytes
        g = dict(host=host, port=port, world_size=num_trainer_ranks + num_engine_ranks, backend=backend,
                 timeout=timeout, rank_offset=num_trainer_ranks, bucket_bytes=bucket_bytes,
                 secret_env=secret_env, secret_file=secret_file)
        self.group = None
        call = self._post({"op": "init", "group": g}) if rank == 0 else None
        try:
            self.group = _join(group_options(g), rank)
            part = (layout, expect) if rank == 0 else None
            self.src_layout, self.dst_layout = _rendezvous(self.group, part, None, rank)
        except BaseException as e:
            if self.group is not None:
                self.group.destroy()
            if call is not None:
                call.join(timeout, quiet=True)
                if call.error is not None and not isinstance(e, (ValueError, NotImplementedError)):
                    # the engine's own reason (it never joined, say), with this rank's beside it
                    call.error.add_note(f"trainer rank {rank}: {type(e).__name__}: {e}")
                    raise call.error from e
            raise
        if call is not None:
            call.join(timeout)
        self.last_report = None

    def _post(self, msg: Mapping) -> _Session:
        return _Session(self.engine, msg, self.timeout)

    _staged: dict | None = None  # a completed send_weights(overlap=True) not yet committed

    def send_weights(self, tensors: Mapping[str, torch.Tensor], version=None, delta: bool | str = False,
                     overlap: bool = False):
        """One refit: every trainer rank passes its local tensors (named as in the trainer layout); rank 0 also
        drives the engine (``begin_weight_update``, ``update_weights_from_tensor``, ``end_weight_update``).
        ``version`` (e.g. the step) is recorded on every engine rank (:func:`sglang_refit_state`).
        ``delta=True`` (or ``"strict"``; an int ``version``): only the changed elements travel after the first
        refit (docs/delta.md); the engine ranks apply them in place to the live parameters; each trainer
        rank's cached Resharder keeps a snapshot of the bytes it sends (``last_report.mode`` says which ran).

        ``overlap=True``: stage, then commit (issue 45). The engine ranks receive into a private staging mirror
        (1x their shard) in a background thread while SGLang serves its live weights; this returns once every
        rank of the refit group staged (the vote); :meth:`commit` later copies the staged boxes in. A failed
        staged update leaves the live weights untouched (raised here, nothing committed)."""
        delta_options(version, delta)  # refused here, before the engine's update session opens (issue 42)
        self._staged = None  # a new update supersedes a staged one not committed
        if overlap:
            return self._stage(tensors, version, delta)
        call = self._post({"op": "refit", "version": version, "delta": delta}) if self.rank == 0 else None
        try:
            self.last_report = refit(tensors, {}, self.src_layout, self.dst_layout, group=self.group,
                                     timeout=self.timeout, bucket_bytes=self.bucket_bytes, version=version,
                                     delta=delta)
        finally:
            if call is not None:
                call.join(self.timeout)
        return self.last_report

    def _stage(self, tensors: Mapping[str, torch.Tensor], version, delta):
        if self.rank == 0:  # the engine's session only starts its ranks' receive threads: its answer comes first
            self._post({"op": "stage", "version": version, "delta": delta}).join(self.timeout)

        def part():
            self.last_report = refit(tensors, {}, self.src_layout, self.dst_layout, group=self.group,
                                     timeout=self.timeout, bucket_bytes=self.bucket_bytes, version=version,
                                     delta=delta)

        _, err, bad = beside(self.group, part, None, self.timeout, f"trainer rank {self.rank}")
        if err is not None or bad:
            reason = f"{type(err).__name__}: {err}" if err is not None else f"rank(s) {bad} failed their part"
            raise RuntimeError(
                f"triton_reshard trainer rank {self.rank}: the staged update to version {version!r} failed "
                f"({reason}); nothing was committed: the engine serves its weights as before (staging is private); "
                "build a new SGLangTrainer if the refit group broke, then send_weights again") from err
        self._staged = {"version": version}
        return self.last_report

    def commit(self) -> None:
        """Copy the weights a completed ``send_weights(..., overlap=True)`` staged into the engine's live
        parameters: one SGLang weight-update call (between two scheduler steps; requests in flight continue on
        the new weights after it: pause the engine around it, SGLang's ``pause_generation``, where every request
        must see one version). Every trainer rank calls it (it ends with the update's vote). Refused, before any
        engine call, without a complete staged update."""
        if self._staged is None:
            raise RuntimeError(f"triton_reshard trainer rank {self.rank}: commit refused: no complete staged update "
                               "(send_weights(..., overlap=True) first; a failed one cannot be committed)")
        version, self._staged = self._staged["version"], None
        call = self._post({"op": "commit", "version": version}) if self.rank == 0 else None
        _, err, bad = beside(self.group, lambda: None, call, self.timeout, f"trainer rank {self.rank}: commit")
        if err is not None or bad:
            reason = f"{type(err).__name__}: {err}" if err is not None else f"rank(s) {bad} refused or failed it"
            raise RuntimeError(f"triton_reshard trainer rank {self.rank}: the commit of version {version!r} failed "
                               f"({reason}); an engine rank that failed part way holds torn weights: send_weights "
                               "again") from err

    def verify(self, tensors: Mapping[str, torch.Tensor]):
        """``verify_refit`` against the engine's live parameters (nothing written); the report."""
        call = self._post({"op": "verify"}) if self.rank == 0 else None
        try:
            self.last_report = verify_refit(tensors, {}, self.src_layout, self.dst_layout, group=self.group,
                                            timeout=self.timeout, bucket_bytes=self.bucket_bytes)
        finally:
            if call is not None:
                call.join(self.timeout)
        return self.last_report

    def shutdown(self) -> None:
        if self.rank == 0 and self.engine is not None:
            self._post({"op": "close"}).join(self.timeout)
        if self.group is not None:
            self.group.destroy()
            self.group = None


class _Session:
    """SGLang's weight-update session for one control message, in a thread (its calls return only once the
    engine ranks ran their side, which needs the trainer ranks' side running at the same time)."""

    def __init__(self, engine, msg: Mapping, timeout: float):
        self.error: BaseException | None = None

        def run():
            try:
                _check(engine.begin_weight_update(), "begin_weight_update")
                try:
                    _check(engine.update_weights_from_tensor(named_tensors=encode_control(msg),
                                                             load_format=LOAD_FORMAT), "update_weights_from_tensor")
                finally:
                    _check(engine.end_weight_update(), "end_weight_update")
            except BaseException as e:  # noqa: BLE001 (re-raised in join)
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float, quiet: bool = False) -> None:
        self.thread.join(timeout)
        if quiet:
            return
        if self.thread.is_alive():
            raise TimeoutError(f"the SGLang engine's weight-update call did not return within {timeout:g}s")
        if self.error is not None:
            raise self.error


def _check(result, what: str) -> None:
    """SGLang's update calls return ``(success, message)`` (or a dict / None); a failure raises."""
    if isinstance(result, tuple) and len(result) >= 2 and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1]}")
    if isinstance(result, Mapping) and result.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {result.get('message')}")


# ---------------------------------------------------------------------------------------------------------
# SGLang's plugin entry point
# ---------------------------------------------------------------------------------------------------------

def _route_load_format(original, self, named_tensors, load_format=None, *args, **kwargs):
    """AROUND ``WeightUpdater.update_weights_from_tensor``: ``load_format=LOAD_FORMAT`` is ours even when
    ``--custom-weight-loader`` does not list it (SGLang then runs its own code for everything else)."""
    if load_format == LOAD_FORMAT and LOAD_FORMAT not in self.custom_weight_loaders:
        receive_weights(self.get_model(), named_tensors)
        return True, "Success"
    return original(self, named_tensors, load_format, *args, **kwargs)


def register() -> None:
    """SGLang's general-plugin hook (entry point ``sglang.srt.plugins``: ``triton_reshard``), run by its
    ``load_plugins()`` in every process before ``HookRegistry.apply_hooks()``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is _route_load_format for _t, h, _s in HookRegistry._hooks.get(HOOK_TARGET, ())):
        HookRegistry.register(HOOK_TARGET, _route_load_format, HookType.AROUND)
