"""Tests of the delta op (``triton_reshard/ops/delta.py``, kernels in ``kernels/delta.py``) and the sender
snapshot (``triton_reshard/ops/snapshot.py``).

Every case runs on both backends: ``torch`` (the reference) and ``triton`` (the kernels under
``TRITON_INTERPRET=1`` on CPU, so the sizes stay small). The expected result is computed independently of
both: the destination after unpack must equal, bit for bit and over the whole poisoned buffer around the
view, the destination with exactly the changed elements (found here by comparing bit patterns) replaced by
the source's bits; a Triton message must equal the reference's byte for byte.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_cached as C
from triton_reshard.ops import delta_cpu
from triton_reshard.ops.snapshot import Snapshot

# These tests pin format version 1 (the v1 kinds, the bytes of the Triton kernels and the torch reference);
# the CPU default, version 2 (narrow values), is tested in tests/test_delta_v2.py.
torch_pack_v1 = functools.partial(D.torch_pack, version=1)
pack_delta_v1 = functools.partial(D.pack_delta, version=1)
pack_deferred_v1 = functools.partial(C.pack_deferred, version=1)

BACKENDS = ("torch", "tensor", "triton")  # torch on CPU = its numpy path; "tensor": its torch-ops path
INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def pack(backend, pairs, **kw):
    fn = {"triton": D.triton_pack, "tensor": D._tensor_pack}.get(backend, torch_pack_v1)
    return fn(pairs, **kw)


def unpack(backend, msg, dsts, **kw):
    fn = {"triton": D.triton_unpack, "tensor": D._tensor_unpack}.get(backend, D.torch_unpack)
    return fn(msg, dsts, **kw)


def random_bits(shape, dtype, g) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infinities, -0.0 and subnormals included for floats)."""
    e = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * e,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def changed_copy(t: torch.Tensor, mask: torch.Tensor, g) -> torch.Tensor:
    """A copy of ``t`` whose bits differ exactly where ``mask`` is set (XOR with a nonzero pattern)."""
    out = t.clone()
    e = t.element_size()
    flip = torch.randint(1, 1 << min(8 * e - 1, 62), t.shape, generator=g, dtype=torch.int64).to(INT[e])
    b = bits(out)
    b[mask] ^= flip[mask]
    return out


def holder(shape, kind: str, dtype, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view of ``shape`` inside it): ``contig``, ``transposed`` (a transpose of the buffer's
    storage), ``offset`` (nonzero storage offset), ``strided`` (every other element of the last dim)."""
    n = math.prod(shape)
    if kind == "contig":
        buf = torch.empty(n + 8, dtype=dtype)
        return buf, buf[4:4 + n].view(shape)
    if kind == "offset":
        buf = torch.empty(n + 13, dtype=dtype)
        return buf, buf[13:].view(shape)
    if kind == "strided":
        buf = torch.empty(*shape[:-1], 2 * shape[-1] + 1, dtype=dtype)
        return buf, buf[..., 1::2]
    if kind == "transposed":
        buf = torch.empty(*reversed(shape), dtype=dtype)
        return buf, buf.permute(*reversed(range(len(shape))))
    raise AssertionError(kind)


def fill_bits(buf: torch.Tensor, value: int) -> None:
    bits(buf).fill_(value)


def case(shape, dtype, mask_fn, seed, src_kind="contig", dst_kind="contig"):
    """(src view, snapshot view, destination buffer, destination view, mask of changed elements)."""
    g = torch.Generator().manual_seed(seed)
    old = random_bits(shape, dtype, g)
    mask = mask_fn(shape, g)
    new = changed_copy(old, mask, g)
    sbuf, src = holder(shape, src_kind, dtype, None)
    fill_bits(sbuf, -1)
    src.copy_(new)
    pbuf, snap = holder(shape, "contig", dtype, None)
    fill_bits(pbuf, -1)
    bits(snap).copy_(bits(old))
    dbuf, dst = holder(shape, dst_kind, dtype, None)
    fill_bits(dbuf, -1)  # poison outside the view
    bits(dst).copy_(bits(old))
    assert torch.equal(bits(src) != bits(snap), mask)
    return src, snap, dbuf, dst, mask


def density(frac):
    return lambda shape, g: torch.rand(shape, generator=g) < frac


def only(*flat_idx):
    def fn(shape, g):
        m = torch.zeros(math.prod(shape), dtype=torch.bool)
        for i in flat_idx:
            m[i % m.numel()] = True
        return m.view(shape)

    return fn


def expect_unpacked(dbuf_before: torch.Tensor, dst_view_pos, src, mask) -> torch.Tensor:
    """The destination buffer's bits after a correct unpack: ``dst[mask] = src[mask]``, nothing else."""
    want = bits(dbuf_before).clone()
    dview = want.as_strided(src.shape, dst_view_pos[0], dst_view_pos[1])
    dview[mask] = bits(src)[mask]
    return want


def run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems, update=True):
    before = dbuf.clone()
    snap_before = bits(snap).clone()
    ref_snap = snap.clone()
    ref = torch_pack_v1([(src, ref_snap)], chunk_elems=chunk_elems, update=False)
    msg = pack(backend, [(src, snap)], chunk_elems=chunk_elems, update=update)
    assert torch.equal(msg, ref), "message differs from the reference's bytes"
    # snapshot: updated to the source (or untouched)
    assert torch.equal(bits(snap), bits(src) if update else snap_before)
    unpack(backend, msg, [dst])
    want = expect_unpacked(before, (dst.stride(), dst.storage_offset()), src, mask)
    assert torch.equal(bits(dbuf), want)
    # the destination held the snapshot: unpack ∘ pack is a dense copy
    assert torch.equal(bits(dst), bits(src))
    return msg


# ---------------------------------------------------------------------------------------------------------
# round trips


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, FP8]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("frac", [0.0, 0.02, 0.07, 0.5, 1.0], ids=lambda f: f"{100 * f:g}pct")
def test_roundtrip_densities(backend, dtype, frac):
    src, snap, dbuf, dst, mask = case((4097,), dtype, density(frac), seed=int(frac * 100) + 7)
    msg = run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems=1024)
    info = D.describe(msg)
    assert [c["numel"] for c in info] == [1024, 1024, 1024, 1024, 1]
    assert sum(c["count"] for c in info) == int(mask.sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", [(0,), (-1,), (1000,), (0, -1), (1023, 1024)], ids=str)
def test_single_and_edge_elements(backend, which):
    src, snap, dbuf, dst, mask = case((4097,), torch.bfloat16, only(*which), seed=3)
    msg = run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems=1024)
    assert sum(c["count"] for c in D.describe(msg)) == len(set(i % 4097 for i in which))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1,), (33,), (7, 33), (3, 5, 33)], ids=str)
@pytest.mark.parametrize("src_kind,dst_kind", [("contig", "contig"), ("transposed", "strided"),
                                               ("offset", "transposed"), ("strided", "offset")])
def test_views(backend, shape, src_kind, dst_kind):
    src, snap, dbuf, dst, mask = case(shape, torch.bfloat16, density(0.2), seed=len(shape),
                                      src_kind=src_kind, dst_kind=dst_kind)
    run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems=64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_elems", [7, 31, 32, 33, 100])
def test_chunk_boundaries(backend, chunk_elems):
    src, snap, dbuf, dst, mask = case((7, 33), torch.float32, density(0.3), seed=chunk_elems,
                                      src_kind="transposed", dst_kind="strided")
    msg = run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems=chunk_elems)
    assert len(D.describe(msg)) == math.ceil(231 / chunk_elems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_chunk_last_offset(backend):
    """A chunk of 65,536 elements whose last element changed: offset 65535 needs all 16 bits."""
    src, snap, dbuf, dst, mask = case((1 << 16,), torch.bfloat16, only(0, 40000, 65535), seed=5)
    msg = run_roundtrip(backend, src, snap, dbuf, dst, mask, chunk_elems=1 << 16)
    assert [c["kind"] for c in D.describe(msg)] == ["offsets"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_destination_keeps_unchanged(backend):
    """An element that did not change is never written: the destination's poison stays there."""
    src, snap, dbuf, dst, mask = case((33, 7), torch.bfloat16, density(0.3), seed=11, dst_kind="transposed")
    fill_bits(dbuf, 0x7FAB)  # a NaN pattern everywhere, the view included
    before = dbuf.clone()
    msg = pack(backend, [(src, snap)], chunk_elems=64)
    unpack(backend, msg, [dst])
    want = expect_unpacked(before, (dst.stride(), dst.storage_offset()), src, mask)
    assert torch.equal(bits(dbuf), want)
    assert int((bits(dst) == 0x7FAB).sum()) == int((~mask).sum()) + int((bits(src)[mask] == 0x7FAB).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_payloads_and_signed_zero(backend):
    """Compared by bits: -0.0 vs +0.0 and two NaN payloads are changes; equal NaN bits are not."""
    old = torch.tensor([0.0, float("nan"), float("nan"), 1.0, -0.0], dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0
    bits(new)[1] = 0x7FC00001  # another NaN payload
    new[4] = 0.0
    snap, dst = old.clone(), old.clone()
    msg = pack(backend, [(new, snap)], chunk_elems=64)
    assert D.describe(msg)[0]["count"] == 3
    unpack(backend, msg, [dst])
    assert torch.equal(bits(dst), bits(new))


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_pairs_mixed_element_sizes(backend):
    """One message over views of several tensors and dtypes (one launch per element size)."""
    specs = [((40,), torch.bfloat16, 0.1, "contig", "strided"), ((0,), torch.float32, 0.5, "contig", "contig"),
             ((9, 7), torch.float32, 0.5, "transposed", "offset"), ((65,), torch.int8, 1.0, "offset", "contig"),
             ((5, 13), torch.float16, 0.0, "strided", "transposed"), ((3,), torch.float64, 0.7, "contig", "contig")]
    cases = [case(s, dt, density(f), seed=i, src_kind=a, dst_kind=b) for i, (s, dt, f, a, b) in enumerate(specs)]
    befores = [c[2].clone() for c in cases]
    ref = torch_pack_v1([(c[0], c[1].clone()) for c in cases], chunk_elems=16, update=False)
    msg = pack(backend, [(c[0], c[1]) for c in cases], chunk_elems=16)
    assert torch.equal(msg, ref)
    assert msg.numel() <= D.max_message_bytes([c[0].numel() for c in cases], [c[0].element_size() for c in cases], 16)
    unpack(backend, msg, [c[3] for c in cases])
    for (src, snap, dbuf, dst, mask), before in zip(cases, befores, strict=True):
        assert torch.equal(bits(snap), bits(src))
        assert torch.equal(bits(dbuf), expect_unpacked(before, (dst.stride(), dst.storage_offset()), src, mask))


def test_kind_is_the_smallest_encoding():
    """Across the density thresholds: every chunk's kind is the smallest of the three encodings (sizes
    recomputed here from the format's definition) and its nbytes is that size."""
    def size(kind, n, c, e):
        p16 = lambda x: -(-x // 16) * 16  # noqa: E731
        return {"offsets": 16 + p16(2 * c) + p16(e * c), "bitmask": 16 + p16(4 * -(-n // 32)) + p16(e * c),
                "dense": 16 + p16(e * n)}[kind]

    g = torch.Generator().manual_seed(0)
    n = 4096
    for dtype in (torch.bfloat16, torch.float32, torch.int8):
        e = torch.empty(0, dtype=dtype).element_size()
        for count in (0, 1, 120, 127, 128, 129, 200, 255, 256, 257, 1000, 3800, 3839, 3840, 3841, 4000, 4096):
            old = random_bits((n,), dtype, g)
            m = torch.zeros(n, dtype=torch.bool)
            m[torch.randperm(n, generator=g)[:count]] = True
            (info,) = D.describe(torch_pack_v1([(changed_copy(old, m, g), old.clone())], chunk_elems=n))
            sizes = {k: size(k, n, count, e) for k in ("offsets", "bitmask", "dense")}
            best = min(sizes.values())
            assert info["count"] == count and info["nbytes"] == best
            assert info["kind"] == next(k for k in ("offsets", "bitmask", "dense") if sizes[k] == best)


# ---------------------------------------------------------------------------------------------------------
# bad input and corrupt messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_pairs(backend):
    a = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'w'.*shapes and dtypes"):
        pack(backend, [(a, torch.zeros(9, dtype=torch.bfloat16))], names=["w"])
    with pytest.raises(ValueError, match="shapes and dtypes"):
        pack(backend, [(a, torch.zeros(8, dtype=torch.float16))])
    for bad in (0, 65537):
        with pytest.raises(ValueError, match="chunk_elems"):
            pack(backend, [(a, a.clone())], chunk_elems=bad)
    with pytest.raises(ValueError, match="no pairs"):
        pack(backend, [])


def _msg():
    src, snap, dbuf, dst, mask = case((100,), torch.bfloat16, only(3, 50, 99), seed=1)
    return torch_pack_v1([(src, snap)], chunk_elems=64, update=False), dst


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_headers_refused_before_any_write(backend):
    msg, dst = _msg()
    before = bits(dst).clone()
    # wrong destinations: another shape, another dtype
    with pytest.raises(ValueError, match="chunks"):
        unpack(backend, msg, [torch.zeros(200, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="elem_size"):
        unpack(backend, msg, [torch.zeros(100, dtype=torch.float32)], names=["model.w"])
    bad = msg.clone()
    bad[:4] = 0
    with pytest.raises(ValueError, match="magic"):
        unpack(backend, bad, [dst])
    with pytest.raises(ValueError, match="multiple of 16|shorter"):
        unpack(backend, msg[:-8].clone(), [dst])
    with pytest.raises(ValueError, match="inconsistent"):
        unpack(backend, msg[:-16].clone(), [dst])
    first = D.describe(msg)[0]["offset"]
    for word, value in ((1, 65), (2, 70), (3, 17), (0, 7 | 2 << 8)):  # numel, count, nbytes, kind
        bad = msg.clone()
        bad[first + 4 * word:first + 4 * word + 4].view(torch.int32)[0] = value
        with pytest.raises(ValueError, match="chunk 0 .*inconsistent"):
            unpack(backend, bad, [dst], names=["w"])
    bad = msg.clone()
    bad[16:24].view(torch.int64)[0] = 1 << 40  # directory entry far outside the message
    with pytest.raises(ValueError, match="chunk 0"):
        unpack(backend, bad, [dst])
    assert torch.equal(bits(dst), before)


def test_cpu_directory_errors_match_the_reference():
    """The CPU unpack reads headers and directory in numpy (``ops/delta_cpu.read_directory_np``): every
    corruption gives the reference's ``ValueError`` word for word (``read_directory``, torch ops)."""
    msg, dst = _msg()
    first = D.describe(msg)[0]["offset"]
    cases = [(msg, [torch.zeros(200, dtype=torch.bfloat16)]), (msg, [torch.zeros(100, dtype=torch.float32)]),
             (msg[:-8].clone(), [dst]), (msg[:-16].clone(), [dst])]
    for word, value in ((1, 65), (2, 70), (3, 17), (0, 7 | 2 << 8)):
        bad = msg.clone()
        bad[first + 4 * word:first + 4 * word + 4].view(torch.int32)[0] = value
        cases.append((bad, [dst]))
    for at, value in ((0, 0), (16, 1 << 40), (16, first + 8), (12, 1 << 17)):  # magic, directory, chunk_elems
        bad = msg.clone()
        bad[at:at + 4 + 4 * (at == 16)].view(torch.int64 if at == 16 else torch.int32)[0] = value
        cases.append((bad, [dst]))
    for m, dsts in cases:
        errors = []
        for fn in (D.read_directory, delta_cpu.read_directory_np):
            with pytest.raises(ValueError) as e:
                fn(m, dsts, ["model.w"])
            errors.append(str(e.value))
        assert errors[0] == errors[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_bodies_raise(backend):
    msg, dst = _msg()
    info = D.describe(msg)
    assert info[0]["kind"] == "offsets" and info[0]["count"] == 2
    bad = msg.clone()
    bad[info[0]["offset"] + 16:info[0]["offset"] + 18].view(torch.int16)[0] = 64  # past the chunk
    with pytest.raises(ValueError, match="chunk 0"):
        unpack(backend, bad, [dst])
    # a bitmask whose popcount is not the header's count
    g = torch.Generator().manual_seed(2)
    old = random_bits((64,), torch.bfloat16, g)
    new = changed_copy(old, density(0.5)((64,), g), g)
    m = torch_pack_v1([(new, old.clone())], chunk_elems=64)
    (c,) = D.describe(m)
    assert c["kind"] == "bitmask"
    m[c["offset"] + 16] ^= 1
    with pytest.raises(ValueError, match="chunk 0"):
        unpack(backend, m, [old.clone()])


# ---------------------------------------------------------------------------------------------------------
# the snapshot over real optimizer steps


def test_snapshot_views_and_versions():
    w = torch.randn(6, 8).to(torch.bfloat16)
    snap = Snapshot({"w": w})
    assert snap.nbytes == 96 and snap.version is None
    with pytest.raises(ValueError, match="no version"):
        snap.pairs([("w", w[1:3])])
    snap.capture(0)
    (v, s), = snap.pairs([("w", w.t()[2:5])])
    assert s.shape == v.shape and s.stride() == v.stride()
    assert torch.equal(bits(s), bits(v)) and s.data_ptr() != v.data_ptr()
    with pytest.raises(ValueError, match="not a view"):
        snap.pairs([("w", torch.zeros(2, 8, dtype=torch.bfloat16))])
    with pytest.raises(KeyError):
        snap.pairs([("x", w)])
    with pytest.raises(ValueError, match="version 0"):
        snap.advance(1, 2)
    snap.advance(0, 1)
    assert snap.version == 1
    with pytest.raises(ValueError, match="not dense"):
        Snapshot({"x": torch.zeros(4, 4)[:, :2]})


@pytest.mark.parametrize("backend,steps", [("torch", 6), ("triton", 1)])
def test_delta_refits_over_adamw_steps(backend, steps):
    """fp32 master weights trained by AdamW, bf16 published: every step's delta (two boxes of the shard into
    two destination shards, strided) leaves the destinations bit-identical to a dense refit."""
    torch.manual_seed(0)
    master = torch.nn.Parameter(torch.randn(64, 48) * 0.02)
    opt = torch.optim.AdamW([master], lr=3e-4)
    shard = master.detach().to(torch.bfloat16)
    snap = Snapshot({"w": shard})
    dests = [torch.full((48, 32), float("nan"), dtype=torch.bfloat16).t(),
             torch.full((48, 32), float("nan"), dtype=torch.bfloat16).t()]
    boxes = [shard[:32], shard[32:]]
    for d, b in zip(dests, boxes, strict=True):
        d.copy_(b)  # the dense refit of version 0
    snap.capture(0)
    changed = []
    for step in range(1, steps + 1):
        (master.sum() * torch.randn(()) + (master ** 2).sum()).backward()
        opt.step()
        opt.zero_grad()
        shard.copy_(master.detach())
        msgs = [pack(backend, snap.pairs([("w", b)]), chunk_elems=512) for b in boxes]
        snap.advance(step - 1, step)
        for m, d in zip(msgs, dests, strict=True):
            unpack(backend, m, [d])
        for d, b in zip(dests, boxes, strict=True):
            assert torch.equal(bits(d), bits(b))
        changed.append(sum(c["count"] for m in msgs for c in D.describe(m)))
    assert 0 < sum(changed) < steps * shard.numel()


def test_cpu_blocks_span_chunks_and_tensors():
    """The CPU pack compares a contiguous pair in blocks of ``_NP_BLOCK`` elements: pairs longer than a block
    (not a multiple of it nor of the chunk), a strided one between them, at 2 % changed: the same bytes as the
    torch-ops reference, the snapshot updated exactly, and unpack lands every change."""
    g = torch.Generator().manual_seed(3)
    n = 2 * delta_cpu._NP_BLOCK + 12345
    srcs = [random_bits((n,), torch.bfloat16, g), random_bits((64, 999), torch.float32, g).t(),
            random_bits((n + 7,), torch.bfloat16, g)]
    snaps = [s.clone() for s in srcs]
    news = [changed_copy(s, torch.rand(s.shape, generator=g) < 0.02, g) for s in srcs]
    ref = D._tensor_pack([(a, b.clone()) for a, b in zip(news, snaps, strict=True)], update=False)
    msg = torch_pack_v1(list(zip(news, snaps, strict=True)), update=True)
    assert torch.equal(msg, ref)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(news, snaps, strict=True))
    dsts = [s.clone() for s in srcs]
    D.torch_unpack(msg, dsts)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(news, dsts, strict=True))
    assert D.message_length(msg) == msg.numel()
