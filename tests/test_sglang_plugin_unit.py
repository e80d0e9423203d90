"""sglang_layout and the SGLang plug-in's pure parts, without SGLang (the real SGLang: tests/sglang_tier)."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.integrations import sglang as ts
from triton_reshard.presets import get_config, sglang_layout, vllm_layout


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_is_vllms_format(model, tp):
    cfg = get_config(model)
    assert sglang_layout(cfg, tp=tp, dtype=torch.float32).digest == vllm_layout(cfg, tp=tp, dtype=torch.float32).digest


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 1), (4, 4)])
def test_moe_names(tp, ep):
    cfg = get_config("tiny_qwen3_moe")
    lay = sglang_layout(cfg, tp=tp, ep=ep, dtype=torch.float32)
    names = {s.name for s in lay.locals}
    assert "model.layers.0.mlp.experts.w13_weight" in names and "model.layers.1.mlp.experts.w2_weight" in names
    assert not any("routed_experts" in n for n in names)
    w13 = {s.rank: s.shape for s in lay.locals if s.name == "model.layers.0.mlp.experts.w13_weight"}
    E, inter, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    want = (E // ep, 2 * inter // (tp // ep), H)
    assert set(w13.values()) == {want}
    # the same boxes as vLLM's (up to 0.23, the same names) with or without expert parallelism
    old = vllm_layout(cfg, tp=tp, enable_expert_parallel=ep > 1, dtype=torch.float32, vllm_version="0.23.0")
    assert lay.digest == old.digest


def test_dp_replicas_and_ranks():
    cfg = get_config("tiny_qwen3_moe")
    lay = sglang_layout(cfg, tp=2, dp=2, ep=2, ranks=4, dtype=torch.float32)
    assert lay.ranks == (4, 5, 6, 7)
    one = sglang_layout(cfg, tp=2, ep=2, ranks=4, dtype=torch.float32)
    assert {(s.name, s.shape) for s in lay.locals if s.rank == 6} == {(s.name, s.shape) for s in one.locals if s.rank == 4}


@pytest.mark.parametrize("kw,match", [
    (dict(enable_dp_attention=True), "attention data parallelism"),
    (dict(tp=4, ep=2), "ep=2 with tp=4"),
    (dict(tp=2, ep=3), "must divide tp"),
    (dict(sglang_version="0.4.9"), "were not checked"),
])
def test_refused_in_one_line(kw, match):
    with pytest.raises((NotImplementedError, ValueError), match=match) as e:
        sglang_layout(get_config("tiny_qwen3_moe"), **kw)
    assert "\n" not in str(e.value)


def test_refused_models():
    with pytest.raises(NotImplementedError, match="deepseek_v3.*layout_from_sglang"):
        sglang_layout(get_config("tiny_deepseek_v3"), tp=2)
    cfg = {**get_config("tiny_llama"), "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(NotImplementedError, match="quantized"):
        sglang_layout(cfg, tp=2)


def test_layout_difference_names_the_tensor():
    cfg = get_config("tiny_qwen3_moe")
    a = sglang_layout(cfg, tp=2, dtype=torch.float32)
    assert ts.layout_difference(a, sglang_layout(cfg, tp=2, dtype=torch.float32)) is None
    why = ts.layout_difference(vllm_layout(cfg, tp=2, dtype=torch.float32, vllm_version="0.33.0"), a)
    assert "mlp.experts" in why and "rank 0" in why
    # the same names, other boxes: KV heads of another TP size's split
    dense = get_config("tiny_llama")
    b = sglang_layout(dense, tp=2, dtype=torch.float32)
    c = sglang_layout(dense, tp=2, dtype=torch.float32, ranks=[1, 0])
    assert "holds a different box" in ts.layout_difference(b, c)


def test_control_messages_are_json():
    nt = ts.encode_control({"op": "refit", "version": 3})
    assert [n for n, _ in nt] == [ts.CONTROL] and nt[0][1].dtype == torch.uint8
    assert ts.decode_control(nt) == {"op": "refit", "version": 3}
    with pytest.raises(ValueError, match="expected one tensor"):
        ts.decode_control([("model.norm.weight", torch.ones(2))])
    with pytest.raises(ValueError, match="unknown control message"):
        ts.decode_control(ts.encode_control({"op": "exec"}))


def test_group_options_one_place(monkeypatch):
    g = {"host": "127.0.0.1", "port": 5, "world_size": 6, "timeout": 30, "rank_offset": 2}
    assert ts.group_options(g) == {"host": "127.0.0.1", "port": 5, "world_size": 6, "backend": None, "timeout": 30.0}
    with pytest.raises(ValueError, match="TR_SECRET"):
        ts.group_options({**g, "secret_env": "TR_SECRET"})


def test_the_control_plane_carries_the_sglang_control_message_as_data():
    """SGLangStoreClient sends the plug-in's control message through the data-only control plane (JSON, one of
    control.METHODS); the engine rank's sglang_update_kwargs rebuilds the tensor SGLang passes our loader."""
    from triton_reshard.comm import wire
    from triton_reshard.integrations import control

    sent = []

    class Client(control.SGLangStoreClient):
        def __init__(self):  # no store: record what would be posted
            pass

        def _call(self, method, payload=None):
            sent.append((method, wire.loads(wire.dumps(payload), "test")))

    Client().update_weights_from_tensor(ts.encode_control({"op": "refit", "version": 3}), load_format=ts.LOAD_FORMAT)
    (method, payload), = sent
    assert method in control.METHODS
    kw = control.sglang_update_kwargs(payload)
    assert kw["load_format"] == ts.LOAD_FORMAT
    assert ts.decode_control(kw["named_tensors"]) == {"op": "refit", "version": 3}


def test_stage_and_commit_messages_and_a_commit_with_nothing_staged():
    """Stage, then commit (issue 45): both are control messages the engine ranks accept; a commit with nothing
    staged is refused on the trainer before any engine call (the real stage/commit: tests/sglang_tier)."""
    for op in ("stage", "commit"):
        assert ts.decode_control(ts.encode_control({"op": op, "version": 3})) == {"op": op, "version": 3}
    tr = object.__new__(ts.SGLangTrainer)  # no group, no engine: the refusal comes first
    tr.rank, tr.engine = 0, None
    with pytest.raises(RuntimeError, match="trainer rank 0: commit refused: no complete staged update"):
        tr.commit()
