"""The vLLM backend's reload mode, the parts that need no vLLM: the staging record (checkpoint coordinates, each
box once), the layer groups (vLLM's order) and their merging under a staging budget; the engine tier
(tests/vllm_cpu_tier) runs them on a running engine."""

from __future__ import annotations

import torch

from triton_reshard.integrations.record import LoadRecord
from triton_reshard.integrations.verl import replicated_layout
from triton_reshard.integrations.vllm_transfer import group_layouts, stage_groups, staging_record
from triton_reshard.layout.specs import Fragment

NAMES = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
         "model.norm.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight",
         "model.layers.1.self_attn.q_proj.weight"]


def _layout(shape=(8, 4)):
    return replicated_layout([(n, shape, torch.bfloat16) for n in NAMES], [0])


def test_stage_groups_follow_vllm_order():
    groups = stage_groups(_layout())
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(NAMES) and len(flat) == len(NAMES)
    # un-indexed names split by position in the layout's (name-sorted) order: before the first layer or after
    assert groups[0] == ["lm_head.weight", "model.embed_tokens.weight"]
    layer0 = [g for g in groups if "model.layers.0.self_attn.q_proj.weight" in g][0]
    assert set(layer0) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    assert groups.index(layer0) < [i for i, g in enumerate(groups) if "model.layers.1.mlp.down_proj.weight" in g][0]
    assert groups[-1] == ["model.norm.weight"]


def test_group_layouts_merge_under_the_budget():
    src = dst = _layout()  # every tensor 8 x 4 bf16 = 64 bytes
    assert len(group_layouts(src, dst, "inplace")) == 1
    per_layer = group_layouts(src, dst, "reload", staging_bytes=1)  # a group bigger than the budget stays whole
    assert len(per_layer) == len(stage_groups(dst))
    merged = group_layouts(src, dst, "reload", staging_bytes=128)
    # head + embeddings, layer 0, layer 1 (128 bytes each): apart; norm (64) does not fit beside layer 1
    assert [len(g) for g, _, _ in merged] == [2, 2, 2, 1]
    assert [len(g) for g, _, _ in group_layouts(src, dst, "reload", staging_bytes=320)] == [4, 3]
    assert [n for g, _, _ in merged for n in g] == [n for g in stage_groups(dst) for n in g]  # same order, all once
    for g, s, d in merged:
        assert {t.name for t in s.tensors} == {t.name for t in d.tensors} == set(g)
    assert len(group_layouts(src, dst, "reload", staging_bytes=1 << 30)) == 1


def test_staging_record_is_checkpoint_coordinates_each_box_once():
    rec = LoadRecord(3, tensors={"w": ((8, 4), torch.bfloat16), "emb": ((6, 4), torch.bfloat16)})
    rec.locals = {"qkv": ((12, 4), torch.bfloat16), "embed": ((3, 4), torch.bfloat16), "head": ((3, 4), torch.bfloat16)}
    rec.fragments = [Fragment("w", 3, (4, 0), (4, 4), "qkv", (0, 0)),
                     Fragment("emb", 3, (3, 0), (3, 4), "embed", (0, 0)),
                     Fragment("emb", 3, (3, 0), (3, 4), "head", (0, 0))]  # a tied embedding: the same box twice
    out = staging_record(rec)
    assert out.locals == {"w": ((8, 4), torch.bfloat16), "emb": ((6, 4), torch.bfloat16)}
    assert [(f.tensor, f.offsets, f.sizes, f.local, f.local_offsets) for f in out.fragments] == [
        ("w", (4, 0), (4, 4), "w", (4, 0)), ("emb", (3, 0), (3, 4), "emb", (3, 0))]


def test_forget_refit_state_makes_the_destination_fresh():
    """Reload mode drops the workers' staged mirror on a dense update; the mirror allocated again for the next delta
    holds nothing, so refit's fence must see a fresh destination (it then runs that delta dense)."""
    from triton_reshard import refit, refit_state
    from triton_reshard.refit import forget_refit_state

    lay = replicated_layout([("w", (4, 4), torch.float32)], [0])
    refit({"w": torch.randn(4, 4)}, {"w": torch.empty(4, 4)}, lay, lay, version=7)
    assert refit_state(lay).version == 7
    forget_refit_state(lay)
    assert refit_state(lay).version is None and not refit_state(lay).torn
