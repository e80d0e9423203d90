"""Patched blocks of delta format v2 (issue 44 item 3; the format: ``ops/delta_v2.py``): the numpy reference's
choice of a block's layout and the exceptions of its patched modes. ``csrc/delta_codec.c`` (``write_block``)
and the Triton pack (:func:`layout_torch` on the device from its stats pass's per-block counts, then the encode
pass writes the exceptions: ``kernels/delta.py``) make the same choice, byte for byte.

A changed block's values are all stored at the width of its widest difference; on real AdamW steps about half
the blocks that need 8 bits do so for one or two far-moved elements, the rest fitting 2 or 4. A *patched* block
(descriptor modes 3..14) stores its values at a narrower base width and the few elements that do not fit as
exceptions, each with its full-width difference:

- ``mode = 3 + 4 * pmode + (nexc - 1)``: ``pmode`` the positions (0 offsets, 1 bitmask, 2 all, as modes 0..2),
  ``nexc`` 1..4 the exceptions (in the descriptor, so every block's size follows from the descriptors alone
  and the readers find the payloads with one prefix sum). ``code`` 1..5 the base width (never raw).
- Payload: the positions as in ``pmode``; the ``nv`` values (``cnt``, or ``blen`` in ``pmode`` 2) at the base
  width, an exception's slot holding 0; then ``nexc`` bytes, each exception's slot in the values (ascending);
  then ``nexc`` values of the element's size, each the exception's difference modulo 2**bits (little-endian),
  which replaces the slot's base value. ``ceil(nv w / 8) + nexc (1 + esize)`` bytes after the positions.
- The packer's choice per changed block: the smallest of (unpatched: offsets, bitmask, all at the block's
  code) then (patched: for base code 1, 2, ... below the block's code and below the element's bits, with
  1..4 exceptions: offsets, bitmask, all); a later candidate only when strictly smaller. So a message
  without a block that gains from patching is byte-identical to one of the unpatched format.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_EXCEPTIONS = 4
FIRST_PATCHED = 3  # mode nibbles 3..14
LAST_PATCHED = FIRST_PATCHED + 3 * MAX_EXCEPTIONS - 1
ALL = 2  # pmode of "all" (delta_v2.MODE_ALL)


def vbytes(n, w):
    return (n * w + 7) // 8


def split_mode(mode: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions mode 0..2, exceptions) of descriptor mode nibbles (unpatched: the mode itself, 0)."""
    p = mode >= FIRST_PATCHED
    rel = np.maximum(mode - FIRST_PATCHED, 0)
    return np.where(p, rel // MAX_EXCEPTIONS, mode), np.where(p, rel % MAX_EXCEPTIONS + 1, 0)


def narrow_codes(esize: int) -> list[int]:
    """The base codes an element of ``esize`` bytes may be stored at (widths below its bits)."""
    return [c for c in range(1, 6) if (1 << c) < 8 * esize]


def choose_layout(ecode, st, cnt, bcode, blen, e: int, unpatched, patch: bool = True):
    """Per changed block (runs ``st`` of the changed elements, whose codes are ``ecode``): (stored code, mode
    nibble, payload bytes, position bytes, exceptions). ``unpatched``: ``delta_v2.block_layout``'s
    (mode, size, posb) at the block's own code; ``patch`` False: those (no patched block)."""
    mode, size, posb = (np.asarray(a, dtype=np.int64).copy() for a in unpatched)
    code = np.asarray(bcode, dtype=np.int64).copy()
    nexc = np.zeros(code.shape, dtype=np.int64)
    if not st.size or not patch:
        return code, mode, size, posb, nexc
    bm_bytes = (blen + 7) // 8
    for c in narrow_codes(e):
        over = np.add.reduceat((ecode > c).astype(np.int64), st)
        ok = (over >= 1) & (over <= MAX_EXCEPTIONS)
        if not ok.any():
            continue
        w, exc = 1 << c, over * (1 + e)
        vb = vbytes(cnt, w)
        for pm, s, pb in (
            (0, cnt + vb + exc, cnt),
            (1, bm_bytes + vb + exc, bm_bytes),
            (2, vbytes(blen, w) + exc, 0),
        ):
            take = ok & (s < size)
            code = np.where(take, c, code)
            mode = np.where(take, FIRST_PATCHED + MAX_EXCEPTIONS * pm + over - 1, mode)
            size = np.where(take, s, size)
            posb = np.where(take, pb, posb)
            nexc = np.where(take, over, nexc)
    return code, mode, size, posb, nexc


def exception_writes(row, slot, ecode, code, nexc, xat, d, e: int):
    """The exceptions of patched blocks: (element mask, byte offsets of their slot bytes, of their values, the
    values (uint64, the difference modulo 2**bits)); ``row`` each changed element's block, ``xat`` each block's
    exception area."""
    exc = (nexc[row] > 0) & (ecode > code[row])
    r = np.flatnonzero(exc)
    xr = np.zeros(0, dtype=np.int64)
    if r.size:
        brow = row[r]
        first = np.concatenate(([True], brow[1:] != brow[:-1]))
        start = np.flatnonzero(first)
        xr = np.arange(r.size) - np.repeat(start, np.diff(np.append(start, r.size)))
    brow = row[r]
    at_slot = xat[brow] + xr
    at_val = xat[brow] + nexc[brow] + xr * e
    mask = np.uint64((1 << (8 * e)) - 1) if e < 8 else np.uint64(0xFFFFFFFFFFFFFFFF)
    return exc, at_slot, slot[r], at_val, d[r].astype(np.uint64) & mask


def read_exceptions(mn, nexc, xat, nv, esize):
    """The exceptions of patched blocks, checked: (bad per block, block of each, slot, value (uint64, the
    difference sign-extended from the element's bits))."""
    xb = np.repeat(np.arange(nexc.size, dtype=np.int64), nexc)
    xk = np.arange(xb.size, dtype=np.int64) - (np.cumsum(nexc) - nexc)[xb]
    slot = mn[xat[xb] + xk].astype(np.int64)
    prev = np.where(xk > 0, mn[xat[xb] + xk - 1].astype(np.int64), -1)
    bad = np.zeros(nexc.size, dtype=bool)
    bad[xb[(slot <= prev) | (slot >= nv[xb])]] = True
    e = esize[xb]
    at = xat[xb] + nexc[xb] + xk * e
    val = np.zeros(xb.size, dtype=np.uint64)
    for k in range(8):
        has = k < e
        val[has] |= mn[at[has] + k].astype(np.uint64) << np.uint64(8 * k)
    top = np.left_shift(np.uint64(1), (8 * e - 1).astype(np.uint64))
    neg = ((val & top) != 0) & (e < 8)
    ext = ~((top << np.uint64(1)) - np.uint64(1))
    val = np.where(neg, val | ext, val)
    return bad, xb, slot, val


RAW = 6  # the raw code (delta_v2.RAW)
OVER_BITS = 9  # the pack kernel's V_OVER: per base code c = 1..5, its exceptions at bit 9 (c - 1)


def layout_torch(cnt, code, over, blen, e, patch: bool = True):
    """``delta_v2.block_layout`` then :func:`choose_layout` in torch, on the device (the Triton pack): per block
    (stored code, positions mode 0..2, payload bytes (0 for an unchanged block), position bytes, exceptions).
    ``code``: each block's widest code; ``over``: the stats pass's counts of changed elements wider than each
    base code's width (``OVER_BITS`` bits per code); ``e``: each block's element size."""
    w = torch.where(code == RAW, 8 * e, 1 << torch.clamp(code, max=5))
    bmb, vb = (blen + 7) // 8, vbytes(cnt, w)
    off, bm, al = cnt + vb, bmb + vb, vbytes(blen, w)
    mode = torch.where((off <= bm) & (off <= al), 0, torch.where(bm <= al, 1, ALL))
    size = torch.where(mode == 0, off, torch.where(mode == 1, bm, al))
    posb = torch.where(mode == 0, cnt, torch.where(mode == 1, bmb, 0))
    nexc = torch.zeros_like(cnt)
    for c in range(1, 6) if patch else ():  # the order and strict "<" of choose_layout: the same choice
        xc = (over >> (OVER_BITS * (c - 1))) & ((1 << OVER_BITS) - 1)
        ok = (xc >= 1) & (xc <= MAX_EXCEPTIONS) & ((1 << c) < 8 * e)
        vc, exc, vall = vbytes(cnt, 1 << c), xc * (1 + e), vbytes(blen, 1 << c)
        for pm, s, pb in ((0, cnt + vc + exc, cnt), (1, bmb + vc + exc, bmb), (ALL, vall + exc, 0)):
            take = ok & (s < size)
            code, mode = torch.where(take, c, code), torch.where(take, pm, mode)
            nexc, size, posb = torch.where(take, xc, nexc), torch.where(take, s, size), torch.where(take, pb, posb)
    return code, mode, torch.where(cnt > 0, size, 0), posb, nexc


def split_mode_torch(mode):
    """:func:`split_mode` of a torch tensor."""
    p = mode >= FIRST_PATCHED
    rel = torch.clamp(mode - FIRST_PATCHED, min=0)
    return torch.where(p, rel // MAX_EXCEPTIONS, mode), torch.where(p, rel % MAX_EXCEPTIONS + 1, 0)


def exceptions_torch(msg, nexc, xat, nv):
    """Per block (torch, on the message's device), whether its exceptions' slots (at ``xat``) are not ascending
    inside its ``nv`` values (blocks whose ``nexc`` is 0: False)."""
    bad = torch.zeros_like(nexc, dtype=torch.bool)
    prev = torch.full_like(nexc, -1)
    last = msg.numel() - 1
    for x in range(MAX_EXCEPTIONS):
        has = nexc > x
        s = msg[torch.clamp(torch.where(has, xat + x, 0), max=last)].to(torch.int64)
        bad |= has & ((s <= prev) | (s >= nv))
        prev = torch.where(has, s, prev)
    return bad
