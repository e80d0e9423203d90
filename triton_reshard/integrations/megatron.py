"""The training side read off a live Megatron-Core model: :func:`layout_from_megatron`.

Instead of restating TP/PP/DP/EP, the stage split, the vocab padding, the layer spec and the dtype for
:func:`~triton_reshard.presets.megatron_layout`, read them from the model and ``megatron.core.parallel_state``
on each training rank, build the preset's layout with them, and check this rank's part of it against the
model's own ``named_parameters()`` (+ buffers)::

    from megatron.core import parallel_state
    from triton_reshard.integrations import layout_from_megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model = GPTModel(config, spec, vocab_size=padded_vocab, ...)   # or [DDP(Float16Module(...))]
    train = layout_from_megatron(model, hf_config)   # the same Layout on every rank
    refit(dict(model.named_parameters()), dict(vllm_model.named_parameters()), train, infer)

What is read from where (megatron-core 0.16.1):

* ``tp``, ``pp``, ``dp``, ``ep``, ``etp``, this rank's stage: ``parallel_state.get_*_world_size()`` /
  ``get_pipeline_model_parallel_rank()``; Megatron's rank order (``tp-cp-ep-dp-pp``, which the preset
  assumes) is checked against the ranks of this rank's TP, PP, DP, EP and expert-TP groups.
* the layer range of every stage: ``transformer_block.get_num_layers_to_build`` and
  ``transformer_layer.get_transformer_layer_offset`` for each ``pp_rank`` (``pipeline_model_parallel_layout``:
  its own per-stage counts), from the model's ``TransformerConfig`` alone, so every rank computes every
  stage's range (uneven ``num_layers_in_first/last_pipeline_stage``, Megatron-LM's
  ``--decoder-first/last-pipeline-num-layers``, included); this rank's range is checked against its
  ``decoder.layers[j].layer_number``.
* the vocab padding: ``GPTModel.vocab_size`` (the padded size, on every stage), checked against the local rows
  of ``embedding.word_embeddings`` / ``output_layer`` times ``tp``, against the HF ``vocab_size``.
* the layer spec: TE (``linear_qkv.layer_norm_weight``, the fused norms) or local (``input_layernorm``) from
  the parameter names; grouped GEMM: ``mlp.experts.linear_fc1.weight0`` (TEGroupedMLP) vs
  ``mlp.experts.local_experts.{k}`` (SequentialMLP) from the names, else ``config.moe_grouped_gemm``.
* tied embeddings: ``GPTModel.share_embeddings_and_output_weights`` (must match the HF config's
  ``tie_word_embeddings``); the dtype: the parameters' (most common) dtype.

No collective is called: every input is either global (the ``TransformerConfig``, the parallel state) or
checked locally, so the ranks may call it independently; all of them get the identical Layout.
The HF config is required: the logical tensors are HF tensors, and the ``TransformerConfig`` holds neither
the HF vocab size (only the padded one) nor the model family (``llama`` / ``mistral`` / ``qwen2`` differ in
HF names and config flags that Megatron does not record).
Not supported (raise ``NotImplementedError``): virtual pipeline (more than one model chunk), context
parallel > 1, multi-token-prediction layers, rank orders other than Megatron's default.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ..layout import Layout
from ..presets.hf import check_ranks, model_spec
from ..presets.megatron import megatron_layout, padded_vocab_size

__all__ = ["layout_from_megatron", "megatron_layout_args"]

_WHAT = "layout_from_megatron"


def _unwrap(model):
    """The GPTModel inside a list of model chunks / DDP / Float16Module wrappers."""
    if isinstance(model, (list, tuple)):
        if not model:
            raise ValueError(f"{_WHAT}: got an empty list of model chunks")
        if len(model) > 1:
            raise NotImplementedError(
                f"{_WHAT}: {len(model)} model chunks: virtual pipeline parallelism (interleaved schedule) is "
                f"not supported (the megatron_layout preset places one contiguous layer range per stage)"
            )
        model = model[0]
    seen = 0
    while not hasattr(model, "decoder") and hasattr(model, "module") and seen < 8:  # DDP, Float16Module, ...
        model, seen = model.module, seen + 1
    if not (hasattr(model, "decoder") and hasattr(model, "config") and hasattr(model, "vocab_size")):
        raise TypeError(
            f"{_WHAT}: expected a Megatron-Core GPTModel (or a list of one, or wrapped in DDP/Float16Module), "
            f"got {type(model).__name__}"
        )
    return model


def _stage_ranges(tc, pp: int) -> list[range]:
    """Global layer indices of every pipeline stage, from the TransformerConfig (Megatron's own functions)."""
    if pp == 1:
        return [range(tc.num_layers)]
    pl = getattr(tc, "pipeline_model_parallel_layout", None)
    if pl is not None:
        from megatron.core.transformer.enums import LayerType

        if getattr(pl, "virtual_pipeline_model_parallel_size", 1) != 1:
            raise NotImplementedError(f"{_WHAT}: a pipeline_model_parallel_layout with virtual stages")
        counts = [pl.layout[p][0].count(LayerType.decoder) for p in range(pp)]
        offsets = [sum(counts[:p]) for p in range(pp)]
    else:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        counts = [int(get_num_layers_to_build(tc, vp_stage=None, pp_rank=p)) for p in range(pp)]
        offsets = [int(get_transformer_layer_offset(tc, vp_stage=None, pp_rank=p)) for p in range(pp)]
    out, start = [], 0
    for p, (n, off) in enumerate(zip(counts, offsets, strict=True)):
        if off != start:
            raise ValueError(f"{_WHAT}: Megatron's stage {p} starts at layer {off}, not {start} (stages {counts})")
        out.append(range(start, start + n))
        start += n
    if start != tc.num_layers:
        raise ValueError(f"{_WHAT}: Megatron's stages hold {counts} layers, not num_layers={tc.num_layers}")
    return out


def _check_rank_order(ps, dist, me: int, tp: int, dp: int, pp: int, ep: int, etp: int, moe: bool) -> None:
    """This rank's groups are those of Megatron's default order ``tp-cp-ep-dp-pp`` (cp = 1), the preset's."""
    td = tp * dp
    stage, q = divmod(me, td)
    want = {
        "tensor": (ps.get_tensor_model_parallel_group, [me - me % tp + i for i in range(tp)]),
        "pipeline": (ps.get_pipeline_model_parallel_group, [q + k * td for k in range(pp)]),
        "data": (ps.get_data_parallel_group, [stage * td + me % tp + d * tp for d in range(dp)]),
    }
    if moe:
        base = stage * td
        want["expert tensor"] = (ps.get_expert_tensor_parallel_group,
                                 [base + q - q % etp + i for i in range(etp)])
        block = q - q % (etp * ep)
        want["expert model"] = (ps.get_expert_model_parallel_group,
                                [base + block + q % etp + e * etp for e in range(ep)])
    for name, (get, ranks) in want.items():
        got = sorted(dist.get_process_group_ranks(get()))
        if got != sorted(ranks):
            raise NotImplementedError(
                f"{_WHAT}: rank {me}: Megatron's {name}-parallel group is {got}, not {sorted(ranks)} as in its "
                f"default rank order 'tp-cp-ep-dp-pp' (the order megatron_layout places): another order= is not "
                f"supported"
            )
    if ps.get_tensor_model_parallel_rank() != me % tp or ps.get_pipeline_model_parallel_rank() != stage:
        raise NotImplementedError(f"{_WHAT}: rank {me}: TP/PP ranks differ from Megatron's default rank order")


def detect_spec(names: Sequence[str]) -> str | None:
    """``"te"`` / ``"local"`` from the decoder layers' parameter names (None: this rank holds no layer)."""
    layer = [n for n in names if n.startswith("decoder.layers.")]
    if not layer:
        return None
    if any(n.endswith(".layer_norm_weight") for n in layer):  # TELayerNormColumnParallelLinear (fused norm)
        return "te"
    if any(n.endswith(".input_layernorm.weight") for n in layer):
        return "local"
    return None


def detect_grouped_gemm(names: Sequence[str]) -> bool | None:
    for n in names:
        if ".mlp.experts.local_experts." in n:
            return False
        if ".mlp.experts.linear_fc1.weight" in n:  # TEGroupedMLP: linear_fc1.weight{k}
            return True
        if n.endswith(".mlp.experts.weight1"):  # the legacy GroupedMLP
            raise NotImplementedError(
                f"{_WHAT}: the legacy GroupedMLP ({n}: the local spec with moe_grouped_gemm=True) is not "
                f"supported; use SequentialMLP (moe_grouped_gemm=False) or the TE spec (TEGroupedMLP)"
            )
    return None


def detect_vocab_divisible_by(vocab: int, vpad: int, tp: int, where: str) -> int | None:
    """A ``vocab_divisible_by`` for which :func:`padded_vocab_size` gives Megatron's ``vpad`` rows (the layout
    depends on ``vpad`` only): ``None`` when unpadded, Megatron-LM's 128 when it fits, else the smallest."""
    if vpad == vocab:
        return None
    if vpad < vocab or vpad % tp:
        raise ValueError(
            f"{_WHAT}: {where}: the model's vocab has {vpad} rows (GPTModel.vocab_size), the HF config's vocab_size is "
            f"{vocab}: Megatron's padded vocab must be >= it and a multiple of tp={tp}"
        )
    m = vpad // tp
    for d in [128] + [d for d in range(1, m + 1) if m % d == 0]:
        if m % d == 0 and padded_vocab_size(vocab, tp, d) == vpad:
            return d
    raise AssertionError("unreachable: d = vpad // tp always pads vocab to vpad")


def _config_differences(tc, s) -> list[str]:
    """Fields where the model's TransformerConfig and the HF config disagree."""
    pairs = [("num_layers", tc.num_layers, "num_hidden_layers", s.layers),
             ("hidden_size", tc.hidden_size, "hidden_size", s.hidden),
             ("num_attention_heads", tc.num_attention_heads, "num_attention_heads", s.heads)]
    if not s.mla:
        pairs += [("num_query_groups", tc.num_query_groups or tc.num_attention_heads, "num_key_value_heads",
                   s.kv_heads),
                  ("kv_channels", tc.kv_channels, "head_dim", s.head_dim),
                  ("add_qkv_bias", bool(tc.add_qkv_bias), "attention bias (qwen2)", s.qkv_bias),
                  ("qk_layernorm", bool(tc.qk_layernorm), "q_norm/k_norm (qwen3)", s.qk_norm)]
    if not all(s.moe_layers or [False]):
        pairs.append(("ffn_hidden_size", tc.ffn_hidden_size, "intermediate_size", s.intermediate))
    pairs.append(("num_moe_experts", tc.num_moe_experts or 0, "num_experts", s.experts))
    if s.experts:
        pairs.append(("moe_ffn_hidden_size", tc.moe_ffn_hidden_size, "moe_intermediate_size", s.moe_intermediate))
    return [f"TransformerConfig.{a}={x} vs HF {b}={y}" for a, x, b, y in pairs if x != y]


def megatron_layout_args(model, config=None, *, ranks: Sequence[int] | int | None = None,
                         dtype: torch.dtype | None = None, spec: str | None = None) -> dict:
    """The keyword arguments of :func:`~triton_reshard.presets.megatron_layout` (all but ``config``) that
    describe the live model on this rank, read as :func:`layout_from_megatron` reads them; see there."""
    return _read(model, config, ranks, dtype, spec)[0]


def _read(model, config, ranks, dtype, spec):
    """``megatron_layout``'s arguments read off the live model (and the model, its spec, rank, world, its named
    parameters as a dict and named buffers as a list: one walk of the modules each)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if config is None:
        raise ValueError(
            f"{_WHAT}: pass the model's HF config (a dict or transformers config): the layout's logical tensors "
            f"are the HF checkpoint's, and Megatron's TransformerConfig does not record the HF vocab size (only "
            f"the padded one) nor the model family (llama/mistral/qwen2/qwen3 names and flags)"
        )
    m = _unwrap(model)
    tc = m.config
    s = model_spec(config)
    tp, pp, dp, ep, etp, me, world = _parallel_sizes(ps, dist, m)
    moe = bool(s.experts)
    _check_rank_order(ps, dist, me, tp, dp, pp, ep, etp, moe)
    where = f"rank {me}"
    stages = _stage_ranges(tc, pp)
    pr = me // (tp * dp)
    got = [int(layer.layer_number) - 1 for layer in m.decoder.layers]
    if got != list(stages[pr]):
        raise ValueError(f"{_WHAT}: {where} (stage {pr}): the model's decoder layers are global layers {got}, "
                         f"the TransformerConfig's stage split gives {list(stages[pr])}")
    named = dict(m.named_parameters())
    buffers = list(m.named_buffers())
    names = list(named) + [n for n, _ in buffers]
    vocab_divisible_by = _vocab_and_tying(m, s, named, tp, where)
    spec, grouped = _layer_spec(names, spec, moe, tc, where)
    args = dict(tp=tp, pp=pp, dp=dp, ep=ep if moe else 1, etp=etp if moe else None, ranks=ranks,
                dtype=_dtype(named, tc) if dtype is None else dtype, vocab_divisible_by=vocab_divisible_by,
                grouped_gemm=grouped, layers_per_stage=None if pp == 1 else [len(r) for r in stages], spec=spec)
    return args, m, s, me, world, named, buffers


def _parallel_sizes(ps, dist, m) -> tuple[int, ...]:
    """``(tp, pp, dp, ep, etp, rank, world)`` from the parallel state; what the layout cannot place raises."""
    tc = m.config
    if not ps.model_parallel_is_initialized() or not dist.is_initialized():
        raise RuntimeError(f"{_WHAT}: megatron.core.parallel_state is not initialized (initialize_model_parallel)")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if (vpp or 1) > 1 or (tc.virtual_pipeline_model_parallel_size or 1) > 1:
        raise NotImplementedError(f"{_WHAT}: virtual pipeline parallelism (virtual_pipeline_model_parallel_size="
                                  f"{vpp or tc.virtual_pipeline_model_parallel_size}) is not supported")
    if getattr(m, "mtp_process", False):
        raise NotImplementedError(f"{_WHAT}: multi-token-prediction layers (mtp.*) are not placed by megatron_layout")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    me, world = dist.get_rank(), dist.get_world_size()
    if cp != 1:
        raise NotImplementedError(f"{_WHAT}: context parallel size {cp} > 1 is not supported")
    if tp * pp * dp != world:
        raise ValueError(f"{_WHAT}: tp*pp*dp = {tp}*{pp}*{dp} is not the world size {world}")
    return tp, pp, dp, ep, etp, me, world


def _vocab_and_tying(m, s, named: dict, tp: int, where: str) -> int:
    """The vocab padding (``vocab_divisible_by``) from the model's padded vocab, checked against the local rows
    of the embedding / output layer; the model's tying checked against the HF config's."""
    vpad = int(m.vocab_size)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in named and named[name].shape[0] * tp != vpad:
            raise ValueError(f"{_WHAT}: {where}: {name} has {named[name].shape[0]} rows x tp={tp}, "
                             f"not the model's vocab_size={vpad}")
    vocab_divisible_by = detect_vocab_divisible_by(s.vocab, vpad, tp, where)
    tied = bool(m.share_embeddings_and_output_weights)
    if tied != s.tied:
        raise ValueError(f"{_WHAT}: {where}: the model's share_embeddings_and_output_weights={tied}, the HF "
                         f"config's tie_word_embeddings={s.tied}")
    return vocab_divisible_by


def _layer_spec(names: list[str], spec, moe: bool, tc, where: str):
    """``(spec, grouped_gemm)``: the layer spec from the parameter names (``spec``, if given, must agree), and
    for MoE whether the experts are grouped GEMMs (from the names, else the config)."""
    live_spec = detect_spec(names)
    if spec is None:
        spec = live_spec
        if spec is None:
            raise ValueError(f"{_WHAT}: {where} holds no decoder layer to read the layer spec from: pass spec="
                             f"'te' or 'local'")
    elif live_spec is not None and live_spec != spec:
        raise ValueError(f"{_WHAT}: {where}: spec={spec!r} but the parameter names are the {live_spec!r} spec's")
    grouped = None
    if moe:
        grouped = detect_grouped_gemm(names)
        if grouped is None:
            grouped = bool(tc.moe_grouped_gemm)
    return spec, grouped


def _dtype(named: dict, tc) -> torch.dtype:
    """The parameters' most common dtype (by elements); without parameters, the config's."""
    if named:
        count = Counter()
        for p in named.values():
            count[p.dtype] += p.numel()
        return count.most_common(1)[0][0]
    return torch.bfloat16 if tc.bf16 else torch.float16 if tc.fp16 else tc.params_dtype


def layout_from_megatron(model, config=None, *, ranks: Sequence[int] | int | None = None,
                         dtype: torch.dtype | None = None, spec: str | None = None) -> Layout:
    """The :func:`~triton_reshard.presets.megatron_layout` of a live Megatron-Core ``GPTModel``.

    ``model``: this rank's GPTModel, a list of one model chunk, or wrapped (DDP, Float16Module: ``.module`` is
    unwrapped); ``megatron.core.parallel_state`` must be initialized. ``config``: the model's HF config (dict or
    transformers config), required. ``ranks``: the layout's ranks in Megatron's rank order (default the global
    ranks ``0..world-1`` of the default group; an int offset or a list for a refit group numbered otherwise).
    ``dtype``: default the parameters' dtype. ``spec``: default read from the parameter names (pass it only on a
    stage that holds no decoder layer).

    Raises ``ValueError`` naming the rank and the tensor when this rank's part of the layout does not match the
    model's ``named_parameters()`` + ``named_buffers()`` (name, shape, dtype), or when the model has parameters
    the layout does not place; ``NotImplementedError`` for what the preset does not place (see the module).
    """
    args, m, s, me, world, named, buffers = _read(model, config, ranks, dtype, spec)
    diffs = _config_differences(m.config, s)
    hint = f" (the model's TransformerConfig and the HF config differ: {'; '.join(diffs)})" if diffs else ""
    try:
        layout = megatron_layout(config, **args)
    except ValueError as e:
        raise ValueError(f"{_WHAT}: rank {me}: {e}{hint}") from e
    lr = check_ranks(ranks, world, _WHAT)[me]
    at = f"rank {me}" if lr == me else f"rank {me} (layout rank {lr})"
    want = layout.local_specs(lr)
    have = {n: (tuple(t.shape), t.dtype) for n, t in (*named.items(), *buffers)}  # (one walk of the modules each)
    params = set(named)
    problems = []
    for n, ls in want.items():
        if n not in have:
            problems.append(f"{n}: in the layout {tuple(ls.shape)} {ls.dtype}, not in the model")
        elif have[n] != (tuple(ls.shape), ls.dtype):
            problems.append(f"{n}: layout {tuple(ls.shape)} {ls.dtype}, model {have[n][0]} {have[n][1]}")
    problems += [f"{n}: a model parameter {have[n][0]} the layout does not place" for n in sorted(params - set(want))]
    if problems:
        shown = "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")
        raise ValueError(f"{_WHAT}: {at}: the model does not match the layout of the HF config: {shown}{hint}")
    if diffs:
        raise ValueError(f"{_WHAT}: {at}: the model's TransformerConfig and the HF config differ: {'; '.join(diffs)}")
    return layout
