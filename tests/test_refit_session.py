"""Refit sessions (execute/session.py): one per cached entry, owning the Resharder, the delta snapshot and the
destination's version / torn state; one registry. The destination's state outlives its sessions: a torn
destination stays torn through a group rebuild (a new session), eviction and ``clear_cache``, until a refit
succeeds."""

from __future__ import annotations

import pytest
import torch

import triton_reshard.ops as ops
from triton_reshard import Fragment, Layout, Replicate, ReshardAbortedError, clear_cache, refit, refit_state
from triton_reshard.comm.group import free_port, init_refit_group
from triton_reshard.execute.options import RefitOptions
from triton_reshard.execute.session import SESSIONS, Sessions
from triton_reshard.refit import forget_refit_state, get_resharder

F32 = torch.float32


def _layouts():
    src = Layout.from_placements({"w": (8, 4), "b": (4,)}, [0], [Replicate()])
    dst = Layout.from_fragments({"w": ((8, 4), F32), "b": ((4,), F32)},
                                [Fragment("w", 0, (0, 0), (8, 4), "w_t"), Fragment("b", 0, (0,), (4,), "b_t")])
    return src, dst


def _src(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}


def _poisoned() -> dict[str, torch.Tensor]:
    return {"w_t": torch.full((8, 4), float("nan")), "b_t": torch.full((4,), float("nan"))}


def _group():
    return init_refit_group("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout=10)


def _tear(monkeypatch, src, dst, d, group, version):
    """A refit that lands one copy and then fails: the destination is torn."""
    real = ops.copy_views

    def broken(pairs, backend="torch", key=None):
        real(pairs[:1], backend, key)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ops, "copy_views", broken)
    with pytest.raises(ReshardAbortedError, match="disk on fire"):
        refit(_src(version), d, src, dst, group=group, version=version)
    monkeypatch.setattr(ops, "copy_views", real)


def test_torn_destination_stays_torn_through_a_group_rebuild_until_a_refit_succeeds(monkeypatch):
    clear_cache()
    src, dst = _layouts()
    d = _poisoned()
    g1 = _group()
    try:
        refit(_src(1), d, src, dst, group=g1, version=1, delta=True)
        first = SESSIONS.get(src, dst, g1, RefitOptions.of())
        assert first.resharder is get_resharder(src, dst, group=g1)
        assert first.snapshot.version == 1 and first.state.version == 1
        _tear(monkeypatch, src, dst, d, g1, 2)
        assert refit_state(dst).torn and refit_state(dst).failed_version == 2
    finally:
        g1.destroy()  # after a failure part way the group is rebuilt
    g2 = _group()
    try:
        second = SESSIONS.get(src, dst, g2, RefitOptions.of())
        assert second is not first and second.resharder is not first.resharder
        assert second.destination is first.destination  # the same destination, a new session
        st = refit_state(dst)
        assert st.torn and st.version == 1 and st.torn_tensors == ("b_t", "w_t"), st
        clear_cache()  # sessions go, the destination's state stays
        assert refit_state(dst).torn
        with pytest.raises(ValueError):  # rejected before anything moved: still torn
            refit(_src(2), {"w_t": torch.zeros(8, 5), "b_t": torch.zeros(4)}, src, dst, group=g2, version=2)
        assert refit_state(dst).torn
        report = refit(_src(2), d, src, dst, group=g2, version=2, delta=True)  # the repair: dense, says why
        assert report.mode == "dense-fallback" and "torn" in report.fallback, report
        assert torch.equal(d["w_t"], _src(2)["w"]) and torch.equal(d["b_t"], _src(2)["b"])
        st = refit_state(dst)
        assert st.version == 2 and not st.torn and st.torn_tensors == () and st.failed_version is None
        report = refit(_src(3), d, src, dst, group=g2, version=3, delta=True)
        # repaired: the fence no longer sees a torn or fresh destination (one rank: local copies only, so
        # nothing can go as a delta)
        assert report.fallback.startswith("no message of this plan can go as a delta"), report
        assert torch.equal(d["w_t"], _src(3)["w"]) and torch.equal(d["b_t"], _src(3)["b"])
    finally:
        g2.destroy()
        clear_cache()


def test_destination_state_outlives_an_evicted_session(monkeypatch):
    clear_cache()
    monkeypatch.setattr(Sessions, "size", 1)
    src, dst = _layouts()
    d = _poisoned()
    refit(_src(1), d, src, dst, version=5)
    other = Layout.from_placements({"v": (3,)}, [0], [Replicate()])
    refit({"v": torch.ones(3)}, {"v": torch.zeros(3)}, other, other, version=9)  # evicts dst's session
    assert refit_state(dst).version == 5 and refit_state(other).version == 9
    refit(_src(6), d, src, dst, version=6)
    assert refit_state(dst).version == 6 and torch.equal(d["w_t"], _src(6)["w"])
    clear_cache()


def test_forget_refit_state_with_a_live_session():
    """Forgetting resets the state every session writing the destination shares: the next refit through the
    same session records again, and a delta into it runs dense (a fresh destination)."""
    clear_cache()
    src, dst = _layouts()
    d = _poisoned()
    refit(_src(1), d, src, dst, version=1, delta=True)
    forget_refit_state(dst)
    assert refit_state(dst).version is None
    report = refit(_src(2), d, src, dst, version=2, delta=True)
    assert report.mode == "dense-fallback" and "hold no refit version" in report.fallback, report
    assert refit_state(dst).version == 2
    clear_cache()
    forget_refit_state(dst)  # no session left: the entry goes
    assert refit_state(dst).version is None
    assert (dst, 1) not in SESSIONS._destinations
