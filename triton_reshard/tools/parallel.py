"""DTensor-style TP/PP/DP layouts of a Llama-shaped model on Hugging Face tensor names.

A light builder for demos, benchmarks and tests: column-parallel weights (q/k/v, gate/up, embedding and
lm_head over the vocab) are ``Shard(0)`` over TP, row-parallel ones (o_proj, down_proj) ``Shard(1)``, norms
replicated; pipeline stages own contiguous layer ranges (embedding on the first, norm and lm_head on the
last), each stage its own ``[dp, tp]`` mesh; DP replicas hold full copies. Framework-exact formats (fused
QKV, padded vocab, Megatron/vLLM names) live in ``triton_reshard.presets``.

Ranks are numbered tp fastest, then dp, then pp (``rank = offset + (pp_idx * dp + dp_idx) * tp + tp_idx``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Layout, Replicate, Shard


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    offset: int = 0  # first global rank

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def parse(cls, text: str) -> Parallelism:
        """``"tp=4,pp=2"``, ``"tp=2,dp=4,offset=8"`` (missing sizes are 1). Raises ``ValueError`` naming the bad
        part (an unknown key, a missing ``=``, a value that is not a whole number, sizes < 1, spaces)."""
        from .cliutil import parse_sizes

        return cls(**parse_sizes(text, ("tp", "pp", "dp", "offset"), "parallelism", "tp=4,pp=2"))

    def __str__(self) -> str:
        s = f"tp{self.tp}"
        if self.pp > 1:
            s += f"xpp{self.pp}"
        if self.dp > 1:
            s += f"xdp{self.dp}"
        return s + (f"@{self.offset}" if self.offset else "")


def llama_tensors(
    hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool = False
) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Logical tensors of a Llama-style model: name -> (shape, kind, layer) with kind in col/row/rep and
    layer -1 for the embedding, ``layers`` for the final norm and lm_head."""
    hd = hidden // heads
    out: dict[str, tuple[tuple[int, ...], str, int]] = {"model.embed_tokens.weight": ((vocab, hidden), "col", -1)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((hidden,), "rep", i)
        out[p + "self_attn.q_proj.weight"] = ((heads * hd, hidden), "col", i)
        out[p + "self_attn.k_proj.weight"] = ((kv_heads * hd, hidden), "col", i)
        out[p + "self_attn.v_proj.weight"] = ((kv_heads * hd, hidden), "col", i)
        out[p + "self_attn.o_proj.weight"] = ((hidden, heads * hd), "row", i)
        out[p + "post_attention_layernorm.weight"] = ((hidden,), "rep", i)
        out[p + "mlp.gate_proj.weight"] = ((intermediate, hidden), "col", i)
        out[p + "mlp.up_proj.weight"] = ((intermediate, hidden), "col", i)
        out[p + "mlp.down_proj.weight"] = ((hidden, intermediate), "row", i)
    out["model.norm.weight"] = ((hidden,), "rep", layers)
    if not tied:
        out["lm_head.weight"] = ((vocab, hidden), "col", layers)
    return out


def llama_for_bytes(target_bytes: int, dtype: torch.dtype = torch.float32, hidden: int | None = None) -> dict:
    """Llama-3-like proportions (head dim 64, GQA 4:1, intermediate 3.5x, vocab 32000) with the layer count
    chosen to reach ``target_bytes``; by default the largest hidden size (up to 4096) that gives >= 4 layers."""
    isz = torch.empty((), dtype=dtype).element_size()
    choices = [hidden] if hidden else [4096, 2048, 1024, 512, 256, 128, 64]
    for h in choices:
        heads, kv, inter, vocab = max(1, h // 64), max(1, h // 256), max(64, int(h * 3.5) // 64 * 64), 32000
        per_layer = (2 * h * h + 2 * kv * 64 * h + 3 * inter * h + 2 * h) * isz
        layers = max(1, round((target_bytes - 2 * vocab * h * isz) / per_layer))
        if layers >= 4 or h == choices[-1]:
            return dict(hidden=h, layers=layers, heads=heads, kv_heads=kv, intermediate=inter, vocab=vocab)
    raise AssertionError("unreachable")


def parallel_layout(
    tensors: dict[str, tuple[tuple[int, ...], str, int]],
    par: Parallelism,
    num_layers: int,
    dtype: torch.dtype = torch.float32,
) -> Layout:
    """The layout of ``tensors`` (from :func:`llama_tensors`) under ``par``: one merged Layout over all stages."""
    if num_layers < par.pp:
        raise ValueError(f"cannot split {num_layers} layers over pp={par.pp} stages")
    bounds = [round(s * num_layers / par.pp) for s in range(par.pp + 1)]
    stages = []
    for s in range(par.pp):
        base = par.offset + s * par.dp * par.tp
        mesh = [[base + d * par.tp + t for t in range(par.tp)] for d in range(par.dp)]
        shapes, placements = {}, {}
        for name, (shape, kind, layer) in tensors.items():
            stage = 0 if layer < 0 else par.pp - 1 if layer >= num_layers else next(
                k for k in range(par.pp) if bounds[k] <= layer < bounds[k + 1]
            )
            if stage != s:
                continue
            shapes[name] = shape
            tp_pl = Shard(0) if kind == "col" else Shard(1) if kind == "row" else Replicate()
            placements[name] = [Replicate(), tp_pl]
        stages.append(Layout.from_placements(shapes, mesh, placements, dtype=dtype))
    return stages[0].merge(*stages[1:])


def llama_pair(mb: float, src: str = "tp=2,dp=2", dst: str = "tp=1,dp=4", dtype: torch.dtype = torch.float32):
    """The source and destination layouts of a Llama-shaped model of about ``mb`` MB: ``src`` and ``dst``
    parallelisms (:meth:`Parallelism.parse`; by default Megatron-style TP2 x DP2 -> TP1 x DP4, where every one of 4
    ranks sends and receives). What the integrity and lane benchmarks and their tests refit."""
    cfg = llama_for_bytes(int(mb * (1 << 20)), dtype)
    tensors = llama_tensors(**cfg)
    return (parallel_layout(tensors, Parallelism.parse(src), cfg["layers"], dtype),
            parallel_layout(tensors, Parallelism.parse(dst), cfg["layers"], dtype))
