"""Block-FP8 side of the real-vLLM tier (``test_vllm_fp8.py``): tiny FP8 checkpoints and the worker that
loads them with vLLM 0.33's own model classes and ``DefaultModelLoader`` on CPU (one process per TP rank,
gloo, ``VLLM_TARGET_DEVICE=cpu``).

Checkpoints (:func:`build_checkpoints`, in the parent): a random ``transformers`` model in BF16, saved by
``save_pretrained`` (per-expert tensors on disk), then every linear-layer weight vLLM quantizes replaced by
its block-FP8 values and ``..._scale_inv`` scales made by **vLLM's own** ``per_block_cast_to_fp8``
(``vllm/utils/deep_gemm.py``; its eager body, the function is wrapped in ``torch.compile``), config.json
gaining ``quantization_config`` ``{"quant_method": "fp8", "activation_scheme": "dynamic",
"weight_block_size": [16, 16]}`` (tiny blocks: many of them per tensor). Which HF tensors are quantized is
decided here by a rule of this file (a ``*_proj`` / expert weight, plus the Qwen3-MoE router, unless the
module or one above it is in ``modules_to_not_convert``), independently of the preset; the worker checks
that vLLM's own ``create_weights`` made exactly those parameters FP8. The BF16 originals are kept next to
the checkpoint (``<name>.bf16.safetensors``) as the trainer's weights of the end-to-end refit.

On this CPU (no AMX) vLLM has no FP8 GEMM kernel: ``Fp8LinearMethod.create_weights`` ends with
``init_fp8_linear_kernel``, which raises (``CPUFp8BlockScaledMMKernel requires AMX tile support``).
:func:`no_fp8_gemm_kernel` replaces that one call with a placeholder (no forward pass runs here); parameters,
their shapes and dtypes, and the loader are vLLM's own. ``process_weights_after_loading`` is not run (on CPU
it would VNNI-prepack the weights; FusedMoE's needs CPU-build ops anyway): the layouts describe the
checkpoint format vLLM's loader writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = [16, 16]
QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
FP8 = torch.float8_e4m3fn
# the kv-cache scales Fp8KVCacheMethod gives every GQA Attention layer: not checkpoint tensors, never loaded
KV_CACHE_SCALES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")

_CLASSES = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
# HF weights of linear layers (attention projections, MLA's, dense / shared / routed expert MLPs)
_LINEAR = re.compile(r"\.(self_attn\.(q|k|v|o|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?"
                     r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def fp8_configs() -> dict[str, dict]:
    """The tiny FP8 models (dims multiples of 16 where vLLM's block checks need it at TP 2)."""
    from triton_reshard.presets import get_config

    def q(name, ignored=(), scale_fmt=None, **over):
        cfg = {**get_config(name), **over}
        cfg["quantization_config"] = {**QC, **({"modules_to_not_convert": list(ignored)} if ignored else {}),
                                      **({"scale_fmt": scale_fmt} if scale_fmt else {})}
        return cfg

    return {
        # layer 1's o_proj and layer 0's fused gate_up (both shards listed) stay BF16
        "fp8_llama": q("tiny_llama", ["model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate_proj",
                                      "model.layers.0.mlp.up_proj"]),
        # power-of-two scales (DeepSeek-V3.1-style scale_fmt "ue8m0"): vLLM's per_block_cast_to_fp8(use_ue8m0=True)
        "fp8_qwen3": q("tiny_qwen3", scale_fmt="ue8m0"),
        # layer 0's router and all of layer 1's experts stay BF16
        "fp8_qwen3_moe": q("tiny_qwen3_moe", ["model.layers.0.mlp.gate", "model.layers.1.mlp.experts"]),
        # rope 8 (q heads of 16), moe_intermediate 32 (TP halves of 16): every TP partition whole blocks
        "fp8_deepseek_v3": q("tiny_deepseek_v3", qk_rope_head_dim=8, moe_intermediate_size=32),
    }


def quantized_in_checkpoint(name: str, cfg: dict) -> bool:
    """The test's own rule for which HF tensors the FP8 checkpoint stores quantized."""
    fam = cfg["model_type"]
    if not (_LINEAR.search(name) or (fam == "qwen3_moe" and name.endswith(".mlp.gate.weight"))):
        return False
    module = name.removesuffix(".weight")
    ignored = cfg["quantization_config"].get("modules_to_not_convert") or ()
    return not any(module == m or module.startswith(m + ".") for m in ignored)


def vllm_per_block_cast():
    """vLLM's block-FP8 quantizer, eager (the body of the ``torch.compile``-wrapped function)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return getattr(per_block_cast_to_fp8, "__wrapped__", per_block_cast_to_fp8)


def build_checkpoints(root: str, configs: dict[str, dict]) -> None:
    import transformers
    from safetensors.torch import load_file, save_file

    cast = vllm_per_block_cast()
    for name, cfg in configs.items():
        cls = _CLASSES[cfg["model_type"]]
        kw = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")}
        conf = getattr(transformers, f"{cls}Config")(**kw)
        torch.manual_seed(sum(map(ord, name)))
        d = os.path.join(root, name)
        getattr(transformers, f"{cls}ForCausalLM")(conf).to(torch.bfloat16).save_pretrained(d)
        path = os.path.join(d, "model.safetensors")
        # BF16, but DeepSeek's expert-score bias, which every framework keeps in float32
        bf16 = {k: v.to(torch.float32 if k.endswith(".e_score_correction_bias") else torch.bfloat16).contiguous()
                for k, v in load_file(path).items()}
        out = {}
        ue8m0 = cfg["quantization_config"].get("scale_fmt") == "ue8m0"
        for k, v in bf16.items():
            if quantized_in_checkpoint(k, cfg):
                out[k], s = cast(v, BLOCK, use_ue8m0=ue8m0)
                out[k + "_scale_inv"] = s.contiguous()
            else:
                out[k] = v
        os.remove(path)
        save_file(out, path)
        save_file(bf16, os.path.join(root, f"{name}.bf16.safetensors"))  # outside the dir vLLM reads
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["quantization_config"] = cfg["quantization_config"]
        c["torch_dtype"] = c["dtype"] = "bfloat16"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=1)


@contextlib.contextmanager
def no_fp8_gemm_kernel():
    """Let ``Fp8LinearMethod.create_weights`` finish on a CPU without vLLM's FP8 GEMM kernels (AMX): its last
    step, ``init_fp8_linear_kernel``, returns a placeholder instead of raising. Parameters are untouched."""
    import vllm.model_executor.layers.quantization.fp8 as fp8

    class NoKernel:  # what Fp8LinearMethod keeps as self.fp8_linear; no forward pass uses it here
        def __init__(self, **kw):
            self.kw = kw

    orig = fp8.init_fp8_linear_kernel
    fp8.init_fp8_linear_kernel = lambda **kw: NoKernel(**kw)
    try:
        yield
    finally:
        fp8.init_fp8_linear_kernel = orig


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of its width (bit-exact compares of fp8 / bf16 / fp32, NaN included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def differs(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    return int((bits(a) != bits(b)).sum())


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    ep: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}{'-ep' if self.ep else ''}"


def run_cases(rank: int, world: int, cases: list[Case], root: str, configs: dict, e2e: bool = True) -> dict:
    """Worker entry (``run_world``): every case; returns ``{case id: report}``. ``e2e``: also refit every
    model from BF16 source shards (:func:`_refit_from_bf16`)."""
    from safetensors.torch import load_file

    from triton_reshard.integrations import checkpoint_shapes
    from triton_reshard.integrations.vllm import layout_from_vllm, load_vllm_model
    from triton_reshard.presets import vllm_layout

    out: dict[str, dict] = {}
    first = True
    moe = lambda c: any(k in configs[c.model] for k in ("num_experts", "n_routed_experts"))  # noqa: E731
    for case in sorted(cases, key=lambda c: not moe(c)):  # the first model decides vLLM's EP group
        rep: dict = {"problems": [], "seconds": {}}
        out[case.id] = rep
        t0 = time.perf_counter()
        ckpt = os.path.join(root, case.model)
        cfg = configs[case.model]
        try:
            with no_fp8_gemm_kernel():
                model, vc = load_vllm_model(ckpt, tensor_parallel_size=case.tp, enable_expert_parallel=case.ep,
                                            dtype="bfloat16", init_groups=first)
            first = False
            rep["seconds"]["build"] = time.perf_counter() - t0
            params = dict(model.named_parameters())
            loaded = {n: p.detach().clone() for n, p in params.items()}
            rep["params"] = {n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()}
            rep["fp8_params"] = sorted(n for n, p in params.items() if p.dtype == FP8)
            sd = load_file(os.path.join(ckpt, "model.safetensors"))
            shapes = checkpoint_shapes(ckpt)

            preset = vllm_layout(cfg, tp=case.tp, enable_expert_parallel=case.ep, dtype=torch.bfloat16)
            rep["preset_digest"] = preset.digest
            rep["preset_quantized"] = sorted(preset.quantized)
            rep["checkpoint_fp8"] = sorted(n for n, t in sd.items() if t.dtype == FP8)
            want = {n: (s.shape, str(s.dtype)) for n, s in preset.local_specs(rank).items()}
            rep["not_in_preset"] = sorted(set(rep["params"]) - set(want))
            mine = preset.shard(sd, rank)
            for n in sorted(set(want) | set(rep["params"])):
                if n not in rep["params"]:
                    rep["problems"].append(f"rank {rank}: preset local {n!r} is not a vLLM parameter")
                elif n in want and want[n] != rep["params"][n]:
                    rep["problems"].append(f"rank {rank}: {n}: vLLM {rep['params'][n]}, preset {want[n]}")
                elif n in want:
                    bad = differs(mine[n], loaded[n])
                    if bad:
                        rep["problems"].append(f"rank {rank}: {n}: {bad} of {loaded[n].numel()} elements differ "
                                               f"from vllm_layout's shard of the checkpoint (bitwise)")

            t1 = time.perf_counter()
            derived = layout_from_vllm(model, shapes)  # records every rank's loader, gathered
            rep["seconds"]["record"] = time.perf_counter() - t1
            rep["derived_digest"] = derived.digest
            # recorded with a BF16 trainer's tensors (no scales; what the weight-transfer backend passes)
            rep["derived_from_bf16_digest"] = layout_from_vllm(
                model, {n: v for n, v in shapes.items() if not n.endswith("_scale_inv")}).digest
            rep["derived_quant"] = {n: (tuple(t.quant.block), t.quant.scale, t.quant.ue8m0)  # data only (run_world)
                                    for n, t in derived.quantized.items()}
            got = derived.shard(sd, rank)
            for n in sorted(got):
                bad = differs(got[n], loaded[n]) if n in loaded else -2
                if bad:
                    rep["problems"].append(f"rank {rank}: {n}: the recorded layout's shard differs from vLLM's "
                                           f"loader ({bad})")
            for n, p in params.items():  # recording must not have written anything
                if differs(p.detach(), loaded[n]):
                    rep["problems"].append(f"rank {rank}: recording load_weights changed parameter {n!r}")
            if e2e:  # its problems apart: a refit failure does not hide what the load checks found
                rep["refit_problems"] = []
                try:
                    _refit_from_bf16(rank, world, model, loaded, preset, root, case, cfg, rep)
                    if cfg["model_type"] == "deepseek_v3":
                        _mla_post_load_refit(rank, world, model, vc, loaded, preset, root, case, cfg, rep)
                except Exception as e:  # noqa: BLE001
                    import traceback

                    rep["refit_problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        except Exception as e:  # noqa: BLE001 (reported per case; the world goes on with the next case)
            import traceback

            rep["problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        rep["seconds"]["total"] = time.perf_counter() - t0
    return out


def odd_split_source(dst, world: int):
    """A plain BF16 source over ``world`` ranks that splits every tensor of ``dst`` (but the scales) at 5/8 of
    its first dim, through the middle of a block: the blocks on both sides are whole on one rank (the sender
    quantizes them) and the straddling block is not (the receiver stages and quantizes it)."""
    from triton_reshard import Fragment, Layout

    specs = {}
    frags = []
    for t in dst.tensors:
        if t.name in dst.scale_of:
            continue
        dt = torch.bfloat16 if t.quant is not None else t.dtype
        specs[t.name] = (t.shape, dt)
        rows = t.shape[0]
        cut = max(1, rows * 5 // 8) if rows > 1 else rows
        parts = [(0, cut), (cut, rows - cut)]
        for r, (o, n) in enumerate(parts[:world]):
            if n:
                frags.append(Fragment(t.name, r, (o,) + (0,) * (len(t.shape) - 1), (n,) + t.shape[1:], t.name))
    return Layout.from_fragments(specs, frags)


def _refit_from_bf16(rank, world, model, loaded, preset, root, case, cfg, rep) -> None:
    """End to end: refit the trainer's BF16 weights (the checkpoint's originals) into the real model's
    poisoned ``named_parameters()`` through ``triton_reshard.refit``, quantizing on the way; every element the
    layout covers must be, bit for bit, what vLLM's loader put there from the FP8 checkpoint made by vLLM's
    own ``per_block_cast_to_fp8``; padding stays poisoned; parameters outside the layout stay untouched."""
    from safetensors.torch import load_file

    from triton_reshard import block_quant_layout, refit, verify_refit
    from triton_reshard.presets import hf_layout, megatron_layout
    from triton_reshard.presets.vllm import block_fp8_config, fp8_tensors

    bf16 = load_file(os.path.join(root, f"{case.model}.bf16.safetensors"))
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    moe = any(k in cfg for k in ("num_experts", "n_routed_experts"))
    sources = {
        # Megatron TP 2 (EP 2 with ETP 1 for the EP cases: whole experts per rank)
        "megatron": megatron_layout(plain, tp=world, ep=world if (moe and case.ep) else 1,
                                    etp=1 if (moe and case.ep) else None, ranks=range(world), dtype=torch.bfloat16),
        "odd_split": odd_split_source(preset, world),
        # the FP8 checkpoint itself on rank 0 (quantized like the destination: values and scales are copied)
        "fp8_checkpoint": block_quant_layout(hf_layout(plain, ranks=(0,), dtype=torch.bfloat16), fp8_tensors(cfg),
                                             tuple(BLOCK), ue8m0=block_fp8_config(cfg).ue8m0),
    }
    ckpt = load_file(os.path.join(root, case.model, "model.safetensors"))
    params = dict(model.named_parameters())
    specs = preset.local_specs(rank)
    ones = {t.name: torch.ones(t.shape, dtype=torch.float32) for t in preset.tensors}
    covered = {n: bits(t) != 0 for n, t in preset.shard(ones, rank).items()}
    rep["refit"] = {}
    for sname, src_layout in sources.items():
        if sname == "fp8_checkpoint":
            src = {n: ckpt[n] for n in src_layout.specs} if rank == 0 else {}
        else:
            src = src_layout.shard({n: bf16[n] for n in src_layout.specs}, rank)
        with torch.no_grad():
            for n in specs:
                bits(params[n].data).fill_(-1)  # all ones: NaN in fp8 e4m3fn, bf16 and fp32
        t1 = time.perf_counter()
        report = refit(src, params, src_layout, preset, timeout=120)
        rep["seconds"][f"refit_{sname}"] = time.perf_counter() - t1
        rep["refit"][sname] = {"ignored": tuple(getattr(report, "ignored", ())), "wrong": {}}
        for n, p in params.items():
            got, want = bits(p.detach()), bits(loaded[n])
            if n not in specs:
                if not torch.equal(got, want):
                    rep["refit_problems"].append(f"rank {rank}: refit ({sname}) changed {n}, which is not in the layout")
                continue
            m = covered[n]
            bad = int((got[m] != want[m]).sum())
            if bad:
                rep["refit"][sname]["wrong"][n] = bad
                rep["refit_problems"].append(f"rank {rank}: refit ({sname}) wrote {bad} of {int(m.sum())} elements of "
                                       f"{n} unlike vLLM's loader of the FP8 checkpoint")
            if not bool((got[~m] == (255 if got.dtype == torch.uint8 else -1)).all()):
                rep["refit_problems"].append(f"rank {rank}: refit ({sname}) wrote outside the layout's boxes in {n}")
        with torch.no_grad():
            for n in specs:
                params[n].data.copy_(loaded[n])
        # verify mode on the loaded model: the right layout 0 mismatches; the ranks swapped, some on every rank
        v = verify_refit(src, params, src_layout, preset, timeout=120)
        rep["refit"][sname]["verify"] = (v.ok, v.total_mismatches)
        v2 = verify_refit(src, params, src_layout, _swapped(preset, world), timeout=120)
        rep["refit"][sname]["verify_swapped"] = (v2.ok, v2.total_mismatches)


def _swapped(layout, world: int):
    """``layout`` with rank r's local tensors on rank (r + 1) % world: a wrong layout of the same tensors."""
    from triton_reshard import Fragment, Layout, LocalSpec

    sh = lambda r: (r + 1) % world  # noqa: E731
    return Layout(layout.tensors,
                  tuple(Fragment(f.tensor, sh(f.rank), f.offsets, f.sizes, f.local, f.local_offsets)
                        for f in layout.fragments),
                  tuple(LocalSpec(sh(s.rank), s.name, s.shape, s.dtype) for s in layout.locals))


def backend_engine_job(rank: int, world: int, ckpt: str, ctl_port: int) -> dict:
    """A vLLM worker of an FP8 model with ``weight_transfer_config={"backend": "triton_reshard"}`` (as
    ``transfer_jobs.engine_job``): build + load with vLLM's loader, poison every parameter, serve the
    trainer's calls; after the update every element the recorded layout covers must be the loader's byte."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from triton_reshard.integrations.control import serve
    from triton_reshard.integrations.vllm import load_vllm_model

    load_general_plugins()
    with no_fp8_gemm_kernel():
        model, vc = load_vllm_model(ckpt, tensor_parallel_size=world, dtype="bfloat16",
                                    weight_transfer_config={"backend": "triton_reshard"})
    out: dict = {"problems": []}
    params = dict(model.named_parameters())
    loaded = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            bits(p.data).fill_(-1)
    engine = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), model)

    def check(_payload):
        lay = engine.dst_layout
        out["quantized"] = sorted(lay.quantized)
        out["digest"] = lay.digest
        specs = lay.local_specs(lay_rank := engine.group.rank)
        ones = {t.name: torch.ones(t.shape, dtype=torch.float32) for t in lay.tensors}
        covered = {n: bits(t) != 0 for n, t in lay.shard(ones, lay_rank).items()}
        out["unwritten"] = {}
        for n, p in params.items():
            got, want = bits(p.detach()), bits(loaded[n])
            poison = 255 if got.dtype == torch.uint8 else -1
            m = covered[n] if n in specs else torch.zeros_like(got, dtype=torch.bool)
            if not torch.equal(got[m], want[m]):
                out["problems"].append(f"rank {rank}: {n}: {int((got[m] != want[m]).sum())} elements differ from "
                                       f"vLLM's loader of the FP8 checkpoint")
            if not bool((got[~m] == poison).all()):
                out["problems"].append(f"rank {rank}: {n}: written outside the recorded layout")
            out["unwritten"][n] = int((~m).sum())
        out["recv_bytes"] = engine.last_report.recv_bytes

    def wrapped(fn):
        def call(payload):
            with set_current_vllm_config(vc):
                return fn(payload)
        return call

    handlers = {
        "init_weight_transfer_engine": wrapped(lambda d: engine.init_transfer_engine(engine.parse_init_info(d))),
        "start_weight_update": wrapped(lambda _p: engine.start_weight_update()),
        "update_weights": wrapped(lambda d: (engine.update_weights(d), check(d))),
        "finish_weight_update": wrapped(lambda _p: engine.finish_weight_update()),
    }
    out["calls"] = serve("127.0.0.1", ctl_port, rank, handlers)
    engine.shutdown()
    return out


def backend_trainer_job(rank: int, world: int, cfg: dict, weights: str, refit_port: int, ctl_port: int,
                        n_workers: int) -> dict:
    """The trainer job: Megatron TP shards of the BF16 weights, sent through vLLM's trainer-side factory."""
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.integrations.control import StoreClient
    from triton_reshard.presets import megatron_layout

    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    layout = megatron_layout(plain, tp=world, ranks=range(world), dtype=torch.bfloat16)
    tensors = layout.shard(load_file(weights), rank)
    info = vt.ReshardTrainerInitInfo(rank=rank, host="127.0.0.1", port=refit_port, world_size=world + n_workers,
                                     num_trainer_ranks=world, layout=layout, timeout=120)
    client = StoreClient("127.0.0.1", ctl_port, n_workers) if rank == 0 else None
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=vt.TensorsSource(tensors))
    eng.send_weights(version="step-0")
    out = {"sent": eng.last_report.sent_bytes}
    if client is not None:
        client.stop()
    eng.shutdown()
    return out


def _mla_post_load_refit(rank, world, model, vc, loaded, preset, root, case, cfg, rep) -> None:
    """The recipe for FP8 MLA: vLLM's MLA post-load step makes ``W_UV`` / ``W_UK_T`` (BF16 copies dequantized
    from the FP8 ``kv_b_proj``, not views of it); a refit ignores them (not in the layout) and rerunning the
    step after the refit gives them back, bit for bit."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    from triton_reshard import refit
    from triton_reshard.presets import megatron_layout

    def post_load() -> int:
        n = 0
        with set_current_vllm_config(vc):
            for m in model.modules():
                if type(m).__name__ == "MLAAttention":
                    m.process_weights_after_loading(torch.bfloat16)
                    n += 1
        return n

    rep["mla_post_load"] = post_load()
    derived = {n: p.detach().clone() for n, p in model.named_parameters() if n not in loaded}
    rep["mla_derived"] = {n: (tuple(t.shape), str(t.dtype)) for n, t in derived.items()}
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    bf16 = load_file(os.path.join(root, f"{case.model}.bf16.safetensors"))
    src_layout = megatron_layout(plain, tp=world, ranks=range(world), dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            bits(p.data).fill_(-1)
    report = refit(src_layout.shard({n: bf16[n] for n in src_layout.specs}, rank), params, src_layout, preset,
                   timeout=120)
    rep["mla_ignored"] = tuple(report.ignored)
    rep["mla_rerun"] = post_load()
    for n, t in derived.items():
        now = dict(model.named_parameters())[n]
        if differs(now.detach(), t):
            rep["refit_problems"].append(f"rank {rank}: {n}: rerunning MLA's post-load step after the refit does not "
                                         f"give back its post-load value")
