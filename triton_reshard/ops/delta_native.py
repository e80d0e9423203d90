"""The CPU codec of delta format v2 (``ops/delta_v2.py``): the native one-pass codec (``csrc/delta_codec.c``,
built as ``triton_reshard._delta_codec`` by ``pip install``) where it was built and the views are contiguous,
else the numpy reference: the same bytes, the same checks and errors.

Why a compiled helper (issue 44): a delta refit on a CPU rank was bound by whole-tensor passes (a compare, a
nonzero, a gather, a scatter: each one pass over the bytes, ~5x a dense copy before any encoding); a C loop
over 256-element blocks compares, counts, encodes and updates the snapshot while the block is in L1, one pass
over the bytes. C rather than a JIT package: nothing to install beyond a compiler, which ``pip install``
needs anyway for the build; without one the package still installs (``setup.py``) and this module runs the
numpy reference. ``TRITON_RESHARD_NATIVE=0`` (or :func:`set_native`) turns the native codec off.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from importlib.util import find_spec

import numpy as np
import torch

from .delta_cpu import DstFacts, body_error, numpy_unpack, read_directory_np
from .delta_format import VERSION2, Pair, check_chunk_elems, chunk_list, pad, validate_pairs
from .delta_v2 import pack_v2_numpy

SLACK = 4096  # bytes past max_message_bytes the native pack may write into before it turns a chunk dense
# trd_unpack_rows' ops (csrc/delta_apply.c): apply, check (no write), and on the snapshot of a pack made with
# update 2 (narrow blocks written in the pass): commit its raw blocks and dense chunks, or undo its narrow ones
APPLY, CHECK, COMMIT, UNDO = 0, 1, 2, 3
NO_PATCH = 4  # trd_pack's flag beside the update: no patched blocks
_P = ctypes.POINTER(ctypes.c_int64)
_state: dict = {"lib": None, "tried": False, "on": os.environ.get("TRITON_RESHARD_NATIVE", "1") != "0"}


def _load():
    # located, not imported: the extension is a plain shared library read through ctypes
    spec = find_spec(__package__.rpartition(".")[0] + "._delta_codec")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    if not all(
        hasattr(lib, f)
        for f in ("trd_pack", "trd_pack_rows", "trd_unpack", "trd_unpack_rows", "trd_directory", "trd_simd")
    ):
        return None  # a build of an older csrc/delta_codec.c (rebuild it): the numpy reference runs
    lib.trd_pack.restype = ctypes.c_int64
    lib.trd_pack.argtypes = [ctypes.c_int64, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.trd_unpack.restype = ctypes.c_int64
    lib.trd_unpack.argtypes = [ctypes.c_void_p, ctypes.c_int64, _P, _P, _P, ctypes.c_int64, ctypes.c_int]
    lib.trd_pack_rows.restype = ctypes.c_int64
    lib.trd_pack_rows.argtypes = [
        ctypes.c_int64,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.trd_unpack_rows.restype = ctypes.c_int64
    lib.trd_unpack_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int]
    lib.trd_directory.restype = ctypes.c_int
    lib.trd_directory.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, _P, _P]
    lib.trd_simd.restype = ctypes.c_int
    if hasattr(lib, "trd_codec_threads"):
        lib.trd_codec_threads.restype, lib.trd_codec_threads.argtypes = ctypes.c_int, [ctypes.c_int]
        lib.trd_codec_threads(_env_threads())
    return lib


def _env_threads() -> int:
    """``TRITON_RESHARD_CODEC_THREADS`` (1 or 2; default 1), capped at the CPUs this process may run on."""
    raw = os.environ.get("TRITON_RESHARD_CODEC_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"TRITON_RESHARD_CODEC_THREADS={raw!r}: expected 1 or 2") from None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 2, cpus))


def native():
    """The loaded native codec (ctypes library) or None (not built, or turned off)."""
    if not _state["on"]:
        return None
    if not _state["tried"]:
        _state["lib"], _state["tried"] = _load(), True
    return _state["lib"]


def set_native(on: bool) -> bool:
    """Turn the native codec on or off for this process (tests compare both); returns the previous setting."""
    prev, _state["on"] = _state["on"], bool(on)
    return prev


def native_info() -> str:
    """``"native (avx512)"`` / ``"native (avx2)"`` / ``"native (portable C)"`` or ``"numpy"``: for reports."""
    lib = native()
    if lib is None:
        return "numpy"
    return "native (" + {512: "avx512", 256: "avx2"}.get(int(lib.trd_simd()), "portable C") + ")"


def codec_threads(n: int | None = None) -> int | None:
    """The threads the native apply and check run on (1 or 2: a message of >= 1 MiB in two parts of its
    chunks, ``csrc/delta_apply.c``); ``n`` first sets it for this process (default: ``TRITON_RESHARD_CODEC_THREADS``,
    else 1). Returns the setting now; None without the extension (or a build without threads)."""
    lib = native()
    if lib is None or not hasattr(lib, "trd_codec_threads"):
        return None
    if n is not None:
        if n not in (1, 2):
            raise ValueError(f"codec_threads: {n!r}; expected 1 or 2")
        lib.trd_codec_threads(n)
    return int(lib.trd_codec_threads(0))


def simd(use: int | None = None) -> int | None:
    """The native codec's SIMD paths: 512 (AVX-512), 256 (AVX2) or 0 (portable C); None without the extension.
    ``use`` (512, 256 or 0) first picks the fastest paths this CPU has up to it, for this process (the tests
    run each against the others: the bytes and results are the same)."""
    lib = native()
    if lib is None:
        return None
    pick = getattr(lib, "trd_codec_use", None)  # absent from a build of an older csrc/delta_codec.c
    if use is None or pick is None:
        return int(lib.trd_simd())
    pick.restype, pick.argtypes = ctypes.c_int, [ctypes.c_int]
    return int(pick(int(use)))


def in_place_bytes(msg: torch.Tensor) -> bool:
    """Can the message's bytes be read where they lie (a 1-D contiguous CPU uint8 tensor of >= 16 bytes)?"""
    return msg.device.type == "cpu" and msg.dtype == torch.uint8 and msg.dim() == 1 and msg.numel() >= 16 \
        and msg.is_contiguous()


def header_word(msg: torch.Tensor, k: int) -> int:
    """Word ``k`` (int32) of a message's 16-byte header: read in place where :func:`in_place_bytes`
    (about 2 us; torch's indexing takes ~10 us, and every delta receive reads two), else through torch."""
    if in_place_bytes(msg):
        return ctypes.c_int32.from_address(msg.data_ptr() + 4 * k).value
    return int(msg[4 * k:4 * k + 4].view(torch.int32)[0])


def _ptrs(values: Sequence[int]) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


def _arg(a: np.ndarray):
    return a.ctypes.data_as(_P)


def max_bytes(numels: Sequence[int], esizes: Sequence[int], ce: int) -> int:
    """``ops.delta.max_message_bytes`` (every chunk dense), computed here to keep the import order."""
    chunks = chunk_list(numels, ce)
    return 16 + pad(8 * len(chunks)) + sum(16 + pad(n * esizes[i]) for i, _a, n in chunks)


class V2PackPlan:
    """One message's v2 pack: ``pairs`` ((source, snapshot) views) in chunks of ``ce`` elements, with the
    native codec's argument arrays when every view is contiguous (``fast``). Reuse it only for the same view
    objects (:meth:`fits`)."""

    def __init__(self, pairs: Sequence[Pair], ce: int, reuse: bool = False) -> None:
        check_chunk_elems(ce)
        if validate_pairs(pairs).type != "cpu":
            raise ValueError("V2PackPlan: CPU tensors only")
        self.pairs, self.ce = [(s, p) for s, p in pairs], ce
        live = [(s, p) for s, p in self.pairs if s.numel()]
        rows = [rows_of(s) for s, _p in live]
        self.fast = all(r is not None and p.is_contiguous() for r, (_s, p) in zip(rows, live, strict=True))
        self.args = self.rows = None
        # reuse: every pack writes into one buffer kept here (the caller drops a message before it packs the
        # next: a refit's send, sent and waited within its run); a fresh buffer per pack costs its pages'
        # faults and zeroing by the kernel, ~15 % of a 10 % delta's pack (measured with perf on the trainer)
        self.reuse, self.out = reuse, None
        if self.fast:
            if any(w != st for w, st in rows):  # row-strided sources: the pack gathers them chunk by chunk
                self.rows = (_ptrs([w for w, _st in rows]), _ptrs([st for _w, st in rows]))
            self.numel = _ptrs([s.numel() for s, _ in live])
            self.esize = _ptrs([s.element_size() for s, _ in live])
            self.src = _ptrs([s.data_ptr() for s, _ in live])
            self.snap = _ptrs([p.data_ptr() for _, p in live])
            self.cap = max_bytes(self.numel.tolist(), self.esize.tolist(), ce) + SLACK
            # the ctypes pointers made once (a refit packs the same views every time)
            self.args = (self.numel.size, _arg(self.src), _arg(self.snap), _arg(self.numel), _arg(self.esize))
            self.rows_args = () if self.rows is None else tuple(_arg(a) for a in self.rows)

    def fits(self, pairs: Sequence[Pair], ce: int) -> bool:
        """Built for exactly these views (the same tensor objects, in order) and chunk size?"""
        return (
            ce == self.ce
            and len(pairs) == len(self.pairs)
            and all(s is a and p is b for (s, p), (a, b) in zip(pairs, self.pairs, strict=True))
        )

    def pack(self, update: bool | list, patch: bool = True) -> torch.Tensor:
        """The v2 message; ``update``: True writes the changes into the snapshot in the same pass; a list: the
        narrow blocks' changes are written in the pass too (they are cheap to undo: their differences are in
        the message), and a :class:`Deferred` appended there completes the update (``commit_updates``: the raw
        blocks and dense chunks) or undoes it (``undo_updates``), so the snapshot is either version; False
        leaves the snapshot. ``patch`` False: no patched blocks (``ops/delta_patch.py``), the Triton pack's bytes."""
        lib = native()
        if lib is None or not self.fast:
            return pack_v2_numpy(self.pairs, self.ce, update, patch)
        out = self.out if self.out is not None else torch.empty(self.cap, dtype=torch.uint8)
        if self.reuse:
            self.out = out
        mode = (1 if update is True else 2 if isinstance(update, list) else 0) | (0 if patch else NO_PATCH)
        if self.rows is None:
            n = lib.trd_pack(*self.args, self.ce, out.data_ptr(), mode)
        else:
            n = lib.trd_pack_rows(*self.args, *self.rows_args, self.ce, out.data_ptr(), mode)
            if n == -3:
                raise MemoryError("delta pack: no memory for the native codec's scratch (nothing written)")
        msg = out[:n]
        if isinstance(update, list):
            update.append(Deferred(self, msg))
        return msg

    def snapshot_op(self, msg: torch.Tensor, op: int) -> None:
        """``COMMIT`` or ``UNDO`` of ``msg`` (made by :meth:`pack` with a list ``update``) on the snapshot views:
        the codec's own message, so no check pass first. Raises if the codec is gone (never expected)."""
        lib = native()
        n, _s, snap, numel, esize = self.args
        if lib is None or lib.trd_unpack_rows(msg.data_ptr(), n, snap, numel, esize, None, None, self.ce, op) != -1:
            raise RuntimeError("delta pack: the native codec could not complete the snapshot update; drop the "
                               "snapshot (the next refit goes dense)")


class Deferred:
    """The rest of a snapshot update that a pack made before it knew whether its message is used (a delta refit
    diffs while its handshake is in flight): calling it commits (the snapshot becomes the new version),
    :meth:`undo` restores the old one. Each at most once, and only one of them."""

    __slots__ = ("plan", "msg")

    def __init__(self, plan: V2PackPlan, msg: torch.Tensor) -> None:
        self.plan, self.msg = plan, msg

    def __call__(self) -> None:
        self.plan.snapshot_op(self.msg, COMMIT)

    def undo(self) -> None:
        self.plan.snapshot_op(self.msg, UNDO)


REUSE = "reuse"  # a cache key: True where each message is dropped before the next pack (V2PackPlan's reuse)


def pack_v2(pairs: Sequence[Pair], ce: int, update: bool | list, cache: dict | None = None) -> torch.Tensor:
    """The v2 message of CPU ``pairs`` (``cache``: a dict kept by the caller for this message, its
    :class:`V2PackPlan` kept there under ``"pack2"``; ``cache[REUSE]`` true: the caller drops each message
    before it packs the next, so every pack writes into the same buffer)."""
    plan = cache.get("pack2") if cache is not None else None
    if plan is None or not plan.fits(pairs, ce):
        plan = V2PackPlan(pairs, ce, reuse=bool(cache is not None and cache.get(REUSE)))
        if cache is not None:
            cache["pack2"] = plan
    return plan.pack(update)


def rows_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(row length, row stride) in elements of a view the native pack reads where it lies: contiguous (the two
    equal), or 2-D rows with unit inner stride (a column block of a row-major tensor); else None."""
    if t.is_contiguous():
        return (max(t.numel(), 1), max(t.numel(), 1))
    if t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.size(1):
        return (t.size(1), t.stride(0))
    return None


def reads_in_place(t: torch.Tensor) -> bool:
    """Does the CPU pack diff view ``t`` where it lies in one native pass (no staging copy first)?"""
    return t.is_contiguous() or (native() is not None and rows_of(t) is not None)


def _dst_args(dsts: Sequence[torch.Tensor], facts: DstFacts | None) -> tuple | None:
    """The native unpack's arguments for CPU ``dsts`` (live ones: count, pointers, numels, element sizes, and
    row lengths and strides when some view is a row view: :func:`rows_of`), kept on ``facts`` (built for these
    views); None when a destination is neither contiguous nor a row view, or not an integer width."""
    got = getattr(facts, "native_args", False) if facts is not None else False
    if got is not False:
        return got
    live = [d for d in dsts if d.numel()]
    ok = all(d.element_size() in (1, 2, 4, 8) and d.device.type == "cpu" for d in dsts)
    rows = [rows_of(d) for d in live] if ok else [None]
    args = None
    if all(r is not None for r in rows):
        arrays = (
            _ptrs([d.data_ptr() for d in live]),
            _ptrs([d.numel() for d in live]),
            _ptrs([d.element_size() for d in live]),
        )
        if all(w == st for w, st in rows):
            geo = (None, None)
        else:  # row views (a column block of a row-major tensor, as a received box often is): written in place
            arrays += (_ptrs([w for w, _st in rows]), _ptrs([st for _w, st in rows]))
            geo = (_arg(arrays[3]), _arg(arrays[4]))
        args = (len(live), *(_arg(a) for a in arrays[:3]), *geo, arrays)
    if facts is not None:
        facts.native_args = args
    return args


def unpack_v2(
    msg: torch.Tensor,
    dsts: Sequence[torch.Tensor],
    names: Sequence[str] | None,
    facts: DstFacts | None = None,
) -> None:
    """Unpack a CPU message of either version: every header checked (``read_directory_np``; the native
    codec's ``trd_directory`` first, the numpy reader only to word a refusal), then every body, before the
    first write; a v2 message into contiguous or row-view destinations by the native codec (in place), any
    other by ``numpy_unpack`` (the same checks, errors and result)."""
    lib = native()
    da = _dst_args(dsts, facts) if lib is not None else None
    fast = (
        da is not None
        and msg.dtype == torch.uint8
        and msg.dim() == 1
        and msg.is_contiguous()
        and msg.device.type == "cpu"
        and not lib.trd_directory(msg.data_ptr(), msg.numel(), da[0], da[2], da[3])
    )
    if not fast:
        dr = read_directory_np(msg, dsts, names, facts)
        if dr.version != VERSION2 or da is None or not dr.chunks:
            return numpy_unpack(msg, dsts, names, facts)
    args = (*da[:6], header_word(msg, 3))
    r = lib.trd_unpack_rows(msg.data_ptr(), *args, CHECK)
    if r == -2:
        return numpy_unpack(msg, dsts, names, facts)
    if r >= 0:
        raise body_error(read_directory_np(msg, dsts, names, facts), int(r), names)
    if lib.trd_unpack_rows(msg.data_ptr(), *args, APPLY) == -3:
        raise MemoryError(
            "delta unpack: no memory for the native codec's per-chunk scratch (nothing written)"
        )
    return None
