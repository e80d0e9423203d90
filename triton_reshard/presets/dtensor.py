"""Layouts from live DTensors (FSDP2, torch TP, or both).

``layout_from_dtensors({name: dtensor})`` reads each DTensor's mesh (global ranks, ``mesh.mesh``), its
placements and its global shape and dtype. The local tensor of ``name`` on each rank is ``name`` (pass
``{n: p.to_local() for n, p in model.named_parameters()}`` as refit's tensors). ``Shard``/``Replicate``
are exact for any sizes (``torch.chunk`` pieces, mesh dims nesting left to right, as DTensor does);
``_StridedShard`` (what FSDP2 puts on a TP-sharded dim: shard over TP first, then over DP) is supported when
the dim divides evenly over all the mesh dims sharding it. ``Partial`` raises TypeError: a partial sum is
not a box of the tensor (reduce it first).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..layout import Fragment, Layout, LocalSpec, Replicate, Shard, TensorSpec, nested_box


def _placements(name: str, dt) -> list[tuple[str, int, int]]:
    """``(kind, dim, split_factor)`` per mesh dim; kind in {'R', 'S', 'SS'}."""
    from torch.distributed.tensor import placement_types as pt

    out = []
    ndim = len(dt.shape)
    for p in dt.placements:
        strided = getattr(pt, "_StridedShard", None)
        if strided is not None and isinstance(p, strided):
            out.append(("SS", p.dim % ndim, int(p.split_factor)))
        elif isinstance(p, pt.Shard):
            out.append(("S", p.dim % ndim, 1))
        elif isinstance(p, pt.Replicate):
            out.append(("R", 0, 1))
        elif isinstance(p, pt.Partial):
            raise TypeError(
                f"DTensor {name!r} has a Partial placement ({p!r}): its local tensors are partial sums, not boxes "
                f"of the tensor; redistribute it to Replicate/Shard first"
            )
        else:
            raise TypeError(f"DTensor {name!r}: unsupported placement {p!r}")
    return out


def _application_order(name: str, pl, mesh_shape, shape) -> list[int] | None:
    """Mesh dims in the order they split the tensor, or None for plain left-to-right nesting."""
    if not any(k == "SS" for k, _, _ in pl):
        return None
    order: list[int] = []
    for d in sorted({dim for k, dim, _ in pl if k in ("S", "SS")}):
        mdims = [m for m, (k, dim, _) in enumerate(pl) if k in ("S", "SS") and dim == d]
        strided = [m for m in mdims if pl[m][0] == "SS"]
        parts = 1
        for m in mdims:
            parts *= mesh_shape[m]
        if shape[d] % parts:
            raise NotImplementedError(
                f"DTensor {name!r}: _StridedShard on dim {d} of size {shape[d]} that does not divide over "
                f"{parts} shards"
            )
        if not strided:
            order += mdims
            continue
        if len(strided) != 1 or strided[0] != mdims[0]:
            raise NotImplementedError(f"DTensor {name!r}: unsupported _StridedShard pattern {pl}")
        later = mdims[1:]
        sf = 1
        for m in later:
            sf *= mesh_shape[m]
        if pl[strided[0]][2] != sf:
            raise NotImplementedError(
                f"DTensor {name!r}: _StridedShard split_factor {pl[strided[0]][2]} != {sf} (the shards after it)"
            )
        order += later + strided  # right-to-left: the later shards first, then the strided one
    return order


def layout_from_dtensors(named_dtensors: Mapping[str, object]) -> Layout:
    """The layout of a dict of DTensors (each may live on its own mesh). Local names = the given names."""
    from torch.distributed.tensor import DTensor

    specs, frags, locs = [], [], []
    for name, dt in named_dtensors.items():
        if not isinstance(dt, DTensor):
            raise TypeError(f"{name!r} is a {type(dt).__name__}, not a DTensor")
        mesh = dt.device_mesh.mesh
        mesh = mesh if isinstance(mesh, torch.Tensor) else torch.as_tensor(mesh)
        mesh_shape = tuple(mesh.shape)
        shape = tuple(dt.shape)
        pl = _placements(name, dt)
        order = _application_order(name, pl, mesh_shape, shape)
        if order is None:  # plain Shard/Replicate: exactly Layout.from_placements
            places = [Shard(d) if k == "S" else Replicate() for k, d, _ in pl]
            sub = Layout.from_placements({name: shape}, mesh.tolist(), {name: places}, dtype=dt.dtype)
            specs += sub.tensors
            frags += sub.fragments
            locs += sub.locals
            continue
        specs.append(TensorSpec(name, shape, dt.dtype))
        coords = torch.stack(torch.meshgrid(*[torch.arange(n) for n in mesh_shape], indexing="ij"), -1)
        for rank, coord in zip(mesh.flatten().tolist(), coords.reshape(-1, len(mesh_shape)).tolist(), strict=True):
            off, size = nested_box(shape, mesh_shape, coord, [(m, pl[m][1]) for m in order])
            locs.append(LocalSpec(rank, name, size, dt.dtype))
            if all(size):
                frags.append(Fragment(name, rank, off, size))
    return Layout(tuple(specs), tuple(frags), tuple(locs))
