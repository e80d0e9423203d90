"""Real AdamW versions of a preset model's global tensors, for the delta refits of ``perf/bench_cluster.py``.

The Hugging Face model of the preset's config (``llama``: ``LlamaForCausalLM``; ``qwen3_moe``:
``Qwen3MoeForCausalLM``, whose experts transformers 5 keeps fused: ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]) is trained as in ``perf/bench_delta.py`` (the Markov next-token task, AdamW,
fp32 master weights, ``bench_delta.train_step``), then per changed fraction ``repeats`` optimizer steps at a
learning rate bisected so that one step changes about that fraction of the bf16 elements.

Every version is written in the preset's global tensors (``presets.logical_tensors``: the checkpoint names, one
tensor per expert and projection), mapped from the HF parameters by transformers' own reverse of its loading
conversion (``transformers.core_model_loading.revert_weight_conversion``, what ``save_pretrained`` writes): the
mapped tensors are views (slices) of the HF parameters, so an element unchanged in HF is unchanged in the mapped
tensor; :func:`preset_tensors` checks the names and shapes against the preset and refuses a mismatch naming the
tensor. Each version's row also says how the change is spread (:func:`structure`): per tensor group, per expert,
the tokens each expert was routed in that step, and the delta format's bytes (``bench_delta.encodings``, 64 KiB
chunks of each global tensor) against a uniform random mask of the same fraction.

    python perf/cluster_versions.py --model small_qwen3_moe --out /tmp/v.json   # the versions' rows alone
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_delta import (  # a sibling script (perf/ is sys.path[0] when a script here runs)
    MarkovTask,
    chunk_counts,
    encodings,
    train_step,
)

# the preset config's model_type -> (transformers config class, model class)
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
CHUNK_ELEMS = 32768  # 64 KiB of bf16: the chunk bench_delta's part 1 reports


def hf_model(model: str, seq: int = 64) -> torch.nn.Module:
    """The HF causal LM of preset ``model``'s config, fp32, seeded."""
    import transformers

    from triton_reshard.presets import get_config

    cfg = get_config(model)
    kind = cfg.pop("model_type")
    if kind not in HF_CLASSES:
        raise ValueError(f"cluster_versions: preset {model!r} is a {kind!r} model; real AdamW versions are made "
                         f"for {sorted(HF_CLASSES)}")
    conf_cls, model_cls = (getattr(transformers, c) for c in HF_CLASSES[kind])
    torch.manual_seed(0)
    return model_cls(conf_cls(**cfg, max_position_embeddings=seq)).float()


def preset_tensors(net: torch.nn.Module, model: str) -> dict[str, torch.Tensor]:
    """``net``'s parameters as preset ``model``'s global tensors (views, fp32), by transformers' reverse of its
    loading conversion; names and shapes checked against ``presets.logical_tensors``."""
    from transformers.core_model_loading import revert_weight_conversion

    from triton_reshard.presets import get_config, logical_tensors

    out = revert_weight_conversion(net, {n: p.detach() for n, p in net.named_parameters()})
    want = logical_tensors(get_config(model))
    missing, extra = sorted(set(want) - set(out)), sorted(set(out) - set(want))
    if missing or extra:
        raise ValueError(f"cluster_versions: {model}: HF tensors do not map onto the preset's: missing "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, extra {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name, shape in want.items():
        if tuple(out[name].shape) != tuple(shape):
            raise ValueError(f"cluster_versions: {model}: tensor {name} is {tuple(out[name].shape)} in HF, "
                             f"{tuple(shape)} in the preset")
    return out


def bits(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bf16 bit patterns of fp32 tensors."""
    return {n: t.to(torch.bfloat16).view(torch.int16).clone() for n, t in tensors.items()}


def changed(a: dict, b: dict) -> float:
    return sum(int((a[n] != b[n]).sum()) for n in a) / sum(t.numel() for t in a.values())


class Trainer:
    """The HF model of a preset, its AdamW and the Markov task; :meth:`step` records the tokens routed to each
    expert (MoE) in that step."""

    def __init__(self, model: str, batch: int = 8, seq: int = 32):
        self.model, self.net = model, hf_model(model, max(64, seq))
        vocab = self.net.config.vocab_size
        self.task, self.args = MarkovTask(vocab), SimpleNamespace(batch=batch, seq=seq)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-3)
        self.routed: dict[str, torch.Tensor] = {}
        for name, mod in self.net.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):  # (logits, scores, indices) -> tokens per expert
                mod.register_forward_hook(lambda m, i, o, name=name: self.routed.__setitem__(
                    name, self.routed.get(name, 0) + torch.bincount(o[2].reshape(-1), minlength=m.num_experts)))

    def step(self, opt=None) -> float:
        self.routed = {}
        return train_step(self.net, opt or self.opt, self.task, self.args)

    def tensors(self) -> dict[str, torch.Tensor]:
        return preset_tensors(self.net, self.model)

    def changed_after(self, lr: float) -> float:
        """The bf16 fraction one step at ``lr`` changes, from a copy of the state, undone afterwards (the task's
        generator moves on, so the step it calibrates on is not the one it is used for)."""
        net, opt = self.net, self.opt
        saved = {n: p.detach().clone() for n, p in net.named_parameters()}
        st = opt.state_dict()  # its tensors are the optimizer's own: the trial steps a copy of them
        o = torch.optim.AdamW(net.parameters(), lr=lr)
        o.load_state_dict({"state": {k: {n: v.clone() for n, v in s.items()} for k, s in st["state"].items()},
                           "param_groups": st["param_groups"]})
        for gr in o.param_groups:
            gr["lr"] = lr
        before = bits(dict(net.named_parameters()))
        self.step(o)
        frac = changed(before, bits(dict(net.named_parameters())))
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(saved[n])
        return frac

    def calibrate(self, frac: float, iters: int = 10) -> float:
        """A learning rate at which one step changes about ``frac`` (bisection in log space)."""
        lo, hi = 1e-9, 1e-3
        for _ in range(iters):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if self.changed_after(mid) < frac else (lo, mid)
        return math.sqrt(lo * hi)


def _group(name: str) -> str:
    if ".mlp.experts." in name:
        return "experts"
    if name.endswith("mlp.gate.weight"):
        return "router"
    if "norm" in name:
        return "norms"
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    return "attention" if ".self_attn." in name else "dense_mlp"


def _adaptive(masks: dict[str, torch.Tensor]) -> float:
    parts = [chunk_counts(m, CHUNK_ELEMS) for m in masks.values()]
    enc = encodings(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    return enc["adaptive"] / enc["dense_lower_bound"]


def structure(prev: dict, cur: dict, routed: dict, seed: int) -> dict:
    """How one step's change is spread: changed fraction per tensor group; per expert (all projections of
    expert e of a layer) the changed fraction and the tokens routed to it; the delta format's bytes for this
    mask and for a uniform one of the same fraction (each a fraction of the dense bytes)."""
    masks = {n: cur[n] != prev[n] for n in cur}
    total = sum(m.numel() for m in masks.values())
    frac = sum(int(m.sum()) for m in masks.values()) / total
    groups: dict[str, list[int]] = {}
    experts: dict[tuple[str, int], list[int]] = {}
    for n, m in masks.items():
        g = groups.setdefault(_group(n), [0, 0])
        g[0], g[1] = g[0] + int(m.sum()), g[1] + m.numel()
        if ".mlp.experts." in n:
            layer, e = n.split(".mlp.experts.")[0], int(n.split(".mlp.experts.")[1].split(".")[0])
            x = experts.setdefault((layer, e), [0, 0])
            x[0], x[1] = x[0] + int(m.sum()), x[1] + m.numel()
    gen = torch.Generator().manual_seed(seed)
    uniform = {n: torch.rand(m.shape, generator=gen) < frac for n, m in masks.items()}
    out = {"groups": {g: c / n for g, (c, n) in sorted(groups.items())},
           "adaptive_bytes": _adaptive(masks), "uniform_adaptive_bytes": _adaptive(uniform)}
    if experts:
        per = {k: c / n for k, (c, n) in experts.items()}
        tokens = {(layer.replace("model.layers.", "L"), e): int(c) for layer, t in
                  ((k.rsplit(".mlp.gate", 1)[0], v) for k, v in routed.items()) for e, c in enumerate(t.tolist())}
        fr = sorted(per.values())
        idle = [per[k] for k in per if tokens.get((k[0].replace("model.layers.", "L"), k[1])) == 0]
        out["experts"] = {"changed_min": fr[0], "changed_median": statistics.median(fr), "changed_max": fr[-1],
                          "tokens_min": min(tokens.values(), default=0), "tokens_max": max(tokens.values(), default=0),
                          "without_tokens": sum(v == 0 for v in tokens.values()),
                          "without_tokens_changed": statistics.fmean(idle) if idle else None}
    return out


def make_versions(model: str, fractions, repeats: int, warmup: int, path: str | None) -> dict:
    """Train the HF model of ``model``'s config ``warmup`` steps at lr 1e-3, then per fraction ``repeats``
    AdamW steps at a learning rate that changes about that fraction of the bf16 elements; write every
    version's bf16 global tensors to ``path`` (safetensors, ``v{k}/{name}``; None: not written) and return
    the versions' rows (measured changed fraction, learning rate, :func:`structure`)."""
    torch.set_num_threads(1)  # on a shared 2-core machine more threads spin: one step 0.16 s -> 3-7 s
    tr = Trainer(model)
    for _ in range(warmup):
        tr.step()
    out = {f"v0/{n}": t.to(torch.bfloat16).contiguous() for n, t in tr.tensors().items()}
    prev = bits(tr.tensors())
    rows, v = [], 0
    for frac in fractions:
        lr = tr.calibrate(frac)
        for gr in tr.opt.param_groups:
            gr["lr"] = lr
        for _ in range(repeats):
            loss = tr.step()
            v += 1
            cur = bits(tr.tensors())
            rows.append({"version": v, "target": frac, "lr": lr, "changed": changed(prev, cur), "loss": loss,
                         "structure": structure(prev, cur, tr.routed, seed=v)})
            prev = cur
            out.update({f"v{v}/{n}": t.to(torch.bfloat16).contiguous() for n, t in tr.tensors().items()})
    if path:
        from safetensors.torch import save_file

        save_file(out, path)
    return {"path": path, "versions": rows}


def describe(r: dict) -> str:
    """One version's row in a line."""
    s, e = r["structure"], r["structure"].get("experts")
    return (f"v{r['version']}: target {100 * r['target']:.1f} %, changed {100 * r['changed']:.2f} % (lr {r['lr']:.3g}); "
            f"by group {({g: round(100 * x, 2) for g, x in s['groups'].items()})} %; delta bytes (64 KiB chunks) "
            f"{s['adaptive_bytes']:.4f} of dense, a uniform mask {s['uniform_adaptive_bytes']:.4f}"
            + (f"; per expert {100 * e['changed_min']:.2f}-{100 * e['changed_max']:.2f} % changed, tokens "
               f"{e['tokens_min']}-{e['tokens_max']}, {e['without_tokens']} without tokens"
               + (f" (changed {100 * e['without_tokens_changed']:.2f} %)" if e["without_tokens"] else "") if e else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small_qwen3_moe")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.05])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--versions", type=Path, help="also write the versions (safetensors)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    res = make_versions(args.model, args.fractions, args.repeats, args.warmup,
                        str(args.versions) if args.versions else None)
    for r in res["versions"]:
        print(describe(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**res, "model": args.model, "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
