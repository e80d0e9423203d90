"""Layout: what is where.

A :class:`Layout` describes, for a set of named *logical* tensors (global shape, dtype), which ranks hold
which *box* of each one and where that box sits inside which *local* tensor on that rank. Everything is a
box: TP/PP/EP/DP sharding, fused QKV or gate_up, interleaved GQA groups and padded vocabularies are all just
lists of :class:`Fragment` s. Special cases belong in layout builders (``from_placements``, presets), never
in the planner or the kernels.

Layouts are immutable, validated on construction and hashable, so plans can be cached on them.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

import numpy as np
import torch

from ..box import box_slices
from .check import check_layout
from .fragment_table import FragmentTable, TensorRows, content_fingerprint
from .specs import (
    FRAG_KEY,
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
    itemsize_of,
    nested_box,
)

_FRAG_ORDER = attrgetter("tensor", "rank", "local", "offsets", "local_offsets")  # Layout's fragment order
_TENSOR = attrgetter("tensor")
_RANK = attrgetter("rank")
_TENSOR_RANK_LOCAL = attrgetter("tensor", "rank", "local")
_NAME = attrgetter("name")
_RANK_NAME = attrgetter("rank", "name")



# --------------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Layout:
    """Which ranks hold which box of which logical tensor, and where inside which local tensor.

    Build with :meth:`from_placements` (DTensor-style mesh + placements), :meth:`from_fragments` (any
    layout), or combine layouts with :meth:`merge` / ``|``. Validated on construction: fragments inside
    their logical tensor and their local tensor, no two fragments sharing local memory, local tensor dtype
    equal to the logical dtype (a violation raises ``ValueError`` or ``TypeError`` naming the tensor).

    The dataclass constructor ``Layout(tensors, fragments, locals)`` is what those builders call: it takes
    already-built ``TensorSpec`` / ``Fragment`` / ``LocalSpec`` tuples and works, but prefer the builders,
    which also fill in local shapes and check your inputs' types. A Layout is immutable and hashable (plans
    are cached on it); ``digest`` names its contents.
    """

    tensors: tuple[TensorSpec, ...]
    fragments: tuple[Fragment, ...]
    locals: tuple[LocalSpec, ...]
    _key: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        with gc_paused():
            # (layout builders hand these over already in order: each sort is then one linear pass)
            tensors = tuple(sorted(self.tensors, key=_NAME))
            frags = tuple(sorted(self.fragments, key=_FRAG_ORDER))
            locs = tuple(sorted(self.locals, key=_RANK_NAME))
            object.__setattr__(self, "tensors", tensors)
            object.__setattr__(self, "fragments", frags)
            object.__setattr__(self, "locals", locs)
            self._validate()
            object.__setattr__(
                self,
                "_key",
                (
                    tuple((t.name, t.shape, dtype_name(t.dtype)) if t.quant is None
                          else (t.name, t.shape, dtype_name(t.dtype), t.quant.key()) for t in tensors),
                    tuple(map(FRAG_KEY, frags)),
                    tuple((s.rank, s.name, s.shape, dtype_name(s.dtype)) for s in locs),
                ),
            )

    # -- value semantics ------------------------------------------------------------------------------

    def __hash__(self) -> int:
        return self._hash  # cached: the key of a 128-rank layout has ~10^5 entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self is other or self._key == other._key)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(repr(self._key).encode()).hexdigest()[:16]

    @cached_property
    def fingerprint(self) -> str:
        """A content identity like ``digest`` (equal layouts, equal fingerprints, however they were built) that
        a columnar layout (``layout.columnar``) computes from its arrays, without building every rank's objects
        (~0.1 s for a 1,024-rank DeepSeek-V3 layout): what ranks compare before a rank plan runs."""
        frags = sorted(self.fragments, key=_RANK)  # stable: (rank, tensor, local, offsets, local offsets)
        names = sorted({s.name for s in self.locals} | {f.local for f in frags})
        tid = {t.name: i for i, t in enumerate(self.tensors)}
        lid = {n: i for i, n in enumerate(names)}
        D = max((len(t.shape) for t in self.tensors), default=0)
        L = max((len(f.local_offsets) for f in frags), default=0)
        n = len(frags)
        off, sz, lo = np.zeros((n, D), np.int64), np.ones((n, D), np.int64), np.full((n, L), -1, np.int64)
        for i, f in enumerate(frags):
            k = len(f.offsets)
            off[i, :k], sz[i, :k], lo[i, :len(f.local_offsets)] = f.offsets, f.sizes, f.local_offsets
        cols = (np.fromiter((f.rank for f in frags), np.int64, n), np.fromiter((tid[f.tensor] for f in frags), np.int64, n),
                np.fromiter((lid[f.local] for f in frags), np.int64, n), off, sz, lo)
        locs = self.locals
        S = max((len(x.shape) for x in locs), default=0)
        sh = np.full((len(locs), S), -1, np.int64)
        for i, x in enumerate(locs):
            sh[i, :len(x.shape)] = x.shape
        dts = sorted({dtype_name(x.dtype) for x in locs})
        did = {d: i for i, d in enumerate(dts)}
        lcols = (np.fromiter((x.rank for x in locs), np.int64, len(locs)),
                 np.fromiter((lid[x.name] for x in locs), np.int64, len(locs)), sh,
                 np.fromiter((did[dtype_name(x.dtype)] for x in locs), np.int64, len(locs)))
        ts = self.tensors
        tensors = ([t.name for t in ts], [t.shape for t in ts], [dtype_name(t.dtype) for t in ts],
                   {i: t.quant.key() for i, t in enumerate(ts) if t.quant is not None})
        return content_fingerprint(tensors, names, [cols], (lcols,), dts)

    def __repr__(self) -> str:
        return (
            f"Layout({len(self.tensors)} tensors, {len(self.fragments)} fragments, "
            f"{len(self.locals)} local tensors on ranks {list(self.ranks)}, digest={self.digest})"
        )

    # -- validation ---------------------------------------------------------------------------------

    def _validate(self) -> None:
        check_layout(self.tensors, self.fragments, self.locals)

    # -- constructors -------------------------------------------------------------------------------

    @classmethod
    def from_fragments(
        cls,
        tensors: Mapping[str, tuple[Sequence[int], torch.dtype]] | Iterable[TensorSpec],
        fragments: Iterable[Fragment],
        local_shapes: Mapping[tuple[int, str], Sequence[int]] | None = None,
    ) -> Layout:
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
    ) -> Layout:
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

    def merge(self, *others: Layout) -> Layout:
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
            return Layout(tuple(specs.values()), tuple(dict.fromkeys(frags)), tuple(locs.values()))

    def __or__(self, other: Layout) -> Layout:
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

    def instances(self, n: int, stride: int | None = None) -> Layout:
        """``n`` copies of this layout on successive rank blocks: copy ``i`` is this layout with every rank
        shifted by ``i * stride`` (default: the span of its ranks, so copies of a layout on consecutive ranks
        follow each other, e.g. ranks 4-7 → 4-7, 8-11, 12-15). Copy 0 is this layout itself. The copies must not
        share a rank. E.g. several independent inference engines, each a full copy of one engine's layout.
        """
        step = self._instance_step(n, stride)
        if n == 1:
            return self
        with gc_paused():
            frags = [Fragment(f.tensor, f.rank + i * step, f.offsets, f.sizes, f.local, f.local_offsets)
                     for i in range(n) for f in self.fragments]
            locs = [LocalSpec(s.rank + i * step, s.name, s.shape, s.dtype) for i in range(n) for s in self.locals]
            return Layout(self.tensors, tuple(frags), tuple(locs))

    def instance_groups(self, n: int, stride: int | None = None) -> tuple[tuple[int, ...], ...]:
        """The ranks of ``self.instances(n, stride)`` that hold the same boxes: per rank ``r`` of this layout,
        ``(r, r + stride, ..., r + (n-1) * stride)`` (the same position in every copy), in rank order. What
        ``plan_reshard(..., relay_groups=...)`` takes to spread the sends over the copies."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"Layout.instance_groups: n={n!r} must be an int >= 1")
        step = self.instance_stride(stride)
        return tuple(tuple(r + i * step for i in range(n)) for r in self.ranks)

    # -- queries ------------------------------------------------------------------------------------

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({s.rank for s in self.locals}))

    @cached_property
    def specs(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def quantized(self) -> dict[str, TensorSpec]:
        """The block-quantized tensors (name -> TensorSpec with ``quant``); empty for a plain layout."""
        return {t.name: t for t in self.tensors if t.quant is not None}

    @cached_property
    def scale_of(self) -> dict[str, str]:
        """Scale tensor name -> the quantized tensor it belongs to."""
        return {t.quant.scale: t.name for t in self.quantized.values()}

    @cached_property
    def _locals_by_rank(self) -> dict[int, dict[str, LocalSpec]]:
        out: dict[int, dict[str, LocalSpec]] = defaultdict(dict)
        for s in self.locals:
            out[s.rank][s.name] = s
        return dict(out)

    @cached_property
    def fragments_by_tensor(self) -> dict[str, tuple[Fragment, ...]]:
        frags = self.fragments
        names = list(map(_TENSOR, frags))  # sorted: fragments are sorted by tensor first
        out = {}
        for t in self.tensors:  # sorted by name, like the fragments
            lo = bisect_left(names, t.name)
            hi = bisect_right(names, t.name, lo)
            if hi > lo:
                out[t.name] = frags[lo:hi]
        return out

    @cached_property
    def fragments_by_local(self) -> dict[tuple[str, int, str], tuple[Fragment, ...]]:
        """``(tensor, rank, local) -> fragments``, in layout order."""
        frags = self.fragments
        with gc_paused():
            keys = list(map(_TENSOR_RANK_LOCAL, frags))
            out = dict(zip(keys, zip(frags), strict=True))  # one fragment per key: the common case
            if len(out) < len(frags):  # some local tensors hold several boxes of one tensor
                out = {}
                for k, f in zip(keys, frags, strict=True):
                    g = out.get(k)
                    out[k] = (f,) if g is None else g + (f,)
        return out

    @cached_property
    def _hash(self) -> int:
        # cheap (equal layouts have equal tensors, counts and ranks); == compares the contents
        return hash((self._key[0], len(self.fragments), len(self.locals), self.ranks))

    def local_specs(self, rank: int) -> dict[str, LocalSpec]:
        """The local tensors ``rank`` holds (name -> LocalSpec); empty if the rank has no part."""
        return dict(self._locals_by_rank.get(rank, {}))

    def local_spec(self, rank: int, name: str) -> LocalSpec | None:
        """Rank ``rank``'s local tensor ``name``, None if it has none of that name (one lookup: what the schedule
        asks of a peer's local tensor, without copying the peer's whole ``local_specs``)."""
        return self._locals_by_rank.get(rank, {}).get(name)

    @property
    def objects_built(self) -> bool:
        """Whether every fragment exists as an object (an eager layout: always; a columnar one: once read)."""
        return True

    def release_objects(self) -> None:
        """Forget the objects built from columns (``fragments``, ``locals`` and the maps over them), to be built
        again when next read: what a whole plan does with the objects it built to route (~0.6 GB at 1,024
        ranks). An eager layout's objects are its data: nothing to release."""

    def same_tensors(self, other: Layout) -> bool:
        """Whether ``other`` is known, without comparing, to hold the same logical tensors (names, shapes, dtypes)
        as this layout: True when both read one set of specs (a preset's source and destination layouts of one
        model share it); False means "not known", not "different"."""
        return self.tensors is other.tensors

    def local_shape_columns(self, ranks: np.ndarray, names: Sequence[str], codes: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, tuple[torch.dtype, ...]]:
        """Row ``i``: rank ``ranks[i]``'s local tensor ``names[codes[i]]``, as columns: ``(shapes, dtype codes,
        dtypes)``: ``shapes`` ``[m, S]`` int64, each shape right-aligned and padded with 1 on the left (S: the
        longest); ``dtype codes`` ``[m]`` int16 into ``dtypes``, -1 where the rank has no such local tensor (its
        shape row is all 1). What the schedule asks of many transfers' local tensors at once (contiguity)."""
        m = len(ranks)
        keys = np.stack([np.asarray(ranks, np.int64), np.asarray(codes, np.int64)], 1) if m else np.zeros((0, 2), np.int64)
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        specs = [self.local_spec(r, names[c]) for r, c in uniq.tolist()]
        dts: dict = {}
        dcode = np.array([-1 if s is None else dts.setdefault(s.dtype, len(dts)) for s in specs] or [0], np.int16)
        width = max((len(s.shape) for s in specs if s is not None), default=0)
        shp = np.ones((len(specs), width), np.int64)
        for i, s in enumerate(specs):
            if s is not None and s.shape:
                shp[i, width - len(s.shape):] = s.shape
        inv = inv.reshape(-1)
        return shp[inv], dcode[inv] if m else np.zeros(0, np.int16), tuple(dts)

    @cached_property
    def memo(self) -> dict:
        """Values derived from this (immutable) layout by its readers, keyed by the reader (the planner keeps the
        tensor order its salts use here): built once per layout, gone with it."""
        return {}

    def local_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the local tensors ``rank`` holds."""
        return {n: s.shape for n, s in self.local_specs(rank).items()}

    # -- per-tensor / per-rank queries (what a rank planner asks; see FragmentTable) -----------------------

    def spec(self, name: str) -> TensorSpec:
        """The logical tensor ``name`` (``ValueError`` if the layout has none of that name)."""
        s = self.specs.get(name)
        if s is None:
            raise ValueError(f"unknown tensor {name!r}")
        return s

    @cached_property
    def _fragments_by_rank(self) -> dict[int, tuple[Fragment, ...]]:
        out: dict[int, list[Fragment]] = defaultdict(list)
        for f in self.fragments:
            out[f.rank].append(f)
        return {r: tuple(v) for r, v in out.items()}

    def fragments_on_rank(self, rank: int) -> tuple[Fragment, ...]:
        """All fragments on ``rank``, in layout order."""
        return self._fragments_by_rank.get(rank, ())

    def tensor_names_on_rank(self, rank: int) -> tuple[str, ...]:
        """The logical tensors with a non-empty fragment on ``rank``, sorted by name."""
        return tuple(dict.fromkeys(f.tensor for f in self.fragments_on_rank(rank) if 0 not in f.sizes))

    # -- the queries the planner uses (both storages answer them; see ``plan/index.py``) ------------------

    lazy_tables = False  # True: ``table(name)`` builds rows on demand, cheaper than ``fragments_by_tensor``

    def tensor_order(self) -> dict[str, int]:
        """Tensor name -> its index among the layout's tensors (sorted by name)."""
        return {t.name: i for i, t in enumerate(self.tensors)}

    def shapes_and_dtypes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Tensor name -> (global shape, dtype)."""
        return {t.name: (t.shape, t.dtype) for t in self.tensors}

    TABLE_CACHE = 512  # tables kept per layout (least recently used dropped): a 1,024-rank table is ~50 KB

    def table(self, name: str) -> FragmentTable:
        """The fragments of tensor ``name`` as a :class:`FragmentTable` (built on first use; the last
        ``TABLE_CACHE`` used are kept: rebuilding one costs ~0.1 ms, keeping all of a 46,000-tensor model's
        at 1,024 ranks would cost GBs)."""
        cache = self.__dict__.get("_tables")
        if cache is None:
            cache = self.__dict__["_tables"] = OrderedDict()
        t = cache.get(name)
        if t is None:
            t = cache[name] = self._build_table(name)
            if len(cache) > self.TABLE_CACHE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(name)
        return t

    def _build_table(self, name: str) -> FragmentTable:
        return FragmentTable.from_fragments(self.spec(name), self.fragments_by_tensor.get(name, ()))

    def tensor_rows(self, names: Sequence[str]) -> TensorRows:
        """The fragments of the tensors ``names`` (each a tensor of this layout) as one set of numpy columns,
        grouped by tensor in that order (see :class:`TensorRows`)."""
        by = self.fragments_by_tensor
        return TensorRows.from_fragments([(n, len(self.spec(n).shape), by.get(n, ())) for n in names])

    def overlapping(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """Rows of ``table(name)`` whose box shares an element with ``offsets``+``sizes`` (ascending)."""
        return self.table(name).overlapping(offsets, sizes)

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
        for f in self.fragments:
            if f.rank != rank or not f.numel:
                continue
            src = global_tensors[f.tensor][box_slices(f.offsets, f.sizes)]
            loff, lsz = f.local_box(f.offsets, f.sizes)
            view = out[f.local][box_slices(loff, lsz)]
            view.copy_(src.reshape(lsz))
        return out

    def nbytes(self, rank: int | None = None) -> int:
        """Bytes of the local tensors of ``rank`` (or of every rank)."""
        return sum(
            math.prod(s.shape) * itemsize_of(s.dtype)
            for s in self.locals
            if rank is None or s.rank == rank
        )

    def restrict(self, names: Iterable[str]) -> Layout:
        """The same layout limited to some logical tensors (local tensors holding none of them are dropped; a
        quantized tensor keeps its scale tensor)."""
        keep = set(names)
        keep |= {self.specs[n].quant.scale for n in keep if n in self.specs and self.specs[n].quant is not None}
        frags = tuple(f for f in self.fragments if f.tensor in keep)
        used = {(f.rank, f.local) for f in frags}
        locs = tuple(
            s for s in self.locals if (s.rank, s.name) in used or (s.name in keep and (s.rank, s.name) not in used)
        )
        return Layout(tuple(t for t in self.tensors if t.name in keep), frags, locs)
