"""Block-FP8 refit end to end (issue 11) on real gloo worlds of 4 and 8 ranks: Megatron-style BF16 shards
(``presets.megatron_layout``) and plain layouts into vLLM-style block-FP8 destinations (``block_quant_layout``
over ``presets.vllm_layout``), dense and MoE, colocated and disaggregated, with source shards that are whole
blocks (the sender quantizes) and shards that split blocks (the receiver quantizes), fp32 sources and UE8M0
scales. Every fp8 byte and every scale of every destination tensor is compared with the torch reference
quantization of the whole BF16 tensor, sliced (``tests/quant_cases.py``); destinations are poisoned; three
refits per case (fresh tensors, reused tensors with new data, column-major destinations), ``verify_refit``
(0 on the result, exactly the two corrupted elements after corrupting them). The torch copy backend in both
worlds, the Triton kernels (``TRITON_INTERPRET=1``: copies and quantization) in a world of 4.
"""

from __future__ import annotations

import pytest

from . import quant_cases as qc

pytestmark = pytest.mark.slow

# the Triton interpreter runs one program per block (block FP8), one after another: two cases that cover both modes, local
# quantization, fp32 sources and UE8M0 (~2 min on 2 cores)
TRITON_IDS = ["moe-tp4-to-vllm-tp2dp2-ep-colocated", "raw-fp32-rows24-to-cols-ue8m0"]
_world = qc.Worlds(qc.quant_world_main, qc.case_ids, TRITON_IDS)
PARAMS = [pytest.param(c.world, False, c.id, id=f"w{c.world}-torch-{c.id}") for c in qc.CASES.values()]
PARAMS += [pytest.param(4, True, cid, id=f"w4-triton-{cid}") for cid in TRITON_IDS]


@pytest.mark.parametrize(("world", "triton", "case_id"), PARAMS)
def test_fp8_refit_bit_exact(world, triton, case_id):
    entries = [r[case_id] for r in _world((world, triton)) if case_id in r]
    assert len(entries) == world
    problems = "\n".join(p for e in entries for p in e["problems"])
    assert not problems, problems
    # verify counted exactly the corrupted elements, summed over the ranks that hold quantized tensors
    assert {e["verify_total"] for e in entries} == {sum(e["flipped"] for e in entries)}
    assert sum(e["flipped"] for e in entries) >= 2


@pytest.mark.parametrize("case_id", list(qc.CASES))
def test_case_uses_the_modes_it_claims(case_id):
    """Pure: each case really exercises what it is there for (source- and/or destination-side quantization)."""
    case = qc.CASES[case_id]
    plan = qc.case_plan(case)
    modes = {t.quant for t in plan.transfers + plan.local_copies if t.quant}
    assert modes == set(case.modes), modes
    st = plan.stats()
    if case.modes == ("src",):
        assert st.wire_bytes == st.lower_bound_bytes
    else:
        assert st.quant_dst_bytes > 0 and st.wire_bytes > st.lower_bound_bytes
