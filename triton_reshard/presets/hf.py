"""Hugging Face side: the logical tensors of a model, and the plain (unsharded) HF layout.

The *logical* tensors of every preset are the tensors of the model's Hugging Face checkpoint
(``model.safetensors``), by name and shape: ``model.layers.{i}.self_attn.q_proj.weight`` ``[nh*hd, H]``, ...,
and for Qwen3-MoE one tensor per expert (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), as the
checkpoint stores them (transformers >= 5 fuses experts in memory, ``save_pretrained`` writes them back per
expert). With tied embeddings there is no ``lm_head.weight``.

Also home of :class:`ModelSpec` (the config fields the builders read) and the small fragment builder the
Megatron and vLLM presets share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..layout import Fragment, Layout, LocalSpec, Replicate, TensorSpec, _gc_paused

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)
HF_ONLY_FAMILIES = ("deepseek_v3",)


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
    raw: Mapping | None = None  # the config as given (for families with more fields, e.g. MLA)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


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
    if family not in DENSE_FAMILIES + MOE_FAMILIES + HF_ONLY_FAMILIES:
        raise NotImplementedError(
            f"model_type {family!r} is not supported (supported: {DENSE_FAMILIES + MOE_FAMILIES + HF_ONLY_FAMILIES})"
        )
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
    elif family == "deepseek_v3":
        k, freq = int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1))
        moe_layers = tuple(i >= k and i % freq == 0 for i in range(layers))
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
    )


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def expert_names(i: int, e: int) -> tuple[str, str, str]:
    """HF checkpoint names of expert ``e`` of layer ``i``: (gate_proj, up_proj, down_proj)."""
    p = f"model.layers.{i}.mlp.experts.{e}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def _mla_layer(s: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    c = s.raw or {}
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    qr, kvr, H, nh = int(c["q_lora_rank"]), int(c["kv_lora_rank"]), s.hidden, s.heads
    return {
        f"{p}.self_attn.q_a_proj.weight": (qr, H),
        f"{p}.self_attn.q_a_layernorm.weight": (qr,),
        f"{p}.self_attn.q_b_proj.weight": (nh * (nope + rope), qr),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kvr + rope, H),
        f"{p}.self_attn.kv_a_layernorm.weight": (kvr,),
        f"{p}.self_attn.kv_b_proj.weight": (nh * (nope + v), kvr),
        f"{p}.self_attn.o_proj.weight": (H, nh * v),
    }


def logical_tensors(config) -> dict[str, tuple[int, ...]]:
    """``{HF checkpoint name: shape}`` of every tensor of the model, in checkpoint order per layer."""
    s = model_spec(config)
    H, hd, q, kv = s.hidden, s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, H)}
    for i in range(s.layers):
        p = layer_prefix(i)
        out[f"{p}.input_layernorm.weight"] = (H,)
        if s.family == "deepseek_v3":
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
            if s.family == "deepseek_v3":
                out[f"{p}.mlp.gate.e_score_correction_bias"] = (s.experts,)
            for e in range(s.experts):
                g, u, d = expert_names(i, e)
                out[g], out[u], out[d] = (im, H), (im, H), (H, im)
            if s.family == "deepseek_v3":
                Is = im * int((s.raw or {}).get("n_shared_experts", 1))
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
    return out


def model_nbytes(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one full copy of the model's logical tensors in ``dtype``."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for shape in logical_tensors(config).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total * item


def _check_ranks(ranks: Iterable[int] | None, world: int, what: str) -> tuple[int, ...]:
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
    ranks = _check_ranks(ranks, len(tuple(ranks)), "hf_layout")
    if not ranks:
        raise ValueError("hf_layout needs at least one rank")
    shapes = logical_tensors(config)
    return Layout.from_placements(shapes, list(ranks), [Replicate()], dtype=dtype)


# --------------------------------------------------------------------------------------------------------
# Fragment builder shared by the presets
# --------------------------------------------------------------------------------------------------------


class LayoutBuilder:
    """Collects local tensors and fragments, then builds a :class:`Layout`.

    Every local tensor is declared with its full shape (so padding, and local tensors holding no fragment at
    all, e.g. a vocab shard that is all padding, are still in the layout: ``named_parameters()`` has them).

    Boxes and local tensors are collected as plain tuples and turned into :class:`Fragment` /
    :class:`LocalSpec` values (validated there) in :meth:`build`, with the garbage collector paused: a
    128-rank MoE layout has ~10^5 of each.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype):
        self.specs = {n: TensorSpec(n, tuple(s), dtype) for n, s in shapes.items()}
        self.dtype = dtype
        self._locals: dict[tuple[int, str], tuple[int, ...]] = {}  # (rank, name) -> shape
        self._boxes: list[tuple] = []  # Fragment fields: (tensor, rank, offsets, sizes, local, local_offsets)

    def local(self, rank: int, name: str, shape: Sequence[int]) -> str:
        shape = tuple(map(int, shape))
        prev = self._locals.setdefault((rank, name), shape)
        if prev != shape:
            raise AssertionError(f"local tensor {name!r} on rank {rank} declared twice with different shapes")
        return name

    def box(self, tensor: str, rank: int, local: str, offsets, sizes, local_offsets=()) -> None:
        """Box ``offsets``+``sizes`` of ``tensor`` at ``local_offsets`` of ``local`` (empty boxes are dropped)."""
        if tensor not in self.specs:
            raise AssertionError(f"unknown logical tensor {tensor!r}")
        if min(sizes, default=1) > 0:
            self._boxes.append((tensor, rank, tuple(offsets), tuple(sizes), local, tuple(local_offsets)))

    def full(self, tensor: str, rank: int, local: str) -> None:
        """All of ``tensor`` as the whole local tensor ``local`` (replicated pieces: norms, routers)."""
        shape = self.specs[tensor].shape
        self.local(rank, local, shape)
        self.box(tensor, rank, local, (0,) * len(shape), shape)

    def rows(self, tensor: str, rank: int, local: str, start: int, count: int, at: int = 0, lead=()) -> None:
        """Rows ``[start, start+count)`` (dim 0) of ``tensor`` at row ``at`` of ``local`` (after ``lead`` dims)."""
        shape = self.specs[tensor].shape
        count = max(0, min(count, shape[0] - start))
        self.box(tensor, rank, local, (start,) + (0,) * (len(shape) - 1), (count,) + shape[1:],
                 tuple(lead) + (at,) + (0,) * (len(shape) - 1))

    def cols(self, tensor: str, rank: int, local: str, start: int, count: int, at: int = 0, lead=()) -> None:
        """Columns ``[start, start+count)`` (dim 1) of a 2-D ``tensor`` at column ``at`` of ``local``."""
        rows, _ = self.specs[tensor].shape
        self.box(tensor, rank, local, (0, start), (rows, count), tuple(lead) + (0, at))

    @property
    def fragments(self) -> list[Fragment]:
        """The fragments collected so far."""
        return [Fragment(*b) for b in self._boxes]

    @property
    def locals(self) -> dict[tuple[int, str], LocalSpec]:
        """The local tensors declared so far."""
        return {(r, n): LocalSpec(r, n, shape, self.dtype) for (r, n), shape in self._locals.items()}

    def build(self) -> Layout:
        covered = {b[0] for b in self._boxes}
        missing = sorted(set(self.specs) - covered)
        if missing:
            raise AssertionError(f"layout builder left tensors without any fragment: {missing[:5]}")
        with _gc_paused():
            return Layout(tuple(self.specs.values()), tuple(self.fragments), tuple(self.locals.values()))
