"""``layout_from_megatron``'s pure readers, without Megatron (the live model: ``tests/engines/test_megatron_live.py``).

The layer spec and the expert MLP class are read from parameter names; here the names are the preset's own for
each spec (the TE spec's cannot be built on CPU: Transformer Engine needs CUDA), so each reader must give back
the argument the names were made with. The vocab reader must find a ``vocab_divisible_by`` that reproduces
Megatron's padded row count.
"""

from __future__ import annotations

import pytest

from triton_reshard.integrations.megatron import detect_grouped_gemm, detect_spec, detect_vocab_divisible_by
from triton_reshard.presets import get_config, megatron_layout, padded_vocab_size


def _names(model: str, rank: int = 0, **kw) -> list[str]:
    return list(megatron_layout(get_config(model), **kw).local_specs(rank))


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe", "tiny_deepseek_v3"])
@pytest.mark.parametrize("spec", ["te", "local"])
def test_spec_from_names(model, spec):
    if spec == "local" and model == "tiny_deepseek_v3":
        pytest.skip("megatron_layout refuses MLA with the local spec")
    assert detect_spec(_names(model, spec=spec)) == spec
    # a last pipeline stage (layers and the output layer) reads the same
    assert detect_spec(_names(model, rank=1, pp=2, spec=spec)) == spec


def test_spec_unknown_without_layers():
    assert detect_spec(["embedding.word_embeddings.weight", "output_layer.weight"]) is None


@pytest.mark.parametrize(("spec", "grouped"), [("te", True), ("te", False), ("local", False)])
def test_grouped_gemm_from_names(spec, grouped):
    names = _names("tiny_qwen3_moe", tp=2, dp=2, ep=2, spec=spec, grouped_gemm=grouped)
    assert detect_grouped_gemm(names) is grouped
    assert detect_grouped_gemm(_names("tiny_llama", spec=spec)) is None


def test_legacy_grouped_mlp_refused():
    with pytest.raises(NotImplementedError, match="legacy GroupedMLP"):
        detect_grouped_gemm(["decoder.layers.0.mlp.experts.weight1"])


@pytest.mark.parametrize(("vocab", "tp", "vpad", "want"), [
    (300, 1, 300, None), (300, 4, 300, None),  # Megatron-Bridge: unpadded
    (300, 2, 512, 128), (300, 1, 384, 128), (151936, 4, 152064, 128),  # Megatron-LM's default
    (301, 2, 302, 1), (300, 2, 320, 16), (300, 4, 304, 2),  # the smallest that reproduces it
    (300, 2, 1000, 500),  # any multiple of tp above the vocab: vpad // tp reproduces it
])
def test_vocab_divisible_by(vocab, tp, vpad, want):
    d = detect_vocab_divisible_by(vocab, vpad, tp, "rank 0")
    assert d == want
    assert padded_vocab_size(vocab, tp, d) == vpad


@pytest.mark.parametrize(("vocab", "tp", "vpad"), [(300, 2, 256), (300, 4, 302)])
def test_vocab_impossible(vocab, tp, vpad):
    with pytest.raises(ValueError, match=r"rank 0: the model's vocab has"):
        detect_vocab_divisible_by(vocab, vpad, tp, "rank 0")
