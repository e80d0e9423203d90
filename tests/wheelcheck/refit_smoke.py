"""A short refit through the public API, as the README shows it, on 4 local gloo ranks: DP2 x TP2 -> TP4,
checked against slicing the global tensors into NaN-poisoned destinations. ``.ci/wheel_check.sh`` runs it by
path with the installed wheel (so it imports the package, never the source tree)."""

from __future__ import annotations

import torch

from triton_reshard import Layout, Replicate, Shard, refit
from triton_reshard.box import box_slices
from triton_reshard.testing import synthetic_box
from triton_reshard.testing.launch import run_world

SHAPES = {"wq": (64, 48), "w_down": (48, 96), "norm": (48,)}
TRAIN = Layout.from_placements(SHAPES, [[0, 1], [2, 3]], {
    "wq": [Replicate(), Shard(0)], "w_down": [Replicate(), Shard(1)], "norm": [Replicate(), Replicate()]})
INFER = Layout.from_placements(SHAPES, [0, 1, 2, 3], {
    "wq": [Shard(0)], "w_down": [Shard(1)], "norm": [Replicate()]})


def _fill(layout: Layout, rank: int, poison: bool) -> dict[str, torch.Tensor]:
    out = layout.allocate(rank)
    for f in layout.fragments_on_rank(rank):
        box = synthetic_box(f.tensor, SHAPES[f.tensor], torch.float32, f.offsets, f.sizes)
        out[f.local or f.tensor][box_slices(f.local_offsets or (0,) * len(f.sizes), f.sizes)] = (
            float("nan") if poison else box)
    return out


def body(rank: int, world: int) -> int:
    src, dst = _fill(TRAIN, rank, poison=False), _fill(INFER, rank, poison=True)
    refit(src, dst, TRAIN, INFER, timeout=60)
    want = _fill(INFER, rank, poison=False)
    for name, t in dst.items():
        assert torch.equal(t, want[name]), f"rank {rank}: {name} differs from the global tensor's slice"
    return sum(t.numel() for t in dst.values())


if __name__ == "__main__":
    n = run_world(body, 4, timeout=120)
    print(f"refit through the public API: 4 ranks, {sum(n)} destination elements exact")
