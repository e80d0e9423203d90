"""Block deltas into MXFP8 / NVFP4 destinations (issue 33): the op (``ops/block_delta.py``) on hand-made chunks,
and delta refits on a gloo world of 4 (``quant_fmt_cases.delta_case``): poisoned destinations, a dense first
version, then versions with ~2 % of the elements moved by one ulp sent as block deltas (fewer bytes than dense),
and a version whose NVFP4 global scale moves (that group named in ``RunReport.rescaled``): every byte of values
and scales equal to the reference quantization of the whole tensors."""

from __future__ import annotations

import functools

import pytest
import torch

from tests import quant_fmt_cases as qc
from triton_reshard.ops.block_delta import max_block_message_bytes, pack_block_delta, unpack_block_delta


@pytest.mark.parametrize("scale_dtype,bb", [(torch.uint8, 32), (torch.float8_e4m3fn, 8)])
def test_op_sends_touched_blocks_and_goes_dense_when_smaller(scale_dtype, bb):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (6, 4 * bb), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (6, 4), dtype=torch.uint8, generator=g).view(scale_dtype)
    snap = (q.clone(), s.clone())
    dq = torch.full((6, 5 * bb), 0xEE, dtype=torch.uint8)[:, bb:]  # strided destination views
    ds = torch.full((6, 5), 0xEE, dtype=torch.uint8)[:, 1:]
    dq.copy_(q)
    ds.copy_(s.view(torch.uint8))
    q2, s2 = q.clone(), s.clone()
    q2[1, 3] ^= 1  # block (1, 0)
    s2.view(torch.uint8)[4, 2] ^= 1  # block (4, 2)
    msg = pack_block_delta([(q2, s2)], [snap])
    dense = max_block_message_bytes([(q.numel(), s.numel())])
    assert msg.numel() < dense and msg.numel() % 16 == 0
    assert torch.equal(snap[0], q2) and torch.equal(snap[1].view(torch.uint8), s2.view(torch.uint8))
    unpack_block_delta(msg, [(dq, ds.view(scale_dtype))])
    assert torch.equal(dq, q2) and torch.equal(ds, s2.view(torch.uint8))
    q3 = torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=g)  # every block: dense
    msg = pack_block_delta([(q3, s2)], [snap])
    assert msg.numel() == dense
    unpack_block_delta(msg, [(dq, ds.view(scale_dtype))])
    assert torch.equal(dq, q3)
    bad = msg.clone()
    bad[:8].view(torch.int64)[0] = 99  # more blocks than the destination has: refused before any write
    before = dq.clone()
    with pytest.raises(ValueError, match="chunk 0"):
        unpack_block_delta(bad, [(dq, ds.view(scale_dtype))])
    assert torch.equal(dq, before)


@functools.cache
def _world():
    from triton_reshard.testing.launch import run_world

    return run_world(qc.delta_world_main, 4, list(qc.DELTA_IDS), timeout=600, pg_timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", qc.DELTA_IDS)
def test_block_delta_refit_bit_exact(case_id):
    reps = [r[case_id] for r in _world()]
    problems = [p for r in reps for p in r["problems"]]
    assert not problems, "\n".join(problems[:5])
    for r in reps:
        modes = [x["mode"] for x in r["reps"]]
        assert modes == ["dense-fallback", "delta", "delta", "delta"], r["reps"]
    sent = [sum(r["reps"][v]["sent"] for r in reps) for v in range(4)]
    dense = [sum(r["reps"][v]["dense"] for r in reps) for v in range(4)]
    assert sent[1] < dense[1] and sent[2] < dense[2], (sent, dense)
    rescaled = {g for r in reps for g in r["reps"][3]["rescaled"]}
    if case_id.startswith("nvfp4"):
        assert reps[0]["changed"] in rescaled, rescaled
        assert not any(r["reps"][v]["rescaled"] for r in reps for v in (1, 2))
    else:
        assert not rescaled


@pytest.mark.slow
def test_bench_quant_delta_small_run_measures_block_deltas(tmp_path):
    """perf/bench_quant_delta.py, small (its perf/smoke.py arguments): real AdamW steps of a tiny model, each
    format's block-delta message applied and checked bit-exact by the script itself; the JSON says that both
    1 x B formats send less than dense and that block FP8's 128 x 128 blocks are all touched."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    perf = Path(__file__).resolve().parents[1] / "perf"
    sys.path.insert(0, str(perf))
    import smoke

    _tier, args, limit = smoke.SMOKE["bench_quant_delta.py"]
    out = tmp_path / "quant_delta.json"
    argv = [a.format(out=tmp_path) for a in args]
    p = subprocess.run([sys.executable, str(perf / "bench_quant_delta.py"), *argv], capture_output=True, text=True,
                       timeout=limit, cwd=perf.parent)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    runs = json.loads(out.read_text())["lrs"]
    assert runs, "no learning rate measured"
    for lr, r in runs.items():
        for fmt in ("mxfp8", "nvfp4"):
            ratio = r["measured"][fmt]["message_vs_dense_bytes"]
            assert 0 < ratio < 1, (lr, fmt, ratio)
        assert r["fp8-128x128"]["touched_fraction"] == 1.0, (lr, r["fp8-128x128"])
