"""The SGLang plug-in's stage, then commit (issue 45), on each engine rank (:mod:`.sglang` routes the control
messages ``"stage"`` / ``"commit"`` here; ``st`` is its per-model state, ``sglang._EngineState``).

``stage``: receive this rank's boxes into a private staging mirror in a background thread while SGLang serves
its live weights; ``commit``: copy the staged boxes into the live parameters inside one SGLang weight-update
call; ``before_full_refit``: what a full (in place) refit does to a mirror. The trainer side is
``SGLangTrainer.send_weights(..., overlap=True)`` / ``commit()``; docs/integrations.md says what SGLang's
lifecycle allows.
"""

from __future__ import annotations

import threading

import torch

from ..refit import RefitState, forget_refit_state, refit, refit_state


def stage(st, msg: dict) -> None:
    """``"stage"``: receive this rank's boxes into its private staging mirror in a background thread and return
    at once, so SGLang's scheduler goes on serving the live weights meanwhile (the control message runs inside
    a weight-update session of its own, which ends before the receive does: nothing the engine serves is
    touched). The thread ends with the update's commit vote: the trainer learns there whether every rank staged.
    A failure drops the mirror (the next update into a new one runs dense) and leaves the live weights as they
    were."""
    from .engine import commit_vote, group_broken

    if st.stage_thread is not None and st.stage_thread.is_alive():
        raise RuntimeError(f"triton_reshard SGLang engine rank {st.group.rank}: a staged receive is still running")
    if st.live is None:
        st.live = refit_state(st.dst_layout)  # what the live parameters hold from now on, while staging
    st.staged, st.stage_error = None, None
    if st.mirror is None:  # a fresh mirror: a delta into it must run dense
        forget_refit_state(st.dst_layout)
        st.mirror = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in st.dst_layout.locals
                     if s.rank == st.group.rank}

    def run() -> None:
        err: BaseException | None = None
        try:
            rep = refit({}, st.mirror, st.src_layout, st.dst_layout, group=st.group, timeout=st.timeout,
                        bucket_bytes=st.bucket_bytes, version=msg.get("version"), delta=msg.get("delta", False))
            st.staged = {"version": msg.get("version")}  # before the vote: the trainer commits right after it
        except Exception as e:  # noqa: BLE001 (voted, then recorded)
            err = e
        if err is None or not group_broken(err):
            try:
                words = commit_vote(st.group, err is None, st.timeout, f"SGLang engine rank {st.group.rank}")
                if err is None and not all(words):
                    err = RuntimeError(f"rank(s) {[r for r, w in enumerate(words) if not w]} of the refit group "
                                       "failed their part of this staged update")
            except Exception as e:  # noqa: BLE001
                err = err or e
        if err is not None:
            st.mirror, st.staged = None, None
            forget_refit_state(st.dst_layout)
            st.stage_error = f"{type(err).__name__}: {err}"[:400]
            return
        st.last_report = rep
        st.reports.append(rep)

    st.stage_thread = threading.Thread(target=run, daemon=True, name="triton_reshard_sglang_stage")
    st.stage_thread.start()


def commit(st, model, params: dict, msg: dict) -> None:
    """``"commit"`` (inside SGLang's weight-update session, between two scheduler steps): copy every staged box
    into its live parameter, then the model's post-load step. Refused, touching nothing, without a complete
    staged update; the commit's vote then tells the trainer ranks."""
    from sglang.srt.model_loader.loader import post_load_weights

    from .engine import commit_vote

    ok = st.staged is not None
    try:
        if not ok:
            why = st.stage_error or "the receive failed or never ran"
            raise RuntimeError(f"triton_reshard SGLang engine rank {st.group.rank}: commit of version "
                               f"{msg.get('version')!r} refused: no complete staged update ({why})")
        with torch.no_grad():
            for f in st.dst_layout.fragments:
                if f.rank == st.group.rank:
                    box = tuple(slice(o, o + n) for o, n in zip(f.local_offsets, f.local_sizes, strict=True))
                    params[f.local][box].copy_(st.mirror[f.local][box])
        post_load_weights(model)
        st.live = RefitState(version=st.staged["version"])
        st.staged = None  # committed: the mirror stays (it holds the live version; a delta patches it)
    finally:
        commit_vote(st.group, ok, st.timeout, f"SGLang engine rank {st.group.rank}: commit")


def before_full_refit(st) -> None:
    """A full refit writes the live parameters: the mirror is stale after it (dropped), and a staged update not
    committed is superseded (the fence forgets it: a delta must not patch the live weights as if they held it)."""
    if st.stage_thread is not None:
        st.stage_thread.join(st.timeout)
    if st.staged is not None:
        forget_refit_state(st.dst_layout)
    st.mirror, st.staged, st.live = None, None, None
