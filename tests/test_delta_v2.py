"""Delta format v2 (issue 44: narrow lossless values, ``ops/delta_v2.py``) and its two codecs: the numpy
reference and the native one-pass codec (``csrc/delta_codec.c``, ``ops/delta_native.py``). Every case: both
codecs write the same bytes; unpack into destinations holding the snapshot, inside poisoned buffers, gives
the source's bits exactly and leaves the poison; the snapshot update equals the source. Adversarial
differences: all changed, sign flips, +-0, NaN payloads, subnormals, a block whose one difference needs 16
bits, raw blocks sent whole."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cpu
from triton_reshard.ops import delta_native as N
from triton_reshard.ops import delta_v2 as V
from triton_reshard.ops.delta_cached import pack_deferred

INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8)
CODECS = ("numpy", "native")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def ulp_steps(old: torch.Tensor, frac: float, g: torch.Generator, spread: int = 2) -> torch.Tensor:
    """``old`` with about ``frac`` of its elements moved by -spread..spread-1 in their bit patterns."""
    new = old.clone()
    b = bits(new)
    m = torch.rand(old.shape, generator=g) < frac
    step = torch.randint(-spread, spread, old.shape, generator=g).to(b.dtype)
    b[m] += step[m]
    return new


def adversarial(
    dtype: torch.dtype, n: int, g: torch.Generator
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, old, new) pairs whose differences need every width, and raw."""
    old = (torch.randn(n, generator=g) * 3).to(dtype)
    e = old.element_size()
    allc = old.clone()
    bits(allc).add_(1)  # every element changed by one ulp
    cases = [
        ("none", old, old.clone()),
        ("1pct", old, ulp_steps(old, 0.01, g)),
        ("10pct", old, ulp_steps(old, 0.1, g)),
        ("all", old, allc),
    ]
    flip = old.clone()
    bits(flip)[::7] ^= torch.tensor(-(1 << (8 * e - 1)), dtype=INT[e])  # sign flips
    cases.append(("sign", old, flip))
    if dtype.is_floating_point:
        z = torch.zeros(n, dtype=dtype)
        nz = z.clone()
        nz[::3] = -0.0
        cases.append(("zeros", z, nz))
        nan = old.clone()
        bits(nan)[::5] = bits(torch.full((1,), float("nan"), dtype=dtype))[0] | 3  # NaN with a payload
        cases.append(("nan", old, nan))
        sub = torch.full((n,), torch.finfo(dtype).tiny, dtype=dtype) / 4  # subnormals
        sub2 = sub.clone()
        bits(sub2)[1::2] -= 1
        cases.append(("subnormal", sub, sub2))
    wide = old.clone()
    wide_bits = bits(wide)
    wide_bits[300] += 1
    wide_bits[301] += (1 << 14) if e > 1 else 64  # one difference of its block needs 16 bits (int8: 8, raw)
    cases.append(("wide", old, wide))
    return cases


def roundtrip(pairs_new_old, ce: int, at: int = 32) -> torch.Tensor:
    """Pack (update) and unpack into destinations holding the snapshot inside poisoned buffers (``at``
    elements in: any alignment to the cache lines); check all."""
    snaps = [old.clone() for _new, old in pairs_new_old]
    msg = D.pack_delta(
        [(new, s) for (new, _o), s in zip(pairs_new_old, snaps, strict=True)], ce, backend="torch"
    )
    bufs, dsts = [], []
    for new, old in pairs_new_old:
        buf = torch.empty(new.numel() + 64, dtype=new.dtype)
        bits(buf).fill_(-1 if new.element_size() > 1 else 0x5A)
        d = buf[at : at + new.numel()].view(new.shape)
        d.copy_(old)
        bufs.append(buf)
        dsts.append(d)
    D.unpack_delta(msg, dsts, backend="torch")
    for (new, _old), s, buf, d in zip(pairs_new_old, snaps, bufs, dsts, strict=True):
        assert torch.equal(bits(s), bits(new)), "the snapshot update"
        assert torch.equal(bits(d), bits(new)), "the unpacked values"
        poison = -1 if new.element_size() > 1 else 0x5A
        assert bool((bits(buf[:at]) == poison).all()) and bool(
            (bits(buf[at + new.numel() :]) == poison).all()
        )
    return msg


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ce", [1 << 15, 1000, 256, 7])
def test_adversarial_roundtrip_same_bytes(codec, dtype, ce):
    g = torch.Generator().manual_seed(1)
    for name, old, new in adversarial(dtype, 3000, g):
        msgs = []
        for c in CODECS:
            codec(c)
            msgs.append(roundtrip([(new, old)], ce))
        assert torch.equal(msgs[0], msgs[1]), f"{name}: the codecs' bytes differ"
        assert int(msgs[0][4:8].view(torch.int32)[0]) == 2
        assert msgs[0].numel() <= D.max_message_bytes([new.numel()], [new.element_size()], ce)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unaligned_destinations(codec, dtype):
    """Destinations starting anywhere in a cache line (the native apply adds whole lines inside a chunk and
    the chunk's partial first and last lines element by element): exact, the poison around them kept."""
    g = torch.Generator().manual_seed(3)
    for name, old, new in adversarial(dtype, 3000, g):
        for at in (1, 3, 17):
            for ce in (1000, 7):
                msgs = []
                for c in CODECS:
                    codec(c)
                    msgs.append(roundtrip([(new, old), (new[5:], old[5:])], ce, at))
                assert torch.equal(msgs[0], msgs[1]), f"{name}: the codecs' bytes differ"


def test_widths_and_modes(codec):
    """One-ulp changes take 2 bits; a block with one 16-bit difference of fp32 takes 16; a bf16 sign flip is
    raw; the modes follow the sizes (few changes: offsets; ~half: bitmask; all: all)."""
    codec("numpy")
    old = torch.randn(4 * 256, dtype=torch.float32)
    new = old.clone()
    b = bits(new)
    b[0:3] += 1  # block 0: 3 one-ulp changes -> 2 bits, offsets
    b[256 : 256 + 128 : 2] -= 2  # block 1: 64 changes -> 2 bits (-2 fits), bitmask
    b[512:768] += 5  # block 2: every element, 4 bits, all
    b[768] += 1
    b[769] += 1 << 14  # block 3: needs 16 bits
    msg = D.pack_delta([(new, old.clone())], 1024, backend="torch")
    (c,) = D.describe(msg)
    assert c["kind"] == "narrow" and c["count"] == 3 + 64 + 256 + 2
    desc = msg[c["offset"] + 16 : c["offset"] + 24].numpy()
    assert [(int(x) & 15, int(x) >> 4) for x in desc[0::2]] == [(1, 0), (1, 1), (2, 2), (4, 0)]
    assert V.block_histogram([msg.numpy()]) == {"2": 2, "4": 1, "16": 1}
    assert V.chunk_histogram([msg.numpy()]) == {"16": 1}  # per chunk: its widest block
    flip = torch.randn(256, dtype=torch.bfloat16)
    new2 = -flip
    msg = D.pack_delta([(new2, flip.clone())], 256, backend="torch")
    assert D.describe(msg)[0]["kind"] == "dense"  # every element raw: the narrow chunk is not smaller
    assert V.chunk_histogram([msg.numpy()]) == {"dense": 1}
    msg = D.pack_delta([(flip, flip.clone()), (new, old.clone())], 512, backend="torch")
    assert V.chunk_histogram([msg.numpy()]) == {
        "2": 1,
        "16": 1,
    }  # blocks 0-1 and 2-3; the unchanged one left out


def test_mixed_pairs_strided_and_empty(codec):
    """Several views of mixed element sizes, an empty one, strided sources, snapshots and destinations: the
    numpy codec (the native one takes contiguous views; it writes the same bytes for contiguous copies)."""
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(64, 100, generator=g)).to(torch.bfloat16)
    b = torch.randn(3000, generator=g)
    e = torch.zeros(0, dtype=torch.float16)
    c = torch.randn(700, generator=g).to(torch.float16)
    pairs = [(ulp_steps(a, 0.05, g).t(), a.t()), (ulp_steps(b, 0.3, g), b), (e, e), (ulp_steps(c, 1.0, g), c)]
    msgs = []
    for name in CODECS:
        codec(name)
        msgs.append(roundtrip(pairs, 512))
        msgs.append(roundtrip([(x.contiguous(), y.contiguous()) for x, y in pairs], 512))
    assert all(torch.equal(msgs[0], m) for m in msgs[1:])


def test_strided_1d_views_with_dense_chunks(codec):
    """A 1-D view with a stride (an every-other-row slice of a fused tensor) whose chunks go dense (every
    element's sign flipped: raw values): the codec reads its bytes through a row-major copy (a strided view
    cannot be reinterpreted as bytes). Found by an 8-rank delta refit's int8/bool and relay cases."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        full = (torch.randn(4000, generator=g) * 50).to(dtype)
        old = full[1::2]
        new = (-full if dtype.is_floating_point else full ^ -128)[1::2]
        msgs = []
        for name in CODECS:
            codec(name)
            msgs.append(roundtrip([(new, old)], 512))
        assert any(c["kind"] == "dense" for c in D.describe(msgs[0]))
        assert all(torch.equal(msgs[0], m) for m in msgs[1:])


def _narrow_then_dense(dtype: torch.dtype, g: torch.Generator) -> tuple:
    """A chunk of 257 elements: its first block all sign-flipped (raw), its second (one element) a one-ulp
    step (narrow): packed block by block it turns dense only at the second block, after that block's change
    was written to the snapshot (update 2 takes that write back)."""
    e = dtype.itemsize
    old = (torch.randn(257, generator=g) * 3).to(dtype)
    new = old.clone()
    bits(new)[:256] ^= torch.tensor(-(1 << (8 * e - 1)), dtype=INT[e])
    bits(new)[256] += 1
    return ("narrow-then-dense", old, new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deferred_update_commits_or_undoes(codec, dtype):
    """``pack_deferred`` (a refit's diff during its handshake): its message is the fused pack's; then
    ``commit_updates`` makes the snapshot the source and ``undo_updates`` restores the old one, bit for bit,
    for every adversarial change (the native codec writes the narrow blocks in the pass: undo subtracts them
    again; raw blocks and dense chunks wait for the commit)."""
    g = torch.Generator().manual_seed(3)
    cases = [*adversarial(dtype, 20_000, g), _narrow_then_dense(dtype, g)]
    for case, old, new in cases:
        for name in CODECS:
            codec(name)
            ref = D.pack_delta([(new, old.clone())], 4096, backend="torch")
            if case == "narrow-then-dense":
                assert D.describe(ref)[0]["kind"] == "dense"
            for commit in (True, False):
                snap, updates = old.clone(), []
                msg = pack_deferred([(new, snap)], 4096, updates, cache={})
                assert torch.equal(msg, ref), (case, name)
                if commit:
                    delta_cpu.commit_updates(updates)
                else:
                    delta_cpu.undo_updates(updates)
                assert torch.equal(bits(snap), bits(new if commit else old)), (case, name, commit)


def test_cached_plans_follow_the_data(codec):
    """A cached pack plan and unpack plan (a refit's) give the same bytes and results across versions of the
    data, and a v1 message still unpacks through the same cache."""
    g = torch.Generator().manual_seed(4)
    for name in CODECS:
        codec(name)
        src = torch.randn(10_000, generator=g).to(torch.bfloat16)
        snap, dst = src.clone(), src.clone()
        pcache, ucache = {}, {}
        for _v in range(3):
            src.copy_(ulp_steps(src, 0.05, g))
            want = D.pack_delta([(src, snap.clone())], 2048, backend="torch")
            msg = D.pack_delta([(src, snap)], 2048, backend="torch", cache=pcache)
            assert torch.equal(msg, want)
            D.unpack_delta(msg, [dst], backend="torch", cache=ucache)
            assert torch.equal(bits(dst), bits(src))
        old = dst.clone()
        src.copy_(ulp_steps(src, 0.05, g))
        v1 = D.pack_delta([(src, old.clone())], 2048, backend="torch", version=1)
        D.unpack_delta(v1, [dst], backend="torch", cache=ucache)
        assert torch.equal(bits(dst), bits(src))


def test_reused_message_buffer_same_bytes(codec):
    """A cache marked ``REUSE`` (a refit's send: each message dropped before the next pack) packs every
    version into one buffer: the same bytes as a fresh pack, nothing left over from a longer earlier message
    (dense chunks, then few changes, then none), deferred updates committed from it; without the mark each
    message keeps its own buffer."""
    codec("native")
    g = torch.Generator().manual_seed(5)
    src = torch.randn(20_000, generator=g).to(torch.bfloat16)
    snap, dst = src.clone(), src.clone()
    for mark in (True, False):
        cache, ucache, ptrs = ({N.REUSE: True} if mark else {}), {}, []
        held = []
        for k, frac in enumerate((0.6, 0.01, 0.0, 0.3, 0.001)):
            src.copy_(ulp_steps(src, frac, g, spread=300))
            want = D.pack_delta([(src, snap.clone())], 2048, backend="torch")
            if k % 2:
                updates: list = []
                msg = pack_deferred([(src, snap)], 2048, updates, cache)
                delta_cpu.commit_updates(updates)
            else:
                msg = D.pack_delta([(src, snap)], 2048, backend="torch", cache=cache)
            assert torch.equal(msg, want), (mark, k)
            assert torch.equal(bits(snap), bits(src)), (mark, k)
            held.append((msg.clone(), msg))
            ptrs.append(msg.data_ptr())
            D.unpack_delta(msg, [dst], backend="torch", cache=ucache)
            assert torch.equal(bits(dst), bits(src)), (mark, k)
        assert len(set(ptrs)) == (1 if mark else len(ptrs)), mark
        if not mark:  # each message kept its own bytes
            assert all(torch.equal(a, b) for a, b in held)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_length_and_header_read_in_a_larger_buffer(codec, dtype):
    """A message received into a larger (poisoned) buffer, as a gloo receive lands: its length from its own
    directory (none changed, a few, every chunk dense), its header's words read in place, and the apply
    through a cached plan."""
    codec("native")
    g = torch.Generator().manual_seed(6)
    old = (torch.randn(5000, generator=g) * 3).to(dtype)
    for frac in (0.0, 0.01, 1.0):
        new = ulp_steps(old, frac, g) if frac < 1 else old.clone()
        if frac == 1:
            bits(new).add_(1)
        msg = D.pack_delta([(new, old.clone())], 1024, update=False, backend="torch")
        box = torch.full((msg.numel() + 4096,), 0xA5, dtype=torch.uint8)
        box[: msg.numel()] = msg
        assert D.message_length(box) == msg.numel(), frac
        assert [N.header_word(box, k) for k in range(4)] == msg[:16].view(torch.int32).tolist()
        dst, cache = old.clone(), {}
        for _ in range(2):
            dst.copy_(old)
            D.unpack_delta(box, [dst], backend="torch", cache=cache)
            assert torch.equal(bits(dst), bits(new)), frac


def _corrupt_cases(msg: torch.Tensor) -> list[torch.Tensor]:
    c = D.describe(msg)[0]
    at = c["offset"] + 16
    out = []
    for where, value in ((at, 0x07), (at, 0x31), (at + 1, 0xFF), (at, 0x00)):  # code, mode, count, unchanged
        bad = msg.clone()
        bad[where] = value
        out.append(bad)
    bad = msg.clone()
    nb = -(-c["numel"] // 256)
    first = at + 2 * nb  # block 0's first offset byte: past the block
    bad[first] = 255 if c["numel"] < 256 else bad[first + 1]  # out of order / repeated
    out.append(bad)
    bad = msg.clone()
    bad[c["offset"] + 8 : c["offset"] + 12].view(torch.int32)[0] += 1  # header count
    out.append(bad)
    return out


def refused_by_both_codecs(codec, bad: torch.Tensor, old: torch.Tensor) -> None:
    """``bad`` unpacked onto a copy of ``old`` by each codec: ValueError naming the destination, nothing written,
    the same message from both."""
    errors = []
    for name in CODECS:
        codec(name)
        dst = old.clone()
        with pytest.raises(ValueError) as e:
            D.unpack_delta(bad, [dst], backend="torch", names=["model.w"])
        assert torch.equal(bits(dst), bits(old)), "written before the check"
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "'model.w'" in errors[0], errors


def test_corrupt_bodies_refused_before_any_write(codec):
    """A narrow body inconsistent with its header (bad code, mode, count, an offset out of order, a count
    that does not add up) raises ValueError naming the chunk and destination, with nothing written; both
    codecs give the same error."""
    g = torch.Generator().manual_seed(5)
    old = torch.randn(4096, generator=g).to(torch.bfloat16)
    new = ulp_steps(old, 0.02, g)
    codec("numpy")
    msg = D.pack_delta([(new, old.clone())], 4096, backend="torch")
    for bad in _corrupt_cases(msg):
        refused_by_both_codecs(codec, bad, old)


def test_version_one_still_reads(codec):
    """Messages of version 1 (the Triton kernels' and the torch reference's) unpack as before."""
    g = torch.Generator().manual_seed(6)
    old = torch.randn(5000, generator=g).to(torch.float16)
    new = ulp_steps(old, 0.05, g)
    msg = D._tensor_pack([(new, old.clone())], 1024, update=False)
    for name in CODECS:
        codec(name)
        dst = old.clone()
        D.unpack_delta(msg, [dst], backend="torch")
        assert torch.equal(bits(dst), bits(new))
