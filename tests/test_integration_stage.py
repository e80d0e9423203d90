"""The kit's two sides of one update (``integrations.stage``): the staging mirror, the voted part of an engine
rank, a trainer rank's part beside the engine's call, the timed receives by layer group, the torn refusal. One
3-rank gloo world (trainer rank 0, engine ranks 1 and 2) against slicing the global tensors, poisoned targets."""

from __future__ import annotations

import threading

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, refit
from triton_reshard.comm.group import free_port
from triton_reshard.integrations import engine as kit
from triton_reshard.integrations.stage import (
    Receiver,
    Staging,
    TornWeightsError,
    beside,
    forward_refused,
    refuse_forward,
    voted,
)
from triton_reshard.testing.launch import run_world

SECRET = "stage-test-secret-0123456789abcdef"
NAMES = ("layers.0.w", "layers.1.w")


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(8, 4, generator=g) for n in NAMES}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _stage_rank(rank: int, world: int, port: int) -> dict:
    group = kit.join_group("127.0.0.1", port, rank, world, backend="gloo", timeout=60.0, secret=SECRET)
    shapes = {n: (8, 4) for n in NAMES}
    src = Layout.from_placements(shapes, [0], [Replicate()])
    dst = Layout.from_placements(shapes, [1, 2], [Shard(0)])
    out: dict = {}
    try:
        rows = slice((rank - 1) * 4, rank * 4)
        live = {n: torch.full((4, 4), float("nan")) for n in NAMES} if rank else {}
        st = Staging(dst, rank) if rank else None
        for version, fail in ((1, False), (2, False), (3, True)):
            w = _weights(version)
            if rank == 0:
                def send(w=w, version=version):
                    return refit(w, {}, src, dst, group=group, timeout=60.0, version=version, delta=True).sent_bytes

                sent, err, bad = beside(group, send, None, 60.0, "trainer rank 0")
                out[version] = (sent, err is None, bad)
                continue
            errs = []

            def part(version=version, fail=fail):
                refit({}, st.mirror(), src, dst, group=group, timeout=60.0, version=version, delta=True)
                st.staged = {"version": version}
                if fail and rank == 2:
                    raise ValueError("boom on rank 2")

            def run(version=version, errs=errs):
                errs.append(voted(group, part, 60.0, f"engine rank {rank}", staged=True))
                if errs[-1] is not None:
                    st.drop()

            st.start(run, who=f"engine rank {rank}", name="stage_test", nice=0)
            st.join(60.0)
            if errs[0] is not None:
                out[version] = ("failed", str(errs[0]), st.tensors is None, st.staged)
                continue
            untouched = all(torch.isnan(t).all() for t in live.values()) if version == 1 else True
            staged_ok = all(torch.equal(_bits(st.tensors[n]), _bits(w[n][rows])) for n in NAMES)
            st.commit(live)
            out[version] = (untouched, staged_ok, st.staged,
                            all(torch.equal(_bits(live[n]), _bits(w[n][rows])) for n in NAMES), st.nbytes())
        # the timed receives by layer group (a reload-mode update): each group into fresh staging, then handed on
        groups = kit.group_layouts(src, dst, "reload", staging_bytes=0)
        w = _weights(4)
        if rank == 0:
            for _names, s, d in groups:
                refit({n: w[n] for n in _names}, {}, s, d, group=group, timeout=60.0)
        else:
            rx = Receiver(group, timeout=60.0)
            rx.stats = {"recv_bytes": 0, "staging_bytes": 0, "refit_s": 0.0, "alloc_s": 0.0, "unpack_s": 0.0}
            got = {n: t.clone() for n, t in rx.groups(groups, prefetch=False)}
            out["groups"] = (len(groups), sorted(got), all(torch.equal(_bits(got[n]), _bits(w[n][rows])) for n in NAMES),
                             rx.stats["recv_bytes"], rx.stats["staging_bytes"], rx.stats["groups"])
        return out
    finally:
        group.destroy()


@pytest.mark.slow
def test_stage_vote_commit_and_groups_on_a_gloo_world():
    res = run_world(_stage_rank, 3, free_port(), backend="gloo", timeout=240)
    half = 4 * 4 * 4 * len(NAMES)  # one engine rank's boxes: 4 rows x 4 fp32 per tensor
    for version in (1, 2):
        assert res[0][version][1:] == (True, [])
        for rank in (1, 2):
            untouched, staged_ok, staged, live_ok, nbytes = res[rank][version]
            assert untouched and staged_ok and live_ok, (rank, version, res[rank][version])
            assert staged is None and nbytes == half  # committed; the mirror stays for the next delta
    # version 3: rank 2's part failed after its receive: it says so in the vote, every rank learns it
    assert res[0][3][1:] == (True, [2])
    _, why, dropped, staged = res[2][3]
    assert "boom on rank 2" in why and dropped and staged is None
    _, why, dropped, staged = res[1][3]
    assert why == "rank(s) [2] of the refit group failed their part of this staged update" and dropped
    for rank in (1, 2):
        n, names, exact, recv, staging, ngroups = res[rank]["groups"]
        assert (n, ngroups, names, exact) == (2, 2, sorted(NAMES), True)
        assert recv == half and staging == half // 2  # one layer's boxes held at a time


def test_a_torn_model_refuses_every_forward_until_repaired():
    model = torch.nn.Linear(3, 2)
    torn = {"version": 7, "reason": "TimeoutError: lost"}
    assert forward_refused(model) is None
    handle = refuse_forward(model, lambda: torn, "engine worker 5")
    want = ("engine worker 5: the weight update to version 7 failed part way (TimeoutError: lost); this worker's "
            "weights are torn, generation is refused until a repair update completes")
    with pytest.raises(TornWeightsError) as e:
        model(torch.zeros(1, 3))
    assert str(e.value) == want and forward_refused(model) == want
    handle.remove()
    assert forward_refused(model) is None
    model(torch.zeros(1, 3))


def test_staging_refuses_a_second_receive_while_one_runs():
    layout = Layout.from_placements({"w": (4, 3)}, [0], [Replicate()])
    st = Staging(layout, 0)
    go = threading.Event()
    st.start(go.wait, 30.0, who="engine rank 0", name="stage_test", nice=0)
    try:
        with pytest.raises(RuntimeError, match="^engine rank 0: a staged receive is still running$"):
            st.start(go.wait, who="engine rank 0", name="stage_test")
    finally:
        go.set()
        st.join(30.0)
    assert not st.busy()
    m = st.mirror()
    assert st.mirror() is m and set(m) == {"w"} and st.nbytes() == 4 * 3 * 4
    st.staged = {"version": 1}
    st.drop()
    assert st.tensors is None and st.staged is None
