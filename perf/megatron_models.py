"""The models ``perf/bench_megatron.py`` and its cluster half ``perf/cluster_megatron.py`` both build: the shapes
(``bench_config``), the seeded global tensors, Megatron-Core GPTModels on either side's process groups. Kept apart
so the two scripts import it, not each other."""

from __future__ import annotations

import os
import zlib

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("megatron", "ours")
SRC, DST = dict(tp=4, pp=2), dict(tp=2, pp=1)  # TP4 x PP2 -> TP2 x DP4 on 8 ranks


SHAPES = ("demo", "small")


def bench_config(layers: int, shape: str = "demo") -> dict:
    """The model of ``shape``: "demo", ``llama_demo`` (hidden 1024, FFN 2816) with ``layers`` layers and vocab
    32768 (428 MiB of fp32 at 4 layers; rank 0's messages 1-16 MiB); "small", the ``small_llama`` preset's
    shapes (hidden 256, FFN 688, 8 heads of 32) with 4 KV heads (TP4 keeps whole query groups) and vocab 4096
    (a multiple of 128 x TP: neither side pads it), ``layers`` layers (31 MiB at 8; messages of 8-512 KiB,
    where a refit's per-call and per-message costs weigh most)."""
    from triton_reshard.presets import get_config

    if shape == "small":
        return {**get_config("small_llama"), "num_key_value_heads": 4, "num_hidden_layers": layers,
                "vocab_size": 4096}
    return {**get_config("llama_demo"), "num_hidden_layers": layers, "vocab_size": 32768}


def global_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    """The model's HF tensors, seeded by name (the same on every rank)."""
    from triton_reshard.presets import logical_tensors

    out = {}
    for name, shape in sorted(logical_tensors(cfg).items()):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = torch.randn(shape, generator=g, dtype=torch.float32)
    return out


def dst_pg_collection(tp: int):
    """The destination's process groups (TP ``tp``, PP 1, DP world / tp, Megatron's rank order), every group a
    new gloo group; all ranks call this in the same order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    grid = HyperCommGrid([tp, 1, 1, 1, world // tp], ["tp", "cp", "ep", "pp", "dp"])
    pp = grid.create_pg("pp")
    pp_ranks = dist.get_process_group_ranks(pp)
    return ProcessGroupCollection(
        tp=grid.create_pg("tp"), cp=grid.create_pg("cp"), pp=pp, ep=grid.create_pg("ep"),
        embd=dist.new_group(ranks=ps.default_embedding_ranks(pp_ranks)),
        pos_embd=dist.new_group(ranks=ps.default_position_embedding_ranks(pp_ranks)),
        dp=grid.create_pg("dp"), tp_cp=grid.create_pg(["tp", "cp"]), mp=grid.create_pg(["tp", "cp", "ep", "pp"]),
        expt_tp=grid.get_pg("tp"), expt_dp=grid.get_pg("dp"), tp_ep=grid.create_pg(["tp", "ep"]),
        tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]), dp_cp=grid.create_pg(["cp", "dp"]),
        tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]),
    )


def gpt_model(cfg: dict, tp: int, pp: int, pg_collection=None):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from triton_reshard.testing.megatron_cpu import transformer_config

    # initialized (overwritten below): with perform_initialization=False, use_cpu_initialization leaves the
    # tensor_model_parallel / partition_dim attributes unset, and Megatron's resharding then copies whole shards
    tc = transformer_config(cfg, tp, pp, 1, tp)
    first = ps.is_pipeline_first_stage() if pg_collection is None else True
    last = ps.is_pipeline_last_stage() if pg_collection is None else True
    return GPTModel(tc, get_gpt_layer_local_spec(qk_layernorm=tc.qk_layernorm, normalization="RMSNorm"),
                    vocab_size=cfg["vocab_size"], max_sequence_length=64, pre_process=first, post_process=last,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    pg_collection=pg_collection)


def check_params(rank: int, sides) -> None:
    """Each (side, parameters, layout) of ``sides``: the model's parameters on ``rank`` are the layout's local
    tensors (names, shapes, dtypes), else an AssertionError naming the side and a few names that differ."""
    for side, params, lay in sides:
        want = {n: (tuple(s.shape), s.dtype) for n, s in lay.local_specs(rank).items()}
        got = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
        if want != got:
            raise AssertionError(f"rank {rank}: the {side} model's parameters are not the layout's: "
                                 f"{sorted(set(want) ^ set(got))[:5]} ...")
