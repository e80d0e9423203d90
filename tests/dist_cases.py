"""Shared test material: an independent reference for layouts, a catalogue of reshard cases, and the
module-level worker functions that spawned gloo worlds run (``triton_reshard.testing.launch.run_world`` pickles
them by name, so they must live in an importable module).

The reference never asks the package where a box lives: for DTensor-style descriptions it nests
``torch.chunk`` over index ranges itself, and for fragment descriptions it places the boxes it was given
with plain indexing. Expected destination tensors are therefore independent of ``Layout``/``plan_reshard``.
"""

from __future__ import annotations

import functools
import math
import operator
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from triton_reshard import Fragment, Layout, Replicate, Resharder, ReshardError, Shard, plan_reshard
from triton_reshard.testing import synthetic_global

S0, S1, S2, S3, S4 = (Shard(i) for i in range(5))
R = Replicate()

# --------------------------------------------------------------------------------------------------------
# Poison and bit-exact comparison
# --------------------------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SEVEN_F = {1: 0x7F, 2: 0x7F7F, 4: 0x7F7F7F7F, 8: 0x7F7F7F7F7F7F7F7F}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as a signed integer tensor of the same element size (bool, floats and ints)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.contiguous())


def poison_(t: torch.Tensor, pattern: int = 0) -> torch.Tensor:
    """Fill ``t`` in place with a value no reshard ever produces from synthetic data.

    pattern 0: NaN for floats, 0x7F.. bytes for ints and bool; pattern 1: all bits set (-1; a NaN for floats).
    """
    if t.numel():
        if pattern == 0 and t.dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            int_view(t).fill_(-1 if pattern else _SEVEN_F[t.element_size()])
    return t


def mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    """None if ``got`` equals ``want`` bit for bit (shape and dtype too), else a readable description."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    bad = bits(got) != bits(want)
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: "
        f"got {got[idx].item()!r} (bits {bits(got)[idx].item():#x}), want {want[idx].item()!r} "
        f"(bits {bits(want)[idx].item():#x})"
    )


# --------------------------------------------------------------------------------------------------------
# Independent reference of where boxes live
# --------------------------------------------------------------------------------------------------------


def mesh_coord(mesh, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(mesh shape, coordinate of ``rank``) or None when ``rank`` is not in the mesh."""
    m = torch.as_tensor(mesh)
    if m.dim() == 0:
        m = m.reshape(1)
    hit = (m == rank).nonzero()
    if len(hit) == 0:
        return None
    return tuple(m.shape), tuple(int(c) for c in hit[0])


def _frozen(x):
    """A hashable copy of a mesh (nested lists/tuples of ints, a tensor or an int), keeping its nesting."""
    if isinstance(x, torch.Tensor):
        return ("tensor", _frozen(x.tolist()))
    return tuple(_frozen(v) for v in x) if isinstance(x, (list, tuple)) else x


_BOXES: dict = {}


def chunk_box(shape: Sequence[int], mesh, placements: Sequence, rank: int):
    """(offsets, sizes) of ``rank``'s shard, by nesting ``torch.chunk`` left to right over index ranges
    (DTensor's rule: the piece from mesh dim 0 is split again over mesh dim 1, ...; missing chunks are empty).
    None when ``rank`` is not in the mesh. Memoized by value (``test_plan_scale`` asks for the same boxes
    many times per layout pair: these torch calls were ~1/10 of its time)."""
    try:
        key = (tuple(shape), _frozen(mesh), tuple(placements), rank)
        return _BOXES[key]
    except TypeError:  # an unhashable placement: computed each time
        return _chunk_box(shape, mesh, placements, rank)
    except KeyError:
        pass
    if len(_BOXES) >= 1 << 16:
        _BOXES.clear()
    _BOXES[key] = out = _chunk_box(shape, mesh, placements, rank)
    return out


def _chunk_box(shape, mesh, placements, rank):
    mc = mesh_coord(mesh, rank)
    if mc is None:
        return None
    mshape, coord = mc
    idx = [torch.arange(n) for n in shape]
    for md, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            pieces = torch.chunk(idx[d], mshape[md])
            idx[d] = pieces[coord[md]] if coord[md] < len(pieces) else idx[d][:0]
    offsets = tuple(int(i[0]) if len(i) else 0 for i in idx)
    return offsets, tuple(len(i) for i in idx)


@dataclass(frozen=True)
class Box:
    """One box of logical tensor ``tensor`` placed in local tensor ``local`` (reference bookkeeping)."""

    tensor: str
    local: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]


@dataclass(frozen=True)
class P:
    """DTensor-style description: each tensor of ``shapes`` over ``mesh`` with ``placements`` (one list for
    all tensors, or a dict per tensor); the local tensors are named like the logical ones."""

    shapes: Mapping[str, tuple[int, ...]]
    mesh: object
    placements: object
    dtype: object = torch.float32

    def _pl(self, name):
        return self.placements[name] if isinstance(self.placements, Mapping) else self.placements

    def _dt(self, name):
        return self.dtype[name] if isinstance(self.dtype, Mapping) else self.dtype

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(s), self._dt(n)) for n, s in self.shapes.items()}

    def layout(self) -> Layout:
        return Layout.from_placements(dict(self.shapes), self.mesh, self.placements, self.dtype)

    def locals(self, rank: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for n, s in self.shapes.items():
            box = chunk_box(s, self.mesh, self._pl(n), rank)
            if box is not None:
                out[n] = (box[1], self._dt(n))
        return out

    def boxes(self, rank: int) -> list[Box]:
        out = []
        for n, s in self.shapes.items():
            box = chunk_box(s, self.mesh, self._pl(n), rank)
            if box is not None and math.prod(box[1]):
                out.append(Box(n, n, box[0], box[1], (0,) * len(s)))
        return out


@dataclass(frozen=True)
class F:
    """Fragment description: ``frags`` are (tensor, rank, offsets, sizes, local, local_offsets) and every
    local tensor's shape is given in ``local_shapes`` {(rank, local): shape} (padding stays untouched)."""

    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    frags: tuple
    local_shapes: Mapping[tuple[int, str], tuple[int, ...]]

    def specs(self):
        return {n: (tuple(s), d) for n, (s, d) in self.tensors.items()}

    def layout(self) -> Layout:
        return Layout.from_fragments(dict(self.tensors), [Fragment(*f) for f in self.frags], dict(self.local_shapes))

    def locals(self, rank: int):
        dtypes = {(f[1], f[4]): self.tensors[f[0]][1] for f in self.frags}
        return {loc: (tuple(shape), dtypes[(r, loc)]) for (r, loc), shape in self.local_shapes.items() if r == rank}

    def boxes(self, rank: int) -> list[Box]:
        return [Box(f[0], f[4], tuple(f[2]), tuple(f[3]), tuple(f[5])) for f in self.frags if f[1] == rank]


Side = tuple  # of P / F descriptions, merged


def side_layout(side: Side) -> Layout:
    return functools.reduce(operator.or_, [d.layout() for d in side])


def side_specs(side: Side) -> dict:
    out: dict = {}
    for d in side:
        out.update(d.specs())
    return out


def side_locals(side: Side, rank: int) -> dict:
    out: dict = {}
    for d in side:
        out.update(d.locals(rank))
    return out


def side_ranks(side: Side, world: int) -> list[int]:
    return [r for r in range(world) if side_locals(side, r)]


def desc_ranks(d) -> list[int]:
    if isinstance(d, P):
        return torch.as_tensor(d.mesh).flatten().tolist()
    return sorted({r for r, _ in d.local_shapes})


def case_ranks(*sides: Side) -> list[int]:
    """Every rank that appears in any description of the given sides."""
    return sorted({r for side in sides for d in side for r in desc_ranks(d)})


def local_index(box: Box, ndim_local: int) -> tuple:
    """Index of ``box`` inside its local tensor: ints for the extra leading dims, slices for the rest."""
    extra = ndim_local - len(box.sizes)
    lo = box.local_offsets
    return tuple(lo[:extra]) + tuple(slice(o, o + s) for o, s in zip(lo[extra:], box.sizes, strict=True))


def global_index(box: Box) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


def global_data(specs: Mapping, version: int = 0, cast: Mapping | None = None) -> dict[str, torch.Tensor]:
    """Synthetic global tensors (a different data set per ``version``), optionally cast to ``cast[name]``."""
    out = {}
    for n, (shape, dtype) in specs.items():
        g = synthetic_global(n if version == 0 else f"{n}#v{version}", shape, dtype)
        out[n] = g.to(cast[n][1]) if cast is not None and n in cast else g
    return out


def build_locals(side: Side, rank: int, data: Mapping[str, torch.Tensor] | None, pattern: int = 0,
                 dtype: torch.dtype | None = None) -> dict:
    """``rank``'s local tensors of ``side``: poison everywhere, then every box copied from ``data`` with plain
    indexing (``data=None``: poison only). ``dtype`` overrides the layout's dtype (for simulations)."""
    out = {
        loc: poison_(torch.empty(shape, dtype=dtype or dt), pattern)
        for loc, (shape, dt) in side_locals(side, rank).items()
    }
    if data is not None:
        for d in side:
            for b in d.boxes(rank):
                t = out[b.local]
                t[local_index(b, t.dim())] = data[b.tensor][global_index(b)]
    return out


def unique_data(specs: Mapping) -> dict[str, torch.Tensor]:
    """Global int64 tensors whose elements are all distinct (1, 2, 3, ... across every tensor)."""
    out, start = {}, 1
    for n, (shape, _dt) in sorted(specs.items()):
        k = math.prod(shape)
        out[n] = torch.arange(start, start + k, dtype=torch.int64).reshape(shape)
        start += k
    return out


def coverage(side: Side, rank: int) -> dict[str, torch.Tensor]:
    """int32 per local tensor: 1 where the reference puts a box, 0 elsewhere (padding)."""
    out = {loc: torch.zeros(shape, dtype=torch.int32) for loc, (shape, _dt) in side_locals(side, rank).items()}
    for d in side:
        for b in d.boxes(rank):
            out[b.local][local_index(b, out[b.local].dim())] += 1
    return out


def held_mask(side: Side, rank: int, name: str, shape) -> torch.Tensor:
    """Elements of global tensor ``name`` that ``rank`` holds in ``side`` (reference boxes)."""
    m = torch.zeros(shape, dtype=torch.bool)
    for d in side:
        for b in d.boxes(rank):
            if b.tensor == name:
                m[global_index(b)] = True
    return m


def sub_index(base_dim: int, local_offsets: Sequence[int], sizes: Sequence[int], rel=None) -> tuple:
    """Index into a local tensor of ``base_dim`` dims for a box of ``sizes`` starting at ``local_offsets``
    (plus ``rel`` inside the box): ints for the extra leading dims, slices for the logical dims."""
    extra = base_dim - len(sizes)
    rel = rel or (0,) * len(sizes)
    return tuple(local_offsets[:extra]) + tuple(
        slice(o + r, o + r + s) for o, r, s in zip(local_offsets[extra:], rel, sizes, strict=True)
    )


def apply_plan(plan, src_by_rank: Mapping, dst_by_rank: Mapping, counts: Mapping | None = None) -> None:
    """Single-process simulation: every wire transfer and local copy as a plain slice assignment (casting like
    the wire does: to the wire dtype, then to the destination dtype); ``counts`` gets +1 per written element.

    Relays last, reading the destination tensors (what their sender received), as the executor's second
    phase does; a relay that read an element nobody had written yet would copy poison and fail the comparison.
    """
    firsts = [t for t in plan.transfers + plan.local_copies if not t.relay]
    for t in firsts + [t for t in plan.transfers if t.relay]:
        s = (dst_by_rank if t.relay else src_by_rank)[t.src_rank][t.src_local]
        d = dst_by_rank[t.dst_rank][t.dst_local]
        piece = s[sub_index(s.dim(), t.src_offsets, t.sizes)]
        if piece.dtype.is_floating_point:
            piece = piece.to(t.wire_dtype)
        d[sub_index(d.dim(), t.dst_offsets, t.sizes)] = piece
        if counts is not None:
            c = counts[t.dst_rank][t.dst_local]
            c[sub_index(c.dim(), t.dst_offsets, t.sizes)] += 1


# --------------------------------------------------------------------------------------------------------
# The case catalogue
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    world: int
    src: Side
    dst: Side
    bucket_bytes: int = 1 << 20
    allow_cast: bool = False
    group_ranks: tuple[int, ...] | None = None  # run on a subgroup of the world
    multi_step: bool = False  # the bucket is smaller than the largest tensor: several steps expected
    gpus_per_node: int | None = None  # plan node-aware (``plan_reshard(..., gpus_per_node)``)
    relay: bool | None = None  # ``plan_reshard``'s relay (None: on when gpus_per_node is given)
    min_relays: int = 0  # the plan must have at least this many relay transfers (checked by the planner tests)
    relay_groups: tuple[tuple[int, ...], ...] | None = None  # ``plan_reshard``'s relay_groups (engine instances)
    notes: str = field(default="", compare=False)


def case_plan(case: Case, rank: int | None = None):
    """The plan of ``case``, with its node size and relay choice (what every tier of the tests runs); with
    ``rank``, that rank's share alone (``plan_reshard(..., rank=rank)``, a Plan with rank=rank)."""
    return plan_reshard(side_layout(case.src), side_layout(case.dst), case.allow_cast, case.gpus_per_node,
                        case.relay, case.relay_groups, rank=rank)


def qkv_fused(ranks: Sequence[int], q: int, kv: int, cols: int, pad: int, dtype) -> F:
    """q [q, cols], k and v [kv, cols] TP-sharded by rows over ``ranks``; each rank holds its q, k and v rows
    stacked in one local tensor 'qkv' (q rows first, then k, then v, then ``pad`` untouched rows)."""
    tp = len(ranks)
    frags, shapes = [], {}
    for i, r in enumerate(ranks):
        row = 0
        for name, n in (("q", q), ("k", kv), ("v", kv)):
            size = n // tp
            frags.append((name, r, (i * size, 0), (size, cols), "qkv", (row, 0)))
            row += size
        shapes[(r, "qkv")] = (row + pad, cols)
    return F({"q": ((q, cols), dtype), "k": ((kv, cols), dtype), "v": ((kv, cols), dtype)}, tuple(frags), shapes)


def stacked_experts(owner: Mapping[int, int], rows: int, cols: int, dtype, pad: int = 0) -> F:
    """Expert e's weight 'e{e}.w' [rows, cols] lives on rank owner[e] inside local 'experts.w'
    [E_local + pad, rows, cols] at index (its position among that rank's experts)."""
    frags, count = [], {}
    for e, r in sorted(owner.items()):
        i = count.get(r, 0)
        count[r] = i + 1
        frags.append((f"e{e}.w", r, (0, 0), (rows, cols), "experts.w", (i, 0, 0)))
    shapes = {(r, "experts.w"): (n + pad, rows, cols) for r, n in count.items()}
    return F({f"e{e}.w": ((rows, cols), dtype) for e in owner}, tuple(frags), shapes)


def _cases() -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    c: list[Case] = []
    # ---- world 2 --------------------------------------------------------------------------------------
    c += [
        Case("tp2-rows-to-cols-fp32", 2, (P({"w": (7, 5)}, [0, 1], [S0]),), (P({"w": (7, 5)}, [0, 1], [S1]),)),
        Case("tp2-to-replicated-bf16", 2, (P({"w": (6, 9)}, [0, 1], [S1], bf16),), (P({"w": (6, 9)}, [0, 1], [R], bf16),)),
        Case("replicated-to-tp2-permuted-mesh-int64", 2, (P({"w": (5, 4)}, [0, 1], [R], torch.int64),),
             (P({"w": (5, 4)}, [1, 0], [S0], torch.int64),)),
        Case("1d-int32", 2, (P({"v": (9,)}, [0, 1], [S0], torch.int32),), (P({"v": (9,)}, [1, 0], [S0], torch.int32),)),
        Case("3d-int8", 2, (P({"v": (3, 5, 7)}, [0, 1], [S2], torch.int8),), (P({"v": (3, 5, 7)}, [0, 1], [S0], torch.int8),)),
        Case("4d-bool", 2, (P({"v": (2, 3, 4, 5)}, [0, 1], [S1], torch.bool),), (P({"v": (2, 3, 4, 5)}, [0, 1], [S3], torch.bool),)),
        Case("5d-int64", 2, (P({"v": (2, 1, 3, 2, 5)}, [0, 1], [S4], torch.int64),),
             (P({"v": (2, 1, 3, 2, 5)}, [0, 1], [S2], torch.int64),)),
        Case("2d-fp16-uneven", 2, (P({"v": (5, 3)}, [0, 1], [S1], torch.float16),), (P({"v": (5, 3)}, [0, 1], [S0], torch.float16),)),
        Case("disagg-0-to-1", 2, (P({"a": (4, 6), "b": (3,)}, [0], [R]),), (P({"a": (4, 6), "b": (3,)}, [1], [R]),)),
        Case("small-bucket-steps", 2, (P({"big": (64, 33), "small": (3, 3)}, [0, 1], [S1]),),
             (P({"big": (64, 33), "small": (3, 3)}, [0, 1], [S0]),), bucket_bytes=1024, multi_step=True),
        Case("fused-qkv", 2, (P({"q": (8, 6), "k": (4, 6), "v": (4, 6)}, [0, 1], [S0]),),
             (qkv_fused([1, 0], 8, 4, 6, pad=1, dtype=f32),)),
        Case("per-expert-tp-to-stacked", 2, (P({f"e{e}.w": (5, 3) for e in range(4)}, [0, 1], [S1], bf16),),
             (stacked_experts({0: 0, 1: 0, 2: 1, 3: 1}, 5, 3, bf16, pad=1),)),
        Case("stacked-to-per-expert-tp", 2, (stacked_experts({0: 1, 1: 0, 2: 1, 3: 0}, 4, 6, f32),),
             (P({f"e{e}.w": (4, 6) for e in range(4)}, [0, 1], [S0]),)),
    ]
    # ---- world 4 --------------------------------------------------------------------------------------
    pp_shapes = {"embed": (11, 6), "l0.w": (6, 6), "l1.w": (6, 6), "head": (6, 11)}
    c += [
        Case("tp4-to-tp2x2", 4, (P({"w": (10, 7), "b": (10,)}, [0, 1, 2, 3], {"w": [S0], "b": [S0]}),),
             (P({"w": (10, 7), "b": (10,)}, [[0, 1], [2, 3]], {"w": [S1, S0], "b": [R, S0]}),)),
        Case("pp2xtp2-to-tp4", 4,
             (P({"embed": (11, 6), "l0.w": (6, 6)}, [0, 1], {"embed": [S0], "l0.w": [S1]}),
              P({"l1.w": (6, 6), "head": (6, 11)}, [2, 3], {"l1.w": [S0], "head": [S1]})),
             (P(pp_shapes, [0, 1, 2, 3], {"embed": [S0], "l0.w": [S0], "l1.w": [S1], "head": [S1]}),)),
        Case("dp2xtp2-replicas-to-tp4", 4, (P({"w": (9, 8)}, [[0, 1], [2, 3]], [R, S0]),),
             (P({"w": (9, 8)}, [0, 1, 2, 3], [S1]),)),
        Case("disagg-tp2-to-tp2-uneven", 4, (P({"w": (5, 3)}, [0, 1], [S0]),), (P({"w": (5, 3)}, [2, 3], [S1]),)),
        Case("disagg-dp2-to-tp2", 4, (P({"w": (6, 4)}, [0, 1], [R], bf16),), (P({"w": (6, 4)}, [3, 2], [S0], bf16),)),
        Case("nested-shard00-to-shard1", 4, (P({"w": (7, 5)}, [[0, 1], [2, 3]], [S0, S0]),),
             (P({"w": (7, 5)}, [0, 1, 2, 3], [S1]),)),
        Case("uneven-empty-shards", 4, (P({"w": (3, 5)}, [0, 1, 2, 3], [S0]),),
             (P({"w": (3, 5)}, [[0, 2], [1, 3]], [S1, S1]),)),
        Case("fused-qkv-tp4-to-tp2-disagg", 4, (P({"q": (8, 6), "k": (4, 6), "v": (4, 6)}, [0, 1, 2, 3], [S0], bf16),),
             (qkv_fused([2, 3], 8, 4, 6, pad=0, dtype=bf16),)),
        Case("per-expert-tp4-to-ep-stacked", 4, (P({f"e{e}.w": (6, 4) for e in range(4)}, [0, 1, 2, 3], [S0]),),
             (stacked_experts({0: 0, 1: 2, 2: 0, 3: 2}, 6, 4, torch.float32),)),
        Case("small-bucket-w4", 4, (P({"big": (40, 17), "mid": (9, 9)}, [0, 1, 2, 3], [S0], torch.int32),),
             (P({"big": (40, 17), "mid": (9, 9)}, [[0, 1], [2, 3]], [S1, R], torch.int32),), bucket_bytes=512,
             multi_step=True),
        Case("cast-fp32-to-bf16", 4, (P({"w": (8, 6)}, [0, 1, 2, 3], [S0], torch.float32),),
             (P({"w": (8, 6)}, [[0, 1], [2, 3]], [S1, R], bf16),), allow_cast=True),
        Case("subgroup-ranks-2-3", 4, (P({"w": (6, 5)}, [2, 3], [S0]),), (P({"w": (6, 5)}, [3, 2], [S1]),),
             group_ranks=(2, 3)),
        Case("5d-tp2x2", 4, (P({"v": (3, 2, 5, 1, 4)}, [[0, 1], [2, 3]], [S2, S0]),),
             (P({"v": (3, 2, 5, 1, 4)}, [[0, 1], [2, 3]], [S4, R]),)),
        # nodes {0, 1}, {2, 3}: ranks 2 and 3 need both halves, held only in node 0; each half crosses the
        # network once (to one of them) and is relayed to the other
        Case("relay-allgather-gpn2", 4, (P({"x": (6, 4), "y": (5, 3), "z": (4, 3)}, [0, 1], [S0]),),
             (P({"x": (6, 4), "y": (5, 3), "z": (4, 3)}, [0, 1, 2, 3], [R]),), gpus_per_node=2, min_relays=6),
    ]
    # ---- world 8 --------------------------------------------------------------------------------------
    layers = {f"l{i}.w": (8, 6) for i in range(4)}
    c += [
        Case("disagg-tp4-0-3-to-tp2x2-4-7", 8, (P({"w": (12, 10)}, [0, 1, 2, 3], [S1]),),
             (P({"w": (12, 10)}, [[4, 5], [6, 7]], [S0, S1]),)),
        Case("dp2xtp4-to-tp8", 8, (P({"w": (16, 9)}, [[0, 1, 2, 3], [4, 5, 6, 7]], [R, S0]),),
             (P({"w": (16, 9)}, list(range(8)), [S1]),)),
        Case("pp4xtp2-to-tp8", 8, tuple(P({f"l{i}.w": (8, 6)}, [2 * i, 2 * i + 1], [S0]) for i in range(4)),
             (P(layers, list(range(8)), [S1]),)),
        Case("3d-mesh-permuted", 8, (P({"w": (6, 5, 4)}, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [S0, R, S2]),),
             (P({"w": (6, 5, 4)}, [[[7, 6], [5, 4]], [[3, 2], [1, 0]]], [S2, S1, R]),)),
        Case("replicas4-to-disjoint4", 8, (P({"w": (16, 8)}, [0, 1, 2, 3], [R]),), (P({"w": (16, 8)}, [4, 5, 6, 7], [S0]),)),
        Case("idle-ranks-4-7", 8, (P({"w": (8, 8)}, [0, 1], [S0]),), (P({"w": (8, 8)}, [2, 3], [S1]),)),
        Case("small-bucket-w8", 8, (P({"a": (64, 24), "b": (7, 13)}, list(range(8)), [S0], bf16),),
             (P({"a": (64, 24), "b": (7, 13)}, [[0, 1, 2, 3], [4, 5, 6, 7]], [S1, S0], bf16),), bucket_bytes=300,
             multi_step=True),
        Case("int8-and-bool-tp8-to-tp2x4", 8,
             (P({"m": (9, 5), "i": (11,)}, list(range(8)), [S0], {"m": torch.bool, "i": torch.int8}),),
             (P({"m": (9, 5), "i": (11,)}, [[0, 1, 2, 3], [4, 5, 6, 7]], {"m": [S0, S1], "i": [R, S0]},
                {"m": torch.bool, "i": torch.int8}),)),
        # the same fan-out with casts that narrow (relayed in bf16) and widen (relayed in bf16 and int32)
        Case("relay-allgather-cast-gpn2", 8,
             (P({"x": (6, 4), "y": (5, 3), "i": (4, 3)}, [0, 1], [S0], {"x": f32, "y": bf16, "i": torch.int32}),),
             (P({"x": (6, 4), "y": (5, 3), "i": (4, 3)}, [0, 1, 2, 3], [R],
                {"x": bf16, "y": f32, "i": torch.int64}),),
             allow_cast=True, gpus_per_node=2, min_relays=6),
        # disaggregated TP2 (ranks 0-1) -> TP2 x DP3 (ranks 2-7), nodes of 4: node 1 holds two replicas and
        # no source, so each TP shard crosses the network once into node 1 and is relayed there
        Case("relay-disagg-tp2-to-tp2xdp3-gpn4", 8, (P({"w": (12, 10), "b": (12,)}, [0, 1], [S0]),),
             (P({"w": (12, 10), "b": (12,)}, [[2, 3], [4, 5], [6, 7]], [R, S0]),), gpus_per_node=4, min_relays=4),
        # uneven bf16 TP3 shards (3, 3, 1) replicated on DP2, each replica pair inside one node of 2
        Case("relay-uneven-bf16-dp2xtp3-gpn2", 8,
             (P({"w": (7, 5), "v": (5, 7), "n": (3,)}, [0, 1], {"w": [S1], "v": [S0], "n": [R]}, bf16),),
             (P({"w": (7, 5), "v": (5, 7), "n": (3,)}, [[2, 4, 6], [3, 5, 7]],
                {"w": [R, S0], "v": [R, S1], "n": [R, R]}, bf16),), gpus_per_node=2, min_relays=15),
        # split fan-out: TP2 on ranks 0-1 -> replicated on ranks 2-7, nodes of 4. Node 1 (ranks 4-7) holds no
        # source: each 4 MiB shard of w is scattered over the network in four 1 MiB row blocks (one per rank)
        # and all-gathered by relays; each uneven bf16 column shard of e (2049 x 516 or 2049 x 515, ~2 MiB) in
        # two row blocks (1025 and 1024 rows), as it is too small for four parts of RELAY_SPLIT_MIN_BYTES
        Case("relay-split-tp2-to-replicated-gpn4", 8,
             (P({"w": (4096, 512), "e": (2049, 1031)}, [0, 1], {"w": [S0], "e": [S1]}, {"w": f32, "e": bf16}),),
             (P({"w": (4096, 512), "e": (2049, 1031)}, [2, 3, 4, 5, 6, 7], [R], {"w": f32, "e": bf16}),),
             gpus_per_node=4, min_relays=36),
        # three engine instances of TP2 (ranks 2-3, 4-5, 6-7) fed by TP2 on ranks 0-1, no node size: each 3 MiB
        # shard of w (fp64) crosses from the trainer once, in three 1 MiB parts (one per instance), each relayed by
        # its instance rank to the same position of the two others; e (bf16, resharded) and b are too small to
        # split: one instance receives each piece and relays it whole
        Case("instances-tp2-to-3x-tp2", 8,
             (P({"w": (1536, 512), "e": (6, 10), "b": (12,)}, [0, 1], {"w": [S0], "e": [S1], "b": [S0]},
                {"w": torch.float64, "e": bf16, "b": f32}),),
             tuple(P({"w": (1536, 512), "e": (6, 10), "b": (12,)}, [2 * i + 2, 2 * i + 3], [S0],
                     {"w": torch.float64, "e": bf16, "b": f32}) for i in range(3)),
             relay_groups=((2, 4, 6), (3, 5, 7)), min_relays=20),
    ]
    return c


CASES: dict[str, Case] = {c.id: c for c in _cases()}


def case_ids(world: int) -> list[str]:
    return [c.id for c in CASES.values() if c.world == world]


# DTensor cross-checks: (mesh, global shape, source placements, destination placements); meshes listed in
# ascending rank order where DTensor is right (see FACTS.md about permuted meshes).
DTENSOR_ITEMS: dict[int, list[tuple]] = {
    2: [
        ([0, 1], (7, 5), [S0], [S1]),
        ([0, 1], (5,), [S0], [R]),
        ([0, 1], (3, 4, 5), [R], [S2]),
    ],
    4: [
        ([0, 1, 2, 3], (7, 5), [S0], [S1]),
        ([0, 1, 2, 3], (9, 3, 2), [S1], [S0]),
        ([0, 1, 2, 3], (3, 5), [S0], [R]),
        ([[0, 1], [2, 3]], (7, 5), [S0, S0], [S1, S1]),
        ([[0, 1], [2, 3]], (7, 5), [S0, S1], [S1, S0]),
        ([[0, 1], [2, 3]], (7, 5), [R, S1], [S0, R]),
        ([[0, 1], [2, 3]], (9, 3, 2), [S1, S0], [S0, S0]),
        ([[0, 1], [2, 3]], (9, 3, 2), [S2, R], [S0, S2]),
        ([[0, 2], [1, 3]], (7, 5), [S0, S1], [S1, S0]),
        ([[0, 2], [1, 3]], (5, 6), [S0, S0], [R, S1]),
    ],
}


def dtensor_item_id(item) -> str:
    mesh, shape, a, b = item
    return f"mesh{mesh}-shape{list(shape)}-{a}->{b}".replace(" ", "")


# --------------------------------------------------------------------------------------------------------
# Workers (run inside spawned ranks)
# --------------------------------------------------------------------------------------------------------


def _check_run(case: Case, rank: int, dst_t: dict, version: int, pattern: int, what: str) -> list[str]:
    dspecs = side_specs(case.dst)
    want = build_locals(case.dst, rank, global_data(side_specs(case.src), version, cast=dspecs), pattern)
    out = []
    if sorted(want) != sorted(dst_t):
        out.append(f"{what}: local tensors {sorted(dst_t)} != {sorted(want)}")
    for n in want:
        m = mismatch(dst_t[n], want[n], f"{what}: rank {rank} destination {n!r}")
        if m:
            out.append(m)
    return out


def run_case(case: Case, rank: int, group=None, timeout: float = 30.0) -> dict:
    """Run ``case`` on this rank four times (fresh tensors; the same tensors with new data written in place
    and the destination re-poisoned; fresh tensors again, with every contiguous chunk as a direct message
    moved in place; the same with column-major tensors, where direct messages must fall back to staging) and
    compare bit for bit after each run. Runs 1-2 run the whole plan, runs 3-4 this rank's rank plan."""
    plan = case_plan(case)
    r = Resharder(plan, group=group, bucket_bytes=case.bucket_bytes, timeout=timeout)
    problems: list[str] = []
    steps = []
    sspecs = side_specs(case.src)

    def check_src_untouched(src_t, version, what):
        want = build_locals(case.src, rank, global_data(sspecs, version), 0)
        for n in want:
            m = mismatch(src_t[n], want[n], f"{what}: rank {rank} source {n!r} was modified")
            if m:
                problems.append(m)

    # run 1: fresh tensors
    src_t = build_locals(case.src, rank, global_data(sspecs, 0), 0)
    dst_t = build_locals(case.dst, rank, None, 0)
    rep = r.run(src_t, dst_t)
    steps.append(rep.steps)
    if rep.in_place_bytes:  # the test tensors are far below DIRECT_MIN_BYTES: every message is packed
        problems.append(f"run 1: rank {rank} moved {rep.in_place_bytes} B in place with the default threshold")
    problems += _check_run(case, rank, dst_t, 0, 0, "run 1")
    check_src_untouched(src_t, 0, "run 1")
    # run 2: same tensor objects, new data copied in place, destination re-poisoned in place
    for n, t in build_locals(case.src, rank, global_data(sspecs, 1), 0).items():
        src_t[n].copy_(t)
    for t in dst_t.values():
        poison_(t, 1)
    steps.append(r.run(src_t, dst_t).steps)
    problems += _check_run(case, rank, dst_t, 1, 1, "run 2 (buffers reused)")
    # run 3: fresh tensors with a third data set, from this rank's own rank plan (every rank runs its share)
    src_t = build_locals(case.src, rank, global_data(sspecs, 2), 1)
    dst_t = build_locals(case.dst, rank, None, 0)
    rd = Resharder(case_plan(case, rank), group=group, bucket_bytes=case.bucket_bytes, timeout=timeout,
                   direct_min_bytes=0)
    rep = rd.run(src_t, dst_t)
    steps.append(rep.steps)
    in_place = [0, 0, rep.in_place_bytes]
    problems += _check_run(case, rank, dst_t, 2, 0, "run 3 (new tensors, direct messages in place)")
    # run 4: the same data in column-major (non-contiguous) tensors: direct messages are staged instead
    src_t = {n: _column_major(t) for n, t in build_locals(case.src, rank, global_data(sspecs, 3), 0).items()}
    dst_t = {n: _column_major(t) for n, t in build_locals(case.dst, rank, None, 1).items()}
    rep = rd.run(src_t, dst_t)
    steps.append(rep.steps)
    in_place.append(rep.in_place_bytes)
    problems += _check_run(case, rank, dst_t, 3, 1, "run 4 (column-major tensors, direct messages staged)")
    return {"problems": problems, "steps": steps, "in_place_bytes": in_place}


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major storage (not contiguous when it has two dims of size > 1)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() >= 2 else t


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)


def refit_shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in TinyModel().named_parameters()}


REFIT_SRC_PLACEMENTS = {"emb.weight": [S0], "proj.weight": [S0], "proj.bias": [S0], "norm.weight": [R], "norm.bias": [R]}


def run_refit(rank: int, world: int, src_ranks: list[int], dst_ranks: list[int]) -> dict:
    """Training side TP over ``src_ranks``; every rank of ``dst_ranks`` holds a full TinyModel and passes its
    ``named_parameters()`` to ``refit`` (parameters require grad). Two refits with different data."""
    from triton_reshard import refit

    shapes = refit_shapes()
    src = P(shapes, src_ranks, REFIT_SRC_PLACEMENTS)
    dst = P(shapes, dst_ranks, [R])  # one full replica per destination rank
    src_layout, dst_layout = src.layout(), dst.layout()
    model = TinyModel() if rank in dst_ranks else None
    params_before = {n: p for n, p in model.named_parameters()} if model is not None else {}
    problems: list[str] = []
    for version in (0, 1):
        g = global_data(src.specs(), version)
        src_t = build_locals((src,), rank, g, 0) if rank in src_ranks else None
        if model is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        refit(src_t, model.named_parameters() if model is not None else None, src_layout, dst_layout,
              bucket_bytes=1024, timeout=30)
        if model is None:
            continue
        for n, p in model.named_parameters():
            if p is not params_before[n]:
                problems.append(f"parameter {n!r} was replaced, not updated in place")
            if not (p.requires_grad and p.is_leaf and p.grad is None):
                problems.append(f"parameter {n!r} lost requires_grad/leaf status")
            m = mismatch(p.detach(), g[n], f"refit {version + 1}: rank {rank} parameter {n!r}")
            if m:
                problems.append(m)
        out = model.norm(model.proj(model.emb(torch.tensor([0, 5, 10]))))
        if not bool(torch.isfinite(out).all()):
            problems.append("forward pass of the refitted model is not finite")
    return {"problems": problems}


_MESHES: dict = {}


def run_dtensor_item(item, rank: int, timeout: float = 30.0) -> dict:
    """Our ``from_placements().shard()`` vs ``distribute_tensor().to_local()``, and our reshard vs
    ``redistribute().to_local()`` on the same mesh (DTensor's local shard is our source input)."""
    from torch.distributed.tensor import DeviceMesh, distribute_tensor
    from torch.distributed.tensor import Replicate as DR
    from torch.distributed.tensor import Shard as DS

    mesh, shape, pa, pb = item

    def conv(pl):
        return [DS(p.dim) if isinstance(p, Shard) else DR() for p in pl]

    key = repr(mesh)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", mesh)
    dm = _MESHES[key]
    g = synthetic_global("x", shape, torch.float32)
    dt = distribute_tensor(g, dm, conv(pa))
    src_l = Layout.from_placements({"x": shape}, mesh, pa)
    dst_l = Layout.from_placements({"x": shape}, mesh, pb)
    problems = []
    m = mismatch(src_l.shard({"x": g}, rank)["x"], dt.to_local(), f"rank {rank}: Layout.shard vs DTensor local shard")
    if m:
        problems.append(m)
    want = dt.redistribute(dm, conv(pb)).to_local()
    out = {"x": poison_(torch.empty(dst_l.local_shapes(rank)["x"]))}
    Resharder(plan_reshard(src_l, dst_l), bucket_bytes=4096, timeout=timeout).run({"x": dt.to_local().clone()}, out)
    m = mismatch(out["x"], want, f"rank {rank}: our reshard vs DTensor.redistribute")
    if m:
        problems.append(m)
    return {"problems": problems}


def _guard(fn, *args) -> dict:
    t0 = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as e:  # report per item, keep the world going
        res = {"problems": [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]}
    res["seconds"] = time.perf_counter() - t0
    return res


# Bad inputs to run(): each scenario runs on every rank of a world of 4; ``bad`` is the rank that misbehaves.
BAD_SRC = (P({"w": (8, 6), "ids": (5,)}, [0, 1, 2, 3], [S0], {"w": torch.float32, "ids": torch.int64}),)
BAD_DST = (P({"w": (8, 6), "ids": (5,)}, [[0, 1], [2, 3]], {"w": [S1, S0], "ids": [R, R]},
             {"w": torch.float32, "ids": torch.int64}),)
BAD_DST_OTHER = (P({"w": (8, 6), "ids": (5,)}, [[0, 1], [2, 3]], {"w": [S0, S1], "ids": [R, R]},
                   {"w": torch.float32, "ids": torch.int64}),)
BAD_TIMEOUT = 3.0  # seconds, for the peer that never arrives


def _mut_wrong_shape(src_t, dst_t):
    dst_t["w"] = poison_(torch.empty(dst_t["w"].shape[0] + 1, dst_t["w"].shape[1]))


def _mut_wrong_dtype(src_t, dst_t):
    src_t["w"] = src_t["w"].double()


def _mut_meta_one(src_t, dst_t):
    src_t["w"] = torch.empty(src_t["w"].shape, dtype=src_t["w"].dtype, device="meta")


def _mut_meta_all_dst(src_t, dst_t):
    for n, t in list(dst_t.items()):
        dst_t[n] = torch.empty(t.shape, dtype=t.dtype, device="meta")


def _mut_missing(src_t, dst_t):
    del dst_t["w"]


def _mut_unknown(src_t, dst_t):
    src_t["bogus"] = torch.zeros(3)


def _mut_not_tensor(src_t, dst_t):
    dst_t["w"] = dst_t["w"].tolist()


def _mut_freed_storage(src_t, dst_t):
    src_t["w"].untyped_storage().resize_(0)  # what FSDP does between steps: a copy from it would segfault


def _mut_expanded_dst(src_t, dst_t):
    n, m = dst_t["w"].shape
    dst_t["w"] = poison_(torch.empty(n, 1)).expand(n, m)  # every column is the same memory


def _mut_aliased(src_t, dst_t):
    dst_t["w"] = src_t["w"].view(-1)[: dst_t["w"].numel()].view(dst_t["w"].shape)  # the source's memory


# id -> (bad rank, mutation, expected exception type on the bad rank, tensor name the message must give)
BAD_INPUTS = {
    "freed-storage": (2, _mut_freed_storage, "ValueError", ("w",)),
    "expanded-destination": (3, _mut_expanded_dst, "ValueError", ("w",)),
    "destination-aliases-source": (1, _mut_aliased, "ValueError", ("w",)),
    "wrong-shape": (1, _mut_wrong_shape, "ValueError", ("w",)),
    "wrong-dtype": (2, _mut_wrong_dtype, "ValueError", ("w",)),
    "meta-device-one-tensor": (0, _mut_meta_one, "ValueError", ("w",)),
    "meta-device-all-destination": (3, _mut_meta_all_dst, "ValueError", ("w", "ids")),
    "missing-name": (3, _mut_missing, "ValueError", ("w",)),
    "unknown-name": (1, _mut_unknown, "ValueError", ("bogus",)),
    "not-a-tensor": (2, _mut_not_tensor, "TypeError", ("w",)),
}
# id -> (rank whose plan differs, how)
BAD_PLANS = {"different-bucket": (1, "bucket"), "different-layouts": (2, "layout"),
             "triton-backend-on-one-rank": (3, "backend")}


def _bad_setup(rank: int, other_layout: bool = False, bucket: int = 4096, timeout: float = 20.0,
               backend: str | None = None):
    plan = plan_reshard(side_layout(BAD_SRC), side_layout(BAD_DST_OTHER if other_layout else BAD_DST))
    r = Resharder(plan, bucket_bytes=bucket, timeout=timeout, backend=backend)
    src_t = build_locals(BAD_SRC, rank, global_data(side_specs(BAD_SRC)), 0)
    dst_t = build_locals(BAD_DST_OTHER if other_layout else BAD_DST, rank, None, 0)
    return r, src_t, dst_t


def _attempt(r, src_t, dst_t) -> dict:
    t0 = time.perf_counter()
    before = {n: bits(t).clone() for n, t in dst_t.items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    try:
        r.run(src_t, dst_t)
        res = {"error": None, "message": ""}
    except Exception as e:
        res = {"error": type(e).__name__, "message": str(e), "is_reshard_error": isinstance(e, ReshardError)}
    res["seconds"] = time.perf_counter() - t0
    res["dst_untouched"] = all(torch.equal(bits(dst_t[n]), b) for n, b in before.items())
    return res


def run_bad_inputs(rank: int) -> dict:
    out = {}
    for sid, (bad, mutate, _exc, _names) in BAD_INPUTS.items():
        r, src_t, dst_t = _bad_setup(rank)
        if rank == bad:
            mutate(src_t, dst_t)
        out[sid] = _attempt(r, src_t, dst_t)
    for sid, (bad, how) in BAD_PLANS.items():
        r, src_t, dst_t = _bad_setup(
            rank, other_layout=(rank == bad and how == "layout"), bucket=8192 if (rank == bad and how == "bucket") else 4096,
            backend="triton" if (rank == bad and how == "backend") else None,
        )
        out[sid] = _attempt(r, src_t, dst_t)
    # the group still works after all those rejected runs
    r, src_t, dst_t = _bad_setup(rank)
    res = _attempt(r, src_t, dst_t)
    want = build_locals(BAD_DST, rank, global_data(side_specs(BAD_SRC)), 0)
    res["problems"] = [m for n in want if (m := mismatch(dst_t[n], want[n], f"rank {rank} {n!r}"))]
    out["good-run-after-errors"] = res
    return out


def run_absent_peer(rank: int, absent: int) -> dict:
    """Rank ``absent`` never calls run(); the others must raise ReshardTimeoutError within the timeout.
    Breaks the process group (FACTS.md): run it last."""
    r, src_t, dst_t = _bad_setup(rank, timeout=BAD_TIMEOUT)
    if rank == absent:
        time.sleep(BAD_TIMEOUT + 2.0)
        return {"error": None, "message": "absent", "seconds": 0.0}
    return _attempt(r, src_t, dst_t)


def world_main(rank: int, world: int, ids: list[str], dtensor: bool, refit_sides: list | None,
               bad_inputs: bool = False) -> dict:
    """Everything one spawned world checks: the cases of this world size, the DTensor cross-checks, refit, and
    (world 4) the bad-input scenarios, with the peer that never arrives last because it breaks the group."""
    import torch.distributed as dist

    groups = {}
    for cid in ids:  # every rank creates every subgroup, in the same order
        if CASES[cid].group_ranks is not None:
            groups[cid] = dist.new_group(list(CASES[cid].group_ranks))
    out: dict = {"cases": {}, "dtensor": {}, "refit": {}, "bad": {}}
    for cid in ids:
        case = CASES[cid]
        if case.group_ranks is not None and rank not in case.group_ranks:
            out["cases"][cid] = {"problems": [], "steps": [], "skipped": True, "seconds": 0.0}
            continue
        out["cases"][cid] = _guard(run_case, case, rank, groups.get(cid))
    if dtensor:
        for item in DTENSOR_ITEMS.get(world, []):
            out["dtensor"][dtensor_item_id(item)] = _guard(run_dtensor_item, item, rank)
    for src_ranks, dst_ranks in refit_sides or []:
        key = f"src{src_ranks}-dst{dst_ranks}"
        out["refit"][key] = _guard(run_refit, rank, world, src_ranks, dst_ranks)
    if bad_inputs:
        out["bad"] = run_bad_inputs(rank)
        out["bad"]["peer-never-arrives"] = run_absent_peer(rank, absent=world - 1)
    return out


REFIT_SIDES = {
    2: [([0, 1], [0, 1])],  # colocated
    4: [([0, 1], [2, 3])],  # disaggregated
}


@functools.cache
def world_results(world: int) -> list:
    """Spawn one gloo world of ``world`` ranks that runs everything for that size; cached for the session, so
    test modules share one spawn per world size. Returns each rank's result dict (or its error text)."""
    from triton_reshard.testing.launch import run_world

    return run_world(world_main, world, case_ids(world), world in DTENSOR_ITEMS, REFIT_SIDES.get(world),
                     world == 4, timeout=420, pg_timeout=120, allow_errors=True)


def world_main_triton(rank: int, world: int, ids: list[str]) -> dict:
    """The cases of this world size with the Triton copy backend (the parent sets TRITON_INTERPRET=1 and
    TRITON_RESHARD_BACKEND=triton before spawning), counting kernel launches per copy list."""
    import triton_reshard.ops.copy as tc

    calls: list[tuple[int, int, int]] = []  # (pairs in the list, kernel launches, dtype groups)
    real_launch = tc.launch

    def counting_launch(table, pairs, *digest):  # the digest's coefficients where the launch hashes (issue 46)
        calls.append((len(pairs), len(table.groups), len({(p[0].dtype, p[1].dtype) for p in pairs})))
        return real_launch(table, pairs, *digest)

    tc.launch = counting_launch
    out: dict = {"cases": {}, "calls": calls}
    for cid in ids:
        if CASES[cid].group_ranks is not None:
            continue
        out["cases"][cid] = _guard(run_case, CASES[cid], rank, None)
    return out
