"""Layouts read off a framework's own weight loader, with no weight data.

A framework's loader (vLLM's ``model.load_weights``, say) knows exactly which slice of which checkpoint tensor
goes into which parameter: the fused QKV order, the replicated KV heads, the vocab padding, the expert
placement, its version's parameter names. :func:`record_load` runs that loader once on *id tensors* instead
of weights (every element of checkpoint tensor ``k`` holds the integer ``TAG + k << 40 + flat index``), under
a ``TorchDispatchMode`` that intercepts every write into the model's parameters: nothing is written, and each
``copy_`` is turned back into a box: which box of which checkpoint tensor lands where in which parameter.
Only axis-aligned box copies in order are accepted; anything else (a transpose, a broadcast, values computed
from the checkpoint, an indexed write) is reported by parameter name and never guessed. Fills (e.g. zeroing
vocab padding) are not transfers and are only counted.

The records of all ranks make one :class:`~triton_reshard.layout.Layout` (:func:`layout_from_records`).
Memory: one checkpoint tensor of int64 ids at a time (the loader consumes an iterator); the parameters are
only read for their addresses, shapes and dtypes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..layout import Fragment, Layout, LocalSpec, TensorSpec

TAG = 1 << 62  # every id is >= TAG: a value below it was not copied from the checkpoint
ID_BITS = 40  # flat index bits per checkpoint tensor (tensors of up to 2^40 elements)
_MASK = (1 << ID_BITS) - 1


@dataclass(frozen=True)
class RecordedCopy:
    """One ``copy_`` the loader made into a parameter, as a box (``fragment``) or a reason it is not one."""

    param: str
    fragment: Fragment | None
    problem: str = ""


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

    def raise_on_problems(self) -> None:
        if self.problems:
            shown = "; ".join(self.problems[:8])
            more = f" (and {len(self.problems) - 8} more)" if len(self.problems) > 8 else ""
            raise ValueError(
                f"rank {self.rank}: the loader wrote parameters in ways that are not box copies of checkpoint "
                f"tensors, so no layout is derived: {shown}{more}"
            )


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


def _id_tensor(index: int, shape: Sequence[int]) -> torch.Tensor:
    n = math.prod(shape)
    if n > _MASK:
        raise ValueError(f"checkpoint tensor of shape {tuple(shape)} has more than 2^{ID_BITS} elements")
    return (torch.arange(n, dtype=torch.int64) + (TAG + (index << ID_BITS))).view(tuple(shape))


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return out[::-1]


def _param_box(view: torch.Tensor, param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of ``param`` that ``view`` is (size-1 dims dropped allowed), or None if it is not one."""
    shape = tuple(param.shape)
    strides = _contiguous_strides(shape)
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


def _ckpt_box(ids: torch.Tensor, shapes: list[tuple[int, ...]]):
    """``(checkpoint index, offsets, sizes)`` if ``ids`` (in view order) is a box of one checkpoint tensor in
    order, else a string saying why not."""
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64:
        return f"copies {flat.dtype} values computed from the checkpoint (arithmetic or a cast), not a slice of it"
    lo, hi = int(flat.min()), int(flat.max())
    if lo < TAG:
        return "copies values that are not checkpoint elements (arithmetic on the weights)"
    index = (lo - TAG) >> ID_BITS
    if (hi - TAG) >> ID_BITS != index:
        return "copies elements of several checkpoint tensors at once (a concatenation into a temporary)"
    shape = shapes[index]
    strides = _contiguous_strides(shape)
    a, b = (lo - TAG) & _MASK, (hi - TAG) & _MASK
    start = [(a // s) % max(n, 1) for s, n in zip(strides, shape, strict=True)]
    end = [(b // s) % max(n, 1) for s, n in zip(strides, shape, strict=True)]
    sizes = [e - s + 1 for s, e in zip(start, end, strict=True)]
    if min(sizes, default=1) < 1 or math.prod(sizes) != flat.numel():
        return "copies checkpoint elements that do not form one box (a gather, broadcast or reordering)"
    expect = torch.zeros((), dtype=torch.int64) + (lo - a)
    for d, (s, n) in enumerate(zip(start, sizes, strict=True)):
        idx = (torch.arange(s, s + n, dtype=torch.int64) * strides[d]).view((n,) + (1,) * (len(sizes) - d - 1))
        expect = expect + idx
    if not torch.equal(expect.reshape(-1), flat):
        return "copies a box of a checkpoint tensor out of order (a transpose or permutation)"
    return index, tuple(start), tuple(sizes)


class _Recorder(TorchDispatchMode):
    def __init__(self, params: Mapping[str, torch.Tensor], names: list[str], shapes: list[tuple[int, ...]],
                 rank: int, record: LoadRecord):
        super().__init__()
        self.by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for n, p in params.items():
            if p.device.type != "meta":
                self.by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((n, p))
        self.names, self.shapes, self.rank, self.record = names, shapes, rank, record

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
        if func.overloadpacket is torch.ops.aten._to_copy and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            if x.dtype == torch.int64 and "dtype" in kwargs and x.numel() and int(x.min()) >= TAG:
                kwargs = {**kwargs, "dtype": torch.int64}  # a cast of ids keeps the ids (the loader's .to())
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
        got = _ckpt_box(src, self.shapes)
        if isinstance(got, str):
            self.record.problems.append(f"{name}: {got}")
            return
        index, offsets, sizes = got
        p_off, p_sizes = pbox
        extra = len(p_sizes) - len(sizes)
        if extra < 0 or any(s != 1 for s in p_sizes[:extra]) or tuple(p_sizes[extra:]) != tuple(sizes):
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
) -> LoadRecord:
    """Run ``load(weights)`` (e.g. ``model.load_weights``) on id tensors shaped like ``checkpoint`` and record,
    without writing anything, where each checkpoint element lands among ``params`` (``named_parameters()``).

    Returns this rank's :class:`LoadRecord`; a loader write that is not a box copy is listed in
    ``problems`` (call ``raise_on_problems()`` to fail closed).
    """
    names = list(checkpoint)
    shapes = [tuple(int(d) for d in checkpoint[n]) for n in names]
    rec = LoadRecord(rank)
    recorder = _Recorder(params, names, shapes, rank, rec)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for i, n in enumerate(names):
            yield n, _id_tensor(i, shapes[i])

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


def layout_from_records(records: Iterable[LoadRecord]) -> Layout:
    """One :class:`Layout` from the :class:`LoadRecord` of every rank (raises if any rank had problems or
    two ranks disagree on a checkpoint tensor's shape or dtype)."""
    records = list(records)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for r in records:
        r.raise_on_problems()
        for n, (shape, dt) in r.tensors.items():
            prev = specs.setdefault(n, (shape, dt))
            if prev != (shape, dt):
                raise ValueError(f"tensor {n!r}: rank {r.rank} sees {shape} {dt}, another rank {prev}")
    frags = sorted((f for r in records for f in r.fragments),
                   key=lambda f: (f.tensor, f.rank, f.local, f.offsets, f.local_offsets))
    locs = sorted((LocalSpec(r.rank, n, s, d) for r in records for n, (s, d) in r.locals.items()),
                  key=lambda s: (s.rank, s.name))
    return Layout(tuple(TensorSpec(n, s, d) for n, (s, d) in sorted(specs.items())), tuple(frags), tuple(locs))
