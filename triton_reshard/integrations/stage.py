"""The kit's two sides of one update (the rest of the kit: :mod:`.engine`, :mod:`.record`).

What a plug-in's ranks do the same way whatever the engine:

* :class:`Staging`: its private staging mirror (stage, then commit): this rank's boxes, allocated once and kept
  between updates so a delta patches it, received into by a background thread while the engine serves, copied
  into the live tensors at the commit, dropped (``refit``'s fence told) when it goes stale.
* :func:`voted` (an engine rank) / :func:`beside` (a trainer rank, next to the engine's control-plane call): this
  rank's part of an update, then the update's vote (:func:`~.engine.vote`), errors returned, not raised.
* :class:`Receiver`: the refits of an update into this rank's tensors, timed into the update's stats, whole or
  one layer group at a time (:func:`~.engine.received_groups`).
* :func:`refuse_forward` / :class:`TornWeightsError` / :func:`forward_refused` / :class:`TornState`: a rank whose
  update failed part way refuses every forward of its model until a later update completes.

Used by the vLLM plug-in (:mod:`.vllm_worker`, :mod:`.vllm_trainer`) and SGLang's (:mod:`.sglang`,
:mod:`.sglang_stage`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from ..comm.group import RefitGroup
from ..layout import Layout
from ..refit import forget_refit_state, refit
from .engine import ControlCall, background, box_bytes, copy_boxes, rank_buffers, received_groups, vote

__all__ = ["Receiver", "Staging", "TornState", "TornWeightsError", "beside", "forward_refused", "log_warning", "refuse_forward",
           "voted"]


def log_warning(msg: str) -> None:
    logging.getLogger("triton_reshard").warning(msg)


class Staging:
    """A rank's private staging mirror of its boxes in ``layout``. ``tensors``: the mirror (1x this rank's shard;
    None until :meth:`mirror`); ``staged``: ``{"version": ...}`` once a staged update is complete in it and not
    yet committed; ``thread``: the background receive; ``error``: why the last one failed."""

    def __init__(self, layout: Layout, rank: int, parts: list[Layout] | None = None):
        self.layout, self.rank = layout, rank
        self.parts = parts or [layout]  # the destination layouts the refits into the mirror use (layer groups)
        self.tensors: dict[str, torch.Tensor] | None = None
        self.staged: dict | None = None
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def drop(self) -> None:
        """Forget the mirror and what it staged, and tell ``refit``'s fence: a delta into a new mirror runs dense
        (a delta onto fresh, unwritten staging would load garbage)."""
        self.tensors = self.staged = None
        for part in self.parts:
            forget_refit_state(part)

    def mirror(self, stats: dict | None = None) -> dict[str, torch.Tensor]:
        """The mirror, allocated (timed into ``stats["alloc_s"]``) if there is none: a fresh one is dropped first."""
        if self.tensors is None:
            self.drop()
            t0 = time.perf_counter()
            self.tensors = rank_buffers(self.layout, self.rank)
            if stats is not None:
                stats["alloc_s"] += time.perf_counter() - t0
        return self.tensors

    def nbytes(self) -> int:
        """The bytes of the boxes the mirror holds."""
        return box_bytes(self.tensors, self.layout, self.rank)

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def start(self, fn: Callable, *args, who: str, name: str, nice: int | None = None) -> None:
        """Run ``fn(*args)`` (a staged receive, ending with its vote) in a background thread (``nice``: its CPU
        priority, :func:`~.engine.background`); refused, naming ``who``, while the last one still runs."""
        if self.busy():
            raise RuntimeError(f"{who}: a staged receive is still running")
        self.staged = self.error = None
        self.thread = background(fn, *args, name=name, nice=nice)

    def commit(self, live: Mapping[str, torch.Tensor]) -> None:
        """Copy every staged box into ``live`` (the commit); the mirror stays (it holds the live version now, and
        a delta patches it)."""
        copy_boxes(live, self.tensors, self.layout, self.rank)
        self.staged = None


def voted(group: RefitGroup, part: Callable[[], object], timeout: float, what: str,
          staged: bool = False) -> BaseException | None:
    """Run this rank's part of an update (an ``Exception`` it raises is this rank's failure), then the update's
    vote: returns the first error, or one naming the ranks that said their part failed, or None."""
    err: BaseException | None = None
    try:
        part()
    except Exception as e:  # noqa: BLE001 (voted, then returned)
        err = e
    err, bad = vote(group, err, timeout, what)
    if err is None and bad:
        err = RuntimeError(f"rank(s) {bad} of the refit group failed their part of this "
                           f"{'staged ' if staged else ''}update")
    return err


def beside(group: RefitGroup, part: Callable[[], object], call: ControlCall | None, timeout: float, what: str,
           lap: Callable[[str], None] | None = None) -> tuple[object, BaseException | None, list[int]]:
    """A trainer rank's part of an update (``part()``) while the engine's control-plane call ``call`` (or None)
    runs its side, then the update's vote, then the call's answer (``lap``: called with ``"send_s"`` after the vote
    and ``"wait_workers_s"`` after the answer). Returns ``(part's result, the first error, the ranks that said
    their part failed)``; nothing is raised."""
    res, err = None, None
    try:
        res = part()
    except BaseException as e:  # noqa: BLE001 (returned, after the vote and the engine's answer)
        err = e
    err, bad = vote(group, err, timeout, what)
    if lap is not None:
        lap("send_s")
    if call is not None:
        try:
            call.join(timeout)
        except BaseException as e:  # noqa: BLE001 (the first error wins)
            err = err or e
    if lap is not None:
        lap("wait_workers_s")
    return res, err, bad


class Receiver:
    """An engine rank's refits (``refit`` with an empty source) into its tensors, timed into ``stats``, the
    update's record: ``refit_s``, ``unpack_s``, ``recv_bytes``, ``delta_mode``, ``alloc_s`` and the most staging
    held at once, ``staging_bytes``. ``last_report``: the last refit's report."""

    def __init__(self, group: RefitGroup, **refit_kw):
        self.group, self.kw = group, refit_kw
        self.stats: dict = {}
        self.last_report = None

    def refit(self, dst: dict, src: Layout, dst_layout: Layout, **kw):
        t0 = time.perf_counter()
        self.last_report = rep = refit({}, dst, src, dst_layout, group=self.group, **self.kw, **kw)
        s = self.stats
        s["refit_s"] += time.perf_counter() - t0
        s["unpack_s"] += rep.unpack_seconds
        s["recv_bytes"] += rep.recv_bytes
        s["delta_mode"] = rep.mode
        return rep

    def groups(self, groups: list, prefetch: bool, **kw):
        """``(name, tensor)`` of every group of ``groups`` (``(names, src, dst)``, an update's layer groups), each
        received into fresh staging, then yielded (with ``prefetch`` staging holds two groups)."""
        s, rank, held = self.stats, self.group.rank, [0]
        s["groups"], s["prefetch"] = len(groups), bool(prefetch)

        def receive(src, dst):
            t0 = time.perf_counter()
            mine = rank_buffers(dst, rank)
            s["alloc_s"] += time.perf_counter() - t0
            self.refit(mine, src, dst, **kw)
            held[0] += box_bytes(mine, dst, rank)
            s["staging_bytes"] = max(s["staging_bytes"], held[0])
            return mine

        for mine, (_names, _src, dst) in received_groups(groups, receive, prefetch):
            yield from mine.items()
            held[0] -= box_bytes(mine, dst, rank)

    def into(self, mirror: dict, groups: list, prefetch: bool = True, **kw):
        """``(name, tensor)`` of ``mirror`` (a staging mirror a delta patches), one group of ``groups`` (``(names,
        src, dst)``) at a time, each yielded once its refit into the mirror has landed. With ``prefetch`` group
        k+1's refit runs in a background thread while the consumer (e.g. the engine's layerwise reload) holds
        group k: the wire and the re-pack overlap, no staging beyond the mirror. A failed refit is raised at the
        group it failed in (earlier groups were yielded)."""
        def receive(src, dst):
            part = {s.name: mirror[s.name] for s in dst.locals if s.rank == self.group.rank}
            self.refit(part, src, dst, **kw)
            return part

        for part, _g in received_groups(groups, receive, prefetch):
            yield from part.items()


class TornWeightsError(RuntimeError):
    """A forward on an engine worker whose last weight update failed part way: its layers hold a mix of
    versions (in reload mode some sit on the meta device). Raised instead of generating from them."""


def refuse_forward(model: torch.nn.Module, torn: Callable[[], dict | None], who: str):
    """Make every forward of ``model`` raise :class:`TornWeightsError` (a forward pre-hook; remove the returned
    handle once a later update completed), naming ``who`` and ``torn()``'s ``version`` / ``reason``."""

    def refuse(_module, _args):
        t = torn() or {"version": "?", "reason": "?"}
        raise TornWeightsError(f"{who}: the weight update to version {t['version']!r} failed part way "
                               f"({t['reason']}); this worker's weights are torn, generation is refused until a "
                               "repair update completes")

    return model.register_forward_pre_hook(refuse)


class TornState:
    """A rank's torn state, kept across its refit groups: ``state`` (``version``, ``mode``, ``reason``) once an
    update failed part way, the model's every forward refused meanwhile (:func:`refuse_forward`), until
    :meth:`repaired`."""

    state: dict | None = None
    _guard = None

    def mark(self, version, mode: str, e: BaseException, who: str, model: torch.nn.Module) -> None:
        self.state = {"version": version, "mode": mode, "reason": f"{type(e).__name__}: {e}"[:400]}
        if self._guard is None:
            self._guard = refuse_forward(model, lambda: self.state, who)

    def repaired(self) -> dict | None:
        """A later update completed: the forward allowed again; the torn state it repaired (None: there was none)."""
        state, self.state = self.state, None
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        return state


def forward_refused(model: torch.nn.Module) -> str | None:
    """Whether ``model`` refuses a forward now (torn weights): the refusal's message, else None. Runs only the
    model's forward pre-hooks (no forward)."""
    try:
        for hook in list(model._forward_pre_hooks.values()):
            hook(model, ())
    except TornWeightsError as e:
        return str(e)
    return None
