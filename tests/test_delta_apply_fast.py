"""The native apply's faster paths (issue 44 item 1, ``csrc/delta_apply.c``, ``csrc/delta_check.c``): the check
of a block's offsets 16 pairs per compare (an offset out of order anywhere in a block, in any block, up to the
message's last bytes, is refused before any write), a block's count that disagrees, the 16-bit offsets blocks
added as decoded, every element size's sparse apply, and the check and apply of a message of >= 1 MiB in two
parts on two threads (``delta_native.codec_threads(2)``): the same bits into poisoned destinations as one
thread and as the numpy reference, the same refusals (the first bad chunk named, nothing written), the
snapshot's commit and undo. Every SIMD level this CPU has."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cpu
from triton_reshard.ops import delta_native as N
from triton_reshard.ops.delta_cached import pack_deferred

from .test_delta_simd import simd  # noqa: F401 (a fixture)
from .test_delta_v2 import adversarial, bits, refused_by_both_codecs, ulp_steps


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request, codec):
    codec("native")
    if N.codec_threads() is None:
        pytest.skip("a build of the native codec without trd_codec_threads")
    prev = N.codec_threads(request.param)
    yield request.param
    N.codec_threads(prev)


def offset_bytes(msg: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    """(first offset byte, count) of every offsets-mode, unpatched, non-raw block of a narrow chunk."""
    c = D.describe(msg)[chunk]
    at, nb = c["offset"] + 16, -(-c["numel"] // 256)
    desc = msg[at : at + 2 * nb].tolist()
    e, body, out = c["elem_size"], at + 2 * nb, []
    for b in range(nb):
        d, cnt = desc[2 * b], desc[2 * b + 1] + 1
        code, mode = d & 15, d >> 4
        blen = min(256, c["numel"] - 256 * b)
        if code == 0:
            continue
        w = 8 * e if code == 6 else 1 << code
        vb = (cnt * w + 7) // 8
        if mode == 0 and code != 6:
            out.append((body, cnt))
        size = cnt + vb if mode == 0 else (blen + 7) // 8 + vb if mode == 1 else (blen * w + 7) // 8
        if mode >= 3:  # patched: a count of exceptions (slot + value each) past the values
            size = (cnt + vb if (mode - 3) // 4 == 0 else (blen + 7) // 8 + vb) + ((mode - 3) % 4 + 1) * (
                1 + e
            )
        body += size
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("frac", [0.01, 0.1])
def test_an_offset_out_of_order_anywhere_is_refused(codec, dtype, frac):
    """An offset made equal to the one before it, or smaller, in the first, a middle or the last offsets block
    of the last chunk (the last one ends near the message's end: the byte-at-a-time check), at any place in
    the block (the 16-pair compares: first, 15th, 16th, 17th, last): ValueError from both codecs, nothing
    written."""
    g = torch.Generator().manual_seed(11)
    old = (torch.randn(3000, generator=g) * 0.02).to(dtype)
    new = ulp_steps(old, frac, g, 8)
    codec("numpy")
    msg = D.pack_delta([(new, old.clone())], 4096, backend="torch")
    blocks = [b for b in offset_bytes(msg, 0) if b[1] >= 2]
    assert blocks, "no offsets block to corrupt"
    for first, cnt in {blocks[0], blocks[len(blocks) // 2], blocks[-1]}:
        for k in sorted({1, 15, 16, 17, cnt - 1} & set(range(1, cnt))):
            for how in ("repeat", "smaller"):
                bad = msg.clone()
                prev = int(bad[first + k - 1])
                if how == "smaller" and prev == 0:
                    continue
                bad[first + k] = prev if how == "repeat" else prev - 1
                refused_by_both_codecs(codec, bad, old)


def big_views(g: torch.Generator, frac: float) -> tuple[list, list]:
    """(new, old) pairs making a message of over 1 MiB of chunks at ce 256 (the two-part apply): bf16, fp16 and
    fp32 tensors of odd sizes, one a row view (a column block of a wider tensor)."""
    shapes = [
        (700, 1031, torch.bfloat16),
        (333, 517, torch.float16),
        (97, 1001, torch.float32),
        (1, 7, torch.bfloat16),
    ]
    pairs = []
    for r, c, dt in shapes:
        old = (torch.randn(r, c, generator=g) * 0.02).to(dt)
        pairs.append((ulp_steps(old.reshape(-1), frac, g, 8).view(r, c), old))
    return pairs


def poisoned_like(old: torch.Tensor, row_view: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer filled with -1 bits, a view of it holding ``old``): a row view 5 columns in, or a flat slice 3
    elements in (unaligned)."""
    if row_view:
        big = torch.empty(old.shape[0], old.shape[1] + 9, dtype=old.dtype)
        bits(big).fill_(-1)
        d = big[:, 5 : 5 + old.shape[1]]
    else:
        big = torch.empty(old.numel() + 11, dtype=old.dtype)
        bits(big).fill_(-1)
        d = big[3 : 3 + old.numel()].view(old.shape)
    d.copy_(old)
    return big, d


def check_poison(big: torch.Tensor, d: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(bits(d), bits(want))
    rest = bits(big)
    keep = torch.ones_like(rest, dtype=torch.bool)
    if d.dim() == 2 and d.stride(0) != d.shape[1]:
        keep[:, 5 : 5 + d.shape[1]] = False
    else:
        keep[3 : 3 + d.numel()] = False
    assert bool((rest[keep] == -1).all()), "a byte outside the destination was written"


@pytest.mark.parametrize("frac", [0.01, 0.1, 1.0])
def test_two_part_apply_is_bit_exact(simd, threads, frac):  # noqa: F811 (the fixture)
    g = torch.Generator().manual_seed(12)
    pairs = big_views(g, frac)
    for ce in (256, 4096) if frac == 0.1 else (256,):
        snaps = [o.clone() for _n, o in pairs]
        msg = D.pack_delta([(n, s) for (n, _o), s in zip(pairs, snaps, strict=True)], ce, backend="torch")
        prev = N.set_native(False)
        try:
            want = D.pack_delta([(n, o.clone()) for n, o in pairs], ce, backend="torch")
        finally:
            N.set_native(prev)
        assert torch.equal(msg, want), (frac, ce, threads, simd)
        bufs = [poisoned_like(o, row_view=(i == 0)) for i, (_n, o) in enumerate(pairs)]
        D.unpack_delta(msg, [d for _b, d in bufs], backend="torch")
        for (n, _o), (big, d) in zip(pairs, bufs, strict=True):
            check_poison(big, d, n)


def test_two_part_adversarial_cases(simd, threads):  # noqa: F811
    """Every adversarial case of ``test_delta_v2`` (all changed, sign flips, +-0, NaN payloads, subnormals, a
    block with one 16-bit difference), each dtype, in one message big enough for two parts."""
    g = torch.Generator().manual_seed(13)
    pairs = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        for _name, old, new in adversarial(dt, 70_000, g):
            pairs.append((new, old))
    msg = D.pack_delta([(n, o.clone()) for n, o in pairs], 256, backend="torch")
    assert msg.numel() + 256 * N.header_word(msg, 2) >= 1 << 20  # the split's weight: two parts
    bufs = [poisoned_like(o, row_view=False) for _n, o in pairs]
    D.unpack_delta(msg, [d for _b, d in bufs], backend="torch")
    for (n, _o), (big, d) in zip(pairs, bufs, strict=True):
        check_poison(big, d, n)


def test_two_part_refusal_names_the_first_bad_chunk(codec, threads):
    """A bad chunk in the second part (and one in each part): the error names the first, as the numpy
    reader's, and nothing is written anywhere."""
    g = torch.Generator().manual_seed(14)
    pairs = big_views(g, 0.02)
    codec("numpy")
    msg = D.pack_delta([(n, o.clone()) for n, o in pairs], 256, backend="torch")
    chunks = D.describe(msg)
    narrow = [i for i, c in enumerate(chunks) if c["kind"] == "narrow" and c["count"] > 0]
    late, early = narrow[-3], narrow[2]
    names = [f"model.w{i}" for i in range(len(pairs))]
    for which in ([late], [early, late]):
        bad = msg.clone()
        for i in which:
            bad[chunks[i]["offset"] + 16] = 0x07  # block 0's code: past raw
        errors = []
        for name in ("numpy", "native"):
            codec(name)
            if name == "native":
                N.codec_threads(threads)
            dsts = [o.clone() for _n, o in pairs]
            with pytest.raises(ValueError) as e:
                D.unpack_delta(bad, dsts, backend="torch", names=names)
            for d, (_n, o) in zip(dsts, pairs, strict=True):
                assert torch.equal(bits(d), bits(o)), "written before the check"
            errors.append(str(e.value))
        assert errors[0] == errors[1], errors


@pytest.mark.parametrize("commit", [True, False])
def test_two_part_commit_and_undo(codec, threads, commit):
    """A deferred snapshot update of a big message, committed or undone on two threads: the new or the old
    bits exactly."""
    codec("native")
    N.codec_threads(threads)
    g = torch.Generator().manual_seed(15)
    for frac in (0.02, 0.1):
        pairs = [(n.reshape(-1), o.reshape(-1)) for n, o in big_views(g, frac)]
        snaps, updates = [o.clone() for _n, o in pairs], []
        pack_deferred([(n, s) for (n, _o), s in zip(pairs, snaps, strict=True)], 256, updates, cache={})
        (delta_cpu.commit_updates if commit else delta_cpu.undo_updates)(updates)
        for (n, o), s in zip(pairs, snaps, strict=True):
            assert torch.equal(bits(s), bits(n if commit else o)), (frac, commit, threads)


def test_codec_threads_setting(codec):
    codec("native")
    if N.codec_threads() is None:
        pytest.skip("no trd_codec_threads in this build")
    prev = N.codec_threads()
    try:
        assert N.codec_threads(2) == 2 and N.codec_threads(1) == 1
        with pytest.raises(ValueError):
            N.codec_threads(3)
    finally:
        N.codec_threads(prev)


def descriptors(msg: torch.Tensor, chunk: int) -> list[tuple[int, int, int]]:
    """(byte index of the descriptor, its first byte, its change count) of every block of a narrow chunk."""
    c = D.describe(msg)[chunk]
    at, nb = c["offset"] + 16, -(-c["numel"] // 256)
    desc = msg[at : at + 2 * nb].tolist()
    return [(at + 2 * b, desc[2 * b], desc[2 * b + 1] + 1) for b in range(nb)]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("frac", [0.01, 0.1])
def test_a_block_count_that_disagrees_is_refused(codec, dtype, frac):
    """The check's inline run of common blocks (csrc/delta_check.c): a block's count one more or one less, an
    empty block given a count, a block made empty with its count kept, in the first, a middle and the
    second-last block of a chunk (inside the run) and the last (check_block): ValueError from both codecs,
    nothing written; each element size (the narrow codes differ)."""
    g = torch.Generator().manual_seed(16)
    old = (torch.randn(8192, generator=g) * 0.02).to(dtype)
    new = ulp_steps(old, frac, g, 8)
    codec("numpy")
    msg = D.pack_delta([(new, old.clone())], 8192, backend="torch")
    blocks = descriptors(msg, 0)
    full = [b for b in blocks if b[1]]
    empty = [b for b in blocks[:-1] if not b[1]]
    picks = {full[0], full[len(full) // 2], blocks[-2], blocks[-1], *empty[:1]}
    for at, d0, cnt in picks:
        for d, c in ((d0, cnt + 1), (d0, cnt - 1), (0, cnt)):
            if not 1 <= c <= 256 or (d, c) == (d0, cnt):
                continue
            bad = msg.clone()
            bad[at], bad[at + 1] = d, c - 1
            refused_by_both_codecs(codec, bad, old)


@pytest.mark.parametrize("frac", [0.01, 0.1])
def test_sparse_apply_every_width_is_bit_exact(simd, threads, frac):  # noqa: F811
    """1-, 2-, 4- and 8-byte elements moved by a few ulps (2-bit values), by up to 100 (8-bit) and, the wider
    ones, by up to 2^20 (raw or 32-bit), into poisoned flat and row views: the bits of the new tensors."""
    g = torch.Generator().manual_seed(17)
    pairs = []
    for dt in (torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for spread in (2, 100) + ((1 << 20,) if dt.itemsize >= 4 else ()):
            old = (torch.randn(61, 257, generator=g) * 0.02).to(dt)
            pairs.append((ulp_steps(old.reshape(-1), frac, g, spread).view(61, 257), old))
    msg = D.pack_delta([(n, o.clone()) for n, o in pairs], 4096, backend="torch")
    bufs = [poisoned_like(o, row_view=bool(i % 2)) for i, (_n, o) in enumerate(pairs)]
    D.unpack_delta(msg, [d for _b, d in bufs], backend="torch")
    for (n, _o), (big, d) in zip(pairs, bufs, strict=True):
        check_poison(big, d, n)


def counted_blocks(dtype: torch.dtype, nblocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) of 16-bit elements (the last block 100 short) whose block b holds exactly b % 13 changes (0 ..
    12: the AVX-512 staged run takes 0 .. 8 and hands a block of more to the generic path), at random places,
    each moved by up to +-1, 7, 120 or 3000 in its bit pattern (2-, 4-, 8-bit values, or raw: a block the run
    hands on) by turns every 13 blocks, sign flips and +-0 among them."""
    n = 256 * nblocks - 100
    old = (torch.randn(n, generator=g) * 0.02).to(dtype)
    old[5] = 0.0
    new = old.clone()
    b16 = bits(new)
    for b in range(nblocks):
        blen = min(256, n - 256 * b)
        k = min(b % 13, blen)
        at = 256 * b + torch.randperm(blen, generator=g)[:k]
        spread = (1, 7, 120, 3000)[b // 13 % 4]
        step = torch.randint(1, spread + 1, (k,), generator=g) * (
            torch.randint(0, 2, (k,), generator=g) * 2 - 1
        )
        b16[at] += step.to(torch.int16)
    if nblocks > 3:
        b16[256 * 3 + 7] ^= -(1 << 15)  # a sign flip (raw) in block 3
        b16[5] = -(1 << 15)  # +0 -> -0 (raw) in block 0
    return new, old


def numpy_unpack(msg: torch.Tensor, olds: list[torch.Tensor]) -> list[torch.Tensor]:
    prev = N.set_native(False)
    try:
        dsts = [o.clone() for o in olds]
        D.unpack_delta(msg, dsts, backend="torch")
        return dsts
    finally:
        N.set_native(prev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_staged_run_every_count_and_width(simd, threads, dtype):  # noqa: F811
    """The sparse apply's AVX-512 run of common blocks (csrc/delta_stage.c) and the apply queued a chunk behind
    its decode: blocks of 0 .. 12 changes of every width, raw blocks, a short last block, chunks of 1, 16 and
    128 blocks, flat and row views (poisoned around), one message of several tensors (the queue's chunks apply
    across them): the numpy reference's bits; every SIMD level, one and two threads."""
    g = torch.Generator().manual_seed(18)
    pairs = [counted_blocks(dtype, nb, g) for nb in (1, 52, 107, 301)]
    pairs.append((pairs[2][0][: 61 * 257].view(61, 257), pairs[2][1][: 61 * 257].view(61, 257)))
    for ce in (256, 4096, 32768):
        msg = D.pack_delta([(n, o.clone()) for n, o in pairs], ce, backend="torch")
        want = numpy_unpack(msg, [o for _n, o in pairs])
        bufs = [poisoned_like(o, row_view=o.dim() == 2) for _n, o in pairs]
        D.unpack_delta(msg, [d for _b, d in bufs], backend="torch")
        for (n, _o), w, (big, d) in zip(pairs, want, bufs, strict=True):
            assert torch.equal(bits(w), bits(n)), ce
            check_poison(big, d, n)


@pytest.mark.parametrize("commit", [True, False])
def test_staged_run_commit_and_undo(simd, threads, commit):  # noqa: F811
    """The staged run's negated values (an undo subtracts the differences) and the queue on the snapshot of a
    deferred pack: the new or the old bits exactly."""
    g = torch.Generator().manual_seed(19)
    pairs = [counted_blocks(dt, 211, g) for dt in (torch.bfloat16, torch.float16)]
    snaps, updates = [o.clone() for _n, o in pairs], []
    pack_deferred([(n, s) for (n, _o), s in zip(pairs, snaps, strict=True)], 4096, updates, cache={})
    (delta_cpu.commit_updates if commit else delta_cpu.undo_updates)(updates)
    for (n, o), s in zip(pairs, snaps, strict=True):
        assert torch.equal(bits(s), bits(n if commit else o)), commit


def test_staged_run_refuses_an_empty_block_with_a_count(simd):  # noqa: F811
    """The run's own check (the apply of a message nobody checked first, as a commit's): an empty block given a
    count inside a run makes trd_unpack_rows return that chunk, with its changes not applied."""
    lib = N.native()
    g = torch.Generator().manual_seed(20)
    new, old = counted_blocks(torch.bfloat16, 64, g)
    msg = D.pack_delta([(new, old.clone())], 4096, backend="torch")
    chunk = 2
    empty = [at for at, d0, _c in descriptors(msg, chunk)[:-1] if d0 == 0]
    assert empty, "no empty block in the chunk"
    bad = msg.clone()
    bad[empty[0] + 1] = 2
    dst = old.clone()
    ptr, numel, esize = (N._ptrs([v]) for v in (dst.data_ptr(), dst.numel(), 2))
    r = lib.trd_unpack_rows(
        bad.data_ptr(), 1, N._arg(ptr), N._arg(numel), N._arg(esize), None, None, 4096, N.APPLY
    )
    assert r == chunk
    assert torch.equal(
        bits(dst[4096 * chunk : 4096 * (chunk + 1)]), bits(old[4096 * chunk : 4096 * (chunk + 1)])
    )
    assert torch.equal(bits(dst[: 4096 * chunk]), bits(new[: 4096 * chunk]))


@pytest.mark.parametrize("frac", [0.015, 0.025])
@pytest.mark.parametrize("lane", range(8))
def test_check_groups_refuse_a_bad_block_in_any_lane(codec, lane, frac):
    """The check's groups of 8 common blocks (csrc/delta_check.c, AVX-512; at 2.5 % many groups' payloads
    near or past its 63 bytes): in the block at each place of a group, an offset equal to the one before (the first and the last pair), a count one more or one less, an
    empty block given a count: ValueError from both codecs, nothing written."""
    g = torch.Generator().manual_seed(21 + lane)
    old = (torch.randn(64 * 256, generator=g) * 0.02).to(torch.bfloat16)
    new = ulp_steps(old, frac, g, 2)
    codec("numpy")
    msg = D.pack_delta([(new, old.clone())], 64 * 256, backend="torch")
    blocks = descriptors(msg, 0)
    offsets = dict(zip([b[0] for b in blocks if b[1]], offset_bytes(msg, 0), strict=True))
    full = [b for b in blocks[8:-9] if b[1] and 3 <= b[2] <= 8 and (b[0] - blocks[0][0]) // 2 % 8 == lane]
    empty = [b for b in blocks[8:-9] if not b[1] and (b[0] - blocks[0][0]) // 2 % 8 == lane]
    assert full, "no block of 3..8 changes at this place"
    at, d0, cnt = full[0]
    first, _cnt = offsets[at]
    cases = []
    for k in (1, cnt - 1):  # an offset equal to the one before
        bad = msg.clone()
        bad[first + k] = bad[first + k - 1]
        cases.append(bad)
    for c in (cnt + 1, cnt - 1):
        bad = msg.clone()
        bad[at + 1] = c - 1
        cases.append(bad)
    for e_at, _d, _c in empty[:1]:
        bad = msg.clone()
        bad[e_at + 1] = 1
        cases.append(bad)
    for bad in cases:
        refused_by_both_codecs(codec, bad, old)


@pytest.mark.parametrize("frac", [0.3, 1.0])
def test_check_of_a_chunk_of_uncommon_blocks(codec, simd, frac):  # noqa: F811
    """A chunk of 256 blocks none of which the check's groups take (bitmask positions at 30 %, every element
    at 100 %: each block by the one-at-a-time path; the span the groups hand on grows and stays bounded):
    checked and applied to the new bits, and a bad count in its last blocks refused."""
    g = torch.Generator().manual_seed(22)
    old = (torch.randn(256 * 256, generator=g) * 0.02).to(torch.bfloat16)
    new = ulp_steps(old, frac, g, 2) if frac < 1 else old.clone()
    if frac == 1:
        bits(new).add_(1)
    msg = D.pack_delta([(new, old.clone())], 256 * 256, backend="torch")
    dst = old.clone()
    D.unpack_delta(msg, [dst], backend="torch")
    assert torch.equal(bits(dst), bits(new))
    at, d0, cnt = descriptors(msg, 0)[-3]
    bad = msg.clone()
    bad[at + 1] = cnt - 2
    refused_by_both_codecs(codec, bad, old)
