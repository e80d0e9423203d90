"""Layouts read off a framework's own weight loader, with no weight data.

A framework's loader (vLLM's ``model.load_weights``, say) knows exactly which slice of which checkpoint tensor
goes into which parameter: the fused QKV order, the replicated KV heads, the vocab padding, the expert
placement, its version's parameter names. :func:`record_load` runs that loader once on **meta** tensors shaped
like the checkpoint (no data at all), under a ``TorchDispatchMode`` that intercepts every write into the
model's parameters: nothing is written, and each ``copy_`` is turned back into a box: the source is a view of
one checkpoint tensor (its storage offset and strides say which box, in which order), the destination a view
of one parameter. Only axis-aligned box copies in order are accepted; anything else (a transposed view, a
broadcast, a tensor computed from the checkpoint: arithmetic, a gather, a concatenation into a temporary;
an indexed write) is reported by parameter name and never guessed. Casts, device moves and clones of a
checkpoint view keep pointing at it (they move data, not which data). Fills (e.g. zeroing vocab padding) are
not transfers and are only counted.

The records of all ranks make one :class:`~triton_reshard.layout.Layout` (:func:`layout_from_records`).
Cost: no weight bytes are read, allocated or moved, whatever the model size (the loader's own Python and
shape logic runs once); the parameters are only read for their addresses, shapes and dtypes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..box import contiguous_strides
from ..comm import wire
from ..layout import BlockQuant, Fragment, Layout, LocalSpec, TensorSpec, dtype_name, scale_shape


@dataclass
class LoadRecord:
    """What one rank's loader did: fragments, the parameters it wrote, and everything it could not explain."""

    rank: int
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # checkpoint name -> (shape, dtype)
    locals: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # written params
    fragments: list[Fragment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "<param>: <what>" for every write that is not a box copy
    uncovered: list[str] = field(default_factory=list)  # parameters the loader never copied into
    unused: list[str] = field(default_factory=list)  # checkpoint tensors that reached no parameter of this rank
    fills: int = 0  # fill_/zero_ calls on parameters (padding), not transfers
    # checkpoint name -> its block quantization (block FP8 weights; set by the framework integration, e.g.
    # integrations.vllm from the model's quantized layers): the scale tensor is a checkpoint tensor of the record
    quant: dict[str, BlockQuant] = field(default_factory=dict)

    def raise_on_problems(self) -> None:
        if self.problems:
            shown = "; ".join(self.problems[:8])
            more = f" (and {len(self.problems) - 8} more)" if len(self.problems) > 8 else ""
            raise ValueError(
                f"rank {self.rank}: the loader wrote parameters in ways that are not box copies of checkpoint "
                f"tensors, so no layout is derived: {shown}{more}"
            )


# The record crosses from each engine worker to the trainer as data only (no pickle): its own wire codec.

def _record_to_data(r: LoadRecord) -> dict:
    return {"rank": r.rank, "tensors": {n: [list(s), dtype_name(d)] for n, (s, d) in r.tensors.items()},
            "locals": {n: [list(s), dtype_name(d)] for n, (s, d) in r.locals.items()},
            "fragments": [wire.encode(f) for f in r.fragments], "problems": list(r.problems),
            "uncovered": list(r.uncovered), "unused": list(r.unused), "fills": r.fills,
            "quant": {n: wire.quant_to_data(q) for n, q in r.quant.items()}}


def _record_from_data(v, path: str) -> LoadRecord:
    keys = {"rank", "tensors", "locals", "fragments", "problems", "uncovered", "unused", "fills", "quant"}
    v = wire.expect_dict(v, path, keys)

    def shapes(m, p):
        if not isinstance(m, dict):
            raise wire.fail(p, "an object", m)
        out = {}
        for n, sd in m.items():
            s, d = wire.expect_list(sd, f"{p}[{n!r}]", 2)
            out[n] = (wire.expect_ints(s, f"{p}[{n!r}][0] (shape)"), wire.dtype_from_name(d, f"{p}[{n!r}][1] (dtype)"))
        return out

    def strs(m, p):
        return [wire.expect_str(x, f"{p}[{i}]") for i, x in enumerate(wire.expect_list(m, p))]

    frags = [wire.decode(f, f"{path}.fragments[{i}]") for i, f in enumerate(wire.expect_list(v["fragments"], f"{path}.fragments"))]
    for i, f in enumerate(frags):
        if not isinstance(f, Fragment):
            raise wire.fail(f"{path}.fragments[{i}]", "a Fragment", f)
    if not isinstance(v["quant"], dict):
        raise wire.fail(f"{path}.quant", "an object", v["quant"])
    return LoadRecord(rank=wire.expect_int(v["rank"], f"{path}.rank"), tensors=shapes(v["tensors"], f"{path}.tensors"),
                      locals=shapes(v["locals"], f"{path}.locals"), fragments=frags,
                      problems=strs(v["problems"], f"{path}.problems"),
                      uncovered=strs(v["uncovered"], f"{path}.uncovered"), unused=strs(v["unused"], f"{path}.unused"),
                      fills=wire.expect_int(v["fills"], f"{path}.fills"),
                      quant={n: wire.quant_from_data(q, f"{path}.quant[{n!r}]") for n, q in v["quant"].items()})


wire.register_codec("LoadRecord", LoadRecord, _record_to_data, _record_from_data)


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a safetensors checkpoint (a ``.safetensors`` file or a directory of them), read
    from the file headers only (no tensor data)."""
    import glob
    import os

    from safetensors import safe_open

    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files at {path!r}")
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                out[k] = tuple(h.get_slice(k).get_shape())
    return out


def _param_box(view: torch.Tensor, param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of ``param`` that ``view`` is (size-1 dims dropped allowed), or None if it is not one."""
    shape = tuple(param.shape)
    strides = contiguous_strides(shape)
    rem = view.storage_offset() - param.storage_offset()
    if rem < 0:
        return None
    start = []
    for s in strides:
        i, rem = divmod(rem, s)
        start.append(i)
    if rem:
        return None
    sizes = [1] * len(shape)
    k = 0
    for n, st in zip(view.shape, view.stride(), strict=True):
        if n == 1:
            continue
        while k < len(shape) and not (strides[k] == st and shape[k] >= n):
            k += 1
        if k == len(shape):
            return None
        sizes[k] = n
        k += 1
    if any(o + n > d for o, n, d in zip(start, sizes, shape, strict=True)):
        return None
    return tuple(start), tuple(sizes)


# ops that move or cast data without choosing it: on a checkpoint view they return a view of the same box
_KEEPS_VIEW = {torch.ops.aten._to_copy, torch.ops.aten.clone, torch.ops.aten.to, torch.ops.aten.alias,
               torch.ops.aten.lift_fresh, torch.ops.aten.detach}


class _Recorder(TorchDispatchMode):
    def __init__(self, params: Mapping[str, torch.Tensor], names: list[str], rank: int, record: LoadRecord):
        super().__init__()
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for n, p in params.items():
            if p.device.type != "meta":
                self.by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((n, p))
        self.names, self.rank, self.record = names, rank, record
        # meta storage -> (checkpoint index, the root tensor); roots are kept alive for the whole load, so a
        # storage identity is never reused while we look it up
        self.roots: dict[int, tuple[int, torch.Tensor]] = {}

    def root(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        self.roots[t.untyped_storage()._cdata] = (index, t)
        return t

    def _root_of(self, t) -> tuple[int, torch.Tensor] | None:
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            return self.roots.get(t.untyped_storage()._cdata)
        return None

    def _param_of(self, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        cands = self.by_storage.get(t.untyped_storage().data_ptr())
        if not cands:
            return None
        for n, p in cands:  # parameters sharing a storage (views): the one containing the view
            if _param_box(t, p) is not None:
                return n, p
        return cands[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                hit = self._param_of(v)
                if hit is not None:
                    written.append(hit)
        if written:
            name, param = written[0]
            base = func.overloadpacket.__name__
            if base == "copy_":
                self._copy(name, param, args[0], args[1])
            elif base in ("fill_", "zero_"):
                self.record.fills += 1
            else:
                self.record.problems.append(f"{name}: written by aten.{base}, not a box copy")
            return args[0]  # nothing is ever written into a parameter
        if func.overloadpacket in _KEEPS_VIEW and args and self._root_of(args[0]) is not None:
            # a cast, device move or clone of a checkpoint view moves data, not which data: keep the view
            return torch.ops.aten.alias.default(args[0])
        return func(*args, **kwargs)

    def _copy(self, name: str, param: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() == 0:
            return
        if not param.is_contiguous():
            self.record.problems.append(f"{name}: parameter is not contiguous")
            return
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
            self.record.problems.append(f"{name}: broadcast copy of shape {tuple(getattr(src, 'shape', ()))} into "
                                        f"{tuple(dst.shape)}")
            return
        pbox = _param_box(dst, param)
        if pbox is None:
            self.record.problems.append(f"{name}: written through a view that is not a box of it (transposed?)")
            return
        got = self._root_of(src)
        if got is None:
            self.record.problems.append(
                f"{name}: copies a tensor computed from the checkpoint (arithmetic, a gather, a concatenation into "
                f"a temporary) or not from it at all, not a view of a checkpoint tensor")
            return
        index, root = got
        box = _param_box(src, root)
        if box is None:
            self.record.problems.append(
                f"{name}: copies a view of checkpoint tensor {self.names[index]!r} that is not one box in order "
                f"(a transpose or another reordering view)")
            return
        offsets, sizes = box
        p_off, p_sizes = pbox
        extra = len(p_sizes) - len(sizes)
        if extra < 0 or any(n != 1 for n in p_sizes[:extra]) or tuple(p_sizes[extra:]) != tuple(sizes):
            self.record.problems.append(
                f"{name}: box {sizes} of checkpoint tensor {self.names[index]!r} lands in a box {p_sizes} of "
                f"another shape")
            return
        self.record.fragments.append(Fragment(self.names[index], self.rank, offsets, sizes, name, p_off))
        self.record.locals[name] = (tuple(param.shape), param.dtype)


def record_load(
    params: Mapping[str, torch.Tensor],
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
    checkpoint: Mapping[str, Sequence[int]],
    rank: int,
    dtype: torch.dtype | None = None,
) -> LoadRecord:
    """Run ``load(weights)`` (e.g. ``model.load_weights``) on meta tensors shaped like ``checkpoint`` and
    record, without reading or writing any data, where each checkpoint element lands among ``params``
    (``named_parameters()``). ``dtype``: the meta tensors' dtype (default: the parameters' most common one, so
    the loader takes its plain path).

    Returns this rank's :class:`LoadRecord`; a loader write that is not a box copy is listed in
    ``problems`` (call ``raise_on_problems()`` to fail closed).
    """
    names = list(checkpoint)
    shapes = [tuple(int(d) for d in checkpoint[n]) for n in names]
    if dtype is None:
        counts = collections.Counter(p.dtype for p in params.values())
        dtype = counts.most_common(1)[0][0] if counts else torch.float32
    rec = LoadRecord(rank)
    recorder = _Recorder(params, names, rank, rec)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for i, n in enumerate(names):
            yield n, recorder.root(i, shapes[i], dtype)

    with torch.no_grad(), recorder:
        load(weights())
    used = {f.tensor for f in rec.fragments}
    dtypes: dict[str, torch.dtype] = {}
    for f in rec.fragments:
        dtypes.setdefault(f.tensor, rec.locals[f.local][1])
    rec.tensors = {n: (shapes[i], dtypes[n]) for i, n in enumerate(names) if n in used}
    rec.unused = [n for n in names if n not in used]
    rec.uncovered = sorted(n for n in params if n not in rec.locals)
    return rec


def record_block_quant(params: Mapping[str, torch.Tensor], load: Callable, checkpoint: Mapping[str, Sequence[int]],
                       rank: int, blocks: Mapping[str, tuple[int, ...]], suffix: str, ue8m0: bool) -> LoadRecord:
    """:func:`record_load` of a loader that holds some parameters block-quantized: ``blocks`` ``{parameter:
    block size}``, each with its scales in the parameter of the same name + ``suffix``. A checkpoint tensor
    ``X`` the loader copies into such a parameter is block-quantized (``ue8m0``: power-of-two scales), its scales
    ``X + suffix``, which must land in that parameter's scales (else a problem is reported). A checkpoint without
    the scales (a BF16 trainer's) is recorded once more with the scale tensors the loader expects,
    ``ceil(shape / block)``, each right after its weight."""
    rec = record_load(params, load, checkpoint, rank)
    if not blocks:
        return rec
    missing = {f.tensor + suffix: scale_shape(tuple(checkpoint[f.tensor]), blocks[f.local]) for f in rec.fragments
               if f.local in blocks and f.tensor + suffix not in checkpoint}
    if missing:
        with_scales: dict[str, Sequence[int]] = {}
        for n, shp in checkpoint.items():
            with_scales[n] = shp
            if n + suffix in missing:
                with_scales[n + suffix] = missing[n + suffix]
        rec = record_load(params, load, with_scales, rank)
    scale_locals = {(f.tensor, f.local) for f in rec.fragments}
    for f in rec.fragments:
        if f.local not in blocks or f.tensor in rec.quant:
            continue
        if (f.tensor + suffix, f.local + suffix) not in scale_locals:
            rec.problems.append(f"{f.local}: block-FP8 parameter loaded from {f.tensor!r}, but the loader put no "
                                f"{f.tensor + suffix!r} into {f.local + suffix!r}")
            continue
        rec.quant[f.tensor] = BlockQuant(blocks[f.local], f.tensor + suffix, ue8m0)
    return rec


def staging_record(rec: LoadRecord) -> LoadRecord:
    """A rank's record in the checkpoint's coordinates (an engine's staging, fed to its loader): each checkpoint
    tensor it loads from becomes one local staging tensor of the checkpoint's full shape, named like it,
    holding exactly the boxes the loader reads (same offsets); the boxes two parameters read (a tied embedding)
    are received once."""
    out = LoadRecord(rec.rank, tensors=dict(rec.tensors), quant=dict(rec.quant), fills=rec.fills)
    seen = set()
    for f in rec.fragments:
        key = (f.tensor, tuple(f.offsets), tuple(f.sizes))
        if key not in seen:
            seen.add(key)
            out.fragments.append(Fragment(f.tensor, f.rank, key[1], key[2], f.tensor, key[1]))
            out.locals[f.tensor] = rec.tensors[f.tensor]
    return out


def layout_from_records(records: Iterable[LoadRecord]) -> Layout:
    """One :class:`Layout` from the :class:`LoadRecord` of every rank (raises if any rank had problems or
    two ranks disagree on a checkpoint tensor's shape, dtype or block quantization). Block-quantized
    tensors (``LoadRecord.quant``) get their :class:`~triton_reshard.layout.BlockQuant`; the Layout then checks
    that every rank's recorded scale boxes are the blocks of its weight boxes."""
    records = list(records)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    quant: dict[str, BlockQuant] = {}
    for r in records:
        r.raise_on_problems()
        for n, (shape, dt) in r.tensors.items():
            prev = specs.setdefault(n, (shape, dt))
            if prev != (shape, dt):
                raise ValueError(f"tensor {n!r}: rank {r.rank} sees {shape} {dt}, another rank {prev}")
        for n, q in r.quant.items():
            prev = quant.setdefault(n, q)
            if prev != q:
                raise ValueError(f"tensor {n!r}: rank {r.rank} holds it quantized as {q}, another rank as {prev}")
    frags = sorted((f for r in records for f in r.fragments),
                   key=lambda f: (f.tensor, f.rank, f.local, f.offsets, f.local_offsets))
    locs = sorted((LocalSpec(r.rank, n, s, d) for r in records for n, (s, d) in r.locals.items()),
                  key=lambda s: (s.rank, s.name))
    missing = sorted(n for n in quant if n not in specs)
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is marked block-quantized but no rank recorded it")
    return Layout(tuple(TensorSpec(n, s, d, quant.get(n)) for n, (s, d) in sorted(specs.items())), tuple(frags),
                  tuple(locs))


def layout_from_model(record: Callable[[object, Mapping[str, Sequence[int]], int], LoadRecord], model,
                      checkpoint: str | Mapping[str, Sequence[int]], group=None, rank: int | None = None) -> Layout:
    """The destination layout of an engine's deployment, read off every rank's live ``model`` by the engine's
    ``record(model, {name: shape}, rank)`` (``checkpoint``: a safetensors directory or ``{name: shape}``). Call on
    every rank of ``group`` (a ``torch.distributed`` group, default the world; ranks with no model pass ``None``):
    the records are all-gathered (data only: nothing a peer sends is unpickled), so every rank returns the same
    Layout; raises on every rank, naming the parameter and rank, if a loader write is not a box copy of a
    checkpoint tensor (fail closed)."""
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    shapes = checkpoint_shapes(checkpoint) if isinstance(checkpoint, str) else checkpoint
    rec = None if model is None else record(model, shapes, rank)
    recs = wire.all_gather_data(rec, group, "load record")
    return layout_from_records(r for r in recs if r is not None)
