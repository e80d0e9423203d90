"""examples/rl_loop.Trainer's step (the RL benches' trainer): its gradients stay in the same memory across steps
(no fresh allocation, hence no page faults, per step: perf/bench_rl_loop_cluster.py), and its fused AdamW
updates the fp32 masters as torch's default AdamW with fresh gradients does (the old step, as reference)."""

from __future__ import annotations

import random

import pytest
import torch

rl = pytest.importorskip("examples.rl_loop")
pytest.importorskip("transformers")


def _rollouts(seed: int, n: int = 4) -> tuple[list, list]:
    rng = random.Random(seed)
    vocab = rl.SIZES["tiny"]["vocab_size"]
    rollouts = [([rng.randrange(vocab) for _ in range(rng.randrange(2, 5))],
                 [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))], None) for _ in range(n)]
    return rollouts, [rng.gauss(0, 1) for _ in range(n)]


def _reference_step(model, masters: dict, opt, rollouts: list, adv: list) -> None:
    """The step before the change: fresh gradients (set_to_none), the master gradients cast anew."""
    model.zero_grad(set_to_none=True)
    x, mask = rl.Trainer.batch(rollouts)
    lp = torch.log_softmax(model(x).logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
    (-(lp * mask * torch.tensor(adv)[:, None]).sum() / mask.sum()).backward()
    for n, p in model.named_parameters():
        masters[n].grad = p.grad.float()
    opt.step()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(masters[n])


@pytest.mark.parametrize("compute", ["bf16", "fp32"])
def test_trainer_keeps_its_gradients_and_matches_the_unfused_step(compute):
    tr = rl.Trainer(rl.policy("tiny", 0), lr=1e-2, compute=compute)
    ref_model = rl.policy("tiny", 0).train()
    ref_masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref_model.named_parameters()}
    ref_opt = torch.optim.AdamW(list(ref_masters.values()), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
    kept = None
    for step in range(3):
        rollouts, adv = _rollouts(step)
        tr.step(rollouts, adv)
        if compute == "bf16":
            _reference_step(ref_model, ref_masters, ref_opt, rollouts, adv)
        grads = {n: m.grad for n, m in tr.masters.items()}
        if compute == "bf16":  # fp32 compute: the bf16 parameters get no gradient (fresh fp32 leaves do)
            grads.update({f"bf16 {n}": p.grad for n, p in tr.params.items()})
        for n, g in (kept or {}).items():  # the same tensors, the same memory (held here: not reusable)
            assert grads[n] is g and grads[n].data_ptr() == g.data_ptr(), f"step {step}: {n}'s gradient is new"
        kept = grads
    if compute == "bf16":  # the fused AdamW against the default one: the same update up to fp32 rounding
        for n, m in tr.masters.items():
            torch.testing.assert_close(m.detach(), ref_masters[n].detach(), rtol=1e-5, atol=1e-6, msg=n)
            assert torch.equal(tr.params[n].detach(), m.detach().to(torch.bfloat16)), n
