"""``triton-reshard verify``: does this machine's vLLM load a checkpoint the way our layout says?

Spawns one process per tensor-parallel rank, builds vLLM's model class for the checkpoint and loads it with
vLLM's own loader, then runs :func:`~triton_reshard.verify_refit` from the checkpoint (held whole on rank 0)
against the loaded parameters: every element the layout places must already be there, bit for bit. The
layout is our preset (``--layout preset``), the one recorded from vLLM's own ``load_weights``
(``--layout engine``), or both (default: both must verify, and their digests are compared). Nothing is
written into the model. Needs vLLM installed (on CPU: its model classes run with ``VLLM_TARGET_DEVICE=cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size (default 1): one process per rank")
    p.add_argument("--ep", action="store_true", help="vLLM enable_expert_parallel")
    p.add_argument("--layout", choices=["preset", "engine", "both"], default="both",
                   help="which destination layout to verify: our vllm_layout preset, the one recorded from "
                        "vLLM's load_weights, or both (default)")
    p.add_argument("--dtype", default="auto", help="vLLM dtype (default auto: the checkpoint's)")
    p.add_argument("--vllm-version", default=None, help="format of the preset (default: the installed vLLM)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole check (default 600)")


def _worker(rank: int, world: int, ckpt: str, ep: bool, kinds: tuple[str, ...], dtype: str,
            vllm_version: str | None) -> dict:
    from safetensors.torch import load_file

    from .. import Layout, Replicate, verify_refit
    from ..integrations import checkpoint_shapes
    from ..integrations.vllm import layout_from_vllm, load_vllm_model
    from ..presets import vllm_layout

    model, _vc = load_vllm_model(ckpt, tensor_parallel_size=world, enable_expert_parallel=ep, dtype=dtype)
    params = dict(model.named_parameters())
    pdtype = next(iter(params.values())).dtype
    layouts = {}
    if "engine" in kinds:
        layouts["engine"] = layout_from_vllm(model, checkpoint_shapes(ckpt))
    if "preset" in kinds:
        with open(os.path.join(ckpt, "config.json")) as f:
            cfg = json.load(f)
        layouts["preset"] = vllm_layout(cfg, tp=world, enable_expert_parallel=ep, dtype=pdtype,
                                        vllm_version=vllm_version)
    sd = {}
    if rank == 0:
        for f in sorted(os.listdir(ckpt)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(ckpt, f)))
    out = {}
    for kind, dst in layouts.items():
        specs = {t.name: t for t in dst.tensors}
        src_layout = Layout.from_placements({n: s.shape for n, s in specs.items()}, [0], [Replicate()],
                                            dtype={n: s.dtype for n, s in specs.items()})
        src = {n: sd[n].to(specs[n].dtype) for n in specs} if rank == 0 else {}
        rep = verify_refit(src, params, src_layout, dst, timeout=120)
        out[kind] = {"digest": dst.digest, "ok": rep.ok, "total": rep.total_mismatches,
                     "mismatches": dict(rep.mismatches), "ignored": list(rep.ignored), "message": str(rep)}
    return out


def run_verify(args) -> int:
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        print(f"triton-reshard verify: error: {args.checkpoint!r} has no config.json", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("triton-reshard verify: error: vLLM is not installed in this environment "
              "(tests/engines/install.sh builds one)", file=sys.stderr)
        return 2
    import torch

    from ..testing.launch import WorldError, run_world

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    kinds = ("preset", "engine") if args.layout == "both" else (args.layout,)
    print(f"loading {args.checkpoint} with vLLM on {args.tp} rank(s) and verifying the "
          f"{' and '.join(kinds)} layout(s) ...", flush=True)
    try:
        res = run_world(_worker, args.tp, os.path.abspath(args.checkpoint), args.ep, kinds, args.dtype,
                        args.vllm_version, timeout=args.timeout, backend="gloo")
    except WorldError as e:
        first = min(e.errors)
        text = e.errors[first].strip().splitlines()
        print(f"triton-reshard verify: rank {first} failed: {text[0] if text else '?'}", file=sys.stderr)
        for line in text[1:]:
            if line.startswith(("ValueError", "KeyError", "NotImplementedError", "RuntimeError")):
                print(f"  {line}", file=sys.stderr)
        return 1
    ok = True
    for kind in kinds:
        reps = [r[kind] for r in res]
        good = all(r["ok"] for r in reps)
        ok &= good
        print(f"{kind:7s} layout {reps[0]['digest']}: {'OK' if good else 'MISMATCH'}, "
              f"{reps[0]['total']} differing elements over {len(reps)} rank(s)")
        for r, rep in enumerate(reps):
            for name, n in sorted(rep["mismatches"].items())[:10]:
                print(f"  rank {r}: {name}: {n} elements differ")
            if r == 0 and rep["ignored"]:
                print(f"  not in the layout (ignored): {', '.join(rep['ignored'][:6])}"
                      f"{' ...' if len(rep['ignored']) > 6 else ''}")
        if not good:
            print("  " + reps[0]["message"].replace("\n", "\n  "))
    if len(kinds) == 2:
        same = res[0]["preset"]["digest"] == res[0]["engine"]["digest"]
        print(f"preset and engine layouts are {'identical' if same else 'DIFFERENT (the preset no longer describes this vLLM)'}")
        ok &= same
    return 0 if ok else 1
