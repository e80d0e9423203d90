"""MXFP8 / NVFP4 refits end to end (issue 33) on real gloo worlds of 4 and 8 ranks: Megatron-style BF16 shards
and plain layouts into vLLM-style quantized destinations (``block_quant_layout(..., format=...)`` over
``presets.vllm_layout``), dense and MoE (fused QKV, gate/up, experts' w13), TP/PP/EP, colocated and
disaggregated, several instances, shards that are whole blocks (the sender quantizes in its pack) and shards that
split blocks (the receiver quantizes). Every value byte and scale byte of every destination tensor is compared
with the format's torch reference on the whole BF16 tensor, sliced (``tests/quant_fmt_cases.py``); destinations
are poisoned; five runs per case and ``verify_refit``. Wire bytes equal the quantized lower bound for the cases
without straddling blocks.
"""

from __future__ import annotations

import pytest

from . import quant_fmt_cases as qc

pytestmark = pytest.mark.slow


# the interpreter runs the small raw case (both modes, fp32 source)
TRITON_IDS = ["mxfp8-raw-fp32-cols48-to-rows", "nvfp4-raw-fp32-cols48-to-rows"]
_world = qc.Worlds(qc.fmt_world_main, qc.case_ids, TRITON_IDS)


PARAMS = [pytest.param(c.world, False, c.id, id=f"w{c.world}-torch-{c.id}") for c in qc.CASES.values()]
PARAMS += [pytest.param(4, True, cid, id=f"w4-triton-{cid}") for cid in TRITON_IDS]


@pytest.mark.parametrize(("world", "triton", "case_id"), PARAMS)
def test_format_refit_bit_exact(world, triton, case_id):
    entries = [r[case_id] for r in _world((world, triton)) if case_id in r]
    assert len(entries) == world
    problems = "\n".join(p for e in entries for p in e["problems"])
    assert not problems, problems
    assert {e["verify_total"] for e in entries} == {sum(e["flipped"] for e in entries)}
    assert sum(e["flipped"] for e in entries) >= 2


@pytest.mark.parametrize("case_id", list(qc.CASES))
def test_case_uses_the_modes_it_claims(case_id):
    """Pure: each case exercises the modes it claims; without straddling blocks the wire carries exactly the
    quantized lower bound (values at the format's bits plus one scale per block)."""
    case = qc.CASES[case_id]
    plan = qc.case_plan(case)
    modes = {t.quant for t in plan.transfers + plan.local_copies if t.quant}
    assert modes == set(case.modes), modes
    assert {t.fmt.name for t in plan.transfers + plan.local_copies if t.quant} == {case.fmt}
    st = plan.stats()
    if case.modes == ("src",):
        assert st.wire_bytes == st.lower_bound_bytes
    else:
        assert st.quant_dst_bytes > 0 and st.wire_bytes > st.lower_bound_bytes


def test_nvfp4_non_finite_source_refused_on_every_rank():
    from triton_reshard.testing.launch import run_world

    out = run_world(qc.nonfinite_main, 2, [float("inf"), float("nan")], timeout=300, pg_timeout=60,
                    allow_errors=True)
    assert all(isinstance(r, list) and len(r) == 2 for r in out), out
    for r in (x for rank in out for x in rank):
        assert isinstance(r, dict) and r["error"], out
        assert "'w.proj.weight'" in r["error"] and ("inf" in r["error"] or "NaN" in r["error"]), r["error"]
        assert "nothing was moved" in r["error"] and r["untouched"], r
