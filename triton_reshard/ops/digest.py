"""The integrity digest's hash on CPU in one read pass (issue 46; ``execute/integrity.py`` keys and compares it).

The hash of a message's bytes (``integrity.partial`` defines it; ``csrc/digest.c`` says it as a formula) is
linear in the bytes, position by position, so it can be summed over pieces of the message wherever they lie.
The native function (``trd_digest``, in the same optional extension as the delta codec) reads a list of views:
the sender's buffer as one, the receiver's message as the destination views its unpack wrote (strided, read in
place: no copy back into staging first) plus the bytes no unpack took (in-place receives, padding, cast
pieces as they arrived). Without the extension (or with ``TRITON_RESHARD_NATIVE=0``) :func:`native` is None and
the caller takes the numpy path, which gives the same value."""

from __future__ import annotations

import bisect
import ctypes

import numpy as np
import torch

WIDTH = 12  # int64 per view: address, offset in the message, inner run bytes, outer dims, 4 sizes, 4 strides
COPY_WIDTH = 18  # int64 per fused copy: 2 addresses, message, offset, run, outer dims, 4 sizes, 2x4 strides
MAX_OUTER = 4
ROW_WORDS = 128  # int64 words per first-level row of the hash (1 KiB; ``execute/integrity.py``)
_fn: dict = {}  # (symbol, id of the loaded library) -> the typed ctypes function, or None


def _symbol(name: str, restype, argtypes):
    """The extension's ``name`` (ctypes, typed once), or None: no extension, the native codec off, or an
    extension built before the symbol was added (the caller then takes the numpy / torch path)."""
    from .delta_native import native as codec

    lib = codec()
    if lib is None:
        return None
    fn = _fn.get((name, id(lib)), False)
    if fn is False:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes
        _fn[name, id(lib)] = fn
    return fn


_P, _I = ctypes.c_void_p, ctypes.c_int64


def native():
    """``trd_digest`` (ctypes) where the extension is built with it and the native codec is on, else None."""
    return _symbol("trd_digest", ctypes.c_uint64, [_I, _P, _I, _P])


def copy_native():
    """``trd_copy_digest`` (ctypes): the copy that hashes what it writes, or None (as :func:`native`)."""
    return _symbol("trd_copy_digest", None, [_I, _P, _P, _P, _P])


def copy_span_native():
    """``trd_copy_digest_span`` (ctypes): an unpack's fused copy of one piece of its messages' bytes, read from
    where the piece lies (a same-host lane's ring), or None (as :func:`native`; an extension built before it)."""
    return _symbol("trd_copy_digest_span", None, [_I, _P, _P, _P, _P, _I, _I, _P])


def lanes(use: int | None = None) -> int | None:
    """The native hash loop's lanes: 256 (AVX2) or 0 (the portable loop), None without the extension. ``use``
    (0 or 256) picks the loop for this process first (the tests run both; the value is the same)."""
    pick = _symbol("trd_digest_use", ctypes.c_int, [ctypes.c_int])
    if pick is None:
        return None
    return pick(use) if use is not None else _symbol("trd_digest_simd", ctypes.c_int, [])()


def copy_row(src: torch.Tensor, dst: torch.Tensor, m: int, off: int) -> list[int] | None:
    """The fused copy's descriptor of ``src`` -> ``dst`` (same dtype and shape, CPU), whose bytes are at offset
    ``off`` of message ``m`` in logical order, or None (the views' common inner run and up to
    :data:`MAX_OUTER` outer dimensions do not describe it: the caller copies with torch)."""
    e = src.element_size()
    dims = [
        (n, s * e, d * e) for n, s, d in zip(src.shape, src.stride(), dst.stride(), strict=True) if n != 1
    ]
    inner = e
    while dims and dims[-1][1] == inner and dims[-1][2] == inner:  # contiguous on both sides
        inner *= dims.pop()[0]
    outer: list[tuple[int, int, int]] = []
    for n, s, d in dims:
        if outer and outer[-1][1] == n * s and outer[-1][2] == n * d:
            outer[-1] = (outer[-1][0] * n, s, d)
        else:
            outer.append((n, s, d))
    if len(outer) > MAX_OUTER:
        return None
    pad = [1] * (MAX_OUTER - len(outer))
    zero = [0] * (MAX_OUTER - len(outer))
    return [
        src.data_ptr(),
        dst.data_ptr(),
        m,
        off,
        inner,
        len(outer),
        *[n for n, _s, _d in outer],
        *pad,
        *[s for _n, s, _d in outer],
        *zero,
        *[d for _n, _s, d in outer],
        *zero,
    ]


def copy_plan(pairs, bufs: list[tuple[torch.Tensor, int]], side: int):
    """The fused copy of ``pairs`` ((source, destination) views) whose message side (``side``: 1, the
    destination, for a pack into send buffers; 0, the source, for an unpack out of received ones) lies in
    the messages ``bufs`` (uint8 CPU buffers and their byte lengths): ``(descriptors, gaps)``, ``gaps`` per
    message the :func:`message_rows`-style views of its bytes no pair copies (hashed from the buffer as it
    is). None where a pair casts, is not on CPU, has a message side that is not contiguous or not inside a
    message, or does not fit a descriptor: the caller copies with torch and hashes as before."""
    spans = sorted((b.data_ptr(), b.data_ptr() + n, k) for k, (b, n) in enumerate(bufs))
    starts = [a for a, _z, _k in spans]
    desc = []
    covered: list[list[tuple[int, int]]] = [[] for _ in bufs]
    for pair in pairs:
        s, d = pair
        if s.dtype != d.dtype or s.shape != d.shape or s.device.type != "cpu" or d.device.type != "cpu":
            return None
        nb = s.numel() * s.element_size()
        if not nb:
            continue
        msg = pair[side]
        if not msg.is_contiguous():
            return None
        p = msg.data_ptr()
        i = bisect.bisect_right(starts, p) - 1
        if i < 0 or p + nb > spans[i][1]:
            return None
        k = spans[i][2]
        off = p - spans[i][0]
        row = copy_row(s, d, k, off)
        if row is None:
            return None
        desc.append(row)
        covered[k].append((off, off + nb))
    gaps = []
    for (b, n), cov in zip(bufs, covered, strict=True):
        rows, at = [], 0
        for a, z in sorted(cov) + [(n, n)]:
            if a < at:  # two copies of the same message bytes: the sum would count them twice
                return None
            if a > at:
                rows.append([b.data_ptr() + at, at, a - at, 0, 1, 1, 1, 1, 0, 0, 0, 0])
            at = max(at, z)
        gaps.append(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, WIDTH))
    return np.ascontiguousarray(desc, dtype=np.int64).reshape(-1, COPY_WIDTH), gaps


def copy_digest(fn, desc: np.ndarray, lens: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """Run the fused copy ``desc`` (:func:`copy_plan`); per message (``lens``: int64 byte lengths) the hash of
    the bytes it copied, as written (uint64)."""
    out = np.zeros(len(lens), dtype=np.uint64)
    if len(desc):
        fn(len(desc), desc.ctypes.data, lens.ctypes.data, coef.ctypes.data, out.ctypes.data)
    return out


def view_row(t: torch.Tensor, off: int) -> list[int] | None:
    """The native descriptor of CPU view ``t`` whose bytes sit at message offset ``off`` (in ``t``'s logical
    order), or None (more than :data:`MAX_OUTER` outer dimensions after merging: the caller copies)."""
    e = t.element_size()
    dims = [(n, s * e) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    inner = e
    while dims and dims[-1][1] == inner:  # the contiguous inner run
        inner *= dims.pop()[0]
    outer: list[tuple[int, int]] = []
    for n, s in dims:  # merge an outer dimension into the one before it where they are one stride
        if outer and outer[-1][1] == n * s:
            outer[-1] = (outer[-1][0] * n, s)
        else:
            outer.append((n, s))
    if len(outer) > MAX_OUTER:
        return None
    sizes = [n for n, _s in outer] + [1] * (MAX_OUTER - len(outer))
    strides = [s for _n, s in outer] + [0] * (MAX_OUTER - len(outer))
    return [t.data_ptr(), off, inner, len(outer), *sizes, *strides]


def message_rows(bufs: list[tuple[torch.Tensor, int]], pairs) -> list[np.ndarray] | None:
    """Per received message (``bufs``: its uint8 buffer and byte length), the views whose bytes make it up
    once landed: for every unpack pair (received view, destination view) inside it, the destination view
    (the received one where the pair casts), and the message's own bytes where no pair took them. None where
    a view does not fit the native descriptor."""
    spans = sorted((b.data_ptr(), b.data_ptr() + n, k) for k, (b, n) in enumerate(bufs))
    starts = [s for s, _z, _k in spans]
    per: list[list] = [[] for _ in bufs]
    for r, d in pairs:
        nb = r.numel() * r.element_size()
        if not nb:
            continue
        p = r.data_ptr()
        i = bisect.bisect_right(starts, p) - 1
        if i < 0 or p + nb > spans[i][1]:
            continue  # not a message's bytes (cannot happen: every unpack reads a receive buffer)
        k = spans[i][2]
        off = p - spans[i][0]
        row = view_row(d if d.dtype == r.dtype else r, off)
        if row is None:
            return None
        per[k].append((off, off + nb, row))
    out = []
    for (b, n), views in zip(bufs, per, strict=True):
        rows, at = [], 0
        for a, z, row in sorted(views, key=lambda v: v[0]):
            if a > at:  # bytes of the message no unpack took: hashed as they arrived
                rows.append([b.data_ptr() + at, at, a - at, 0, 1, 1, 1, 1, 0, 0, 0, 0])
            rows.append(row)
            at = max(at, z)
        if at < n:
            rows.append([b.data_ptr() + at, at, n - at, 0, 1, 1, 1, 1, 0, 0, 0, 0])
        out.append(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1, WIDTH))
    return out


def digest_rows(fn, rows: np.ndarray, n: int, coef: np.ndarray) -> int:
    """The hash of an ``n``-byte message made of ``rows`` (:func:`message_rows`); ``coef``: at least
    ``ceil(n / 1024) + 8`` keyed coefficients (uint64)."""
    return int(fn(len(rows), rows.ctypes.data, n, coef.ctypes.data))


def digest_many(rows: list[np.ndarray], lens: list[int], coef: np.ndarray) -> list[int]:
    """The native hashes of several messages (a step's), in one call (``trd_digest_many``; one per message with
    an extension built before it): message ``m`` is made of the views ``rows[m]`` (:func:`message_rows`) and is
    ``lens[m]`` bytes long; ``coef``: at least the coefficients of each (uint64). Needs :func:`native`."""
    many = _symbol("trd_digest_many", None, [_I, _P, _P, _P, _P, _P])
    if many is None:
        fn = native()
        return [digest_rows(fn, r, n, coef) for r, n in zip(rows, lens, strict=True)]
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    desc = np.ascontiguousarray(np.concatenate(rows) if len(rows) > 1 else rows[0], dtype=np.int64)
    sizes = np.array(lens, dtype=np.int64)
    out = np.zeros(len(rows), dtype=np.uint64)
    many(len(rows), counts.ctypes.data, desc.ctypes.data, sizes.ctypes.data, coef.ctypes.data, out.ctypes.data)
    return out.tolist()


def buffer_rows(buf: torch.Tensor) -> np.ndarray:
    """The native views of the contiguous uint8 CPU buffer ``buf`` as one message: one view."""
    return np.array([[buf.data_ptr(), 0, buf.numel(), 0, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=np.int64)


def digest_buffer(fn, buf: torch.Tensor, coef: np.ndarray) -> int:
    """The hash of the contiguous uint8 CPU buffer ``buf`` (one view)."""
    row = buffer_rows(buf)  # kept alive across the call (``.ctypes.data`` alone does not hold the array)
    return int(fn(1, row.ctypes.data, buf.numel(), coef.ctypes.data))


def span_torch(buf: torch.Tensor, a: int, z: int, n: int, coef: torch.Tensor) -> torch.Tensor:
    """The hash of bytes ``[a, z)`` of the ``n``-byte message in the flat uint8 ``buf`` (any device; a 0-dim
    int64 tensor, no sync), as ``csrc/digest.c`` defines it: ``coef`` (int64, on ``buf``'s device) holds at
    least the message's coefficients. For the bytes a fused copy did not take (padding, quantized pieces,
    pieces copied by torch): the whole words inside the range one int64 each, the bytes around them one by
    one."""
    lim = n // 8 * 8
    w0, w1 = min(-(-a // 8) * 8, z), max(min(z // 8 * 8, lim), a)
    total = _bytes_torch(buf, a, min(w0, z), n, coef)
    if w1 > w0:
        words = buf[w0:w1]
        if words.data_ptr() % 8:  # an unaligned buffer: one aligned copy
            words = words.clone()
        idx = torch.arange(w0 // 8, w1 // 8, dtype=torch.int64, device=buf.device) >> 7
        total = total + (words.view(torch.int64) * coef[idx]).sum()
    return total + _bytes_torch(buf, max(w1, w0), z, n, coef)


def _bytes_torch(buf: torch.Tensor, a: int, z: int, n: int, coef: torch.Tensor) -> torch.Tensor:
    """:func:`span_torch` of ``[a, z)`` byte by byte."""
    k = torch.arange(a, z, dtype=torch.int64, device=buf.device)
    lim = n // 8 * 8
    rows = -(-(n // 8) // 128)
    body = k < lim
    idx = torch.where(body, k >> 10, rows + k - lim)
    shift = torch.where(body, (k & 7) * 8, 0)
    return ((buf[a:z].to(torch.int64) << shift) * coef[idx]).sum()


def cut_pairs(pairs, spans: list[tuple[int, int]]) -> tuple[list, list]:
    """Split copies ``pairs`` ((source, destination) views, CPU) by where their sources lie: the pieces whose
    source lies inside one of the byte ``spans`` ((address, bytes) of messages), each cut from a contiguous
    source along its first dimension at the spans' edges, and the rest (``(inside, rest)``; together they copy
    what ``pairs`` copy). A source an edge cuts off a row boundary is left whole in the rest."""
    spans = sorted((a, a + n) for a, n in spans if n)
    edges = sorted({e for s in spans for e in s})
    inside, rest = [], []
    for s, d in pairs:
        nb = s.numel() * s.element_size()
        p = s.data_ptr()
        k = bisect.bisect_right(spans, (p, float("inf")))  # spans starting at or before p come before k
        hit = (k and spans[k - 1][1] > p) or (k < len(spans) and spans[k][0] < p + nb)
        if not nb or not hit or not s.is_contiguous() or s.dim() == 0 or s.device.type != "cpu":
            rest.append((s, d))
            continue
        row = nb // s.shape[0]
        cuts = [e - p for e in edges[bisect.bisect_right(edges, p) : bisect.bisect_left(edges, p + nb)]]
        if any(c % row for c in cuts):
            rest.append((s, d))
            continue
        for a, z in zip([0, *cuts], [*cuts, nb], strict=True):
            piece = (s[a // row : z // row], d[a // row : z // row])
            i = bisect.bisect_right(spans, (p + a, float("inf"))) - 1
            (inside if i >= 0 and spans[i][0] <= p + a and p + z <= spans[i][1] else rest).append(piece)
    return inside, rest


def entries(n: int) -> int:
    """The coefficients an ``n``-byte message uses: one per row of :data:`ROW_WORDS` words, one per tail byte."""
    return -(-(n // 8) // ROW_WORDS) + n % 8


def fused_copy(views: dict, coef, pairs, bufs, side: int, key, backend: str = "torch"):
    """Copy ``pairs`` natively (``backend`` torch: ``ops.digest.copy_plan``, its descriptors cached in
    ``views`` under ``key``) or with the Triton copy kernel (triton: ``ops.copy.triton_copy_digest``, each
    program hashing what it moves), hashing what they write per message of ``bufs``: ``(hashes, gaps)``, or
    None (nothing copied). ``coef``: the digest's keyed coefficients (``execute.integrity.Coefficients``)."""
    if backend == "triton":
        if not bufs or not pairs:
            return None
        from .copy import triton_copy_digest

        need = max(entries(n) for _b, n in bufs)
        return triton_copy_digest(pairs, bufs, side, coef.get(need, bufs[0][0].device), key)
    fn = copy_native()
    got = fused_plan(views, pairs, bufs, side, key) if fn is not None else None
    if got is None:
        return None
    desc, gaps, lens, need = got
    return copy_digest(fn, desc, lens, coef.numpy(need)), gaps


def fused_plan(views: dict, pairs, bufs, side: int, key):
    """The native fused copy of ``pairs`` over the messages ``bufs`` (:func:`copy_plan`): ``(descriptors, gaps,
    lens, coefficients needed)``, cached in ``views`` under ``key`` (None: not cached), or None where the native
    copy cannot make it (the caller copies with torch)."""
    if not bufs or not pairs or bufs[0][0].device.type != "cpu":
        return None
    sig = ("copy", key, side, tuple((b.data_ptr(), n) for b, n in bufs), len(pairs))
    got = views.get(sig) if key is not None else None
    if got is None:
        plan = copy_plan(pairs, bufs, side)
        lens = np.array([n for _b, n in bufs], dtype=np.int64)
        got = False if plan is None else (*plan, lens, max(entries(n) for _b, n in bufs))
        if key is not None:
            if len(views) >= 512:
                views.clear()
            views[sig] = got
    return got or None
