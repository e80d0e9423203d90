"""The object form of a layout: the constructors that take Python objects (:meth:`LayoutBuilders.from_fragments`,
:meth:`~LayoutBuilders.from_placements`, :meth:`~LayoutBuilders.merge`, :meth:`~LayoutBuilders.restrict`), the
conveniences over them (``allocate``, ``shard``) and :func:`to_columns`, which turns ``TensorSpec`` /
``Fragment`` / ``LocalSpec`` objects into the columns every :class:`~triton_reshard.layout.Layout` is stored as
(:mod:`.columnar`). The builders reach the layout only through its query interface; what they build is handed to
``Layout(tensors, fragments, locals)``, which converts it to columns once and validates it there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Self

import numpy as np
import torch

from ..box import box_slices
from .check import check_layout
from .columns import I64, Columns, LogicalTensors
from .specs import (
    Fragment,
    LocalSpec,
    Placement,
    Replicate,
    Shard,
    TensorSpec,
    as_shape,
    check_names,
    dtype_name,
    gc_paused,
    nested_box,
)

FRAG_ORDER = attrgetter("tensor", "rank", "local", "offsets", "local_offsets")  # a layout's fragment order
_NAME = attrgetter("name")
_RANK_NAME = attrgetter("rank", "name")


def sorted_parts(tensors: Iterable[TensorSpec], fragments: Iterable[Fragment], locals_: Iterable[LocalSpec]
                 ) -> tuple[tuple[TensorSpec, ...], tuple[Fragment, ...], tuple[LocalSpec, ...]]:
    """The parts of a layout in its order: tensors by name, fragments by (tensor, rank, local, offsets, local
    offsets), local tensors by (rank, name) (builders hand them over in order: each sort is one linear pass)."""
    with gc_paused():
        return (tuple(sorted(tensors, key=_NAME)), tuple(sorted(fragments, key=FRAG_ORDER)),
                tuple(sorted(locals_, key=_RANK_NAME)))


def to_columns(tensors: tuple[TensorSpec, ...], frags: tuple[Fragment, ...], locs: tuple[LocalSpec, ...]
               ) -> tuple[LogicalTensors, Columns]:
    """The columns of a layout's parts, given in layout order (:func:`sorted_parts`): the rows keep that order
    (tensor and local ids are in name order, local offsets are padded with -1, so the order of the rows is the
    order of the objects). Parts no columns can hold (a tensor declared twice, a fragment of an unknown tensor or
    with the wrong number of dims) raise the eager checks' message (``check_layout``)."""
    if len({t.name for t in tensors}) < len(tensors):
        _eager_raise(tensors, frags, locs)  # "declared twice"
    lt = LogicalTensors.from_specs(tensors)
    lnames = sorted({f.local for f in frags} | {x.name for x in locs})
    lid = {n: i for i, n in enumerate(lnames)}
    dtypes = list(dict.fromkeys([*lt.dtypes, *(x.dtype for x in locs)]))
    did = {d: i for i, d in enumerate(dtypes)}
    n, m = len(frags), len(locs)
    D = max(map(len, lt.shapes), default=0)
    L = max([len(f.local_offsets) for f in frags] + [D])
    S = max([len(x.shape) for x in locs] + [0])
    with gc_paused():
        offs, szs, los = [f.offsets for f in frags], [f.sizes for f in frags], [f.local_offsets for f in frags]
        ndo, flnd = np.fromiter(map(len, offs), I64, n), np.fromiter(map(len, los), I64, n)
        if (ndo > D).any() or (np.fromiter(map(len, szs), I64, n) != ndo).any():
            _eager_raise(tensors, frags, locs)
        try:
            ft = np.fromiter((lt.index[f.tensor] for f in frags), I64, n)
        except KeyError:
            _eager_raise(tensors, frags, locs)
        if (np.fromiter(map(len, lt.shapes), I64, len(lt))[ft] != ndo).any():
            _eager_raise(tensors, frags, locs)  # a box with the wrong number of dims
        foff, fsz, flo = _padded(offs, ndo, D, 0), _padded(szs, ndo, D, 1), _padded(los, flnd, L, -1)
        fr = np.fromiter((f.rank for f in frags), I64, n)
        fl = np.fromiter((lid[f.local] for f in frags), I64, n)
        shapes = [x.shape for x in locs]
        lnd = np.fromiter(map(len, shapes), I64, m)
        lsh = _padded(shapes, lnd, S, -1)
        return lt, Columns(lt.names, lnames, dtypes, ft, fr, fl, foff, fsz, flo, flnd,
                           np.fromiter((x.rank for x in locs), I64, m), np.fromiter((lid[x.name] for x in locs), I64, m),
                           lsh, lnd, np.fromiter((did[x.dtype] for x in locs), I64, m))


def _padded(rows: Sequence[Sequence[int]], lens: np.ndarray, width: int, fill: int) -> np.ndarray:
    """``rows`` (``lens[i]`` ints each) as an int64 ``[len(rows), width]`` matrix, each row padded with ``fill``:
    one conversion when every row has the full width (the common case), row by row otherwise."""
    n = len(rows)
    if n and (lens == width).all():
        return np.array(rows, I64).reshape(n, width)
    out = np.full((n, width), fill, I64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _eager_raise(tensors, frags, locs) -> None:
    check_layout(tensors, frags, locs)  # raises its message
    raise AssertionError("layout: parts the eager checks accept but the columns cannot hold")


class LayoutBuilders:
    """The constructors and conveniences of :class:`~triton_reshard.layout.Layout` that take or give Python
    objects (a mixin: the layout itself is stored as columns)."""

    @classmethod
    def from_fragments(
        cls,
        tensors: Mapping[str, tuple[Sequence[int], torch.dtype]] | Iterable[TensorSpec],
        fragments: Iterable[Fragment],
        local_shapes: Mapping[tuple[int, str], Sequence[int]] | None = None,
    ) -> Self:
        """Any layout, from fragments.

        ``tensors``: ``{name: (global_shape, dtype)}`` (or ``(global_shape, dtype, BlockQuant)``) or TensorSpecs. ``local_shapes``: ``{(rank, local_name):
        shape}`` for local tensors larger than what their fragments cover (e.g. padded vocab); local tensors
        not listed get the smallest shape that holds their fragments. A local tensor's dtype is the dtype of
        the logical tensors it holds.
        """
        if isinstance(tensors, Mapping):
            specs = []
            for n, sd in tensors.items():
                if not isinstance(sd, (tuple, list)) or len(sd) not in (2, 3):
                    raise TypeError(f"tensor {n!r}: expected (shape, dtype) or (shape, dtype, BlockQuant), got {sd!r}")
                specs.append(TensorSpec(n, as_shape(sd[0], f"tensor {n!r} shape"), *sd[1:]))
        else:
            specs = list(tensors)
            for t in specs:
                if not isinstance(t, TensorSpec):
                    raise TypeError(f"tensors: expected a dict name -> (shape, dtype) or TensorSpecs, got {t!r}")
        by_name = {s.name: s for s in specs}
        if not isinstance(fragments, Iterable):
            raise TypeError(f"fragments: expected an iterable of Fragment, got {fragments!r}")
        frags = list(fragments)
        for i, f in enumerate(frags):
            if not isinstance(f, Fragment):
                raise TypeError(f"fragments[{i}]: expected a Fragment, got {type(f).__name__} {f!r}")
        if local_shapes is not None and not isinstance(local_shapes, Mapping):
            raise TypeError(f"local_shapes: expected a dict (rank, local name) -> shape, got {local_shapes!r}")
        extent: dict[tuple[int, str], list[int]] = {}
        dtypes: dict[tuple[int, str], torch.dtype] = {}
        for f in frags:
            key = (f.rank, f.local)
            spec = by_name.get(f.tensor)
            if spec is None:
                raise ValueError(f"fragment of unknown tensor {f.tensor!r} on rank {f.rank}")
            ends = [o + s for o, s in zip(f.local_offsets, f.local_sizes, strict=True)]
            prev = extent.get(key)
            if prev is None:
                extent[key] = ends
            elif len(prev) != len(ends):
                raise ValueError(
                    f"local tensor {f.local!r} on rank {f.rank}: fragments disagree on its number of dims"
                )
            else:
                extent[key] = [max(a, b) for a, b in zip(prev, ends, strict=True)]
            if key in dtypes and dtypes[key] != spec.dtype:
                raise ValueError(
                    f"local tensor {f.local!r} on rank {f.rank} would hold tensors of dtypes "
                    f"{dtype_name(dtypes[key])} and {dtype_name(spec.dtype)} (tensor {f.tensor!r})"
                )
            dtypes[key] = spec.dtype
        shapes = {k: tuple(v) for k, v in extent.items()}
        for key, shape in (local_shapes or {}).items():
            if (not isinstance(key, tuple) or len(key) != 2 or not isinstance(key[1], str)
                    or not isinstance(key[0], int) or isinstance(key[0], bool)):
                raise TypeError(f"local_shapes: keys must be (rank, local name) pairs, got {key!r}")
            shape = as_shape(shape, f"local tensor {key[1]!r} on rank {key[0]}")
            shapes[tuple(key)] = tuple(shape)
            if key not in dtypes:
                raise ValueError(f"local tensor {key[1]!r} on rank {key[0]} has a shape but holds no fragment")
        locs = [LocalSpec(r, n, shapes[(r, n)], dtypes[(r, n)]) for (r, n) in shapes]
        return cls(tuple(specs), tuple(frags), tuple(locs))

    @classmethod
    def from_placements(
        cls,
        shapes: Mapping[str, Sequence[int]],
        mesh,
        placements: Mapping[str, Sequence[Placement]] | Sequence[Placement],
        dtype: torch.dtype | Mapping[str, torch.dtype] = torch.float32,
    ) -> Self:
        """DTensor-style: ``mesh`` is a nested list (or int tensor) of global ranks; ``placements[name]`` has
        one Placement per mesh dim (a single sequence applies to every tensor). Each rank of the mesh holds
        one local tensor per logical tensor, named like it, shaped like its shard (possibly empty).
        Several mesh dims sharding one tensor dim nest left to right, as DTensor does by default.

        A flat list (``[0, 1, 2, 3]``) is a 1-D mesh and a single int a mesh of one rank: then each
        ``placements`` entry has one Placement. ``shapes``: ``{name: global shape}``; ``dtype``: one dtype or
        ``{name: dtype}``. Shards split like ``torch.chunk`` (the last ones may be smaller or empty).

        Raises ``TypeError`` for a mesh that is not integer ranks (or empty), a placement other than
        ``Shard``/``Replicate``, a bad shape; ``ValueError`` for repeated or negative ranks in the mesh, a
        tensor with no placements, a placement count that differs from the mesh's dims, a ``Shard`` dim out of
        range.
        """
        try:
            mesh_t = torch.as_tensor(mesh)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"mesh must be a non-empty nested list or tensor of integer ranks, got {mesh!r}") from None
        if mesh_t.dtype.is_floating_point or mesh_t.dtype == torch.bool or mesh_t.numel() == 0:
            raise TypeError(f"mesh must be a non-empty nested list or tensor of integer ranks, got {mesh!r}")
        if mesh_t.dim() == 0:
            mesh_t = mesh_t.reshape(1)
        ranks = mesh_t.flatten().tolist()
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"mesh must list distinct ranks >= 0, got {mesh_t.tolist()}")
        coords = list(zip(*[t.flatten().tolist() for t in torch.meshgrid(
            *[torch.arange(n) for n in mesh_t.shape], indexing="ij")], strict=True))
        specs, frags, locs = [], [], []
        mesh_shape = tuple(mesh_t.shape)
        with gc_paused():
            if not isinstance(shapes, Mapping):
                raise TypeError(f"shapes: expected a dict name -> shape, got {type(shapes).__name__} {shapes!r}")
            if isinstance(placements, Mapping):
                check_names("placements", placements, shapes)
            if isinstance(dtype, Mapping):
                check_names("dtype", dtype, shapes)
            for name, shape in shapes.items():
                shape = as_shape(shape, f"tensor {name!r} shape")
                if isinstance(dtype, Mapping) and name not in dtype:
                    raise ValueError(f"tensor {name!r} has no dtype (dtype is a dict without it: {sorted(dtype)})")
                dt = dtype[name] if isinstance(dtype, Mapping) else dtype
                spec = TensorSpec(name, shape, dt)
                specs.append(spec)
                if isinstance(placements, Mapping) and name not in placements:
                    raise ValueError(f"tensor {name!r} has no placements")
                pl = placements[name] if isinstance(placements, Mapping) else placements
                if not isinstance(pl, (tuple, list)):
                    raise TypeError(f"tensor {name!r}: placements must be a list of Shard/Replicate, got {pl!r}")
                pl = tuple(pl)
                if len(pl) != mesh_t.dim():
                    raise ValueError(
                        f"tensor {name!r}: {len(pl)} placements for a {mesh_t.dim()}-D mesh {tuple(mesh_t.shape)}"
                    )
                for p in pl:
                    if not isinstance(p, (Shard, Replicate)):
                        raise TypeError(f"tensor {name!r}: unsupported placement {p!r} (Shard or Replicate only)")
                    if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):
                        raise ValueError(f"tensor {name!r} of shape {shape}: {p!r} is out of range")
                shards = [(m, p.dim % len(shape)) for m, p in enumerate(pl) if isinstance(p, Shard)]
                for rank, coord in zip(ranks, coords, strict=True):
                    off, size = nested_box(shape, mesh_shape, coord, shards)
                    locs.append(LocalSpec(rank, name, size, spec.dtype))
                    if all(size):
                        frags.append(Fragment(name, rank, off, size))
            return cls(tuple(specs), tuple(frags), tuple(locs))

    def merge(self, *others: LayoutBuilders) -> Self:
        """Union of layouts (e.g. one per pipeline stage). Tensors and local tensors declared in several must agree."""
        specs = {t.name: t for t in self.tensors}
        locs = {(s.rank, s.name): s for s in self.locals}
        frags = list(self.fragments)
        for other in others:
            for t in other.tensors:
                if t.name in specs and specs[t.name] != t:
                    raise ValueError(
                        f"cannot merge layouts: tensor {t.name!r} is {specs[t.name].shape} "
                        f"{dtype_name(specs[t.name].dtype)} in one and {t.shape} {dtype_name(t.dtype)} in another"
                    )
                specs[t.name] = t
            for s in other.locals:
                key = (s.rank, s.name)
                if key in locs and locs[key] != s:
                    raise ValueError(
                        f"cannot merge layouts: local tensor {s.name!r} on rank {s.rank} is {locs[key].shape} in "
                        f"one and {s.shape} in another"
                    )
                locs[key] = s
            frags.extend(other.fragments)
        with gc_paused():
            return type(self)(tuple(specs.values()), tuple(dict.fromkeys(frags)), tuple(locs.values()))

    def __or__(self, other: LayoutBuilders) -> Self:
        return self.merge(other)

    def instance_stride(self, stride: int | None = None) -> int:
        """The rank shift between two copies (see :meth:`instances`): ``stride``, checked, or the span of this
        layout's ranks (``max - min + 1``: the number of ranks of one copy when they are consecutive)."""
        ranks = self.ranks
        if not ranks:
            raise ValueError("Layout.instances: the layout has no ranks")
        if stride is None:
            return ranks[-1] - ranks[0] + 1
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
            raise ValueError(f"Layout.instances: stride={stride!r} must be an int >= 1")
        return stride

    def _instance_step(self, n: int, stride: int | None) -> int:
        """The rank shift between copies of ``instances(n, stride)``; raises if ``n`` is not an int >= 1 or the
        copies would share a rank (what every representation of a layout checks before copying)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Layout.instances: n={n!r} must be an int >= 1")
        step = self.instance_stride(stride)
        ranks = self.ranks
        if n > 1 and len({r + i * step for i in range(n) for r in ranks}) < n * len(ranks):
            raise ValueError(f"Layout.instances: {n} copies of ranks {list(ranks)} shifted by stride={step} share "
                             f"ranks (the stride must be at least the span of the ranks, {ranks[-1] - ranks[0] + 1}, "
                             f"or interleave them without collisions)")
        return step

    def instance_groups(self, n: int, stride: int | None = None) -> tuple[tuple[int, ...], ...]:
        """The ranks of ``self.instances(n, stride)`` that hold the same boxes: per rank ``r`` of this layout,
        ``(r, r + stride, ..., r + (n-1) * stride)`` (the same position in every copy), in rank order. What
        ``plan_reshard(..., relay_groups=...)`` takes to spread the sends over the copies."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Layout.instance_groups: n={n!r} must be an int >= 1")
        step = self.instance_stride(stride)
        return tuple(tuple(r + i * step for i in range(n)) for r in self.ranks)

    # -- queries ------------------------------------------------------------------------------------

    def local_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the local tensors ``rank`` holds."""
        return {n: s.shape for n, s in self.local_specs(rank).items()}


    def allocate(self, rank: int, device: torch.device | str = "cpu", fill: float | None = None) -> dict[str, torch.Tensor]:
        """Fresh local tensors for ``rank`` (uninitialised, or filled with ``fill``)."""
        out = {}
        for n, s in self.local_specs(rank).items():
            t = torch.empty(s.shape, dtype=s.dtype, device=device)
            if fill is not None:
                t.fill_(fill)
            out[n] = t
        return out

    def shard(self, global_tensors: Mapping[str, torch.Tensor], rank: int, device=None) -> dict[str, torch.Tensor]:
        """Build ``rank``'s local tensors by slicing full tensors (for demos, tests and checks).

        Parts of a local tensor no fragment covers (padding) are zero.
        """
        out: dict[str, torch.Tensor] = {}
        for n, s in self.local_specs(rank).items():
            out[n] = torch.zeros(s.shape, dtype=s.dtype, device=device)
        for f in self.fragments_on_rank(rank):
            if not f.numel:
                continue
            src = global_tensors[f.tensor][box_slices(f.offsets, f.sizes)]
            loff, lsz = f.local_box(f.offsets, f.sizes)
            view = out[f.local][box_slices(loff, lsz)]
            view.copy_(src.reshape(lsz))
        return out

    def restrict(self, names: Iterable[str]) -> Self:
        """The same layout limited to some logical tensors (local tensors holding none of them are dropped; a
        quantized tensor keeps its scale tensor)."""
        keep = set(names)
        keep |= {self.specs[n].quant.scale for n in keep if n in self.specs and self.specs[n].quant is not None}
        frags = tuple(f for f in self.fragments if f.tensor in keep)
        used = {(f.rank, f.local) for f in frags}
        locs = tuple(
            s for s in self.locals if (s.rank, s.name) in used or (s.name in keep and (s.rank, s.name) not in used)
        )
        return type(self)(tuple(t for t in self.tensors if t.name in keep), frags, locs)
