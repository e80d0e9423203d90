"""Hugging Face side: the logical tensors of a model, and the plain (unsharded) HF layout.

The *logical* tensors of every preset are the tensors of the model's Hugging Face checkpoint
(``model.safetensors``), by name and shape: ``model.layers.{i}.self_attn.q_proj.weight`` ``[nh*hd, H]``, ...,
and for Qwen3-MoE / DeepSeek-V3 one tensor per expert (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``),
as the checkpoint stores them (transformers >= 5 fuses experts in memory, ``save_pretrained`` writes them back
per expert). With tied embeddings there is no ``lm_head.weight``.

DeepSeek-V3 (``model_type="deepseek_v3"``, MLA + DeepSeekMoE, transformers ``modeling_deepseek_v3.py``):
per layer ``self_attn.q_a_proj`` ``[q_lora_rank, H]``, ``q_a_layernorm`` ``[q_lora_rank]``, ``q_b_proj``
``[nh*(nope+rope), q_lora_rank]`` (rows per head ``[q_nope; q_rope]``; ``q_lora_rank=None``: one ``q_proj``
``[nh*(nope+rope), H]`` instead), ``kv_a_proj_with_mqa`` ``[kv_lora_rank+rope, H]``, ``kv_a_layernorm``
``[kv_lora_rank]``, ``kv_b_proj`` ``[nh*(nope+v), kv_lora_rank]`` (rows per head ``[k_nope; v]``), ``o_proj``
``[H, nh*v]``; the first ``first_k_dense_replace`` layers have a dense MLP, the others ``mlp.gate.weight``
``[E, H]``, ``mlp.gate.e_score_correction_bias`` ``[E]`` (kept in **float32** by transformers, Megatron's
``router.expert_bias`` and vLLM alike, whatever the model dtype: see :func:`tensor_dtypes`), the routed experts
and ``mlp.shared_experts.{gate,up,down}_proj`` (intermediate ``moe_intermediate_size * n_shared_experts``).
The multi-token-prediction layer of the published checkpoint (``model.layers.61.*``,
``num_nextn_predict_layers``) is not listed: transformers does not load it and no preset places it; the FP8
``weight_scale_inv`` tensors neither (bf16/fp32 layouts only).

Also home of :class:`ModelSpec` (the config fields the builders read) and the small fragment builder the
Megatron and vLLM presets share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..layout import ColumnBuilder, Layout, LogicalTensors, Replicate, gc_paused

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)
MLA_FAMILIES = ("deepseek_v3",)  # multi-head latent attention + DeepSeekMoE (shared experts, expert bias)
SUPPORTED_FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + MLA_FAMILIES
EXPERT_BIAS_DTYPE = torch.float32  # e_score_correction_bias / router.expert_bias, in every framework


@dataclass(frozen=True)
class ModelSpec:
    """The parts of a HF config the layout builders read (see :func:`model_spec`)."""

    family: str  # the config's model_type
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    tied: bool
    qkv_bias: bool  # bias on q/k/v (Qwen2 always, others with attention_bias)
    o_bias: bool  # bias on o_proj (Llama/Qwen3 with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    experts: int = 0
    moe_intermediate: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE block or dense MLP
    raw: Mapping | None = None  # the config as given
    # MLA (DeepSeek-V3); q_lora_rank None: a plain q_proj instead of q_a_proj/q_a_layernorm/q_b_proj
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    shared_intermediate: int = 0  # DeepSeekMoE shared experts: moe_intermediate_size * n_shared_experts
    expert_bias: bool = False  # mlp.gate.e_score_correction_bias (DeepSeek-V3, noaux_tc routing)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def mla(self) -> bool:
        return self.family in MLA_FAMILIES

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head dim: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _as_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return config.to_dict()
    raise TypeError(f"config must be a dict or a transformers config, got {type(config).__name__}")


def model_spec(config) -> ModelSpec:
    """Read a HF-style config (dict or ``transformers`` config) into a :class:`ModelSpec`."""
    if isinstance(config, ModelSpec):
        return config
    c = _as_dict(config)
    family = c.get("model_type", "llama")
    if family not in SUPPORTED_FAMILIES:
        raise NotImplementedError(f"model_type {family!r} is not supported (supported: {SUPPORTED_FAMILIES})")
    try:
        hidden, heads, layers, vocab = (int(c[k]) for k in (
            "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"))
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}") from None
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    bias = bool(c.get("attention_bias", False))
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
    moe_layers: tuple[bool, ...] = ()
    if family in MOE_FAMILIES and experts:
        step = int(c.get("decoder_sparse_step", 1) or 1)
        dense_only = set(c.get("mlp_only_layers") or ())
        moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
    elif family in MLA_FAMILIES and experts:
        # vLLM deepseek_v2.py / transformers: layer i is MoE iff i >= first_k_dense_replace and
        # i % moe_layer_freq == 0
        k, freq = int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1) or 1)
        moe_layers = tuple(i >= k and i % freq == 0 for i in range(layers))
    mla: dict = {}
    if family in MLA_FAMILIES:
        try:
            q_lora = c.get("q_lora_rank")
            mla = dict(
                q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(c["kv_lora_rank"]),
                qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                v_head_dim=int(c["v_head_dim"]),
                shared_intermediate=int(c.get("moe_intermediate_size") or 0) * int(c.get("n_shared_experts") or 0),
                expert_bias=bool(experts),
            )
        except KeyError as e:
            raise ValueError(f"config lacks {e.args[0]!r}") from None
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if mla[name] <= 0:
                raise ValueError(f"config {name}={mla[name]} must be positive")
        if mla["q_lora_rank"] is not None and mla["q_lora_rank"] <= 0:
            raise ValueError(f"config q_lora_rank={mla['q_lora_rank']} must be positive or None")
    for name, v in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                    ("num_hidden_layers", layers), ("vocab_size", vocab), ("head_dim", head_dim)):
        if v <= 0:
            raise ValueError(f"config {name}={v} must be positive")
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return ModelSpec(
        family=family,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=int(c.get("intermediate_size", 0)),
        layers=layers,
        vocab=vocab,
        tied=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bias,
        o_bias=bias and family != "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        experts=experts,
        moe_intermediate=int(c.get("moe_intermediate_size") or 0),
        moe_layers=moe_layers,
        raw=c,
        **mla,
    )


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def expert_names(i: int, e: int) -> tuple[str, str, str]:
    """HF checkpoint names of expert ``e`` of layer ``i``: (gate_proj, up_proj, down_proj)."""
    p = f"model.layers.{i}.mlp.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _mla_layer(s: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    qr, kvr, H, nh = s.q_lora_rank, s.kv_lora_rank, s.hidden, s.heads
    a = f"{p}.self_attn"
    out: dict[str, tuple[int, ...]] = {}
    if qr is None:
        out[f"{a}.q_proj.weight"] = (nh * s.qk_head_dim, H)
    else:
        out[f"{a}.q_a_proj.weight"] = (qr, H)
        out[f"{a}.q_a_layernorm.weight"] = (qr,)
        out[f"{a}.q_b_proj.weight"] = (nh * s.qk_head_dim, qr)
    out[f"{a}.kv_a_proj_with_mqa.weight"] = (kvr + s.qk_rope_head_dim, H)
    out[f"{a}.kv_a_layernorm.weight"] = (kvr,)
    out[f"{a}.kv_b_proj.weight"] = (nh * (s.qk_nope_head_dim + s.v_head_dim), kvr)
    out[f"{a}.o_proj.weight"] = (H, nh * s.v_head_dim)
    return out


def logical_tensors(config) -> dict[str, tuple[int, ...]]:
    """``{HF checkpoint name: shape}`` of every tensor of the model, in checkpoint order per layer."""
    return _tensor_table(model_spec(config))[0]


@gc_paused()  # ~10^5 new tuples and strings, no cycles: the collector's passes would dominate
def _tensor_table(s: ModelSpec) -> tuple[dict[str, tuple[int, ...]], dict[int, int]]:
    """``logical_tensors`` of ``s``, and per MoE layer where (in the dict's order) its experts start: expert
    ``e``'s gate / up / down projections (``expert_names``) are entries ``3 e``, ``3 e + 1``, ``3 e + 2`` from
    there."""
    H, hd, q, kv = s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, H)}
    experts_at: dict[int, int] = {}
    for i in range(s.layers):
        p = layer_prefix(i)
        out[f"{p}.input_layernorm.weight"] = (H,)
        if s.mla:
            out.update(_mla_layer(s, p))
        else:
            out[f"{p}.self_attn.q_proj.weight"] = (q, H)
            out[f"{p}.self_attn.k_proj.weight"] = (kv, H)
            out[f"{p}.self_attn.v_proj.weight"] = (kv, H)
            if s.qkv_bias:
                out[f"{p}.self_attn.q_proj.bias"] = (q,)
                out[f"{p}.self_attn.k_proj.bias"] = (kv,)
                out[f"{p}.self_attn.v_proj.bias"] = (kv,)
            out[f"{p}.self_attn.o_proj.weight"] = (H, q)
            if s.o_bias:
                out[f"{p}.self_attn.o_proj.bias"] = (H,)
            if s.qk_norm:
                out[f"{p}.self_attn.q_norm.weight"] = (hd,)
                out[f"{p}.self_attn.k_norm.weight"] = (hd,)
        out[f"{p}.post_attention_layernorm.weight"] = (H,)
        if s.is_moe_layer(i):
            im = s.moe_intermediate
            out[f"{p}.mlp.gate.weight"] = (s.experts, H)
            if s.expert_bias:
                out[f"{p}.mlp.gate.e_score_correction_bias"] = (s.experts,)
            experts_at[i] = len(out)
            gate, down, pe = (im, H), (H, im), f"{p}.mlp.experts."
            for e in range(s.experts):  # (the names of ``expert_names``, without a call per expert)
                x = f"{pe}{e}"
                out[x + ".gate_proj.weight"] = gate
                out[x + ".up_proj.weight"] = gate
                out[x + ".down_proj.weight"] = down
            if len(out) != experts_at[i] + 3 * s.experts:
                raise AssertionError(f"layer {i}: expert names collide with other tensors")
            if s.shared_intermediate:
                Is = s.shared_intermediate
                out[f"{p}.mlp.shared_experts.gate_proj.weight"] = (Is, H)
                out[f"{p}.mlp.shared_experts.up_proj.weight"] = (Is, H)
                out[f"{p}.mlp.shared_experts.down_proj.weight"] = (H, Is)
        else:
            out[f"{p}.mlp.gate_proj.weight"] = (s.intermediate, H)
            out[f"{p}.mlp.up_proj.weight"] = (s.intermediate, H)
            out[f"{p}.mlp.down_proj.weight"] = (H, s.intermediate)
    out["model.norm.weight"] = (H,)
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, H)
    return out, experts_at


def tensor_dtypes(config, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    """``{logical tensor: dtype}`` of the model held in ``dtype``: everything in ``dtype`` except the
    DeepSeek expert-score correction bias, which every framework keeps in float32 (transformers
    ``DeepseekV3TopkRouter`` buffer, Megatron ``TopKRouter.expert_bias`` buffer "maintained in float32",
    vLLM ``gate.e_score_correction_bias = Parameter(..., dtype=torch.float32)``)."""
    return {n: EXPERT_BIAS_DTYPE if n.endswith(_FP32_SUFFIX) else dtype for n in logical_tensors(config)}


_FP32_SUFFIX = ".e_score_correction_bias"


def model_numel(config) -> int:
    """Number of elements (parameters) of the model's logical tensors."""
    total = 0
    for shape in logical_tensors(config).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def model_nbytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one full copy of the model's logical tensors held in ``dtype`` (see :func:`tensor_dtypes`)."""
    s = model_spec(config)
    shapes = logical_tensors(s)
    item: dict[torch.dtype, int] = {}
    total = 0
    for name, dt in tensor_dtypes(s, dtype).items():
        if dt not in item:
            item[dt] = torch.empty((), dtype=dt).element_size()
        n = item[dt]
        for d in shapes[name]:
            n *= d
        total += n
    return total


def check_ranks(ranks: Iterable[int] | None, world: int, what: str) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(world))
    if isinstance(ranks, int):  # an offset
        return tuple(range(ranks, ranks + world))
    r = tuple(int(x) for x in ranks)
    if len(r) != world:
        raise ValueError(f"{what} needs {world} ranks, got {len(r)}: {list(r)}")
    if len(set(r)) != len(r) or min(r) < 0:
        raise ValueError(f"{what}: ranks must be distinct and >= 0, got {list(r)}")
    return r


def hf_layout(config, ranks: Sequence[int] | int = (0,), dtype: torch.dtype = torch.bfloat16) -> Layout:
    """Every rank of ``ranks`` holds the whole model, local tensors named like the HF checkpoint.

    ``ranks``: the ranks holding a (replicated) copy; an int means that one rank.
    """
    if isinstance(ranks, int):
        ranks = (ranks,)
    ranks = check_ranks(ranks, len(tuple(ranks)), "hf_layout")
    if not ranks:
        raise ValueError("hf_layout needs at least one rank")
    shapes = logical_tensors(config)
    return Layout.from_placements(shapes, list(ranks), [Replicate()], dtype=tensor_dtypes(config, dtype))


# --------------------------------------------------------------------------------------------------------
# Fragment builder shared by the presets
# --------------------------------------------------------------------------------------------------------


_MODEL_TENSORS: dict[tuple, LogicalTensors] = {}  # a few models per process: trainer and engine share one


def _model_tensors(s: ModelSpec, dtype: torch.dtype) -> LogicalTensors:
    """The logical tensors of model ``s`` held in ``dtype`` (see :func:`tensor_dtypes`), cached per model and
    dtype: the Megatron and vLLM layouts of one model share them (~46,000 names for DeepSeek-V3)."""
    key = (tuple(getattr(s, f.name) for f in fields(s) if f.name != "raw"), dtype)
    lt = _MODEL_TENSORS.get(key)
    if lt is None:
        shapes, experts_at = _tensor_table(s)
        # (the names ending in _FP32_SUFFIX: only _tensor_table's router biases, looked up instead of scanning)
        biases = (f"{layer_prefix(i)}.mlp.gate{_FP32_SUFFIX}" for i in range(s.layers))
        lt = LogicalTensors.from_shapes(shapes, dtype, {n: EXPERT_BIAS_DTYPE for n in biases if n in shapes})
        if experts_at:  # LayoutBuilder.expert_ids from the dict's order: no name built or looked up twice
            pos = np.fromiter(map(lt.index.__getitem__, shapes), np.int64, len(shapes))  # dict order -> tensor id
            a = np.full((s.layers, max(s.experts, 1), 3), -1, dtype=np.int64)
            for i, at in experts_at.items():
                a[i] = pos[at:at + 3 * s.experts].reshape(s.experts, 3)
            a.setflags(write=False)
            lt.cache["expert_ids"] = a
        if len(_MODEL_TENSORS) >= 8:
            _MODEL_TENSORS.pop(next(iter(_MODEL_TENSORS)))
        _MODEL_TENSORS[key] = lt
    return lt


class LayoutBuilder(ColumnBuilder):
    """Collects local tensors and boxes, then builds a :class:`~triton_reshard.layout.ColumnarLayout`.

    Every local tensor is declared with its full shape (so padding, and local tensors holding no fragment at
    all, e.g. a vocab shard that is all padding, are still in the layout: ``named_parameters()`` has them).

    Each call takes one rank or a whole array of ranks (``rank`` an int or an int array; ``start``, ``at``,
    ``lead`` entries and even ``tensor``, a sequence of names, may differ per rank): the presets describe a
    model with one call per tensor family and group of alike ranks, so a 1,024-rank layout costs a few
    thousand numpy calls, not a million Python objects (see ``layout.columnar``).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]] | LogicalTensors, dtype: torch.dtype,
                 dtypes: Mapping[str, torch.dtype] | None = None):
        super().__init__(shapes if isinstance(shapes, LogicalTensors) else
                         LogicalTensors.from_shapes(shapes, dtype, dtypes), dtype)

    @classmethod
    def for_model(cls, s: ModelSpec, dtype: torch.dtype) -> LayoutBuilder:
        """A builder over the logical tensors of model ``s`` held in ``dtype`` (see :func:`tensor_dtypes`)."""
        return cls(_model_tensors(s, dtype), dtype)

    def full(self, tensor: str, rank, local: str) -> None:
        """All of ``tensor`` as the whole local tensor ``local`` (replicated pieces: norms, routers)."""
        i = self.tensors.index[tensor]
        shape = self.tensors.shapes[i]
        self.local(rank, local, shape, self.tensors.dtypes[i])
        self.box(tensor, rank, local, (0,) * len(shape), shape)

    def _shape(self, tensor) -> tuple[int, ...]:
        if type(tensor) is str:
            return self.shape_of(tensor)
        if isinstance(tensor, np.ndarray) and tensor.dtype.kind in "iu":  # tensor ids, all of one shape
            return self.tensors.shapes[int(tensor.reshape(-1)[0])]
        return self.shape_of(tensor[0])

    def expert_ids(self, s: ModelSpec) -> np.ndarray:
        """``[layers, experts, 3]``: the tensor ids (see ``tensors.names``) of expert ``e``'s gate / up / down
        projection in layer ``i`` (-1 in dense layers); built once per model (cached on its tensors)."""
        a = self.tensors.cache.get("expert_ids")
        if a is None:
            idx = self.tensors.index
            a = np.full((s.layers, max(s.experts, 1), 3), -1, dtype=np.int64)
            for i in range(s.layers):
                if s.is_moe_layer(i):
                    a[i] = [[idx[n] for n in expert_names(i, e)] for e in range(s.experts)]
            a.setflags(write=False)
            self.tensors.cache["expert_ids"] = a
        return a

    def rows(self, tensor, rank, local: str, start, count, at=0, lead=()) -> None:
        """Rows ``[start, start+count)`` (dim 0) of ``tensor`` at row ``at`` of ``local`` (after ``lead`` dims)."""
        shape = self._shape(tensor)
        if type(start) is int and type(count) is int:
            count = max(0, min(count, shape[0] - start))
        else:
            count = np.maximum(0, np.minimum(count, shape[0] - np.asarray(start)))
        self.box(tensor, rank, local, (start,) + (0,) * (len(shape) - 1), (count,) + shape[1:],
                 tuple(lead) + (at,) + (0,) * (len(shape) - 1))

    def cols(self, tensor, rank, local: str, start, count, at=0, lead=()) -> None:
        """Columns ``[start, start+count)`` (dim 1) of a 2-D ``tensor`` at column ``at`` of ``local``."""
        rows, _ = self._shape(tensor)
        self.box(tensor, rank, local, (0, start), (rows, count), tuple(lead) + (0, at))
