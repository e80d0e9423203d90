"""Refit a tiny Qwen3-MoE from Megatron-Core TP2 x PP2 shards into vLLM TP2 x DP2 shards, on 4 local CPU
ranks, in the main environment (no vLLM, no Megatron, no GPU needed):

    python examples/refit_presets.py        # ~20-40 s on 2 CPU cores, mostly starting the 4 processes

The preset path of the README's "Presets" section, runnable: ``megatron_layout`` and ``vllm_layout`` say which
box of which Hugging Face tensor each rank of each framework holds, under the names its
``named_parameters()`` gives (fused QKV, fused gate/up, stacked experts, padded vocab). Here the trainer's
tensors are the checkpoint sliced with the Megatron layout and the engine's are empty tensors of the vLLM
shapes; in a real RL loop they are ``dict(model.named_parameters())`` of the two models. Every rank is both
a trainer and an engine rank (colocated); ``ranks=range(4, 8)`` on the vLLM side would put the engine on
ranks of its own (then spawn 8).

Three "training steps" are refit; after each, every engine rank checks its tensors bit for bit against the
step's weights sliced the vLLM way, and ``verify_refit`` confirms the same thing without writing.
"""

from __future__ import annotations

import torch

STEPS, WORLD = 3, 4


def checkpoint(layout, step: int) -> dict[str, torch.Tensor]:
    """The 'trained' weights after ``step`` steps, full size (deterministic, so every rank can check them)."""
    g = torch.Generator().manual_seed(1234 + step)
    return {t.name: torch.randn(t.shape, generator=g).to(t.dtype) for t in layout.tensors}


def rank_main(rank: int, world: int) -> str:
    from triton_reshard import plan_reshard, refit, verify_refit
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("tiny_qwen3_moe")  # 2 layers, 8 experts, hidden 64: see triton_reshard.presets.CONFIGS
    train = megatron_layout(cfg, tp=2, pp=2, dp=1, ranks=range(4), dtype=torch.float32)
    infer = vllm_layout(cfg, tp=2, dp=2, ranks=range(4), dtype=torch.float32)
    # stand-in for dict(vllm_model.named_parameters()); zeros, because the refit writes only the boxes the layout
    # places and leaves the rest (vLLM's vocab padding rows) alone, as shard() below does
    engine = infer.allocate(rank, fill=0)
    lines = []
    if rank == 0:
        st = plan_reshard(train, infer).stats()
        lines.append(f"Megatron TP2xPP2 -> vLLM TP2xDP2 of tiny_qwen3_moe: {len(infer.tensors)} tensors; "
                     f"{st.wire_bytes} B on the wire (lower bound {st.lower_bound_bytes} B), "
                     f"{st.local_bytes} B copied locally")
        lines.append(f"rank 0 trainer tensors: {sorted(train.local_shapes(0))[:3]} ...; engine tensors: "
                     f"{sorted(infer.local_shapes(0))[:3]} ...")
    for step in range(1, STEPS + 1):
        weights = checkpoint(train, step)
        trainer = train.shard(weights, rank)  # stand-in for dict(megatron_model.named_parameters())
        rep = refit(trainer, engine, train, infer)  # plan and buffers cached after the first step
        want = infer.shard(weights, rank)
        bad = [n for n, t in want.items() if not torch.equal(engine[n], t)]
        if bad:
            raise RuntimeError(f"rank {rank}, step {step}: wrong tensors {bad}")
        lines.append(f"rank {rank} step {step}: received {rep.recv_bytes} B; OK, every engine tensor exact")
    check = verify_refit(trainer, engine, train, infer)
    if not check.ok:
        raise RuntimeError(str(check))
    lines.append(f"rank {rank}: verify_refit OK ({check.compared_elements} elements compared, nothing written)")
    return "\n".join(lines)


def main() -> int:
    from triton_reshard.testing.launch import run_world

    for out in run_world(rank_main, WORLD, backend="gloo", timeout=300):
        print(out)
    print(f"done: {STEPS} refits on {WORLD} ranks, every engine tensor exact")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
