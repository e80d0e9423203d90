"""The receive modes (integration kit): an engine rank writes its live parameters in place, or, where the engine
rewrites its weights after loading (its kernels read packed copies, not what its loader writes), hands the
checkpoint's tensors to the engine's own reload, which re-runs the post-processing.

* :func:`rendezvous_modes`: the kit's rendezvous (:func:`~.engine.exchange_layouts`) where every engine rank
  shares its load record and its mode (in reload mode a record in the checkpoint's coordinates,
  :func:`~.record.staging_record`); one rank in reload mode puts the whole refit in it; a rank's refusal reaches
  every member, by name, before a byte moves.
* :func:`pick_mode`: ``"auto"`` / ``"inplace"`` / ``"reload"`` from what the engine rewrote.
* :func:`rewritten` / :func:`load_format_params`: the parameters whose live tensor is not what the loader writes
  (against the engine's record of its load format), and those put back in the load format while the loader is
  recorded.

The engine's own records and reload stay in its plug-in (vLLM's: :mod:`.vllm_transfer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch

from ..comm.group import RefitGroup
from ..layout import Layout
from .engine import exchange_layouts, plan_pair
from .record import LoadRecord, layout_from_records, staging_record
from .session import MODES

__all__ = ["load_format_params", "pick_mode", "rendezvous_modes", "rewritten"]


def rendezvous_modes(group: RefitGroup, trainer_part: tuple | None,
                     record: Callable[[dict], tuple[LoadRecord, str]] | None, cache: dict | None = None,
                     key: tuple = ()) -> tuple[Layout, Layout, str]:
    """Trainer rank 0 shares ``trainer_part`` (its layout first); each engine rank ``record(shapes)``: its load
    record of the checkpoint ``{name: shape}`` and its receive mode (trainer ranks: ``record=None``). Returns
    ``(src, dst, mode)`` on every rank. ``cache``: a rank's earlier parts by ``key`` and the shapes (a re-init
    after a failed update may find the model mid-reload, where recording again would see the wrong tensors)."""

    def engine_part(first: tuple) -> object:
        shapes = {t.name: t.shape for t in first[0].tensors}
        k = (*key, tuple(sorted((n, tuple(v)) for n, v in shapes.items())))
        if cache is not None and k in cache:
            return cache[k]
        if record is None:
            return None
        try:
            rec, m = record(shapes)
            rec.raise_on_problems()
            part = (staging_record(rec) if m == "reload" else rec, m)
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
            return ("error", f"{type(e).__name__}: {e}")  # every member learns why, nobody waits for a timeout
        if cache is not None:
            cache[k] = part
        return part

    (src_layout,), got = exchange_layouts(group, trainer_part, engine_part)
    errors = [r[1] for r in got if r[0] == "error"]
    if errors:
        raise RuntimeError(f"rank {group.rank}: the refit group's rendezvous was refused by the engine workers: "
                           + " | ".join(errors))
    mode = "reload" if "reload" in {m for _, m in got} else "inplace"
    src, dst = plan_pair(group, src_layout, layout_from_records([r for r, _ in got]))
    return src, dst, mode


def pick_mode(mode: str, who: str, rewritten: Callable[[], list[str]], reload: Callable[[], bool],
              needs: str) -> str:
    """An engine rank's receive mode: ``"auto"`` reloads when the engine rewrote some parameters after loading
    (``rewritten()``, their names), else in place. Refused, naming ``who`` and the parameters, before any byte
    moves: a forced ``"inplace"`` on such a model; ``"reload"`` where the engine has no reload
    (``reload()`` false; ``needs`` names what it lacks)."""
    if mode not in MODES:
        raise ValueError(f"{who}: mode must be one of {MODES}, got {mode!r}")
    if mode == "reload":
        if not reload():
            raise ValueError(f"{who}: mode 'reload' needs {needs}, not found")
        return mode
    bad = rewritten()
    if mode == "inplace" and bad:
        raise ValueError(f"{who}: mode 'inplace' cannot reach the kernels: the engine "
                         f"rewrote {len(bad)} parameters after loading ({bad[:4]}{' ...' if len(bad) > 4 else ''}); "
                         "use mode 'reload' (or 'auto')")
    return "reload" if bad else "inplace"


def rewritten(model: torch.nn.Module, layer_metas: Iterable[tuple[torch.nn.Module, dict]],
              packed: Callable[[torch.nn.Module, str], bool]) -> list[tuple[str, torch.nn.Module, str, object]]:
    """``(name, module, parameter name, load-format meta)`` of every parameter of ``layer_metas`` (the engine's
    record of its load format: ``(module, {parameter name: meta tensor})``) whose live tensor is gone or differs in
    shape or dtype from it, or whose kernel reads a packed copy instead (``packed(module, parameter name)``)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for m, metas in layer_metas:
        for pn, meta in metas.items():
            cur = m._parameters.get(pn)
            if packed(m, pn) or cur is None or tuple(cur.shape) != tuple(meta.shape) or cur.dtype != meta.dtype:
                prefix = names.get(id(m), "")
                out.append((f"{prefix}.{pn}" if prefix else pn, m, pn, meta))
    return out


@contextlib.contextmanager
def load_format_params(params: Iterable[tuple[torch.nn.Module, str, Callable[[], torch.Tensor]]]):
    """Within: each ``module._parameters[name]`` of ``params`` is ``make()`` (a fresh tensor in the load format,
    so that recording the loader sees what it writes into); the engine's own tensors are put back on exit."""
    saved = []
    try:
        for m, pn, make in params:
            t = make()
            saved.append((m, pn, m._parameters.get(pn)))
            m._parameters[pn] = t
        yield
    finally:
        for m, pn, old in reversed(saved):
            if old is None:
                del m._parameters[pn]
            else:
                m._parameters[pn] = old
