"""The kit's update sessions (``integrations.session``): a trainer rank's :class:`TrainerSession` (pause, start, its
sends beside the engine's part, the vote, finish, resume; stage then commit; the failure texts) and an engine rank's
:class:`WorkerSession` (full / stage / commit, in place or through the engine's loader, torn and repaired), without
an engine: one 3-rank gloo world (trainer rank 0, engine ranks 1 and 2), the engine's calls recorded, its loader a
dict, poisoned targets compared bit for bit with slices of the global tensors."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, refit
from triton_reshard.comm.group import free_port
from triton_reshard.integrations import engine as kit
from triton_reshard.integrations.session import EngineCalls, TrainerSession, UpdateFields, WorkerSession
from triton_reshard.integrations.stage import TornState, forward_refused
from triton_reshard.testing.launch import run_world

SECRET = "session-test-secret-0123456789abcdef"
NAMES = ("layers.0.w", "layers.1.w")


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(8, 4, generator=g) for n in NAMES}


def _exact(got: dict, w: dict, rows: slice) -> bool:
    return all(torch.equal(got[n].view(torch.int32), w[n][rows].view(torch.int32)) for n in NAMES)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in NAMES)
        for m in self.layers:
            m.w = torch.nn.Parameter(torch.full((4, 4), float("nan")), requires_grad=False)


def _trainer(group, src, dst, groups) -> dict:
    log: list = []
    calls = EngineCalls(lambda: log.append("start"), lambda info: log.append(("update", info["phase"])),
                        lambda v: log.append(("finish", v)), lambda: log.append("pause"), lambda: log.append("resume"),
                        engine="the test engine", finish_name="finish_update")
    s, out = TrainerSession(group, 0, 1, 60.0, calls, "inplace"), {}

    def send(w, per_group=False):
        def run(phases):
            parts = groups if per_group else [(NAMES, src, dst)]
            return sum(s.tally(phases, refit({n: w[n] for n in names}, {}, a, b, group=group, timeout=60.0,
                                                  bucket_bytes=1 << 20))
                       for names, a, b in parts)
        return run

    s.run({"version": 1, "phase": "full"}, send(_weights(1)))
    out["full"] = (log[:], s.last_update["sent_bytes"], s.last_update["refits"])
    log.clear()
    s.run({"version": 2, "phase": "stage"}, send(_weights(2), per_group=True))  # staging: by layer group
    out["stage"] = (log[:], s.staged, s.last_update["phase"])
    log.clear()
    s.commit()
    out["commit"] = (log[:], s.last_update["phase"], s.last_update["version"])
    with pytest.raises(RuntimeError) as e:
        s.commit()
    out["empty_commit"] = str(e.value)
    log.clear()
    s.mode = "reload"
    with pytest.raises(RuntimeError) as e:
        s.run({"version": 3, "phase": "full"}, send(_weights(3), per_group=True))
    out["failed"] = (str(e.value), log[:], s.last_update)
    s.run({"version": 4, "phase": "full"}, send(_weights(4), per_group=True))
    out["repair"] = s.last_update["refits"]
    return out


def _engine(rank, group, src, dst, groups) -> dict:
    model, torn, out, rows = _Model(), TornState(), {}, slice((rank - 1) * 4, rank * 4)
    live = lambda: {n: p.detach() for n, p in model.named_parameters()}  # noqa: E731
    loaded: dict = {}

    def load(items, stats):
        loaded.update((n, t.clone()) for n, t in items)  # the engine's loader: consumes every item, then fails
        if rank == 2 and 3 in loaded.get("fail", ()):
            raise ValueError("loader boom on rank 2")

    def session(mode):
        return WorkerSession(group, src, dst, mode, groups, torn, model=lambda: model, load=load, build=None,
                             timeout=60.0, bucket_bytes=1 << 20, rank_offset=1, prefetch=False, shadow=False,
                             device="cpu", who=f"test engine rank {rank}", engine="the test engine")

    def update(ws, version, phase="full"):
        ws.started(0.0)
        ws.receive(UpdateFields(version=version, phase=phase))
        if phase == "stage":
            ws.staging.join(60.0)
        if ws.finishing():
            ws.finished(finalize_s=0.0)

    ws = session("inplace")
    update(ws, 1)
    out["full"] = _exact(live(), _weights(1), rows)
    update(ws, 2, "stage")
    out["stage"] = (_exact(live(), _weights(1), rows), _exact(ws.staging.tensors, _weights(2), rows),
                    ws.staging.staged, ws.finishing())
    update(ws, 2, "commit")
    out["commit"] = (_exact(live(), _weights(2), rows), ws.last_update["commit_path"], ws.staging.staged)
    ws = session("reload")  # a new session (e.g. a new trainer): the torn state is the rank's, kept across them
    loaded["fail"] = (3,)
    update(ws, 3)
    out["failed"] = (torn.state, forward_refused(model), ws.finishing(), _exact(loaded, _weights(3), rows))
    loaded.clear()
    update(ws, 4)
    out["repair"] = (torn.state, forward_refused(model), ws.last_update.get("repaired", {}).get("version"),
                     _exact(loaded, _weights(4), rows), ws.last_update["mode"])
    return out


def _rank(rank: int, world: int, port: int) -> dict:
    group = kit.join_group("127.0.0.1", port, rank, world, backend="gloo", timeout=60.0, secret=SECRET)
    shapes = {n: (8, 4) for n in NAMES}
    src = Layout.from_placements(shapes, [0], [Replicate()])
    dst = Layout.from_placements(shapes, [1, 2], [Shard(0)])
    groups = kit.group_layouts(src, dst, "reload", staging_bytes=0)
    try:
        return _trainer(group, src, dst, groups) if rank == 0 else _engine(rank, group, src, dst, groups)
    finally:
        group.destroy()


@pytest.mark.slow
def test_trainer_and_worker_sessions_on_a_gloo_world():
    res = run_world(_rank, 3, free_port(), backend="gloo", timeout=240)
    t = res[0]
    # a full update: paused throughout, the engine's part started beside the sends, finished with the version
    assert t["full"] == (["pause", "start", ("update", "full"), ("finish", "1"), "resume"], 2 * 8 * 4 * 4, 1)
    # a staged one: not paused, the session closed with nothing committed; the commit under the pause
    assert t["stage"] == (["start", ("update", "stage"), ("finish", None)], {"version": 2}, "stage")
    assert t["commit"] == (["pause", "start", ("update", "commit"), ("finish", "2"), "resume"], "commit", 2)
    assert t["empty_commit"] == ("triton_reshard trainer rank 0: commit refused: no complete staged update "
                                 "(send_weights(overlap=True) first; a failed one cannot be committed)")
    why, log, last = t["failed"]
    assert why == (
        "triton_reshard trainer rank 0: the weight update to version 3 failed (rank(s) [2] of the refit group failed "
        "their part (see their log)); the engine's workers hold torn weights and refuse a forward, and the engine "
        "stays paused (queued requests wait, none is served from torn weights) until a repair update completes: "
        "re-init the trainer engine if its refit group broke, then send_weights again")
    assert log == ["pause", "start", ("update", "full"), ("finish", None)]  # no resume: it stays paused
    assert last["failed"].startswith("rank(s) [2]") and t["repair"] == 2  # one refit per layer group
    for rank in (1, 2):
        e = res[rank]
        assert e["full"] and e["stage"] == (True, True, {"version": 2}, False), (rank, e)
        assert e["commit"] == (True, "copy", None), (rank, e)
        state, refused, finishing, exact = e["failed"]
        assert state["version"] == 3 and refused and "version 3 failed part way" in refused and not finishing
        assert exact  # the loader got every byte: the failure was its own (rank 2's) or the vote's (rank 1's)
        reason = "ValueError: loader boom on rank 2" if rank == 2 else \
            "RuntimeError: rank(s) [2] of the refit group failed their part of this update"
        assert state["reason"] == reason, (rank, state)
        assert e["repair"] == (None, None, 3, True, "reload"), (rank, e["repair"])


def test_module_shadow_build_runs_the_engines_steps_and_forgets_on_failure():
    """``ModuleShadow.build``: the engine's prepare / load / done on the shadow (the live tree untouched until the
    swap), the rebuilt modules' bytes counted, and ``forget`` for every module prepare saw, also when it raised."""
    torch.manual_seed(0)
    root = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = {n: t.clone() for n, t in root.state_dict().items()}
    new = {n: torch.randn_like(t) for n, t in root.state_dict().items()}
    forgot: list = []

    def prepare(name, m, s):
        if not isinstance(m, torch.nn.Linear):
            return None
        for pn in ("weight", "bias"):
            s._parameters[pn] = kit.private_tensor(m._parameters[pn], (m,), s)
        return name

    def load(shadow_root):
        with torch.no_grad():
            for n, p in shadow_root.named_parameters():
                p.copy_(new[n])

    stats: dict = {}
    sh = kit.ModuleShadow(root).build(prepare, load, lambda s, name: 4 * s.weight.numel(), forgot.append, stats)
    assert [n for n, _, _ in sh.built] == ["0", "2"] and stats["shadow_bytes"] == 4 * (12 + 8)
    assert stats["shadow_layers"] == 2 and len(forgot) == 4  # the root, both linears, the ReLU
    assert all(torch.equal(before[n], t) for n, t in root.state_dict().items()), "the build wrote the live tree"
    sh.swap()
    assert all(torch.equal(new[n], t) for n, t in root.state_dict().items())

    def refuse(name, m, s):
        if name == "1":
            raise NotImplementedError("shadow build: 1 is not covered")
        return prepare(name, m, s)

    forgot.clear()
    with pytest.raises(NotImplementedError, match="shadow build: 1 is not covered"):
        kit.ModuleShadow(root).build(refuse, load, lambda s, name: 1, forgot.append, {})
    assert len(forgot) == 3  # the root, linear 0 and the module that refused
