"""MXFP8 / NVFP4 side of the real-vLLM tier (``test_quant_formats_vllm_models.py``): tiny ModelOpt checkpoints
loaded by vLLM 0.33's own model classes and ``DefaultModelLoader`` on CPU (one process per TP rank, gloo,
``VLLM_TARGET_DEVICE=cpu``), compared with ``vllm_layout``.

Checkpoints (:func:`build_checkpoints`, in the parent): a random ``transformers`` model in BF16, every linear
weight the preset quantizes replaced as a ModelOpt export stores it, made by **vLLM's own** quantizers:

* MXFP8: ``weight`` float8_e4m3fn and ``weight_scale`` uint8 E8M0 from ``mxfp8_utils._mxfp8_e4m3_quantize_torch``;
* NVFP4: ``weight`` uint8 (two E2M1 codes a byte, the even element low: vLLM's ``break_fp4_bytes`` reads them
  so), ``weight_scale`` float8_e4m3fn and ``weight_scale_2`` (a float32 scalar, ``1 / gs``) from
  ``nvfp4_emulation_utils.ref_nvfp4_quant(x, gs, 16)`` with ``gs = 2688 / amax`` over the tensors ModelOpt
  fuses (q/k/v, gate/up, each expert's w1/w3), and ``input_scale`` (a calibrated activation scale: here 1.0).

``config.json`` gains ``quantization_config`` ``{"quant_method": "modelopt", "quantization": {"quant_algo":
"NVFP4" | "MXFP8", "group_size": 16 | 32, "exclude_modules": [...]}}``.

On this CPU vLLM has no NVFP4 / MXFP8 GEMM: ``ModelOptLinearMethod.create_weights`` ends with
``select_linear_kernel`` (and the MoE methods pick a backend), which raise; :func:`no_quant_kernels` replaces
those calls with placeholders (no forward pass runs). Parameters, shapes, dtypes and the loader are vLLM's own.
``process_weights_after_loading`` is not run by the loader path used here; what it does is stated in
docs/quant_formats.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from tests.engines.vllm_fp8_cases import bits, differs  # noqa: E402

_CLASSES = {"llama": "Llama", "qwen3_moe": "Qwen3Moe"}


def quant_configs() -> dict[str, dict]:
    from triton_reshard.presets import get_config

    def q(name, algo, excluded, **over):
        cfg = {**get_config(name), **over}
        cfg["quantization_config"] = {"quant_method": "modelopt", "quantization": {
            "quant_algo": algo, "group_size": 16 if algo == "NVFP4" else 32, "kv_cache_quant_algo": None,
            "exclude_modules": list(excluded)}}
        return cfg

    return {
        "nvfp4_llama": q("tiny_llama", "NVFP4", ["lm_head", "model.layers.1.self_attn.o_proj"]),
        # MXFP8 needs whole 1x32 blocks in every TP partition (vLLM raises otherwise; so does the preset)
        "mxfp8_llama": q("tiny_llama", "MXFP8", ["lm_head", "model.layers.0.mlp*"], intermediate_size=128),
        "nvfp4_qwen3_moe": q("tiny_qwen3_moe", "NVFP4", ["lm_head", "model.layers.1.mlp.gate"]),
        "mxfp8_qwen3_moe": q("tiny_qwen3_moe", "MXFP8", ["lm_head"], moe_intermediate_size=64),
    }


def _vllm_nvfp4(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``ref_nvfp4_quant`` and the byte packing vLLM's ``break_fp4_bytes`` undoes."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant

    v, s = ref_nvfp4_quant(x, gs, 16)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mag = v.abs()
    code = (mag[..., None] == lut).to(torch.uint8).argmax(-1).to(torch.uint8)
    code |= torch.signbit(v).to(torch.uint8) << 3
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), s.to(torch.float8_e4m3fn).contiguous()


def build_checkpoints(root: str, configs: dict[str, dict]) -> None:
    import transformers
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch

    from triton_reshard.presets import vllm_layout

    for name, cfg in configs.items():
        cls = _CLASSES[cfg["model_type"]]
        kw = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config")}
        conf = getattr(transformers, f"{cls}Config")(**kw)
        torch.manual_seed(sum(map(ord, name)))
        d = os.path.join(root, name)
        getattr(transformers, f"{cls}ForCausalLM")(conf).to(torch.bfloat16).save_pretrained(d)
        path = os.path.join(d, "model.safetensors")
        bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items()}
        preset = vllm_layout(cfg, tp=1, dtype=torch.bfloat16)
        out = dict(bf16)
        if cfg["quantization_config"]["quantization"]["quant_algo"] == "MXFP8":
            for n in preset.quantized:
                out[n], out[n + "_scale"] = (t.contiguous() for t in _mxfp8_e4m3_quantize_torch(bf16[n]))
        else:
            groups: dict[str, list[str]] = {}
            for n, t in preset.quantized.items():
                groups.setdefault(t.quant.global_group, []).append(n)
            for members in groups.values():  # ModelOpt's rule: tensors vLLM fuses share one global scale
                amax = max(bf16[n].abs().amax().float() for n in members)
                gs = 2688.0 / amax.clamp_min(1e-8)  # vLLM's online NVFP4 expression
                for n in members:
                    out[n], out[n + "_scale"] = _vllm_nvfp4(bf16[n], gs)
                    out[n + "_scale_2"] = (1.0 / gs).to(torch.float32).reshape(())
                    out[n.removesuffix("weight") + "input_scale"] = torch.ones((), dtype=torch.float32)
        os.remove(path)
        save_file(out, path)
        save_file(bf16, os.path.join(root, f"{name}.bf16.safetensors"))
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["quantization_config"] = cfg["quantization_config"]
        c["torch_dtype"] = c["dtype"] = "bfloat16"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=1)


@contextlib.contextmanager
def no_quant_kernels():
    """Let vLLM's ModelOpt NVFP4 / MXFP8 methods build on a CPU with no such GEMM: kernel selection returns a
    placeholder. Parameters and loaders are untouched."""
    import vllm.model_executor.layers.quantization.modelopt as mo

    class NoKernel:
        supports_pre_processed_weights = False

        def __init__(self, *a, **kw):
            pass

        def process_weights_after_loading(self, layer):
            pass

    patches = [(mo, "select_linear_kernel", lambda *a, **kw: NoKernel()),
               (mo, "expose_input_quant_key", lambda *a, **kw: None),
               # the FusedMoE methods pick an NVFP4 / MXFP8 expert backend in __init__ (none on CPU: "No NvFp4 MoE
               # backend supports the deployment configuration")
               (mo, "select_nvfp4_moe_backend", lambda *a, **kw: (None, None)),
               (mo, "select_mxfp8_moe_backend", lambda *a, **kw: (None, None)),
               (mo, "is_global_sf_supported_for_nvfp4_backend", lambda *a, **kw: False)]
    from triton_reshard.integrations.vllm import amx_packing_unbuilt

    if amx_packing_unbuilt():
        import vllm.model_executor.layers.utils as lu

        # on an AMX CPU vLLM's post-load step packs small bf16 GEMM weights with torch.ops._C.convert_weight_packed,
        # which only vLLM's CPU build ships (this env has the PyPI wheel): take the path it takes on a CPU
        # without AMX (oneDNN, else torch's linear), as on the machines where this tier was written
        patches.append((lu, "check_cpu_sgl_kernel", lambda *a, **kw: False))
    saved = []
    for mod, attr, fn in patches:
        if hasattr(mod, attr):
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, fn)
    try:
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    ep: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}{'-ep' if self.ep else ''}"


def run_cases(rank: int, world: int, cases: list[Case], root: str, configs: dict) -> dict:
    """Worker entry (``run_world``): per case, vLLM's parameters against ``vllm_layout`` (names, shapes,
    dtypes), the loader's bytes against the preset's shard of the checkpoint, and a refit of the BF16
    originals into the poisoned parameters against the loader's bytes."""
    from safetensors.torch import load_file

    from triton_reshard.integrations.vllm import load_vllm_model
    from triton_reshard.presets import vllm_layout

    out: dict[str, dict] = {}
    first = True
    moe = lambda c: "num_experts" in configs[c.model]  # noqa: E731
    for case in sorted(cases, key=lambda c: not moe(c)):
        rep: dict = {"problems": [], "refit_problems": [], "seconds": {}}
        out[case.id] = rep
        t0 = time.perf_counter()
        ckpt = os.path.join(root, case.model)
        cfg = configs[case.model]
        try:
            try:
                with no_quant_kernels():
                    model, _vc = load_vllm_model(ckpt, tensor_parallel_size=case.tp, enable_expert_parallel=case.ep,
                                                 dtype="bfloat16", init_groups=first)
            finally:
                first = False  # the groups exist once the first build started
            rep["seconds"]["build"] = time.perf_counter() - t0
            params = dict(model.named_parameters())
            loaded = {n: p.detach().clone() for n, p in params.items()}
            rep["params"] = {n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()}
            sd = load_file(os.path.join(ckpt, "model.safetensors"))
            preset = vllm_layout(cfg, tp=case.tp, enable_expert_parallel=case.ep, dtype=torch.bfloat16)
            want = {n: (s.shape, str(s.dtype)) for n, s in preset.local_specs(rank).items()}
            rep["preset_locals"] = sorted(want)
            rep["not_in_preset"] = sorted(set(rep["params"]) - set(want))
            sd = {n: (t.reshape(1) if n.endswith("_scale_2") else t) for n, t in sd.items()}
            mine = preset.shard({n: t for n, t in sd.items() if n in preset.specs}, rank)
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
            try:
                _refit_from_bf16(rank, world, params, loaded, preset, root, case, cfg, rep)
                if not moe(case):  # FusedMoE's post-load step needs CPU-build ops (docs: FACTS.md)
                    _after_post_load(rank, model, _vc, preset, root, case, rep)
            except Exception as e:  # noqa: BLE001
                import traceback

                rep["refit_problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        except Exception as e:  # noqa: BLE001 (reported per case; the world goes on with the next case)
            import traceback

            rep["problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        rep["seconds"]["total"] = time.perf_counter() - t0
    return out


def last_dim_split_source(dst, bf16: dict, world: int):
    """A BF16 source over ``world`` ranks splitting every tensor's last dim at 5/8 (through the middle of a
    1x16 / 1x32 block: the straddling blocks are quantized by their receivers, the rest by the senders)."""
    from triton_reshard import Fragment, Layout

    specs, frags = {}, []
    for name in dst.specs:
        if name not in bf16:
            continue
        t = bf16[name]
        specs[name] = (tuple(t.shape), t.dtype)
        k = t.shape[-1]
        cut = max(1, k * 5 // 8) if k > 1 else k
        for r, (o, n) in enumerate([(0, cut), (cut, k - cut)][:world]):
            if n:
                frags.append(Fragment(name, r, (0,) * (t.dim() - 1) + (o,), tuple(t.shape[:-1]) + (n,), name))
    return Layout.from_fragments(specs, frags)


def _refit_from_bf16(rank, world, params, loaded, preset, root, case, cfg, rep) -> None:
    """Refit the BF16 originals into vLLM's poisoned parameters; every covered element must be the loader's."""
    from safetensors.torch import load_file

    from triton_reshard import refit, verify_refit
    from triton_reshard.presets import megatron_layout

    bf16 = load_file(os.path.join(root, f"{case.model}.bf16.safetensors"))
    plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
    moe = "num_experts" in cfg
    sources = {
        "megatron": megatron_layout(plain, tp=world, ep=world if (moe and case.ep) else 1,
                                    etp=1 if (moe and case.ep) else None, ranks=range(world), dtype=torch.bfloat16),
        "last_dim_split": last_dim_split_source(preset, bf16, world),
    }
    specs = preset.local_specs(rank)
    ones = {t.name: torch.ones(t.shape, dtype=torch.float32) for t in preset.tensors}
    covered = {n: bits(t) != 0 for n, t in preset.shard(ones, rank).items()}
    rep["refit"] = {}
    for sname, src_layout in sources.items():
        src = src_layout.shard({n: bf16[n] for n in src_layout.specs}, rank)
        with torch.no_grad():
            for n in specs:
                bits(params[n].data).fill_(-1)
        t1 = time.perf_counter()
        refit(src, params, src_layout, preset, timeout=120)
        rep["seconds"][f"refit_{sname}"] = time.perf_counter() - t1
        rep["refit"][sname] = {"wrong": {}}
        for n, p in params.items():
            got, want = bits(p.detach()), bits(loaded[n])
            if n not in specs:
                if not torch.equal(got, want):
                    rep["refit_problems"].append(f"rank {rank}: refit ({sname}) changed {n}, not in the layout")
                continue
            m = covered[n]
            bad = int((got[m] != want[m]).sum())
            if bad:
                rep["refit"][sname]["wrong"][n] = bad
                rep["refit_problems"].append(f"rank {rank}: refit ({sname}) wrote {bad} of {int(m.sum())} elements "
                                             f"of {n} unlike vLLM's loader of the ModelOpt checkpoint")
            if not bool((got[~m] == (255 if got.dtype == torch.uint8 else -1)).all()):  # vocab padding rows
                rep["refit_problems"].append(f"rank {rank}: refit ({sname}) wrote outside the layout's boxes in {n}")
        with torch.no_grad():
            for n in specs:
                params[n].data.copy_(loaded[n])
        v = verify_refit(src, params, src_layout, preset, timeout=120)
        rep["refit"][sname]["verify"] = (v.ok, v.total_mismatches)


def _after_post_load(rank, model, vc, preset, root, case, rep) -> None:
    """vLLM's ``process_weights_after_loading`` (the quant methods' own ``process``; the GEMM kernel's repack is
    the placeholder's no-op on this CPU), then a refit into the rewritten parameters: what changed, and that the
    refit refuses by name before writing anything."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from triton_reshard import refit

    before = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    with set_current_vllm_config(vc), no_quant_kernels():
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    params = dict(model.named_parameters())
    after = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
    rep["post_load"] = {"removed": sorted(set(before) - set(after)), "added": sorted(set(after) - set(before)),
                        "changed": sorted(n for n in set(before) & set(after) if before[n] != after[n])}
    bf16 = load_file(os.path.join(root, f"{case.model}.bf16.safetensors"))
    src_layout = last_dim_split_source(preset, bf16, 2)
    src = src_layout.shard({n: bf16[n] for n in src_layout.specs}, rank)
    snap = {n: bits(p.detach()).clone() for n, p in params.items()}
    try:
        refit(src, params, src_layout, preset, timeout=60)
        rep["post_load"]["refit"] = "ran"
    except Exception as e:  # noqa: BLE001
        rep["post_load"]["refit"] = f"{type(e).__name__}: {e}"
    rep["post_load"]["untouched"] = all(torch.equal(bits(p.detach()), snap[n]) for n, p in params.items())
