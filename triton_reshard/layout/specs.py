"""The values a layout is made of: placements, dtype helpers, block quantization, tensor and local
specs, fragments (validated one by one), and the fast constructors the columnar storage uses."""

from __future__ import annotations

import difflib
import gc
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from operator import add, attrgetter, sub

import torch

from .formats import FP8_BLOCK, QuantFormat, quant_format

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


# --------------------------------------------------------------------------------------------------------
# Placements (torch DTensor's meaning)
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dim ``dim`` over one mesh dim, ``torch.chunk`` style (uneven, trailing shards may be empty)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank along the mesh dim holds the full extent."""

    def __repr__(self) -> str:
        return "Replicate()"


Placement = Shard | Replicate


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``index`` when ``torch.chunk`` splits ``length`` into ``parts``.

    torch.chunk uses pieces of ``ceil(length / parts)``; the trailing pieces may be smaller or empty (DTensor
    pads the missing ones with empty shards, so every index is valid).
    """
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    step = -(-length // parts) if length else 0
    start = min(index * step, length)
    return start, max(0, min(step, length - start))


def nested_box(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], shards: Sequence[tuple[int, int]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the shard at mesh coordinate ``coord``: ``shards`` lists ``(mesh_dim, tensor_dim)``
    in the order they apply, each chunking (``torch.chunk`` style) what the previous ones left."""
    off, size = [0] * len(shape), list(shape)
    for m, d in shards:
        o, n = chunk_range(size[d], mesh_shape[m], coord[m])
        off[d] += o
        size[d] = n
    return tuple(off), tuple(size)


# --------------------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------------------


_INT_TYPES = frozenset((int,))  # ``type(x) is int`` for every entry: the fast path of the value types
_ITEMSIZE: dict[torch.dtype, int] = {}
_DTYPE_NAME: dict[torch.dtype, str] = {}


def itemsize_of(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: called once per fragment and transfer)."""
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def dtype_name(dtype: torch.dtype) -> str:
    n = _DTYPE_NAME.get(dtype)
    if n is None:
        n = _DTYPE_NAME[dtype] = str(dtype).removeprefix("torch.")
    return n


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restoring its state after).

    Building a 128-rank layout or plan allocates ~10^6 small objects and no cycles; with the collector on,
    its repeated passes over the growing heap cost ~40% of the time.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_int_tuple(t: object) -> bool:
    return type(t) is tuple and _INT_TYPES.issuperset(map(type, t))


def check_names(what: str, given: Iterable, known: Iterable[str]) -> None:
    """Raise if ``given`` (the keys of a per-tensor dict such as ``placements`` or ``dtype``) names a tensor
    that is not one of ``known``: almost always a typo, which would otherwise be ignored silently."""
    known = known if isinstance(known, (set, frozenset, Mapping)) else set(known)
    bad = [k for k in given if k not in known]
    if bad:
        k = min(bad, key=repr)
        near = difflib.get_close_matches(str(k), [str(n) for n in known], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        rest = sorted(repr(b) for b in bad if b != k)
        more = f" (and {len(rest)} more: {', '.join(rest[:4])})" if rest else ""
        raise ValueError(f"{what}: {k!r} is not a tensor of the layout{hint}{more}")


def _as_dtype(dtype: object, what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TypeError(f"{what}: expected a torch.dtype, got {dtype!r}")


# bytes: no device addresses more (x86-64 and CUDA virtual addresses are 48-49 bits); a larger tensor is a
# mistake, and planning or scheduling one would not finish
MAX_TENSOR_BYTES = 1 << 48


def check_bytes(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    n = math.prod(shape)
    if n > MAX_TENSOR_BYTES or n * itemsize_of(dtype) > MAX_TENSOR_BYTES:
        raise ValueError(f"{what}: shape {shape} of {dtype_name(dtype)} is {n} elements, more than "
                         f"{MAX_TENSOR_BYTES} bytes (2**48), beyond what any device can address")


def _as_index(v: object, what: str) -> int:
    """An int (or integer-like: numpy, torch scalars) for field ``what``; floats, strings, None and bools raise."""
    if type(v) is int:
        return v
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{what}: expected an int, got {v!r}")


def _as_ints(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list, torch.Size)):
        raise TypeError(f"{what}: expected a tuple of ints, got {v!r}")
    return tuple(_as_index(x, what) for x in v)


def as_shape(shape: object, what: str) -> tuple[int, ...]:
    if _is_int_tuple(shape) and min(shape, default=0) >= 0:  # fast path: already a tuple of ints >= 0
        return shape
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in shape
    ):
        raise TypeError(f"{what}: expected a tuple of ints, got {shape!r}")
    if any(s < 0 for s in shape):
        raise ValueError(f"{what}: negative size in {tuple(shape)}")
    return tuple(shape)


# the dtype of a block-FP8 tensor's values (vLLM / DeepSeek block FP8) and of its scales
QUANT_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class BlockQuant:
    """Block quantization of a logical tensor (block FP8, MXFP8, NVFP4: ``format``, a :class:`QuantFormat`).

    The tensor's values are ``format.value_dtype``; each block of ``block`` stored elements (one extent per
    logical dim, blocks laid from index 0; the last block along a dim may be partial) has one scale of
    ``format.scale_dtype`` (block FP8: the float32 dequantization multiplier, vLLM's ``weight_scale_inv``:
    ``x ~= q * scale``). The scales are a logical tensor of their own, named ``scale``, of shape
    ``ceil(shape / block)`` per dim, laid out like the weight: the rank holding a (block-aligned) box of the
    weight holds the box of its blocks' scales. ``ue8m0`` (block FP8 only): scales rounded up to powers of two
    (DeepGEMM / SGLang), still stored as float32. A packed format's tensor is in stored elements (NVFP4:
    ``[N, K/2]`` uint8) and so is ``block`` (``(1, 8)``: 16 FP4 values). ``global_scale`` (formats with a
    per-tensor scale): the name of the float32 global-scale tensor (shape ``(1,)``); tensors naming the same
    one share it (the engine's fused tensors) and it is computed from the amax of all of them.

    A shorter ``block`` applies to the trailing dims (leading dims get blocks of 1: ``(128, 128)`` on an
    ``[E, r, c]`` tensor is ``(1, 128, 128)``); ``TensorSpec`` stores it normalized to its number of dims.
    """

    block: tuple[int, ...]
    scale: str
    ue8m0: bool = False
    format: QuantFormat = FP8_BLOCK
    global_scale: str = ""
    global_group: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.block, (tuple, list)) or not self.block or not all(
                type(b) is int and b > 0 for b in self.block):
            raise ValueError(f"BlockQuant: block must be a non-empty tuple of ints > 0, got {self.block!r}")
        object.__setattr__(self, "block", tuple(self.block))
        if not isinstance(self.scale, str) or not self.scale:
            raise TypeError(f"BlockQuant: scale must be the non-empty name of the scale tensor, got {self.scale!r}")
        if not isinstance(self.ue8m0, bool):
            raise TypeError(f"BlockQuant: ue8m0 must be a bool, got {self.ue8m0!r}")
        fmt = quant_format(self.format) if isinstance(self.format, str) else self.format
        if not isinstance(fmt, QuantFormat):
            raise TypeError(f"BlockQuant: format must be a QuantFormat or its name, got {self.format!r}")
        object.__setattr__(self, "format", fmt)
        if self.ue8m0 and fmt.scale_encoding != "fp32":
            raise ValueError(f"BlockQuant: ue8m0 is a block-FP8 scale rule; format {fmt.name!r} has its own")
        if fmt.block is not None:
            want = fmt.block // fmt.pack
            if self.block[-1] != want or any(b != 1 for b in self.block[:-1]):
                raise ValueError(f"BlockQuant: format {fmt.name!r} blocks 1x{fmt.block} along the last dim (stored "
                                 f"block (..., 1, {want})), got {self.block}")
        if not isinstance(self.global_scale, str):
            raise TypeError(f"BlockQuant: global_scale must be a tensor name, got {self.global_scale!r}")
        if not isinstance(self.global_group, str):
            raise TypeError(f"BlockQuant: global_group must be a str, got {self.global_group!r}")
        if self.global_scale and not self.global_group:
            object.__setattr__(self, "global_group", self.global_scale)
        if bool(self.global_scale) != fmt.global_scale:
            raise ValueError(f"BlockQuant: format {fmt.name!r} "
                             f"{'needs' if fmt.global_scale else 'has no'} a global-scale tensor "
                             f"(global_scale={self.global_scale!r})")

    @property
    def logical_block(self) -> tuple[int, ...]:
        """The block in logical (unpacked) elements."""
        p = self.format.pack
        return self.block if p == 1 else self.block[:-1] + (self.block[-1] * p,)

    def key(self) -> tuple:
        k = (self.block, self.scale, self.ue8m0)
        tag = self.format.tag  # plan-format-1 formats (block FP8) unnamed: their layouts keep their digests
        return k + tag + (self.global_scale, self.global_group) if tag else k


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scales of a tensor of ``shape`` quantized in blocks of ``block`` (same number of dims)."""
    return tuple(-(-n // b) for n, b in zip(shape, block, strict=True))


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A logical tensor: its global shape and dtype; ``quant``: its block quantization (dtype its format's
    ``value_dtype``; see :class:`BlockQuant`), None for a plain tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant: BlockQuant | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"tensor name must be a non-empty str, got {self.name!r}")
        if not (_is_int_tuple(self.shape) and min(self.shape, default=0) >= 0):
            object.__setattr__(self, "shape", as_shape(self.shape, f"tensor {self.name!r} shape"))
        if type(self.dtype) is not torch.dtype:
            object.__setattr__(self, "dtype", _as_dtype(self.dtype, f"tensor {self.name!r} dtype"))
        check_bytes(self.shape, self.dtype, f"tensor {self.name!r}")
        q = self.quant
        if q is not None:
            if not isinstance(q, BlockQuant):
                raise TypeError(f"tensor {self.name!r}: quant must be a BlockQuant or None, got {q!r}")
            if self.dtype != q.format.value_dtype:
                raise ValueError(f"tensor {self.name!r}: a {q.format.name} tensor is "
                                 f"{dtype_name(q.format.value_dtype)}, got {dtype_name(self.dtype)}")
            nd = len(self.shape)
            if not nd or len(q.block) > nd:
                raise ValueError(f"tensor {self.name!r} of shape {self.shape}: block {q.block} has more dims "
                                 f"than the tensor")
            if len(q.block) < nd:
                object.__setattr__(self, "quant", BlockQuant((1,) * (nd - len(q.block)) + q.block, q.scale,
                                                             q.ue8m0, q.format, q.global_scale,
                                                             q.global_group))
            if q.scale == self.name:
                raise ValueError(f"tensor {self.name!r}: its scale tensor needs another name")

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of the scale tensor of a quantized tensor."""
        if self.quant is None:
            raise ValueError(f"tensor {self.name!r} is not quantized")
        return scale_shape(self.shape, self.quant.block)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)


@dataclass(frozen=True, slots=True)
class LocalSpec:
    """A local tensor on one rank: the tensor ``run()``/``refit()`` expects under ``name`` on ``rank``."""

    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not (_is_int_tuple(self.shape) and min(self.shape, default=0) >= 0):
            object.__setattr__(
                self, "shape", as_shape(self.shape, f"local tensor {self.name!r} on rank {self.rank}")
            )
        if type(self.dtype) is not torch.dtype:
            object.__setattr__(
                self, "dtype", _as_dtype(self.dtype, f"local tensor {self.name!r} on rank {self.rank}")
            )
        check_bytes(self.shape, self.dtype, f"local tensor {self.name!r} on rank {self.rank}")


@dataclass(frozen=True, slots=True)
class Fragment:
    """A box of logical tensor ``tensor`` held on ``rank`` inside local tensor ``local``.

    ``offsets``/``sizes`` give the box in the logical tensor (one entry per logical dim).
    ``local_offsets`` gives where it starts in the local tensor; the local tensor may have *more* dims than
    the logical one (e.g. a stacked expert tensor ``[E, rows, cols]`` holding one expert's ``[rows, cols]``):
    the extra leading dims are indexed by ``local_offsets`` with size 1. ``local_offsets`` defaults to zeros
    of the logical rank; ``local`` defaults to the logical tensor's name.
    """

    tensor: str
    rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: str = ""
    local_offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rank = self.rank
        if type(rank) is not int and (not isinstance(rank, int) or isinstance(rank, bool)) or rank < 0:
            raise TypeError(f"fragment of {self.tensor!r}: rank must be an int >= 0, got {rank!r}")
        off, lo = self.offsets, self.local_offsets
        # fast path (layout builders): tuples of plain ints need no conversion
        if not (type(off) is tuple and type(self.sizes) is tuple and type(lo) is tuple
                and _INT_TYPES.issuperset(map(type, off + self.sizes + lo))):
            if not isinstance(self.tensor, str) or not self.tensor:
                raise TypeError(f"fragment: tensor must be a non-empty str, got {self.tensor!r}")
            where = f"fragment of tensor {self.tensor!r} on rank {rank}"
            off = _as_ints(off, f"{where}: offsets")
            object.__setattr__(self, "offsets", off)
            object.__setattr__(self, "sizes", _as_ints(self.sizes, f"{where}: sizes"))
            lo = _as_ints(lo, f"{where}: local_offsets")
            object.__setattr__(self, "local_offsets", lo)
        if type(self.tensor) is not str or type(self.local) is not str:
            raise TypeError(f"fragment of {self.tensor!r} on rank {rank}: tensor and local must be str, got "
                            f"{self.tensor!r} and {self.local!r}")
        if not self.local:
            object.__setattr__(self, "local", self.tensor)
        if not lo and off:
            lo = (0,) * len(off)
            object.__setattr__(self, "local_offsets", lo)
        if min(off + self.sizes + lo, default=0) >= 0 and len(off) == len(self.sizes) <= len(lo):
            return
        if len(self.offsets) != len(self.sizes):
            raise ValueError(
                f"fragment of tensor {self.tensor!r} on rank {self.rank}: offsets {self.offsets} and sizes "
                f"{self.sizes} differ in length"
            )
        if len(lo) < len(self.sizes):
            raise ValueError(
                f"fragment of tensor {self.tensor!r} on rank {self.rank}: local_offsets {lo} has fewer dims "
                f"than the box {self.sizes}"
            )
        if any(o < 0 for o in self.offsets + lo) or any(s < 0 for s in self.sizes):
            raise ValueError(
                f"fragment of tensor {self.tensor!r} on rank {self.rank}: negative offset or size "
                f"(offsets={self.offsets}, sizes={self.sizes}, local_offsets={lo})"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def local_sizes(self) -> tuple[int, ...]:
        """The box's sizes in the local tensor's dims (extra leading dims have size 1)."""
        return (1,) * (len(self.local_offsets) - len(self.sizes)) + self.sizes

    def local_box(self, offsets: Sequence[int], sizes: Sequence[int]) -> Box:
        """Map a sub-box of this fragment (in logical coordinates) to local-tensor coordinates."""
        fo, lo = self.offsets, self.local_offsets
        if len(offsets) != len(fo):
            raise ValueError(f"box {tuple(offsets)} has {len(offsets)} dims, the fragment has {len(fo)}")
        extra = len(lo) - len(fo)
        if not extra:
            return tuple(map(add, lo, map(sub, offsets, fo))), tuple(sizes)
        return lo[:extra] + tuple(map(add, lo[extra:], map(sub, offsets, fo))), (1,) * extra + tuple(sizes)


FRAG_KEY = attrgetter("tensor", "rank", "offsets", "sizes", "local", "local_offsets")  # Layout._key entry


def block_scale_box(f: Fragment, block: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes, local offsets) of the scale fragment that goes with block-aligned weight fragment
    ``f``: its blocks' box in the scale tensor, at the weight's local offsets divided by the block (extra
    leading local dims unchanged)."""
    off = tuple(o // b for o, b in zip(f.offsets, block, strict=True))
    sizes = tuple(-(-(o + n) // b) - o // b for o, n, b in zip(f.offsets, f.sizes, block, strict=True))
    lo = f.local_offsets
    extra = len(lo) - len(block)
    return off, sizes, lo[:extra] + tuple(o // b for o, b in zip(lo[extra:], block, strict=True))


_FRAG_FIELDS = ("tensor", "rank", "offsets", "sizes", "local", "local_offsets")


def slot_setters(cls, names: tuple[str, ...]):
    if getattr(cls, "__slots__", None) != names:
        return None
    return tuple(cls.__dict__[k].__set__ for k in names)


_FRAG_SET = slot_setters(Fragment, _FRAG_FIELDS)


def trusted_fragment(tensor, rank, offsets, sizes, local, local_offsets) -> Fragment:
    """A :class:`Fragment` of values the columns' validation has checked (plain ints, the right lengths):
    built without re-running its checks (10^6 of them at 1,024 ranks)."""
    if _FRAG_SET is None:
        return Fragment(tensor, rank, offsets, sizes, local, local_offsets)
    f = object.__new__(Fragment)
    a, b, c, d, e, g = _FRAG_SET
    a(f, tensor)
    b(f, rank)
    c(f, offsets)
    d(f, sizes)
    e(f, local)
    g(f, local_offsets)
    return f
