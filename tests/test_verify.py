"""Verify mode (``verify_refit`` / ``Resharder.verify``) and refit's handling of destination tensors the layout
does not cover.

Expected mismatch counts are computed independently of the package: ``tests/dist_cases.py`` places every box
of a (right or deliberately wrong) destination description with plain indexing, and a count is the number of
covered elements whose bits differ from what the tensors hold. One process for the single-rank tests; one
spawned gloo world of 4 ranks runs every multi-rank scenario (``SCENARIOS``) and the bad-input ones.
"""

from __future__ import annotations

import re
import traceback
import warnings
from dataclasses import dataclass

import pytest
import torch

from triton_reshard import (
    Fragment,
    Layout,
    Replicate,
    Resharder,
    VerifyReport,
    plan_reshard,
    refit,
    verify_refit,
)
from triton_reshard.refit import get_resharder

from . import dist_cases as dc
from .dist_cases import S0, S1, F, P, R
from .test_bad_input import SINGLE_RANK, _one_rank, names

F32, BF16 = torch.float32, torch.bfloat16

# --------------------------------------------------------------------------------------------------------
# Reference: what a verify against ``side`` must find in ``held``
# --------------------------------------------------------------------------------------------------------


def expected_counts(side, rank: int, want_data, held: dict) -> dict[str, int]:
    """{local: covered elements whose bits differ} from the reference placement of ``want_data`` by ``side``."""
    want = dc.build_locals(side, rank, want_data, 0)
    cov = dc.coverage(side, rank)
    out = {}
    for n, t in held.items():
        k = int(((dc.bits(want[n]) != dc.bits(t)) & (cov[n] > 0)).sum())
        if k:
            out[n] = k
    return out


def expected_first(side, rank: int, want_data, held: dict, name: str):
    """(logical tensor, logical index, local index, want bits, held bits) of the first (row-major in the local
    tensor) covered element of ``name`` that differs."""
    want = dc.build_locals(side, rank, want_data, 0)[name]
    t = held[name]
    bad = (dc.bits(want) != dc.bits(t)) & (dc.coverage(side, rank)[name] > 0)
    lidx = tuple(int(i) for i in bad.nonzero()[0])
    for d in side:
        for b in d.boxes(rank):
            if b.local != name:
                continue
            extra = t.dim() - len(b.sizes)
            if lidx[:extra] != tuple(b.local_offsets[:extra]):
                continue
            rel = [i - o for i, o in zip(lidx[extra:], b.local_offsets[extra:], strict=True)]
            if all(0 <= r < s for r, s in zip(rel, b.sizes, strict=True)):
                index = tuple(o + r for o, r in zip(b.offsets, rel, strict=True))
                mask = (1 << (8 * t.element_size())) - 1
                return b.tensor, index, lidx, int(dc.bits(want)[lidx]) & mask, int(dc.bits(t)[lidx]) & mask
    raise AssertionError(f"no box holds {name}{list(lidx)}")


def check_report(rep: VerifyReport, side, rank: int, want_data, held: dict, what: str) -> list[str]:
    """Problems with ``rep`` (this rank's part) against the reference."""
    problems = []
    want = expected_counts(side, rank, want_data, held)
    if rep.mismatches != want:
        problems.append(f"{what}: rank {rank}: mismatches {rep.mismatches}, expected {want}")
    covered = sum(int((c > 0).sum()) for c in dc.coverage(side, rank).values())
    if rep.compared_elements != covered:
        problems.append(f"{what}: rank {rank}: compared {rep.compared_elements} elements, {covered} are covered")
    if rep.mismatches_by_rank.get(rank) != sum(want.values()):
        problems.append(f"{what}: rank {rank}: by rank {rep.mismatches_by_rank}, expected {sum(want.values())} here")
    if rep.ok != (rep.total_mismatches == 0) or rep.total_mismatches != sum(rep.mismatches_by_rank.values()):
        problems.append(f"{what}: rank {rank}: inconsistent report {rep}")
    if sorted(rep.differences) != sorted(want):
        problems.append(f"{what}: rank {rank}: differences for {sorted(rep.differences)}, expected {sorted(want)}")
    for n in want:
        d = rep.differences.get(n)
        if d is None:
            continue
        tensor, index, lidx, wb, hb = expected_first(side, rank, want_data, held, n)
        got = (d.tensor, d.index, d.local_index, d.expected_bits, d.actual_bits)
        if got != (tensor, index, lidx, wb, hb):
            problems.append(f"{what}: rank {rank}: first difference of {n!r} {got}, expected {(tensor, index, lidx, wb, hb)}")
        if not all(o <= i < o + s for i, o, s in zip(d.index, d.offsets, d.sizes, strict=True)):
            problems.append(f"{what}: rank {rank}: {d} lies outside its box")
        if f"'{n}'" not in rep.message or tensor not in rep.message:
            problems.append(f"{what}: rank {rank}: the message does not name {n!r} / {tensor!r}: {rep.message}")
    return problems


def snapshot(tensors: dict) -> dict:
    return {n: dc.bits(t).clone() for n, t in tensors.items()}


def untouched(tensors: dict, snap: dict, what: str) -> list[str]:
    return [f"{what}: destination {n!r} was written by verify" for n, b in snap.items()
            if not torch.equal(dc.bits(tensors[n]), b)]


# --------------------------------------------------------------------------------------------------------
# Destination descriptions, right and wrong
# --------------------------------------------------------------------------------------------------------


def fused_gate_up(ranks, inter: int, hidden: int, swap: bool = False, dtype=F32) -> F:
    """gate and up [inter, hidden], TP-sharded by rows; each rank's local 'gate_up' is [gate shard; up shard]
    (``swap``: [up; gate], the wrong claim)."""
    n = inter // len(ranks)
    frags, shapes = [], {}
    for i, r in enumerate(ranks):
        for name, row in ((("up", 0), ("gate", n)) if swap else (("gate", 0), ("up", n))):
            frags.append((name, r, (i * n, 0), (n, hidden), "gate_up", (row, 0)))
        shapes[(r, "gate_up")] = (2 * n, hidden)
    return F({"gate": ((inter, hidden), dtype), "up": ((inter, hidden), dtype)}, tuple(frags), shapes)


def interleaved_qkv(ranks, groups: int, q_per_group: int, head_dim: int, hidden: int, reverse: bool = False) -> F:
    """GQA q [groups*q_per_group*head_dim, hidden], k and v [groups*head_dim, hidden]; each rank holds its
    KV groups in one local 'qkv', group by group [q_g; k_g; v_g] (Megatron's interleaving). ``reverse``: the
    groups of each rank in the wrong order (the broken claim)."""
    per = groups // len(ranks)
    qrows = q_per_group * head_dim
    frags, shapes = [], {}
    for i, r in enumerate(ranks):
        mine = list(range(i * per, (i + 1) * per))
        row = 0
        for g in reversed(mine) if reverse else mine:
            for name, n, start in (("q", qrows, g * qrows), ("k", head_dim, g * head_dim), ("v", head_dim, g * head_dim)):
                frags.append((name, r, (start, 0), (n, hidden), "qkv", (row, 0)))
                row += n
        shapes[(r, "qkv")] = (row, hidden)
    qshape, kvshape = (groups * qrows, hidden), (groups * head_dim, hidden)
    return F({"q": (qshape, F32), "k": (kvshape, F32), "v": (kvshape, F32)}, tuple(frags), shapes)


@dataclass(frozen=True)
class V:
    """A verify scenario: the tensors hold ``dst`` (after a refit); ``wrong`` are destination descriptions with
    the same local shapes that a verify must flag, element for element."""

    id: str
    src: tuple
    dst: tuple
    wrong: tuple = ()
    bucket_bytes: int = 1 << 20
    allow_cast: bool = False
    gpus_per_node: int | None = None
    direct: bool = False  # run and verify through one Resharder with direct_min_bytes=0 (in-place candidates)
    multi_step: bool = False
    local_only: bool = False
    relays: bool = False  # refit's plan has relays (verify's must not)


QKV_SRC = (P({"q": (16, 6), "k": (8, 6), "v": (8, 6)}, [0, 1, 2, 3], [S0]),)
W4 = (P({"w": (12, 8)}, [0, 1, 2, 3], [S0]),)
SCENARIOS = [
    V("gate-up-swapped", (P({"gate": (12, 5), "up": (12, 5)}, [0, 1], [S0]),),
      (fused_gate_up([2, 3], 12, 5),), wrong=((fused_gate_up([2, 3], 12, 5, swap=True),),)),
    V("qkv-kv-groups-reversed", QKV_SRC, (interleaved_qkv([3, 0], 4, 2, 2, 6),),
      wrong=((interleaved_qkv([3, 0], 4, 2, 2, 6, reverse=True),),)),
    V("shards-permuted", W4, (P({"w": (12, 8)}, [[0, 1], [2, 3]], [S1, S0]),),
      wrong=((P({"w": (12, 8)}, [[1, 0], [3, 2]], [S1, S0]),), (P({"w": (12, 8)}, [[2, 3], [0, 1]], [S1, S0]),))),
    V("multi-step-small-bucket", (P({"big": (40, 16), "mid": (9, 8)}, [0, 1, 2, 3], [S0], torch.int32),),
      (P({"big": (40, 16), "mid": (9, 8)}, [[0, 1], [2, 3]], [S1, R], torch.int32),),
      wrong=((P({"big": (40, 16), "mid": (9, 8)}, [[2, 3], [0, 1]], [S1, R], torch.int32),),),
      bucket_bytes=512, multi_step=True),
    V("cast-fp32-to-bf16", (P({"w": (8, 6)}, [0, 1, 2, 3], [S0], F32),), (P({"w": (8, 6)}, [[0, 1], [2, 3]], [S1, R], BF16),),
      wrong=((P({"w": (8, 6)}, [[2, 3], [0, 1]], [S1, R], BF16),),), allow_cast=True),
    V("direct-messages-staged", W4, (P({"w": (12, 8)}, [3, 2, 1, 0], [S0]),),
      wrong=((P({"w": (12, 8)}, [2, 3, 0, 1], [S0]),),), direct=True),
    V("local-copies-only", (P({"w": (6, 5), "b": (7,)}, [0, 1, 2, 3], [S0], {"w": F32, "b": BF16}),),
      (P({"w": (6, 5), "b": (7,)}, [0, 1, 2, 3], [S0], {"w": F32, "b": BF16}),), local_only=True),
    V("relay-gpn2", (P({"x": (6, 4), "y": (5, 3)}, [0, 1], [S0]),), (P({"x": (6, 4), "y": (5, 3)}, [0, 1, 2, 3], [R]),),
      gpus_per_node=2, relays=True),
]
EXTRA = "model.layers.0.self_attn.mla_attn.mla_attn.W_UV"  # what vLLM's MLA registers after loading


def run_scenario(v: V, rank: int) -> dict:
    sl, dl = dc.side_layout(v.src), dc.side_layout(v.dst)
    sspecs = dc.side_specs(v.src)
    want_data = dc.global_data(sspecs, cast=dc.side_specs(v.dst))
    src_t = dc.build_locals(v.src, rank, dc.global_data(sspecs), 0)
    dst_t = dc.build_locals(v.dst, rank, None, 0)
    opts = {"bucket_bytes": v.bucket_bytes, "allow_cast": v.allow_cast, "gpus_per_node": v.gpus_per_node, "timeout": 30}
    if v.direct:
        r = Resharder(plan_reshard(sl, dl), bucket_bytes=v.bucket_bytes, timeout=30, direct_min_bytes=0)

        def do_refit(dst):
            return r.run(src_t, dst)

        def do_verify(dst, layout=dl):
            if layout is dl:
                return r.verify(src_t, dst)
            return Resharder(plan_reshard(sl, layout), bucket_bytes=v.bucket_bytes, timeout=30,
                             direct_min_bytes=0).verify(src_t, dst)
    else:
        def do_refit(dst):
            return refit(src_t, dst, sl, dl, **opts)

        def do_verify(dst, layout=dl):
            return verify_refit(src_t, dst, sl, layout, **opts)

    problems, reports = [], []

    def verify(dst, side, layout, what):
        snap = snapshot(dst)
        rep = do_verify(dst, layout)
        reports.append((what, rep.ok, rep.total_mismatches, rep.mismatches_by_rank))
        problems.extend(untouched(dst, snap, what) + check_report(rep, side, rank, want_data, dst, what))
        return rep

    # poisoned destinations: nothing written, every covered element mismatched
    for pattern in (0, 1):
        for t in dst_t.values():
            dc.poison_(t, pattern)
        rep = verify(dst_t, v.dst, dl, f"poison {pattern}")
        for n, c in dc.coverage(v.dst, rank).items():  # in floats poison (NaN) is never a synthetic value
            if dst_t[n].dtype.is_floating_point and rep.mismatches.get(n, 0) != int((c > 0).sum()):
                problems.append(f"poison {pattern}: rank {rank}: {rep.mismatches} differ, {int((c > 0).sum())} "
                                f"elements of {n!r} covered")
        if v.multi_step and (src_t or dst_t) and rep.stats.steps < 2:
            problems.append(f"rank {rank}: bucket {v.bucket_bytes} B should need several steps, got {rep.stats.steps}")
    # a correct refit, then verify: ok everywhere
    run_rep = do_refit(dst_t)
    want = dc.build_locals(v.dst, rank, want_data, 1)
    cov = dc.coverage(v.dst, rank)
    for n, t in dst_t.items():
        if not torch.equal(dc.bits(t)[cov[n] > 0], dc.bits(want[n])[cov[n] > 0]):
            problems.append(f"refit: rank {rank}: {n!r} is not what the reference places there")
    rep = verify(dst_t, v.dst, dl, "after refit")
    if not rep.ok or rep.mismatches:
        problems.append(f"after refit: rank {rank}: not ok: {rep}")
    if v.local_only and (rep.stats.sent_bytes or rep.stats.recv_bytes or not rep.stats.local_bytes):
        problems.append(f"rank {rank}: local-only case moved bytes over the wire: {rep.stats}")
    in_place = (run_rep.in_place_bytes, rep.stats.in_place_bytes)  # verify: sends only
    if v.relays:
        kw = {k: opts[k] for k in ("bucket_bytes", "allow_cast", "gpus_per_node")}
        # refit runs rank plans: a rank sees only its own relays, so count them in the whole plans
        whole = {k: opts[k] for k in ("allow_cast", "gpus_per_node")}
        refit_relays = sum(t.relay for t in plan_reshard(sl, dl, **whole).transfers)
        verify_relays = sum(t.relay for t in plan_reshard(sl, dl, **whole, relay=False).transfers)
        assert get_resharder(sl, dl, **kw, timeout=30, relay=False).plan.rank == rank
        if not refit_relays or verify_relays:
            problems.append(f"relays: refit's plan has {refit_relays}, verify's {verify_relays}")
        try:  # a plan with relays cannot be verified (it would read the tensors under test)
            Resharder(get_resharder(sl, dl, **kw, timeout=30).plan, timeout=30).verify(src_t, dst_t)
            problems.append("Resharder.verify accepted a plan with relays")
        except ValueError as e:
            if "relay" not in str(e):
                problems.append(f"relay plan rejected with {e}")
    # deliberately wrong destination layouts: exact counts
    for k, wrong in enumerate(v.wrong):  # same local shapes (test_scenarios_are_well_formed)
        verify(dst_t, wrong, dc.side_layout(wrong), f"wrong layout {k}")
    return {"problems": problems, "reports": reports, "in_place": in_place}


def run_ignored(rank: int) -> dict:
    """Destination dicts with a tensor the layout does not cover: listed, warned once per Resharder."""
    v = SCENARIOS[0]
    sl, dl = dc.side_layout(v.src), dc.side_layout(v.dst)
    src_t = dc.build_locals(v.src, rank, dc.global_data(dc.side_specs(v.src)), 0)
    dst_t = dc.build_locals(v.dst, rank, None, 0)
    dst_t[EXTRA] = torch.full((3, 2), float("nan"))
    extra = dst_t[EXTRA].clone()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rep1 = refit(src_t, dst_t, sl, dl, timeout=30)
        rep2 = refit(src_t, dst_t, sl, dl, timeout=30)
        vrep = verify_refit(src_t, dst_t, sl, dl, timeout=30)
    texts = [str(x.message) for x in w if EXTRA in str(x.message)]
    return {"ignored": [rep1.ignored, rep2.ignored, vrep.ignored], "warnings": texts, "ok": vrep.ok,
            "extra_untouched": bool(torch.equal(dc.bits(dst_t[EXTRA]), dc.bits(extra))), "problems": []}


def _attempt(fn, dst: dict) -> dict:
    snap = snapshot(dst)
    try:
        fn()
        res = {"error": None, "message": ""}
    except Exception as e:
        res = {"error": type(e).__name__, "message": str(e)}
    res["dst_untouched"] = not untouched(dst, snap, "")
    return res


def run_bad(rank: int) -> dict:
    """Bad input to verify: the bad rank raises ValueError naming the tensor, the others ReshardError, before
    any byte moves; a rank running ``run`` while the others verify is rejected on every rank."""
    v = SCENARIOS[2]
    sl, dl = dc.side_layout(v.src), dc.side_layout(v.dst)
    src_t = dc.build_locals(v.src, rank, dc.global_data(dc.side_specs(v.src)), 0)
    out = {}
    dst_t = dc.build_locals(v.dst, rank, None, 0)
    if rank == 2:
        dst_t["w"] = dc.poison_(torch.empty(dst_t["w"].shape[0] + 1, dst_t["w"].shape[1]))
    out["wrong-shape"] = _attempt(lambda: verify_refit(src_t, dst_t, sl, dl, timeout=30), dst_t)
    dst_t = dc.build_locals(v.dst, rank, None, 0)
    if rank == 1:
        dst_t[EXTRA] = torch.zeros(2)
    out["strict-extra"] = _attempt(lambda: verify_refit(src_t, dst_t, sl, dl, timeout=30, strict=True), dst_t)
    dst_t = dc.build_locals(v.dst, rank, None, 0)
    r = Resharder(plan_reshard(sl, dl), timeout=30)
    out["mixed-modes"] = _attempt(lambda: (r.run if rank == 0 else r.verify)(src_t, dst_t), dst_t)
    # the group still works
    refit(src_t, dst_t, sl, dl, timeout=30)
    out["ok-after-errors"] = verify_refit(src_t, dst_t, sl, dl, timeout=30).ok
    return out


def verify_world(rank: int, world: int) -> dict:
    out: dict = {"scenarios": {}}
    for v in SCENARIOS:
        try:
            out["scenarios"][v.id] = run_scenario(v, rank)
        except Exception as e:  # report per scenario, keep the world going
            out["scenarios"][v.id] = {"problems": [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"], "reports": []}
    out["ignored"] = run_ignored(rank)
    out["bad"] = run_bad(rank)
    return out


@pytest.fixture(scope="module")
def world():
    from triton_reshard.testing.launch import run_world

    results = run_world(verify_world, 4, timeout=300, pg_timeout=60, allow_errors=True)
    failed = {r: v for r, v in enumerate(results) if not isinstance(v, dict)}
    if failed:
        pytest.fail("world of 4 ranks failed: " + "\n".join(f"rank {r}: {v}" for r, v in failed.items()))
    return results


def test_scenarios_are_well_formed():
    """Every wrong claim has the right claim's local shapes on every rank (else it would be a bad input, not a
    wrong layout), and really places something differently."""
    for v in SCENARIOS:
        right = dc.side_layout(v.dst)
        for wrong in v.wrong:
            wl = dc.side_layout(wrong)
            assert wl != right, v.id
            for rank in range(4):
                assert wl.local_shapes(rank) == right.local_shapes(rank), (v.id, rank)


# --------------------------------------------------------------------------------------------------------
# Multi-process (one gloo world of 4)
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sid", [pytest.param(v.id, id=v.id) for v in SCENARIOS])
def test_verify_scenario(world, sid):
    """Poisoned destinations stay poisoned bit for bit and every covered element is counted; after a correct
    refit verify is ok; wrong layouts give exactly the reference's counts and first differences; the global
    part of the report is identical on every rank."""
    entries = [r["scenarios"][sid] for r in world]
    problems = "\n".join(p for e in entries for p in e["problems"])
    assert not problems, problems
    per_rank = [e["reports"] for e in entries]
    assert all(len(x) == len(per_rank[0]) for x in per_rank) and per_rank[0]
    for reports in zip(*per_rank, strict=True):
        assert len({repr(x) for x in reports}) == 1, reports  # (what, ok, total, by rank) identical
    whats = {what: (ok, total) for what, ok, total, _ in per_rank[0]}
    assert whats["after refit"] == (True, 0)
    assert not whats["poison 0"][0] and whats["poison 0"][1] > 0
    for what, (ok, total) in whats.items():
        if what.startswith("wrong"):
            assert not ok and total > 0, (what, total)  # the wrong claims really differ somewhere
    if dict((v.id, v) for v in SCENARIOS)[sid].direct:  # run received in place, verify staged every receive
        run_b, ver_b = (sum(e["in_place"][k] for e in entries) for k in (0, 1))
        assert run_b > ver_b > 0, (run_b, ver_b)


@pytest.mark.slow
def test_ignored_destination_tensors(world):
    for rank, res in enumerate(r["ignored"] for r in world):
        assert res["ignored"] == [(EXTRA,)] * 3, (rank, res)
        assert res["ok"] and res["extra_untouched"], (rank, res)
        # one warning per Resharder: refit's (twice called) and verify's share one here (no gpus_per_node)
        assert len(res["warnings"]) == 1, (rank, res["warnings"])
        assert re.search(rf"\brank {rank}\b", res["warnings"][0])


@pytest.mark.slow
def test_bad_input_to_verify(world):
    bad = [r["bad"] for r in world]
    for scenario, culprit, exc, name in (("wrong-shape", 2, "ValueError", "w"), ("strict-extra", 1, "ValueError", EXTRA)):
        for rank, res in enumerate(b[scenario] for b in bad):
            assert res["dst_untouched"], (scenario, rank, res)
            if rank == culprit:
                assert res["error"] == exc and f"'{name}'" in res["message"], (scenario, rank, res)
                assert re.search(rf"\brank {rank}\b", res["message"]), res["message"]
            else:
                assert res["error"] == "ReshardError" and f"[{culprit}]" in res["message"], (scenario, rank, res)
    for rank, b in enumerate(bad):
        res = b["mixed-modes"]
        assert res["error"] == "ReshardError" and "different plans" in res["message"], (rank, res)
        assert "verify" in res["message"] and res["dst_untouched"], (rank, res)
        assert b["ok-after-errors"] is True, (rank, b)


# --------------------------------------------------------------------------------------------------------
# Single process (world 1, no process group)
# --------------------------------------------------------------------------------------------------------


def _one(swap: bool = False, dtype=F32):
    src = (P({"gate": (12, 5), "up": (12, 5)}, [0], [R], dtype),)
    right = (fused_gate_up([0], 12, 5, dtype=dtype),)
    wrong = (fused_gate_up([0], 12, 5, swap=True, dtype=dtype),)
    return src, right, wrong


def test_single_process_refit_then_verify_and_swapped_halves():
    src, right, wrong = _one()
    sl, dl, wl = dc.side_layout(src), dc.side_layout(right), dc.side_layout(wrong)
    data = dc.global_data(dc.side_specs(src))
    src_t = dc.build_locals(src, 0, data)
    dst_t = dc.build_locals(right, 0, None)
    snap = snapshot(dst_t)
    rep = verify_refit(src_t, dst_t, sl, dl)
    assert untouched(dst_t, snap, "poisoned") == []
    assert rep.mismatches == {"gate_up": 120} and rep.total_mismatches == 120 and not rep.ok
    assert rep.compared_elements == 120 and rep.mismatches_by_rank == {0: 120}
    refit(src_t, dst_t, sl, dl)
    rep = verify_refit(src_t, dst_t, sl, dl)
    assert rep.ok and rep.mismatches == {} and rep.differences == {} and rep.total_mismatches == 0
    assert "OK" in str(rep) and rep.stats.local_bytes == 480
    rep = verify_refit(src_t, dst_t, sl, wl)
    assert check_report(rep, wrong, 0, data, dst_t, "swapped") == []
    n_diff = int((dc.bits(data["gate"]) != dc.bits(data["up"])).sum())
    assert rep.mismatches == {"gate_up": 2 * n_diff} and n_diff > 0
    d = rep.differences["gate_up"]
    assert d.tensor == "up" and d.local_index[0] < 12 and d.offsets == (0, 0) and d.sizes == (12, 5)
    assert "up[0:12, 0:5]" in rep.message and "MISMATCH" in rep.message
    assert d.actual == data["gate"][d.index].item() and d.expected == data["up"][d.index].item()


def test_single_process_local_compares_are_split_to_the_bucket(monkeypatch):
    """Local copies (whole tensors) are compared in sub-boxes of at most half a bucket: bounded temporaries."""
    import triton_reshard.ops as ops

    src = (P({"big": (64, 33)}, [0], [R]),)
    right = (P({"big": (64, 33)}, [0], [S0]),)
    wrong = (F({"big": ((64, 33), F32)}, (("big", 0, (0, 0), (32, 33), "big", (32, 0)),
                                         ("big", 0, (32, 0), (32, 33), "big", (0, 0))), {(0, "big"): (64, 33)}),)
    sizes = []
    real = ops.compare_views
    monkeypatch.setattr(ops, "compare_views", lambda pairs: sizes.extend(p[0].numel() for p in pairs) or real(pairs))
    data = dc.global_data(dc.side_specs(src))
    src_t = dc.build_locals(src, 0, data)
    dst_t = dc.build_locals(right, 0, data)
    rep = verify_refit(src_t, dst_t, dc.side_layout(src), dc.side_layout(wrong), bucket_bytes=1024)
    assert check_report(rep, wrong, 0, data, dst_t, "halves") == []
    assert sum(sizes) == 64 * 33 and max(sizes) * 4 <= 512 and len(sizes) > 1


def test_single_process_cast_and_poison_patterns():
    src = (P({"w": (7, 5)}, [0], [R], F32),)
    dst = (P({"w": (7, 5)}, [0], [R], BF16),)
    sl, dl = dc.side_layout(src), dc.side_layout(dst)
    src_t = dc.build_locals(src, 0, {"w": torch.randn(7, 5)})
    for pattern in (0, 1):
        dst_t = dc.build_locals(dst, 0, None, pattern)
        snap = snapshot(dst_t)
        rep = verify_refit(src_t, dst_t, sl, dl, allow_cast=True)
        assert rep.mismatches == {"w": 35} and untouched(dst_t, snap, "") == []
    refit(src_t, dst_t, sl, dl, allow_cast=True)
    assert verify_refit(src_t, dst_t, sl, dl, allow_cast=True).ok
    dst_t["w"][3, 1] = -dst_t["w"][3, 1]  # one element off
    rep = verify_refit(src_t, dst_t, sl, dl, allow_cast=True)
    assert rep.mismatches == {"w": 1} and rep.differences["w"].index == (3, 1)
    # bits, not values: -0.0 vs 0.0 differs; after a cast verify does itself, NaN matches NaN (the payload a
    # cast writes depends on the copy path: contiguous fp32 -> bf16 on CPU gives 0xffff, strided 0x7fc0)
    z = {"w": torch.zeros(7, 5)}
    z["w"][0, 1:3] = float("nan")
    held = {"w": torch.zeros(7, 5, dtype=BF16)}
    held["w"][0, 0] = -0.0
    held["w"].view(torch.int16)[0, 1] = 0x7FC0
    held["w"].view(torch.int16)[0, 2] = -1  # 0xffff
    held["w"].view(torch.int16)[0, 3] = 0x7FC0  # NaN where the cast gives 0.0
    rep = verify_refit(z, held, sl, dl, allow_cast=True)
    assert rep.mismatches == {"w": 2}, rep
    assert (rep.differences["w"].expected_bits, rep.differences["w"].actual_bits) == (0x0000, 0x8000)
    # no cast: NaN payloads compare as bits
    same = dc.side_layout((P({"w": (7, 5)}, [0], [R], F32),))
    held = {"w": z["w"].clone()}
    held["w"].view(torch.int32)[0, 1] = 0x7FC00001
    rep = verify_refit(z, held, sl, same)
    assert rep.mismatches == {"w": 1} and rep.differences["w"].index == (0, 1), rep
    assert (rep.differences["w"].expected_bits, rep.differences["w"].actual_bits) == (0x7FC00000, 0x7FC00001)


def test_single_process_ignored_warned_once_and_strict():
    src, right, _ = _one()
    sl, dl = dc.side_layout(src), dc.side_layout(right)
    src_t = dc.build_locals(src, 0, dc.global_data(dc.side_specs(src)))
    dst_t = {**dc.build_locals(right, 0, None), EXTRA: torch.zeros(2), "a.W_UK_T": torch.zeros(1)}
    with pytest.warns(UserWarning, match="W_UK_T") as w:
        rep = refit(src_t, dst_t, sl, dl, bucket_bytes=4096)
    assert rep.ignored == ("a.W_UK_T", EXTRA) and len(w) == 1 and "rank 0" in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same Resharder: no second warning
        assert refit(src_t, dst_t, sl, dl, bucket_bytes=4096).ignored == ("a.W_UK_T", EXTRA)
        vrep = verify_refit(src_t, dst_t, sl, dl, bucket_bytes=4096)
    assert vrep.ok and vrep.ignored == ("a.W_UK_T", EXTRA) and EXTRA in str(vrep)
    assert torch.equal(dst_t[EXTRA], torch.zeros(2))
    for fn in (refit, verify_refit):
        with pytest.raises(ValueError, match="unknown destination tensor") as e:
            fn(src_t, dst_t, sl, dl, bucket_bytes=4096, strict=True)
        assert "'a.W_UK_T'" in str(e.value) and "rank 0" in str(e.value)
    # a layout tensor that is missing, and an unknown source tensor, stay errors
    for fn in (refit, verify_refit):
        with pytest.raises(ValueError, match="'gate_up' is missing"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # EXTRA is ignored (and warned about) before run rejects the rest
            fn(src_t, {EXTRA: torch.zeros(2)}, sl, dl, bucket_bytes=4096)
        with pytest.raises(ValueError, match="unknown source tensor 'bogus'"):
            fn({**src_t, "bogus": torch.zeros(1)}, dst_t, sl, dl, bucket_bytes=4096)
    assert refit(src_t, dst_t, sl, dl, bucket_bytes=4096).ignored  # cache unaffected by the failures


def test_single_process_parameters_are_compared_not_written():
    """named_parameters() of a module (requires_grad leaves) as the destination, plus a derived parameter."""
    from .dist_cases import REFIT_SRC_PLACEMENTS, TinyModel, refit_shapes

    shapes = refit_shapes()
    src = P(shapes, [0], REFIT_SRC_PLACEMENTS)
    dst = P(shapes, [0], [R])
    model = TinyModel()
    model.register_parameter("W_UV", torch.nn.Parameter(torch.ones(2)))  # derived after loading, not in the layout
    g = dc.global_data(src.specs())
    src_t = dc.build_locals((src,), 0, g)
    with pytest.warns(UserWarning, match="W_UV"):
        rep = verify_refit(src_t, model.named_parameters(), src.layout(), dst.layout())
    assert not rep.ok and rep.ignored == ("W_UV",) and set(rep.mismatches) == set(shapes)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in g:
                p.copy_(g[n])
    rep = verify_refit(src_t, model.named_parameters(), src.layout(), dst.layout())
    assert rep.ok, rep
    assert all(p.grad is None and p.is_leaf for p in model.parameters())


@pytest.mark.parametrize(("mutate", "exc", "tensor"), SINGLE_RANK)
def test_single_process_verify_rejects_bad_input(mutate, exc, tensor):
    """The same bad local tensors ``run`` rejects, rejected by ``verify`` with the same messages."""
    r, src_t, dst_t = _one_rank()
    mutate(src_t, dst_t)
    with pytest.raises(exc) as e:
        r.verify(src_t, dst_t)
    msg = str(e.value)
    assert names(msg, tensor, 0) if tensor else (names(msg, "w_t", 0) or names(msg, "ids_t", 0)), msg


def test_verify_report_is_frozen():
    src = Layout.from_placements({"w": (3, 2)}, [0], [Replicate()])
    dst = Layout.from_fragments({"w": ((3, 2), F32)}, [Fragment("w", 0, (0, 0), (3, 2), "w_local")])
    rep = Resharder(plan_reshard(src, dst)).verify({"w": torch.ones(3, 2)}, {"w_local": torch.ones(3, 2)})
    assert rep.ok and rep.rank == 0 and rep.compared_elements == 6 and rep.stats.local_bytes == 24
    with pytest.raises(AttributeError):
        rep.ok = False  # type: ignore[misc]
