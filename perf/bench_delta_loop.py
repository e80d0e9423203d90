"""Part 7 of ``perf/bench_delta.py`` (``--part trainer``, issue 44 item 2): the RL loop's refit without vLLM.

A gloo world of 3: rank 0 holds the full 125M Llama's weights (the RL loop's trainer), ranks 1-2 receive vLLM's
TP2 boxes. Per repeat every weight changes by one ulp at ``frac`` of its elements (random positions), then a dense
and a delta refit of the same change (two Resharders, each into its own destination). Reported: the trainer
rank's CPU in the delta refit against the codec alone (one pack of all its tensors, cached plan), and each
receiver's against its apply alone (its shard's whole change as one message, cached plan); bit-exact. With
``--ab`` a third Resharder runs the same delta with one wire message per plan message (``execute.delta.GROUP``
off when it first plans its messages), in alternating order with the grouped one, so both see the same load.

    .venv/bin/python perf/bench_delta.py --part trainer --fractions 0.1 --repeats 5 --ab
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from triton_reshard.ops import delta as D


def llama_shapes(vocab: int, hidden: int, inter: int, layers: int, kv: int) -> list[tuple[int, int]]:
    """The 2-D weights of a Llama (norms left out): 125M (32000, 768, 2048, 12, 256): 86 tensors, 249 MB bf16."""
    per = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
           (hidden, inter)]
    return [(vocab, hidden)] + per * layers + [(vocab, hidden)]


def _change(src: dict, frac: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in src.values():
        pos = torch.randint(t.numel(), (int(frac * t.numel()),), generator=gen)
        t.view(-1).view(torch.int16)[pos] += (torch.randint(0, 2, pos.shape, generator=gen) * 2 - 1).short()


def _alone(rank: int, row: dict, src: dict, snap: dict, plain: dict, cache: dict, got: dict, before: dict,
           work: dict, ucache: dict) -> None:
    """The codec alone on rank 0 (and a copy_ of the same bytes), a receiver's apply alone elsewhere."""
    if rank == 0:
        t0 = time.thread_time()
        D.pack_delta([(src[n], snap[n]) for n in src], update=True, backend="torch", cache=cache)
        t1 = time.thread_time()
        _ = [plain[n].copy_(src[n]) for n in src]
        row.update(codec_cpu_s=t1 - t0, copy_cpu_s=time.thread_time() - t1)
        return
    msg = D.pack_delta([(got[n], before[n]) for n in work], update=False, backend="torch")
    _ = [work[n].copy_(t) for n, t in before.items()]
    t0 = time.thread_time()
    D.unpack_delta(msg, list(work.values()), backend="torch", cache=ucache)
    row["apply_cpu_s"] = time.thread_time() - t0
    row["apply_exact"] = all(torch.equal(w.view(torch.int16), got[n].view(torch.int16)) for n, w in work.items())


def trainer_worker(rank: int, world: int, vocab: int, layers: int, frac: float, repeats: int, ab: bool = False
                   ) -> list[dict]:
    """Per repeat a dense and a delta refit of the same change (``ab``: and an ungrouped delta), then on rank 0
    the codec alone and a copy_, on a receiver its apply alone."""
    import triton_reshard.execute.delta as xd
    from triton_reshard import Layout, Replicate, Resharder, Shard, plan_reshard
    from triton_reshard.execute.delta import DeltaRequest

    torch.set_num_threads(1)
    shapes = {f"w{i}": d for i, d in enumerate(llama_shapes(vocab, 768, 2048, layers, 256))}
    cut = [0] + [1, 0, 0, 1, 0, 0, 1] * layers + [0]  # 1: a row-parallel weight (o_proj, down_proj: columns)
    dst_l = Layout.from_placements(shapes, [1, 2], {n: [Shard(c)] for n, c in zip(shapes, cut, strict=True)},
                                   torch.bfloat16)
    src_l = Layout.from_placements(shapes, [0], [Replicate()], torch.bfloat16)
    tags = ("dense", "delta", "ungrouped") if ab else ("dense", "delta")
    runs = [Resharder(plan_reshard(src_l, dst_l, rank=rank), timeout=600) for _ in tags]
    g = torch.Generator().manual_seed(1)
    src = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()} if rank == 0 else {}
    dsts, snap, cache = [dst_l.allocate(rank) if rank else {} for _ in runs], {n: t.clone() for n, t in src.items()}, {}
    plain = {n: torch.empty_like(t) for n, t in src.items()}
    # a receiver's apply alone: its shard's whole change as one message (cached plan), into copies
    work, ucache = ({n: torch.empty_like(t) for n, t in dsts[1].items()} if rank else {}), {}
    for v in range(2):
        for k, (tag, r, d) in enumerate(zip(tags, runs, dsts, strict=True)):
            xd.GROUP = tag != "ungrouped"  # (read when a Resharder first plans its delta messages)
            r.run(src, d, delta=DeltaRequest(v, held=v - 1 if v else None) if k else None)
    xd.GROUP = True
    rows = []
    for rep in range(repeats):
        row: dict = {}
        _change(src, frac, 100 + rep)
        before = {n: t.clone() for n, t in dsts[1].items()}
        order = [0, 1, 2] if len(runs) == 2 or rep % 2 == 0 else [0, 2, 1]
        for k in order[: len(runs)]:
            t0 = time.thread_time()  # this rank's CPU, not the machine's load
            rp = runs[k].run(src, dsts[k], delta=DeltaRequest(rep + 2, held=rep + 1) if k else None)
            tag = tags[k]
            row.update({f"{tag}_cpu_s": time.thread_time() - t0, f"{tag}_s": rp.seconds, f"{tag}_sent": rp.sent_bytes,
                        f"{tag}_pack_s": rp.pack_seconds, f"{tag}_unpack_s": rp.unpack_seconds})
        _alone(rank, row, src, snap, plain, cache, dsts[1], before, work, ucache)
        row["exact"] = all(torch.equal(dsts[0][n].view(torch.int16), d[n].view(torch.int16)) for d in dsts[1:]
                           for n in dsts[0])
        rows.append(row)
    return rows


def run_trainer(args: argparse.Namespace) -> dict:
    """Part 7 (``--part trainer``, issue 44 item 2): the RL loop's refit without vLLM, dense vs delta."""
    from triton_reshard.testing.launch import run_world

    frac, ab = args.fractions[-1], getattr(args, "ab", False)
    res = run_world(trainer_worker, 3, args.codec_vocab, args.codec_layers, frac, args.repeats, ab, backend="gloo",
                    timeout=3000)
    med = {k: statistics.median(r[k] for r in res[0]) for k in res[0][0] if k != "exact"}
    tags = ("dense", "delta", "ungrouped", "apply") if ab else ("dense", "delta", "apply")
    med["recv_cpu_s"] = {t: max(statistics.median(r[f"{t}_cpu_s"] for r in res[k]) for k in (1, 2)) for t in tags}
    for tag in tags[1:-1]:
        key = "" if tag == "delta" else f"_{tag}"
        med[f"beyond_codec{key}"] = (med[f"{tag}_cpu_s"] - med["codec_cpu_s"]) / med["codec_cpu_s"]
        # a receiver's CPU in the delta refit beyond its apply alone (its median; the larger of the two receivers)
        recv = [tuple(statistics.median(r[k] for r in res[q]) for k in (f"{tag}_cpu_s", "apply_cpu_s")) for q in (1, 2)]
        med[f"recv_beyond_apply{key}"] = max((cpu - alone) / alone for cpu, alone in recv)
    med["exact"] = all(r["exact"] and r.get("apply_exact", True) for rs in res for r in rs)
    ung = (f"; one message per plan message: trainer {100 * med['beyond_codec_ungrouped']:.0f} % beyond the codec, "
           f"receivers {100 * med['recv_beyond_apply_ungrouped']:.0f} % beyond the apply") if ab else ""
    print(f"trainer rank, {100 * frac:g} % changed: CPU dense {1e3 * med['dense_cpu_s']:.1f} ms, delta "
          f"{1e3 * med['delta_cpu_s']:.1f} ms, the codec alone {1e3 * med['codec_cpu_s']:.1f} ms (a copy_ "
          f"{1e3 * med['copy_cpu_s']:.1f} ms): {100 * med['beyond_codec']:.0f} % beyond the codec; wall dense "
          f"{med['dense_s']:.3f} s, delta {med['delta_s']:.3f} s; receivers' CPU (ms) "
          f"{ {k: round(1e3 * v, 1) for k, v in med['recv_cpu_s'].items()} }: "
          f"{100 * med['recv_beyond_apply']:.0f} % beyond the apply{ung}; exact {med['exact']}; load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    return {"fraction": frac, "ab": ab, "median": med, "rows": res, "load": os.getloadavg()}
