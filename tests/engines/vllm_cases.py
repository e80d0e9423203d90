"""Worker side of the real-vLLM tier (``test_vllm_real.py``): runs in spawned gloo worlds, one process per
vLLM tensor-parallel rank, with ``VLLM_TARGET_DEVICE=cpu`` (see ../shared/FACTS.md).

For every case the rank builds the real vLLM model class from a tiny checkpoint directory through
``EngineArgs(...).create_engine_config()`` and ``initialize_model``, loads it with vLLM's own
``DefaultModelLoader``, and then checks, on its own shard:

1. names, shapes and dtypes of ``named_parameters()`` against our ``vllm_layout`` preset;
2. every element of every parameter against ``vllm_layout(...).shard(checkpoint)`` (padding included);
3. records vLLM's ``load_weights`` on id tensors (``integrations.record``) and returns the record, so the
   parent can build the derived layout and compare its digest with the preset's;
4. poisons every parameter, refits from the checkpoint (held on rank 0 alone) into
   ``dict(model.named_parameters())`` as it is, and requires every element the layout covers to equal what
   vLLM's loader wrote and every element it does not cover to stay poisoned;
5. ``verify_refit`` of the loaded model: 0 mismatches against the right layout and the exact count against
   one with the ranks permuted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass(frozen=True)
class Case:
    model: str  # a name of triton_reshard.presets.CONFIGS, or a no-preset architecture of NO_PRESET
    tp: int
    ep: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.tp}{'-ep' if self.ep else ''}"


def _mla_post_load(model, vc) -> int:
    """vLLM's post-load step for the MLA attention layers only (FusedMoE's needs CPU-build ops)."""
    from vllm.config import set_current_vllm_config

    n = 0
    with set_current_vllm_config(vc):
        for m in model.modules():
            if type(m).__name__ == "MLAAttention" and hasattr(m, "process_weights_after_loading"):
                m.process_weights_after_loading(torch.float32)
                n += 1
    return n


def run_cases(rank: int, world: int, cases: list[Case], ckpt_root: str, configs: dict) -> dict:
    """Worker entry (``run_world``): every case of this world size; returns ``{case id: report}``."""
    from safetensors.torch import load_file

    import triton_reshard
    from triton_reshard import refit
    from triton_reshard.comm import wire
    from triton_reshard.integrations import checkpoint_shapes
    from triton_reshard.integrations.vllm import layout_from_vllm, load_vllm_model, record_vllm
    from triton_reshard.presets import vllm_layout

    torch.manual_seed(0)
    out: dict[str, dict] = {}
    first = True
    # vLLM creates its expert-parallel group only if the config it initialises its groups under has experts
    moe = lambda c: any(k in configs[c.model] for k in ("num_experts", "n_routed_experts"))  # noqa: E731
    for case in sorted(cases, key=lambda c: not moe(c)):
        rep: dict = {"problems": [], "seconds": {}}
        out[case.id] = rep
        t0 = time.perf_counter()
        ckpt = os.path.join(ckpt_root, case.model)
        cfg = configs[case.model]
        try:
            model, vc = load_vllm_model(ckpt, tensor_parallel_size=case.tp, enable_expert_parallel=case.ep,
                                        init_groups=first)
            first = False
            rep["seconds"]["build"] = time.perf_counter() - t0
            params = dict(model.named_parameters())
            loaded = {n: p.detach().clone() for n, p in params.items()}
            rep["params"] = {n: (tuple(p.shape), str(p.dtype)) for n, p in params.items()}
            sd = {k: v.float() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
            shapes = checkpoint_shapes(ckpt)

            t1 = time.perf_counter()
            rec = record_vllm(model, shapes, rank)
            rep["record"] = wire.dumps(rec)  # run_world returns data only: the record as its wire JSON
            rep["seconds"]["record"] = time.perf_counter() - t1
            for n, p in params.items():  # the recorder must not have written anything
                if not torch.equal(p, loaded[n]):
                    rep["problems"].append(f"rank {rank}: recording load_weights changed parameter {n!r}")

            preset = None if cfg.get("no_preset") else vllm_layout(cfg, tp=case.tp, enable_expert_parallel=case.ep,
                                                                    dtype=torch.float32)
            rep["preset_digest"] = None if preset is None else preset.digest
            if preset is not None:
                specs = preset.local_specs(rank)
                want = {n: (s.shape, str(s.dtype)) for n, s in specs.items()}
                if want != rep["params"]:
                    extra = sorted(set(rep["params"]) - set(want))
                    missing = sorted(set(want) - set(rep["params"]))
                    diff = sorted(n for n in set(want) & set(rep["params"]) if want[n] != rep["params"][n])
                    rep["problems"].append(
                        f"rank {rank}: vLLM parameters differ from vllm_layout: only in vLLM {extra[:6]}, only in the "
                        f"preset {missing[:6]}, other shape/dtype {[(n, rep['params'][n], want[n]) for n in diff[:4]]}")
                else:
                    mine = preset.shard(sd, rank)
                    for n, p in loaded.items():
                        if not torch.equal(mine[n], p):
                            bad = int((mine[n] != p).sum())
                            rep["problems"].append(f"rank {rank}: {n}: {bad} of {p.numel()} elements differ from "
                                                   f"vllm_layout's shard of the checkpoint")

            # the layout derived from vLLM's own loader, on every rank, must slice the checkpoint exactly as
            # vLLM's loader did (padding included)
            derived = layout_from_vllm(model, shapes)  # all ranks' records, gathered
            rep["derived_digest"] = derived.digest
            mine = derived.shard(sd, rank)
            if sorted(mine) != sorted(loaded):
                rep["problems"].append(f"rank {rank}: derived layout's local tensors {sorted(set(mine) ^ set(loaded))[:6]} "
                                       f"differ from the model's parameters")
            for n in sorted(set(mine) & set(loaded)):
                if not torch.equal(mine[n], loaded[n]):
                    rep["problems"].append(f"rank {rank}: {n}: {int((mine[n] != loaded[n]).sum())} elements of the derived "
                                           f"layout's shard differ from vLLM's loader")

            # refit from the checkpoint (rank 0 holds it) into the model's own named_parameters(), poisoned
            dst_layout = derived if preset is None else preset
            names = sorted({t.name for t in dst_layout.tensors})
            src_layout = hf_layout_for(dst_layout, names)
            src = {n: sd[n] for n in names} if rank == 0 else {}
            if cfg.get("model_type") == "deepseek_v3":
                rep["mla_post_load"] = _mla_post_load(model, vc)
                params = dict(model.named_parameters())
                loaded = {n: p.detach().clone() for n, p in params.items()}
            covered = dst_layout.shard({t.name: torch.ones(t.shape) for t in dst_layout.tensors}, rank)
            with torch.no_grad():
                for p in params.values():
                    p.fill_(float("nan"))
            t1 = time.perf_counter()
            report = refit(src, dict(model.named_parameters()), src_layout, dst_layout, timeout=120)
            rep["seconds"]["refit"] = time.perf_counter() - t1
            rep["ignored"] = tuple(getattr(report, "ignored", ()))
            for n, p in params.items():
                want = loaded[n]
                if n in covered:
                    m = covered[n].bool()
                    if not torch.equal(p[m], want[m]):
                        rep["problems"].append(f"rank {rank}: refit wrote {int((p[m] != want[m]).sum())} wrong "
                                               f"elements into {n}")
                    if not bool(torch.isnan(p[~m]).all()):
                        rep["problems"].append(f"rank {rank}: refit wrote outside the layout's boxes in {n}")
                elif not torch.equal(p, want):  # not in the layout: a derived parameter sharing storage
                    rep["problems"].append(
                        f"rank {rank}: {n} (not in the layout, ignored by refit) differs from its post-load value "
                        f"after the refit: it does not share storage with what refit writes")
                with torch.no_grad():
                    p.copy_(want)

            # verify mode on the loaded model: right layout -> 0; ranks permuted -> the exact count
            if not hasattr(triton_reshard, "verify_refit"):
                raise RuntimeError("triton_reshard.verify_refit is missing")
            verify_refit = triton_reshard.verify_refit
            v = verify_refit(src, dict(model.named_parameters()), src_layout, dst_layout, timeout=120)
            rep["verify_ok"], rep["verify_total"] = v.ok, v.total_mismatches
            perm = _permuted(dst_layout, world)
            v2 = verify_refit(src, dict(model.named_parameters()), src_layout, perm, timeout=120)
            wrong = perm.shard({t: sd[t] for t in names}, rank)
            cov2 = perm.shard({t.name: torch.ones(t.shape) for t in perm.tensors}, rank)
            expect = sum(int(((wrong[n] != loaded[n]) & cov2[n].bool()).sum()) for n in wrong)
            rep["verify_perm"] = (v2.ok, sum(v2.mismatches.values()), expect)
        except Exception as e:  # noqa: BLE001 (reported per case; the world goes on with the next case)
            import traceback

            rep["problems"].append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        rep["seconds"]["total"] = time.perf_counter() - t0
    return out


def hf_layout_for(dst_layout, names):
    """The checkpoint as a source: every tensor whole on rank 0, in the destination's dtypes."""
    from triton_reshard import Layout, Replicate

    specs = {t.name: t for t in dst_layout.tensors}
    return Layout.from_placements({n: specs[n].shape for n in names}, [0], [Replicate()],
                                  dtype={n: specs[n].dtype for n in names})


def _permuted(layout, world: int):
    """The same layout with rank r's local tensors declared on rank (r + 1) % world: a deliberately wrong
    layout (every TP shard lands on its neighbour)."""
    from triton_reshard import Fragment, Layout, LocalSpec

    sh = lambda r: (r + 1) % world  # noqa: E731
    frags = tuple(Fragment(f.tensor, sh(f.rank), f.offsets, f.sizes, f.local, f.local_offsets) for f in layout.fragments)
    locs = tuple(LocalSpec(sh(s.rank), s.name, s.shape, s.dtype) for s in layout.locals)
    return Layout(layout.tensors, frags, locs)
