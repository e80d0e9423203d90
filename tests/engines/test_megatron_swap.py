"""Megatron-Core's own resharding (``megatron.core.resharding.swap_model_weights``) and our ``refit`` between
the same real GPTModels (megatron-core 0.16.1, CPU, gloo): the world of ``perf/bench_megatron.py`` at test size.

One spawned world of 8 ranks builds a TP4 x PP2 source GPTModel (``parallel_state``) and a TP2 x DP4
destination GPTModel (its own ``ProcessGroupCollection``), fills the source from seeded global tensors through
our layout, and runs each side's first call and one more refit; before every call the destination is poisoned
(NaN) and after it every rank compares every destination parameter bit for bit with the global tensors sliced
by the destination layout (``world_main`` raises on a difference). Then: ours moves no more bytes than Megatron's
plan. Skips (with the reason) when ``megatron.core.resharding`` cannot be imported.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("megatron.core.resharding",
                    reason="megatron.core cannot be imported (tests/engines/install.sh installs megatron-core 0.16.1)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "perf"))
import bench_megatron  # noqa: E402

from triton_reshard.presets import get_config  # noqa: E402
from triton_reshard.testing.launch import run_world  # noqa: E402

pytestmark = pytest.mark.slow


def test_megatron_swap_and_ours_bit_exact():
    # 4 KV heads: TP4 keeps whole query groups; vocab 1024: neither side pads it
    cfg = {**get_config("small_llama"), "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1024}
    res = run_world(bench_megatron.world_main, 8, cfg, 0, 1, True, timeout=900, pg_timeout=120)
    for r in res:
        assert set(r["first"]) == set(bench_megatron.SIDES) and all(v > 0 for v in r["first"].values())
        assert all(len(r["steady"][s]) == 1 for s in bench_megatron.SIDES)
    sent = {s: sum(r["sent_bytes"][s] for r in res) for s in bench_megatron.SIDES}
    assert 0 < sent["ours"] <= sent["megatron"], sent
