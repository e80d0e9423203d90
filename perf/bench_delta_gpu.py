"""The Triton delta codec (issue 44 item 6) against one dense copy of the same bytes, on the device: pack
(diff + encode + snapshot update, cached plan as in a refit) and apply of format v2 (narrow values) and v1, one-ulp changes at random
positions of a Llama's bf16 weights (125M shapes by default), changed fractions 1 %, 2 %, 10 %; best of
``--repeats``; bit-exact, and the v2 message equal to the CPU codec's bytes for the same data (a GPU sender and
a CPU receiver interoperate).

    python perf/bench_delta_gpu.py --device cuda --out perf/results/delta_gpu.json    # on a GPU (perf/gpu_check.sh)
    TRITON_INTERPRET=1 python perf/bench_delta_gpu.py --device cpu --vocab 256 --hidden 64 --inter 128 --layers 1

On CPU the kernels run in Triton's interpreter: only the smoke run's tiny sizes, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def llama_shapes(vocab: int, hidden: int, inter: int, layers: int, kv: int) -> list[tuple[int, int]]:
    per = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ]
    return [(vocab, hidden)] + per * layers + [(vocab, hidden)]


def split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, at = [], 0
    for r, c in shapes:
        out.append(flat[at : at + r * c].view(r, c))
        at += r * c
    return out


def best(fn, repeats: int, sync, setup=None) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up), ``setup`` run untimed before each."""
    out = []
    for _ in range(repeats + 1):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return min(out[1:])


def row(flat: torch.Tensor, shapes, frac: float, args, sync) -> dict:
    from triton_reshard.ops import delta as D

    g = torch.Generator().manual_seed(int(frac * 1e4))
    nb = flat.view(torch.int16).cpu().clone()  # (.cpu() of a CPU tensor is the tensor itself)
    pos = torch.randint(flat.numel(), (int(frac * flat.numel()),), generator=g)
    nb[pos] += (torch.randint(0, 2, pos.shape, generator=g) * 2 - 1).to(torch.int16)
    new = nb.view(torch.bfloat16).to(flat.device)
    snap, dst = flat.clone(), flat.clone()
    pairs = list(zip(split(new, shapes), split(snap, shapes), strict=True))
    dviews = split(dst, shapes)
    out = {"fraction": frac}
    for version in (2, 1):
        msgs: list[torch.Tensor] = []
        pc: dict = {}  # a refit's per-message cache (v2 keeps its kernel tables there)

        def pack(version=version, msgs=msgs, pc=pc):
            msgs[:] = [D.pack_delta(pairs, update=True, backend="triton", version=version, cache=pc)]

        pack_s = best(pack, args.repeats, sync, lambda: snap.copy_(flat))
        apply_s = best(
            lambda msgs=msgs: D.unpack_delta(msgs[0], dviews, backend="triton"),
            args.repeats,
            sync,
            lambda: dst.copy_(flat),
        )
        exact = torch.equal(snap, new) and torch.equal(dst.view(torch.int16), new.view(torch.int16))
        tag = f"v{version}"
        out.update(
            {
                f"{tag}_pack_s": pack_s,
                f"{tag}_apply_s": apply_s,
                f"{tag}_bytes": int(msgs[0].numel()),
                f"{tag}_exact": exact,
            }
        )
        if version == 2:  # the CPU codec's bytes of the same data (native where built, else numpy)
            cpu_pairs = [
                (s.cpu(), p.cpu()) for s, p in zip(split(new, shapes), split(flat, shapes), strict=True)
            ]
            ref = D.pack_delta(cpu_pairs, update=False, backend="torch", version=2)
            out["v2_equals_cpu_codec"] = torch.equal(ref, msgs[0].cpu())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = llama_shapes(args.vocab, args.hidden, args.inter, args.layers, min(args.kv, args.hidden))
    total = sum(r * c for r, c in shapes)
    flat = torch.randn(total, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(dev)
    plain = torch.empty_like(flat)
    copy_s = best(lambda: plain.copy_(flat), args.repeats, sync)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(
        f"{name}: {len(shapes)} tensors, {2 * total / 1e6:.1f} MB bf16; one dense copy_ {1e3 * copy_s:.3f} ms",
        flush=True,
    )
    rows = []
    for frac in args.fractions:
        r = row(flat, shapes, frac, args, sync)
        for tag in ("v2", "v1"):
            r[f"{tag}_pack_over_copy"] = r[f"{tag}_pack_s"] / copy_s
            r[f"{tag}_apply_over_copy"] = r[f"{tag}_apply_s"] / copy_s
            r[f"{tag}_dense_over_bytes"] = 2 * total / r[f"{tag}_bytes"]
        rows.append(r)
        print(
            f"{100 * frac:4.1f} % changed: v2 pack {r['v2_pack_over_copy']:.2f}x copy, apply "
            f"{r['v2_apply_over_copy']:.2f}x, {r['v2_dense_over_bytes']:.1f}x fewer bytes; v1 pack "
            f"{r['v1_pack_over_copy']:.2f}x, apply {r['v1_apply_over_copy']:.2f}x, {r['v1_dense_over_bytes']:.1f}x; "
            f"exact {r['v2_exact'] and r['v1_exact']}; v2 bytes = CPU codec's {r['v2_equals_cpu_codec']}",
            flush=True,
        )
    ok = all(r["v2_exact"] and r["v1_exact"] and r["v2_equals_cpu_codec"] for r in rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "device": name,
                    "tensors": len(shapes),
                    "dense_bytes": 2 * total,
                    "copy_s": copy_s,
                    "repeats": args.repeats,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
