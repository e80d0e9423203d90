"""Spawned-world worker for ``test_megatron_real.py``: real Megatron-Core GPTModels on CPU over gloo.

Each rank of a world (``triton_reshard.testing.launch.run_world``) builds, case after case, a real megatron-core
``GPTModel`` with the local (non-Transformer-Engine) layer spec after
``parallel_state.initialize_model_parallel(...)``, and reports back to the parent process:

* ``params``: ``{name: (shape, dtype)}`` of ``named_parameters()`` (and ``named_buffers()``);
* ``shards``: after the rank's parameters were overwritten with ``megatron_layout(...).shard(...)`` of HF
  tensors holding unique ids (and a sentinel where no fragment lands: vocab padding), every ShardedTensor
  of ``model.sharded_state_dict()`` (factories applied): key, global shape, global offset, local data,
  replica id. The parent assembles the Megatron-global tensors from them and checks them against its own
  HF -> Megatron-global conversion.

Three stubs make the model build without CUDA (see ``shared/FACTS.md``): ``model_parallel_cuda_manual_seed``
is never called (it asserts CUDA; ``use_cpu_initialization=True`` does not need it), ``Tensor.cuda`` is a
no-op (called on the tied output layer when PP > 1), ``torch.cuda.Stream`` is a dummy (the MoE token
dispatcher makes one).
"""

from __future__ import annotations

import traceback

import torch

from triton_reshard.testing.megatron_cpu import install_cpu_stubs as _install_stubs
from triton_reshard.testing.megatron_cpu import transformer_config

SENTINEL = -1.0  # what the local tensors hold where no fragment lands (ids are >= 1)


def hf_ids(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every HF tensor filled with ids unique over the whole model (1, 2, ...), exact in float32."""
    out, start = {}, 1
    for name in sorted(shapes):
        n = 1
        for d in shapes[name]:
            n *= d
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(shapes[name])
        start += n
    if start >= 2**24:
        raise AssertionError(f"{start} ids do not fit float32 exactly")
    return out


def _sharded_tensors(sharded_sd) -> list:
    """Every ShardedTensor of a sharded state dict, factories built (ShardedObjects skipped)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out, todo = [], list(sharded_sd.values())
    while todo:
        x = todo.pop()
        if isinstance(x, ShardedTensorFactory):
            todo.append(x.build())
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, ShardedTensor):
            out.append(x)
        elif not isinstance(x, ShardedObject):
            raise TypeError(f"unexpected {type(x).__name__} in the sharded state dict")
    return out


def init_parallel(case: dict) -> None:
    """``parallel_state.initialize_model_parallel`` with the case's TP/PP/EP/ETP (undo: ``destroy_model_parallel``)."""
    from megatron.core import parallel_state as ps

    tp, pp = case["tp"], case["pp"]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=case.get("ep", 1),
        expert_tensor_parallel_size=case.get("etp") or tp,
        distributed_timeout_minutes=1,  # Megatron's subgroups (default 30 min): a stuck collective fails fast
    )


def build_model(case: dict):
    """This rank's real GPTModel of the case (local spec), after :func:`init_parallel`. ``case["tc_kw"]``: more
    TransformerConfig fields (uneven pipeline stages, params_dtype, ...)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    cfg, tp, pp = case["cfg"], case["tp"], case["pp"]
    ep, etp = case.get("ep", 1), case.get("etp") or tp
    tc = transformer_config(cfg, tp, pp, ep, etp, **case.get("tc_kw", {}))
    if tc.num_moe_experts:  # the block spec applies moe_layer_freq (dense layers of a mixed model)
        spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=tc.qk_layernorm, normalization="RMSNorm")
    return GPTModel(
        tc,
        spec,
        vocab_size=case["megatron_vocab"],  # Megatron takes the padded size, as its trainers pass it
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
    )


def run_case(case: dict, rank: int, world: int) -> dict:
    """Build the case's model on this rank, fill it from the layout, return what the parent checks."""
    from megatron.core import parallel_state as ps

    from triton_reshard.presets import logical_tensors, megatron_layout

    cfg, tp, pp = case["cfg"], case["tp"], case["pp"]
    ep = case.get("ep", 1)
    init_parallel(case)
    try:
        model = build_model(case)
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        got = {n: (tuple(p.shape), p.dtype) for n, p in {**params, **buffers}.items()}
        out = {"params": got, "shards": None, "error": None}
        layout = megatron_layout(cfg, tp=tp, pp=pp, dp=world // (tp * pp), ep=ep, etp=case.get("etp"),
                                 spec="local", dtype=torch.float32, **case.get("layout_kw", {}))
        want = {n: (s.shape, s.dtype) for n, s in layout.local_specs(rank).items()}
        if want != got:
            return out  # the parent reports the difference; the boxes cannot be compared
        shapes = logical_tensors(cfg)
        hf = hf_ids(shapes)
        local = layout.shard(hf, rank)
        covered = layout.shard({n: torch.ones(s) for n, s in shapes.items()}, rank)
        with torch.no_grad():
            for n, t in local.items():
                t[covered[n] == 0] = SENTINEL
                params[n].copy_(t)
        spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), n) for n, p in params.items()]
        shards = []
        for st in _sharded_tensors(model.sharded_state_dict()):
            if st.flattened_range is not None:
                raise AssertionError(f"{st.key}: flattened ShardedTensor not expected")
            ptr = st.data.data_ptr()
            param = next((n for a, e, n in spans if a <= ptr < e), "?")  # for the parent's messages
            shards.append((st.key, tuple(st.global_shape), tuple(st.global_offset), st.prepend_axis_num,
                           tuple(st.replica_id) if isinstance(st.replica_id, tuple) else (st.replica_id,),
                           st.data.detach().clone(), param))
        out["shards"] = shards
        return out
    finally:
        ps.destroy_model_parallel()


def world_main(rank: int, world: int, cases: list[dict]) -> dict:
    """Run every case; a case that fails to build is reported (with its traceback), not raised."""
    _install_stubs()
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, rank, world)
        except Exception as e:  # reported per case to the parent (the other ranks may still build it)
            results[case["name"]] = {"params": None, "shards": None,
                                     "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results


# --------------------------------------------------------------------------------------------------------
# test_megatron_live.py: layout_from_megatron on the live model
# --------------------------------------------------------------------------------------------------------


class _Wrapper(torch.nn.Module):
    """A DDP-like wrapper: the model under ``.module`` (parameter names get a ``module.`` prefix)."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def _wrap(model, how: str | None):
    if how is None:
        return model
    if how == "list":
        return [model]
    if how == "wrapper_list":  # [DDP(model)]-like
        return [_Wrapper(model)]
    if how == "float16":  # Megatron's own Float16Module (casts the model to bf16 when config.bf16)
        from megatron.core.transformer.module import Float16Module

        return _Wrapper(Float16Module(model.config, model))
    raise ValueError(how)


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the parent checks the type and the message
        return f"{type(e).__name__}: {e}"
    return None


def live_case(case: dict, rank: int, world: int) -> dict:
    """``layout_from_megatron`` on this rank's live model: digest, derived arguments, and the errors of the
    case's wrong inputs (``{label: "Type: message" or None}``)."""
    from megatron.core import parallel_state as ps

    from triton_reshard.integrations import layout_from_megatron, megatron_layout_args

    init_parallel(case)
    try:
        model = _wrap(build_model(case), case.get("wrap"))
        kw = case.get("live_kw", {})
        layout = layout_from_megatron(model, case["cfg"], **kw)
        args = megatron_layout_args(model, case["cfg"], **kw)
        args["dtype"] = str(args["dtype"])
        errors = {}
        for label, wrong in case.get("wrong", {}).items():
            wkw = {**kw, **{k: v for k, v in wrong.items() if k != "cfg"}}
            errors[label] = _error(lambda w=wrong, k=wkw: layout_from_megatron(model, w.get("cfg", case["cfg"]), **k))
        if case.get("chunks2"):
            errors["two_chunks"] = _error(lambda: layout_from_megatron([model, model], case["cfg"]))
        if case.get("no_config"):
            errors["no_config"] = _error(lambda: layout_from_megatron(model))
        return {"digest": layout.digest, "args": args, "errors": errors, "error": None,
                "names": sorted(n for n, _ in model_named(model))}
    finally:
        ps.destroy_model_parallel()


def model_named(model):
    """``named_parameters()`` of the unwrapped GPTModel."""
    while isinstance(model, list) or hasattr(model, "module"):
        model = model[0] if isinstance(model, list) else model.module
    return model.named_parameters()


def live_world_main(rank: int, world: int, cases: list[dict]) -> dict:
    """Every case of ``test_megatron_live.py`` on this rank; a failing case is reported, not raised."""
    _install_stubs()
    results = {}
    for case in cases:
        try:
            results[case["name"]] = live_case(case, rank, world)
        except Exception as e:
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return results
