"""Would block-level deltas pay for MXFP8 / NVFP4 destinations (issue 33)? The fraction of quantization blocks a
refit step touches, on the real AdamW diffs of ``perf/bench_delta.py``'s training run (a small Llama trained on a
Markov task, then RL-like steps at lr 1e-6 .. 1e-5: 1-3 % of the bf16 weights change per step at 1e-6 .. 3e-6).

A quantized block must be re-sent whole (values and scale) when any of its elements changed: its scale, and
with it every value, may change. Per step, per block shape (1x16 NVFP4, 1x32 MXFP8, 128x128 block FP8, along
the weights' last dim, as the destination layouts block them), the touched-block fraction and the bytes a
block delta would carry against the dense quantized refit (touched blocks + a 4-byte block index each, vs all
blocks). Uniform random masks at 1 / 2 / 3 % beside them (a touched fraction of ``1 - (1 - p)^block``). And
the fraction of weight tensors whose bf16 amax changed in the step: NVFP4's global scale follows it, and a
changed global scale re-quantizes every block of the tensor (a block delta would send it all).

Then the implemented block deltas (``ops/block_delta.py``, what a delta refit into MXFP8 / NVFP4 sends) on
``--measured`` of those steps: the message's bytes against the dense quantized bytes, and the seconds to pack and
unpack it against a dense copy.

    python perf/bench_quant_delta.py --out perf/results/bench_quant_delta.json [--steps 40 --warmup 150]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from bench_delta import MarkovTask, add_train_args, bf16_bits, make_model, train_step  # a sibling script

from triton_reshard.ops.block_delta import pack_block_delta, unpack_block_delta
from triton_reshard.ops.quantize import nvfp4_global_scale, quantize_mxfp8, quantize_nvfp4

BLOCKS = {"nvfp4-1x16": (1, 16), "mxfp8-1x32": (1, 32), "fp8-128x128": (128, 128)}
# bytes per block in the destination format: values + scale (NVFP4: 16 x 4 bits + 1; MXFP8: 32 + 1; FP8: 16 Ki + 4)
BLOCK_BYTES = {"nvfp4-1x16": 9, "mxfp8-1x32": 33, "fp8-128x128": 128 * 128 + 4}
INDEX_BYTES = 4


def touched(mask: torch.Tensor, block: tuple[int, int]) -> tuple[int, int]:
    """(touched blocks, all blocks) of a 2-D bool mask (1-D: one row) cut into ``block`` from index 0."""
    m = mask if mask.dim() == 2 else mask.reshape(1, -1)
    r, c = m.shape
    br, bc = min(block[0], r), block[1]
    pr, pc = -(-r // br) * br, -(-c // bc) * bc
    p = torch.nn.functional.pad(m.to(torch.int8), (0, pc - c, 0, pr - r))
    t = p.view(pr // br, br, pc // bc, bc).amax(dim=(1, 3))
    return int(t.sum()), t.numel()


def step_blocks(masks: dict[str, torch.Tensor], cur=None, prev=None) -> dict:
    out = {"changed_fraction": sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())}
    if cur is not None:  # NVFP4's global scale follows the tensor's amax: a changed amax re-quantizes every block
        quantized = [n for n, m in masks.items() if m.dim() == 2 and m.shape[-1] % 16 == 0]
        amax = lambda b: b.view(torch.bfloat16).abs().amax()  # noqa: E731
        out["amax_changed_tensors"] = sum(bool(amax(cur[n]) != amax(prev[n])) for n in quantized) / len(quantized)
    for name, blk in BLOCKS.items():
        hit = tot = 0
        for m in masks.values():
            if m.dim() == 2 and m.shape[-1] % blk[1] == 0:  # the weights a destination would quantize
                h, t = touched(m, blk)
                hit, tot = hit + h, tot + t
        out[name] = {"touched_fraction": hit / tot,
                     "delta_vs_dense_bytes": hit * (BLOCK_BYTES[name] + INDEX_BYTES) / (tot * BLOCK_BYTES[name])}
    return out


def quantized(w: dict[str, torch.Tensor], fmt: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The weights a destination would quantize (2-D, last dim whole 1x32 blocks), in ``fmt`` (torch reference;
    NVFP4 with each tensor's own global scale)."""
    out = {}
    for n, b in w.items():
        if b.dim() == 2 and b.shape[-1] % 32 == 0:
            x = b.view(torch.bfloat16)
            if fmt == "mxfp8":
                q, s = quantize_mxfp8(x)
                out[n] = (q.view(torch.uint8), s)
            else:
                out[n] = quantize_nvfp4(x, global_scale=nvfp4_global_scale(x.abs().amax())[0])
    return out


def measured_step(cur: dict, prev: dict, fmt: str, repeats: int = 3) -> dict:
    """The implemented block delta (``ops/block_delta.py``) between two versions' quantized weights, one chunk
    per tensor: message bytes vs dense (values + scales), and the seconds to pack (diff + gather) and unpack
    (scatter) it vs a dense copy of the same bytes (best of ``repeats``; the quantization itself is the dense
    refit's too and is not counted)."""
    qc, qp = quantized(cur, fmt), quantized(prev, fmt)
    chunks = [qc[n] for n in sorted(qc)]
    dense = sum(q.numel() + s.numel() for q, s in chunks)
    snaps = [(q.clone(), s.clone()) for n in sorted(qp) for q, s in [qp[n]]]
    dst = [(q.clone(), s.clone()) for q, s in snaps]
    best = {"pack": 1e9, "unpack": 1e9, "dense_copy": 1e9}
    for _ in range(repeats):
        t = time.perf_counter()
        msg = pack_block_delta(chunks, snaps, update=False)
        best["pack"] = min(best["pack"], time.perf_counter() - t)
        t = time.perf_counter()
        unpack_block_delta(msg, dst)
        best["unpack"] = min(best["unpack"], time.perf_counter() - t)
        t = time.perf_counter()
        for (q, s), (dq, ds) in zip(chunks, dst, strict=True):
            dq.copy_(q)
            ds.copy_(s)
        best["dense_copy"] = min(best["dense_copy"], time.perf_counter() - t)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for (a, _), (b, _) in zip(chunks, dst, strict=True))
    return {"message_vs_dense_bytes": msg.numel() / dense, **{f"{k}_s": v for k, v in best.items()}}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model = make_model(args)
    task = MarkovTask(args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr)
    for _ in range(args.warmup):
        train_step(model, opt, task, args)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = {"lrs": {}, "synthetic": {}}
    for lr in args.lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        prev = bf16_bits(model)
        steps = []
        for _ in range(args.steps):
            train_step(model, opt, task, args)
            cur = bf16_bits(model)
            steps.append(step_blocks({n: cur[n] != prev[n] for n in cur}, cur, prev))
            if len(steps) > min(9, args.steps - 1) and len(steps) <= min(9, args.steps - 1) + args.measured:
                steps[-1]["measured"] = {f: measured_step(cur, prev, f) for f in ("nvfp4", "mxfp8")}
            prev = cur
        win = steps[min(9, len(steps) - 1):]
        summ = {"changed_fraction": statistics.fmean(s["changed_fraction"] for s in win),
                "amax_changed_tensors": statistics.fmean(s["amax_changed_tensors"] for s in win)}
        for name in BLOCKS:
            summ[name] = {k: statistics.fmean(s[name][k] for s in win) for k in win[0][name]}
        meas = [s["measured"] for s in win if "measured" in s]
        if meas:
            summ["measured"] = {f: {k: statistics.fmean(m[f][k] for m in meas) for k in meas[0][f]} for f in meas[0]}
            print(f"lr {lr:g} measured block deltas: " + ", ".join(
                f"{f} {v['message_vs_dense_bytes']:.2f}x dense bytes, pack {1e3 * v['pack_s']:.1f} ms + unpack "
                f"{1e3 * v['unpack_s']:.1f} ms vs dense copy {1e3 * v['dense_copy_s']:.1f} ms"
                for f, v in summ["measured"].items()), flush=True)
        res["lrs"][str(lr)] = summ
        print(f"lr {lr:g}: changed {100 * summ['changed_fraction']:.2f} %; amax changed in "
              f"{100 * summ['amax_changed_tensors']:.1f} % of the weights; touched blocks "
              + ", ".join(f"{n} {100 * summ[n]['touched_fraction']:.1f} % (delta {summ[n]['delta_vs_dense_bytes']:.2f}x"
                          f" dense)" for n in BLOCKS), flush=True)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for frac in (0.01, 0.02, 0.03):
        g = torch.Generator().manual_seed(int(frac * 1000))
        s = step_blocks({n: torch.rand(sh, generator=g) < frac for n, sh in shapes.items()})
        res["synthetic"][str(frac)] = s
        print(f"uniform {100 * frac:.0f} %: touched " + ", ".join(
            f"{n} {100 * s[n]['touched_fraction']:.1f} %" for n in BLOCKS), flush=True)
    return res


def machine(threads: int) -> str:
    return (f"CPU ({platform.machine()}, {platform.system()}), {os.cpu_count()} cores, {threads} torch thread(s), "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_train_args(ap, steps=30, lrs=[1e-6, 2e-6, 3e-6])
    ap.add_argument("--measured", type=int, default=3, help="steps per lr whose block deltas are built and timed")
    args = ap.parse_args()
    res = run(args)
    res["meta"] = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "torch": torch.__version__, "machine": machine(args.threads), "load_average": os.getloadavg()}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
