"""The SGLang plug-in's stage, then commit (issue 45), on each engine rank (:mod:`.sglang` routes the control
messages ``"stage"`` / ``"commit"`` here; ``st`` is its per-model state, ``sglang._EngineState``), on the kit's
:class:`~.stage.Staging` and :func:`~.stage.voted`.

``stage``: receive this rank's boxes into a private staging mirror in a background thread while SGLang serves
its live weights; ``commit``: copy the staged boxes into the live parameters inside one SGLang weight-update
call; ``before_full_refit``: what a full (in place) refit does to a mirror. The trainer side is
``SGLangTrainer.send_weights(..., overlap=True)`` / ``commit()``; docs/integrations.md says what SGLang's
lifecycle allows.
"""

from __future__ import annotations

from ..refit import RefitState, forget_refit_state, refit, refit_state
from .engine import commit_vote, copy_boxes
from .stage import Staging, voted


def stage(st, msg: dict) -> None:
    """``"stage"``: receive this rank's boxes into its private staging mirror in a background thread and return
    at once, so SGLang's scheduler goes on serving the live weights meanwhile (the control message runs inside
    a weight-update session of its own, which ends before the receive does: nothing the engine serves is
    touched). The thread ends with the update's commit vote: the trainer learns there whether every rank staged.
    A failure drops the mirror (the next update into a new one runs dense) and leaves the live weights as they
    were."""
    rank = st.group.rank
    sg = st.staging = st.staging or Staging(st.dst_layout, rank)
    if sg.busy():
        raise RuntimeError(f"triton_reshard SGLang engine rank {rank}: a staged receive is still running")
    if st.live is None:
        st.live = refit_state(st.dst_layout)  # what the live parameters hold from now on, while staging
    sg.mirror()  # a fresh mirror: a delta into it must run dense
    reports = []

    def part() -> None:
        reports.append(refit({}, sg.tensors, st.src_layout, st.dst_layout, group=st.group, timeout=st.timeout,
                             bucket_bytes=st.bucket_bytes, version=msg.get("version"), delta=msg.get("delta", False)))
        sg.staged = {"version": msg.get("version")}  # before the vote: the trainer commits right after it

    def run() -> None:
        err = voted(st.group, part, st.timeout, f"SGLang engine rank {rank}", staged=True)
        if err is not None:
            sg.drop()
            sg.error = f"{type(err).__name__}: {err}"[:400]
            return
        st.last_report = reports[0]
        st.reports.append(reports[0])

    sg.start(run, who=f"triton_reshard SGLang engine rank {rank}", name="triton_reshard_sglang_stage", nice=0)


def commit(st, model, params: dict, msg: dict) -> None:
    """``"commit"`` (inside SGLang's weight-update session, between two scheduler steps): copy every staged box
    into its live parameter, then the model's post-load step. Refused, touching nothing, without a complete
    staged update; the commit's vote then tells the trainer ranks."""
    from sglang.srt.model_loader.loader import post_load_weights

    sg = st.staging
    ok = sg is not None and sg.staged is not None
    try:
        if not ok:
            why = (sg.error if sg is not None else None) or "the receive failed or never ran"
            raise RuntimeError(f"triton_reshard SGLang engine rank {st.group.rank}: commit of version "
                               f"{msg.get('version')!r} refused: no complete staged update ({why})")
        copy_boxes(params, sg.tensors, st.dst_layout, st.group.rank)
        post_load_weights(model)
        st.live = RefitState(version=sg.staged["version"])
        sg.staged = None  # committed: the mirror stays (it holds the live version; a delta patches it)
    finally:
        commit_vote(st.group, ok, st.timeout, f"SGLang engine rank {st.group.rank}: commit")


def before_full_refit(st) -> None:
    """A full refit writes the live parameters: the mirror is stale after it (dropped), and a staged update not
    committed is superseded (the fence forgets it: a delta must not patch the live weights as if they held it)."""
    sg = st.staging
    if sg is not None:
        sg.join(st.timeout)
        if sg.staged is not None:
            forget_refit_state(st.dst_layout)
        sg.tensors = sg.staged = None
    st.live = None
