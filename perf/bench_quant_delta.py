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

    python perf/bench_quant_delta.py --out perf/results/bench_quant_delta.json [--steps 40 --warmup 150]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_delta import MarkovTask, bf16_bits, make_model, train_step  # noqa: E402

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
            prev = cur
        win = steps[min(9, len(steps) - 1):]
        summ = {"changed_fraction": statistics.fmean(s["changed_fraction"] for s in win),
                "amax_changed_tensors": statistics.fmean(s["amax_changed_tensors"] for s in win)}
        for name in BLOCKS:
            summ[name] = {k: statistics.fmean(s[name][k] for s in win) for k in win[0][name]}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--warmup-lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 2e-6, 3e-6])
    args = ap.parse_args()
    res = run(args)
    res["meta"] = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "torch": torch.__version__}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
