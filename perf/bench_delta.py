"""Delta refit groundwork (issue 24): how many bf16 weights change per RL step, which encoding of the changed
elements is smallest, and what the torch reference of pack / unpack costs against a plain copy.

Part 1 (``--part train``): a small Llama (``transformers.LlamaForCausalLM`` from a tiny config, random
init) is first trained at lr 1e-3 (AdamW, fp32 master weights) on a synthetic next-token task (a fixed random
Markov chain over the vocabulary: the loss goes from ln(V) down), then, from that checkpoint and with a fresh
AdamW, for ``--steps`` steps at each RL learning rate. After every step the fp32 weights are cast to bf16 and
compared bit for bit with the previous step's bf16 copy: the changed fraction per step and per tensor, and
per-chunk densities for chunks of 4 KiB .. 1 MiB of each tensor's (row-major, contiguous) bytes.

Part 2 (same run, same masks): encoded bytes per refit for every chunk size and encoding, against the dense
lower bound (2 bytes per bf16 element):

- ``bitmask``: 1 bit per element + the changed values;
- ``off16``: sorted uint16 offsets within 64 Ki-element blocks (a 4-byte count per block when a chunk holds
  more than one block) + values; ``off32``: sorted int32 absolute offsets + values;
- ``dense``; ``adaptive``: per chunk the smallest of off16 / bitmask / dense (the format of
  ``triton_reshard.ops.delta``, whose ``chunk_sizes`` gives the bytes for chunks up to 64 Ki elements);
  ``adaptive32``: the same with off32 instead of off16.

Every chunk costs its 16-byte header and an 8-byte directory entry in every encoding (the format's framing;
dense lower bound has none). The same is computed for uniformly random masks at 1 / 2 / 3 / 7 % on the same
tensors (``synthetic``).

Part 3 (``--part speed``): the torch reference of ``pack`` / ``unpack`` on CPU against a plain ``copy_`` of
the same dense bytes into a preallocated buffer, same run, at several changed fractions.

Part 4 (``--part refit``): the wired delta refit on a real gloo world of 4 processes: trainer TP2 (ranks
0-1, rows) -> engine TP2 (ranks 2-3, columns: every rank sends to both engine ranks), ``--refit-tensors``
bf16 tensors of ``--refit-rows`` x ``--refit-cols``. Per changed fraction (uniform random bit flips, which
give the same encoded bytes as the real AdamW masks of part 1), one dense refit and one delta refit of the
same change on the same ranks, each into its own destination (two Resharders of the same plan), timed
(the slowest rank's ``RunReport.seconds``, median of ``--repeats``); the wire bytes summed over ranks
against the dense lower bound (the payload a dense refit sends); the two destinations compared bit for bit.

    .venv/bin/python perf/bench_delta.py --part train --out perf/results/bench_delta_train.json
    .venv/bin/python perf/bench_delta.py --part speed --out perf/results/bench_delta_speed.json
    .venv/bin/python perf/bench_delta.py --part refit --out perf/results/bench_delta_refit.json
    .venv/bin/python perf/bench_delta.py --part codec --out perf/results/bench_delta_codec.json
    .venv/bin/python perf/bench_delta.py --part wire --out perf/results/bench_delta_wire.json
    .venv/bin/python perf/bench_delta.py --part trainer --fractions 0.1 --out perf/results/bench_delta_trainer.json

Part 5 (``--part codec``, issue 44): the CPU codec (format v2, native where built) on the 125M Llama's 86
weights (249 MB bf16) at 1 / 2 / 10 % one-ulp changes at random positions (``--outliers F``: a fraction F of
them moved 8..120 ulps instead, as real steps' far movers, which make patched blocks): pack (diff + encode +
snapshot update, cached plan) and apply, best of ``--repeats``, next to one dense ``copy_`` of all bytes in
the same run, and format v1 (the numpy codec) for comparison; bit-exact. Part 6 (``--part wire``): wire bytes
of v2 (and of v2 without patched blocks, ``ops/delta_patch.py``, the same steps) and v1 against dense on real
AdamW steps of the small Llama at lr 1e-5 and 1e-6, with how many bits each changed 256-element block needed
(patched: ``"2p"``, ... and the exceptions) and each changed chunk (its widest block; ``dense``: sent dense);
``--triton``: each counted step packed by the Triton kernels too (a GPU, or ``TRITON_INTERPRET=1`` on CPU,
slow), which must write the same bytes (``triton_bytes``). Part 7
(``--part trainer``, in ``perf/bench_delta_loop.py``): the RL loop's refit without vLLM (gloo: one trainer rank
-> two TP2 receivers), dense and delta side by side, the trainer's CPU against the codec alone and each
receiver's against its apply alone; ``--ab`` adds a delta refit with one message per plan message.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_delta_loop import llama_shapes, run_trainer  # a sibling script (perf/ is sys.path[0] here)

from triton_reshard.ops import delta as D

CHUNK_BYTES = (4096, 16384, 65536, 262144, 1 << 20)
LRS = (1e-6, 2e-6, 3e-6, 1e-5)
SYNTH_FRACTIONS = (0.01, 0.02, 0.03, 0.07)
DENSITY_EDGES = (0.0, 0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.0625, 0.1, 0.2, 0.5, 0.94, 1.0)
DIRECTORY_BYTES = 8
BLOCK = 1 << 16


# ---------------------------------------------------------------------------------------------------------
# model and task


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


class MarkovTask:
    """Next token = ``perm[token]`` with probability ``p``, else uniform: learnable, with an entropy floor."""

    def __init__(self, vocab: int, p: float = 0.8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=g)
        self.vocab, self.p, self.g = vocab, p, g

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(self.vocab, (batch,), generator=self.g)
        for t in range(1, seq):
            follow = torch.rand(batch, generator=self.g) < self.p
            rnd = torch.randint(self.vocab, (batch,), generator=self.g)
            x[:, t] = torch.where(follow, self.perm[x[:, t - 1]], rnd)
        return x


def train_step(model, opt, task, args) -> float:
    x = task.batch(args.batch, args.seq)
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def bf16_bits(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).view(torch.int16).clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------
# chunk statistics and encodings


def chunk_counts(mask: torch.Tensor, elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(numel per chunk, changed count per chunk) of a flat bool mask cut into runs of ``elems``."""
    n, m = mask.numel(), mask.reshape(-1).to(torch.int64)
    nch = max(1, math.ceil(n / elems))
    counts = torch.nn.functional.pad(m, (0, nch * elems - n)).view(nch, elems).sum(1)
    numel = torch.full((nch,), elems, dtype=torch.int64)
    numel[-1] = n - (nch - 1) * elems
    return numel, counts


def encodings(numel: torch.Tensor, count: torch.Tensor, esize: int = 2) -> dict[str, int]:
    """Total encoded bytes of the chunks under each encoding (header + directory per chunk included)."""
    pad, hdr = D.pad, D.HEADER_BYTES + DIRECTORY_BYTES
    values = pad(count * esize)
    blocks = (numel + BLOCK - 1) // BLOCK
    block_hdr = torch.where(blocks > 1, 4 * blocks, torch.zeros_like(blocks))
    off16 = hdr + pad(block_hdr + 2 * count) + values
    off32 = hdr + pad(4 * count) + values
    bitmask = hdr + pad(4 * ((numel + 31) // 32)) + values
    dense = hdr + pad(numel * esize)
    out = {"dense_lower_bound": int((numel * esize).sum()), "dense": int(dense.sum()),
           "bitmask": int(bitmask.sum()), "off16": int(off16.sum()), "off32": int(off32.sum()),
           "adaptive": int(torch.minimum(torch.minimum(off16, bitmask), dense).sum()),
           "adaptive32": int(torch.minimum(torch.minimum(off32, bitmask), dense).sum())}
    if int(numel.max()) <= D.MAX_CHUNK_ELEMS:  # the library's own format: must agree with ``adaptive``
        lib = int((D.chunk_sizes(numel, count, esize)[1] + DIRECTORY_BYTES).sum())
        assert lib == out["adaptive"], (lib, out["adaptive"])
    return out


def step_stats(masks: dict[str, torch.Tensor]) -> dict:
    total = sum(m.numel() for m in masks.values())
    changed = sum(int(m.sum()) for m in masks.values())
    rec = {"changed_fraction": changed / total,
           "per_tensor": {n: int(m.sum()) / m.numel() for n, m in masks.items()}, "chunks": {}}
    for cb in CHUNK_BYTES:
        elems = cb // 2
        parts = [chunk_counts(m, elems) for m in masks.values()]
        numel, count = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        dens = count.double() / numel.double()
        edges = torch.tensor(DENSITY_EDGES, dtype=torch.float64)
        bucket = torch.bucketize(dens, edges[1:-1], right=True)
        rec["chunks"][cb] = {
            "num_chunks": int(numel.numel()),
            "density_quantiles": {q: float(torch.quantile(dens, q)) for q in (0.1, 0.5, 0.9, 0.99)},
            "zero_chunks": float((count == 0).double().mean()),
            "chunk_hist": torch.bincount(bucket, minlength=len(DENSITY_EDGES) - 1).tolist(),
            "bytes": encodings(numel, count),
        }
    return rec


def synthetic(shapes: dict[str, torch.Size], frac: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return step_stats({n: torch.rand(s, generator=g) < frac for n, s in shapes.items()})


def summarize(steps: list[dict], lo: int, hi: int) -> dict:
    sel = steps[lo:hi]
    out = {"steps": [lo + 1, hi], "changed_fraction_mean": statistics.fmean(s["changed_fraction"] for s in sel),
           "changed_fraction_min": min(s["changed_fraction"] for s in sel),
           "changed_fraction_max": max(s["changed_fraction"] for s in sel), "bytes_vs_dense": {}}
    for cb in CHUNK_BYTES:
        tot = {k: sum(s["chunks"][cb]["bytes"][k] for s in sel) for k in sel[0]["chunks"][cb]["bytes"]}
        lb = tot.pop("dense_lower_bound")
        out["bytes_vs_dense"][cb] = {k: v / lb for k, v in tot.items()}
    return out


def run_train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model = make_model(args)
    nparams = sum(p.numel() for p in model.parameters())
    task = MarkovTask(args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr)
    t0 = time.perf_counter()
    warm_loss = [train_step(model, opt, task, args) for _ in range(args.warmup)]
    warm_s = time.perf_counter() - t0
    print(f"warmup {args.warmup} steps lr {args.warmup_lr}: loss {warm_loss[0]:.3f} -> {warm_loss[-1]:.3f} "
          f"({warm_s:.1f} s, {nparams / 1e6:.2f} M params)", flush=True)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    result = {"params": nparams, "tensors": {n: list(s) for n, s in shapes.items()},
              "warmup": {"steps": args.warmup, "lr": args.warmup_lr, "loss_first": warm_loss[0],
                         "loss_last": warm_loss[-1], "seconds": warm_s}, "lrs": {}}
    for lr in args.lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        prev = bf16_bits(model)
        losses, steps = [], []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            losses.append(train_step(model, opt, task, args))
            cur = bf16_bits(model)
            steps.append(step_stats({n: cur[n] != prev[n] for n in cur}))
            prev = cur
        secs = time.perf_counter() - t0
        window = summarize(steps, 9, min(30, args.steps))
        allw = summarize(steps, 0, args.steps)
        k = max(1, args.steps // 10)
        print(f"lr {lr:g}: loss {statistics.fmean(losses[:k]):.4f} -> {statistics.fmean(losses[-k:]):.4f}; "
              f"changed steps 10-30 {100 * window['changed_fraction_mean']:.2f} % "
              f"(all steps {100 * allw['changed_fraction_mean']:.2f} %, "
              f"last {100 * steps[-1]['changed_fraction']:.2f} %); "
              f"adaptive @64KiB {window['bytes_vs_dense'][65536]['adaptive']:.4f} of dense ({secs:.1f} s)",
              flush=True)
        result["lrs"][str(lr)] = {
            "loss": losses, "changed_fraction": [s["changed_fraction"] for s in steps],
            "steps_10_30": window, "all_steps": allw,
            "per_tensor_steps_10_30": {n: statistics.fmean(s["per_tensor"][n] for s in steps[9:30])
                                       for n in shapes},
            "chunks_step_20": steps[min(19, len(steps) - 1)]["chunks"], "seconds": secs}
    result["synthetic"] = {}
    for frac in SYNTH_FRACTIONS:
        s = synthetic(shapes, frac, seed=int(frac * 1000))
        result["synthetic"][str(frac)] = {"changed_fraction": s["changed_fraction"],
                                          "bytes_vs_dense": summarize([s], 0, 1)["bytes_vs_dense"]}
        print(f"synthetic {100 * frac:.0f} %: adaptive @64KiB "
              f"{result['synthetic'][str(frac)]['bytes_vs_dense'][65536]['adaptive']:.4f} of dense", flush=True)
    return result


# ---------------------------------------------------------------------------------------------------------
# part 3: torch reference speed


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    return [-time.perf_counter() + (fn(), time.perf_counter())[1] for _ in range(repeats)]


def time_ops(src, snap, dst, plain, packed, repeats: int) -> dict[str, float]:
    """Median seconds of a plain copy of the dense bytes, the reference pack and the reference unpack."""
    ops = {"copy": lambda: plain.copy_(src),
           "pack": lambda: D.torch_pack([(src, snap)], update=False),
           "unpack": lambda: D.torch_unpack(packed, [dst])}
    return {name: statistics.median(timed(fn, repeats)) for name, fn in ops.items()}


def run_speed(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n = args.speed_elems
    rows = []
    for frac in (0.0, 0.01, 0.02, 0.07, 0.5, 1.0):
        src = torch.randn(n // 1024, 1024, generator=g).to(torch.bfloat16)
        snap = src.clone()
        flip = torch.rand(src.shape, generator=g) < frac
        src.view(torch.int16)[flip] ^= 1
        dst = snap.clone()
        plain = torch.empty_like(src)
        packed = D.torch_pack([(src, snap)], update=False)
        med = time_ops(src, snap, dst, plain, packed, args.repeats)
        dense = src.numel() * src.element_size()
        row = {"fraction": frac, "dense_bytes": dense, "encoded_bytes": int(packed.numel()),
               "copy_s": med["copy"], "pack_s": med["pack"], "unpack_s": med["unpack"],
               "pack_over_copy": med["pack"] / med["copy"], "unpack_over_copy": med["unpack"] / med["copy"]}
        rows.append(row)
        print(f"{100 * frac:5.1f} %: encoded {row['encoded_bytes'] / dense:.4f} of dense; copy "
              f"{1e3 * med['copy']:.2f} ms, pack {1e3 * med['pack']:.2f} ms ({row['pack_over_copy']:.1f}x), unpack "
              f"{1e3 * med['unpack']:.2f} ms ({row['unpack_over_copy']:.1f}x)", flush=True)
    return {"elems": n, "dtype": "bfloat16", "rows": rows}


# ---------------------------------------------------------------------------------------------------------
# part 5: the codec at memory speed (issue 44)


def best(fn, repeats: int, setup=None) -> float:
    """Fastest of ``repeats`` timed calls (after one warm-up), ``setup`` run untimed before each."""
    out = []
    for _ in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out[1:])


def codec_row(flat, views, frac: float, args) -> dict:
    """One changed fraction: one-ulp changes (+-1 in the bit pattern) at random positions; pack (diff + encode +
    snapshot update, cached plan) and apply (cached plan) of v2 and v1, best of ``--repeats``; bit-exact."""
    from triton_reshard.ops.delta_v2 import block_histogram, chunk_histogram

    g = torch.Generator().manual_seed(int(frac * 1e4))
    new = flat.clone()
    pos = torch.randint(flat.numel(), (int(frac * flat.numel()),), generator=g)
    nb = new.view(torch.int16)
    nb[pos] += (torch.randint(0, 2, pos.shape, generator=g) * 2 - 1).to(torch.int16)
    far = pos[torch.rand(pos.shape, generator=g) < args.outliers]  # --outliers: moved 8..120 ulps instead
    nb[far] += (torch.randint(8, 121, far.shape, generator=g) * (torch.randint(0, 2, far.shape, generator=g) * 2 - 1)
                ).to(torch.int16)
    snap, dst = flat.clone(), flat.clone()
    nviews, sviews, dviews = (split(t, views) for t in (new, snap, dst))
    pairs = list(zip(nviews, sviews, strict=True))
    row = {"fraction": frac, "outliers": args.outliers, "changed": int((nb != flat.view(torch.int16)).sum())}
    for version in args.versions:
        pc, uc, msgs = {}, {}, []

        def pack(version=version, pc=pc, msgs=msgs):
            msgs[:] = [D.pack_delta(pairs, update=True, backend="torch", cache=pc, version=version)]

        pack_s = best(pack, args.repeats, lambda: snap.copy_(flat))
        apply_s = best(lambda uc=uc, msgs=msgs: D.unpack_delta(msgs[0], dviews, backend="torch", cache=uc),
                       args.repeats, lambda: dst.copy_(flat))
        exact = torch.equal(snap.view(torch.int16), nb) and torch.equal(dst.view(torch.int16), nb)
        tag = f"v{version}"
        row.update({f"{tag}_pack_s": pack_s, f"{tag}_apply_s": apply_s, f"{tag}_bytes": int(msgs[0].numel()),
                    f"{tag}_exact": exact})
        if version == 2:
            row["v2_block_bits"] = block_histogram([msgs[0].numpy()])
            row["v2_chunk_bits"] = chunk_histogram([msgs[0].numpy()])
    return row


def split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    ends = [0, *itertools.accumulate(r * c for r, c in shapes)]
    return [flat[a:z].view(r, c) for a, z, (r, c) in zip(ends[:-1], ends[1:], shapes, strict=True)]


def run_codec(args: argparse.Namespace) -> dict:
    from triton_reshard.ops.delta_native import codec_threads, native_info

    torch.set_num_threads(args.threads)
    threads = codec_threads(args.codec_threads)  # the native check / apply's (1 or 2; None: no native codec)
    shapes = llama_shapes(args.codec_vocab, 768, 2048, args.codec_layers, 256)
    total = sum(r * c for r, c in shapes)
    flat = torch.randn(total, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    plain = torch.empty_like(flat)
    copy_s = best(lambda: plain.copy_(flat), args.repeats)
    dense = 2 * total
    print(f"codec: {native_info()}, {threads} thread(s); {len(shapes)} tensors, {dense / 1e6:.0f} MB bf16; one dense copy_ "
          f"{1e3 * copy_s:.1f} ms (best of {args.repeats})", flush=True)
    rows = []
    for frac in args.fractions:
        row = codec_row(flat, shapes, frac, args)
        for tag in (f"v{v}" for v in args.versions):
            row[f"{tag}_pack_over_copy"] = row[f"{tag}_pack_s"] / copy_s
            row[f"{tag}_apply_over_copy"] = row[f"{tag}_apply_s"] / copy_s
            row[f"{tag}_dense_over_bytes"] = dense / row[f"{tag}_bytes"]
        rows.append(row)
        print(f"{100 * frac:4.1f} % changed:", "; ".join(
            f"v{v} pack {1e3 * row[f'v{v}_pack_s']:.1f} ms ({row[f'v{v}_pack_over_copy']:.2f}x copy), apply "
            f"{1e3 * row[f'v{v}_apply_s']:.1f} ms ({row[f'v{v}_apply_over_copy']:.2f}x), "
            f"{row[f'v{v}_dense_over_bytes']:.1f}x fewer bytes than dense, exact {row[f'v{v}_exact']}"
            for v in args.versions), f"; block bits {row.get('v2_block_bits')}", flush=True)
    return {"codec": native_info(), "codec_threads": threads, "tensors": len(shapes), "dense_bytes": dense, "copy_s": copy_s,
            "repeats": args.repeats, "rows": rows}


def run_wire(args: argparse.Namespace) -> dict:
    """Wire bytes of v2 and v1 delta messages against dense on real AdamW steps (fp32 masters, bf16 weights)
    of the small Llama of ``--part train``, per learning rate, with the per-block bits histogram."""
    from triton_reshard.ops.delta_format import DEFAULT_CHUNK_ELEMS
    from triton_reshard.ops.delta_native import V2PackPlan
    from triton_reshard.ops.delta_v2 import block_histogram, chunk_histogram

    torch.set_num_threads(args.threads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # --triton on CPU: run with TRITON_INTERPRET=1 (slow)
    model = make_model(args)
    task = MarkovTask(args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr)
    for _ in range(args.warmup):
        train_step(model, opt, task, args)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {"params": sum(p.numel() for p in model.parameters()), "lrs": {}}
    for lr in args.lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        snaps = {n: t.clone() for n, t in bf16_bits(model).items()}
        hist, chist, hist0, v2b, v20b, v1b, dense, changed, tri = {}, {}, {}, 0, 0, 0, 0, 0, 0
        for step in range(args.steps):
            train_step(model, opt, task, args)
            cur = bf16_bits(model)
            pairs = [(cur[n], snaps[n]) for n in cur]
            v1 = D.pack_delta(pairs, update=False, backend="torch", version=1)
            msg = D.pack_delta(pairs, update=False, backend="torch")
            plain = V2PackPlan(pairs, DEFAULT_CHUNK_ELEMS).pack(False, patch=False)  # v2 before patched blocks
            if args.triton and step >= args.skip:  # the Triton pack's message: the same bytes, or stop here
                tmsg = D.pack_delta([(a.to(dev), b.to(dev)) for a, b in pairs], update=False, backend="triton")
                if not torch.equal(tmsg.cpu(), msg):
                    raise SystemExit(f"lr {lr:g} step {step}: the Triton pack's bytes differ from the CPU codec's")
                tri += tmsg.numel()
            if step >= args.skip:
                changed += sum(int((a != b).sum()) for a, b in pairs)
                v2b, v1b, dense = v2b + msg.numel(), v1b + v1.numel(), dense + sum(2 * a.numel() for a, _ in pairs)
                v20b += plain.numel()
                for k, v in block_histogram([plain.numpy()]).items():
                    hist0[k] = hist0.get(k, 0) + v
                for k, v in block_histogram([msg.numpy()]).items():
                    hist[k] = hist.get(k, 0) + v
                for k, v in chunk_histogram([msg.numpy()]).items():
                    chist[k] = chist.get(k, 0) + v
            snaps = cur
        r = {"steps": args.steps - args.skip, "changed_fraction": changed / (dense / 2), "dense_over_v2": dense / v2b,
             "dense_over_v1": dense / v1b, "block_bits": hist, "chunk_bits": chist,
             "dense_over_v2_unpatched": dense / v20b, "block_bits_unpatched": hist0}
        if args.triton:
            r["triton_bytes"], r["triton_equal_to_cpu"] = tri, tri == v2b
        out["lrs"][str(lr)] = r
        print(f"lr {lr:g}: {100 * r['changed_fraction']:.2f} % changed per step; v2 {r['dense_over_v2']:.2f}x fewer "
              f"bytes than dense (without patched blocks {r['dense_over_v2_unpatched']:.2f}x; v1 "
              f"{r['dense_over_v1']:.1f}x); changed blocks by bits {hist} (without patched blocks {hist0}); changed "
              f"chunks by the bits of their widest difference {chist}", flush=True)
    return out


REFIT_FRACTIONS = (0.0, 0.01, 0.02, 0.03, 0.07, 0.25, 1.0)


def refit_worker(rank: int, world: int, shapes: dict, fractions: list, repeats: int) -> dict:
    from triton_reshard import Layout, Resharder, Shard, plan_reshard
    from triton_reshard.execute.delta import DeltaRequest

    src_l = Layout.from_placements(shapes, [0, 1], [Shard(0)], torch.bfloat16)
    dst_l = Layout.from_placements(shapes, [2, 3], [Shard(1)], torch.bfloat16)
    plan = plan_reshard(src_l, dst_l, rank=rank)
    dense_r, delta_r = Resharder(plan, timeout=120), Resharder(plan, timeout=120)
    g = torch.Generator().manual_seed(1)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}
    src = src_l.shard(full, rank) if rank < 2 else {}
    d_dense = dst_l.allocate(rank) if rank >= 2 else {}
    d_delta = dst_l.allocate(rank) if rank >= 2 else {}
    version = 0
    dense_r.run(src, d_dense)
    delta_r.run(src, d_delta, delta=DeltaRequest(version))  # the first delta refit is dense (captures)
    rows = []
    for frac in fractions:
        for rep in range(repeats):
            gen = torch.Generator().manual_seed(1000 * rep + int(frac * 1e4))
            for t in src.values():  # flip the low bit of a uniform random `frac` of the elements
                flip = torch.rand(t.shape, generator=gen) < frac
                t.view(torch.int16)[flip] ^= 1
            a = dense_r.run(src, d_dense)
            b = delta_r.run(src, d_delta, delta=DeltaRequest(version + 1, held=version))
            version += 1
            same = all(torch.equal(d_dense[n].view(torch.int16), d_delta[n].view(torch.int16)) for n in d_dense)
            rows.append({"fraction": frac, "repeat": rep, "dense_s": a.seconds, "delta_s": b.seconds,
                         "dense_sent": a.sent_bytes, "delta_sent": b.sent_bytes, "mode": b.mode,
                         "delta_pack_s": b.pack_seconds, "delta_wire_s": b.wire_seconds,
                         "delta_unpack_s": b.unpack_seconds, "same": same})
    return {"rows": rows, "snapshot_bytes": delta_r.snapshot_bytes}


def run_refit(args: argparse.Namespace) -> dict:
    from triton_reshard.testing.launch import run_world

    shapes = {f"w{i}": (args.refit_rows, args.refit_cols) for i in range(args.refit_tensors)}
    res = run_world(refit_worker, 4, shapes, list(REFIT_FRACTIONS), args.repeats, backend="gloo", timeout=3000)
    lower = sum(math.prod(s) * 2 for s in shapes.values())  # every element crosses once (disaggregated)
    out = []
    for frac in REFIT_FRACTIONS:
        per = [[r for r in res[k]["rows"] if r["fraction"] == frac] for k in range(4)]
        reps = len(per[0])
        dense_s = statistics.median(max(per[k][i]["dense_s"] for k in range(4)) for i in range(reps))
        delta_s = statistics.median(max(per[k][i]["delta_s"] for k in range(4)) for i in range(reps))
        sent = statistics.median(sum(per[k][i]["delta_sent"] for k in range(4)) for i in range(reps))
        dense_sent = per[0][0]["dense_sent"] + per[1][0]["dense_sent"]
        ok = all(per[k][i]["same"] for k in range(4) for i in range(reps))
        modes = sorted({per[k][i]["mode"] for k in range(4) for i in range(reps)})
        row = {"fraction": frac, "dense_lower_bound": lower, "dense_sent": dense_sent, "delta_sent": sent,
               "delta_over_lower": sent / lower, "dense_s": dense_s, "delta_s": delta_s,
               "delta_over_dense_time": delta_s / dense_s, "bit_exact": ok, "modes": modes,
               "delta_pack_s": statistics.median(per[0][i]["delta_pack_s"] for i in range(reps)),
               "delta_unpack_s": statistics.median(per[2][i]["delta_unpack_s"] for i in range(reps))}
        out.append(row)
        print(f"{100 * frac:5.1f} %: wire {sent / lower:.4f} of the dense lower bound ({sent} / {lower} B); time "
              f"{delta_s:.3f} s delta vs {dense_s:.3f} s dense ({delta_s / dense_s:.2f}x); bit-exact {ok}; {modes}",
              flush=True)
    return {"shapes": shapes, "rows": out, "snapshot_bytes_by_rank": [r["snapshot_bytes"] for r in res]}


def add_train_args(ap: argparse.ArgumentParser, steps: int = 150, lrs=LRS) -> None:
    """The training run's arguments (the model, the task, warm-up, RL-like steps), shared with
    ``bench_quant_delta.py``."""
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
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lrs", type=float, nargs="+", default=list(lrs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("train", "speed", "refit", "codec", "wire", "trainer"), required=True)
    add_train_args(ap)
    ap.add_argument("--speed-elems", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--refit-tensors", type=int, default=4)
    ap.add_argument("--refit-rows", type=int, default=1024)
    ap.add_argument("--refit-cols", type=int, default=2048)
    ap.add_argument("--codec-vocab", type=int, default=32000, help="--part codec: the Llama's vocabulary")
    ap.add_argument("--codec-layers", type=int, default=12, help="--part codec: its layers (12: 125M)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.1], help="--part codec")
    ap.add_argument("--codec-threads", type=int, default=None, choices=(1, 2),
                    help="--part codec: the native check / apply's threads (default: TRITON_RESHARD_CODEC_THREADS, 1)")
    ap.add_argument("--versions", type=int, nargs="+", default=[2, 1], help="--part codec: the formats timed")
    ap.add_argument("--outliers", type=float, default=0.0,
                    help="--part codec: the fraction of changes moved 8..120 ulps (real steps' far movers)")
    ap.add_argument("--skip", type=int, default=2, help="--part wire: first steps left out of the sums")
    ap.add_argument("--ab", action="store_true", help="--part trainer: also a delta refit without grouping")
    ap.add_argument("--triton", action="store_true",
                    help="--part wire: also pack each step with the Triton kernels (stops unless the same bytes)")
    args = ap.parse_args()
    if args.part == "wire":  # its own defaults
        args.lrs = args.lrs if "--lrs" in sys.argv else [1e-5, 1e-6]
        args.steps = args.steps if "--steps" in sys.argv else 12
    res = {"train": run_train, "speed": run_speed, "refit": run_refit, "codec": run_codec,
           "wire": run_wire, "trainer": run_trainer}[args.part](args)
    res["meta"] = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "torch": torch.__version__, "platform": platform.platform(), "threads": args.threads}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
