"""The native delta unpack into row views (2-D, unit inner stride: a column block of a row-major tensor, as a
received box is in a destination's local tensor when the source splits that tensor along its columns). Such
destinations went to the numpy reference (4.7 s of a 5.1 s worker refit in the RL loop at 12 % changed), then
through contiguous staging buffers; now ``trd_unpack_rows`` (csrc/delta_apply.c) writes them where they lie: a
256-element block inside one row as a contiguous run (the vector path of 16-bit blocks), a block across a row
end element by element. Same values as the numpy codec, poison around the blocks untouched, a refused message
writes nothing."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_native as N

INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def steps(old: torch.Tensor, frac: float | str, g: torch.Generator) -> torch.Tensor:
    new = old.clone()
    b = bits(new)
    if frac == "flip":  # every sign flipped: raw blocks, dense chunks (written row by row)
        b ^= torch.tensor(-(1 << (8 * old.element_size() - 1)), dtype=b.dtype)
        return new
    m = torch.rand(old.shape, generator=g) < frac
    b[m] += torch.randint(-2, 2, old.shape, generator=g).to(b.dtype)[m]
    b[0, 0] ^= torch.tensor(-(1 << (8 * old.element_size() - 1)), dtype=b.dtype)  # a sign flip: a raw block
    return new


def _world(dtype: torch.dtype, g: torch.Generator):
    """Row-major destination tensors inside poison; the message's views are column blocks of them (rows of
    128 and 64 elements: every block crosses row ends; 512: every block inside a row; 300: some of each) plus
    one contiguous tensor."""
    poison = -1 if dtype.itemsize > 1 else 0x5A
    full = [
        torch.empty(96, 256, dtype=dtype),
        torch.empty(40, 128, dtype=dtype),
        torch.empty(3000, dtype=dtype),
        torch.empty(24, 1024, dtype=dtype),
        torch.empty(17, 333, dtype=dtype),
    ]
    for t in full:
        bits(t).fill_(poison)
    views = [full[0][:, 64:192], full[1][:, :64], full[2][100:2900], full[3][:, 256:768], full[4][:, 33:]]
    olds = [(torch.randn(v.shape, generator=g) * 4).to(dtype) for v in views]
    for v, o in zip(views, olds, strict=True):
        v.copy_(o)
    return full, views, olds, poison


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8], ids=str)
@pytest.mark.parametrize("frac", [0.01, 0.12, 1.0, "flip"])
def test_row_view_unpack_native_equals_numpy(dtype, frac, monkeypatch):
    if N.native() is None:
        pytest.skip("the native codec is not built (pip install -e . builds it)")
    g = torch.Generator().manual_seed(7)
    full, views, olds, poison = _world(dtype, g)
    news = [
        steps(o.view(-1, o.shape[-1]) if o.dim() == 2 else o.view(1, -1), frac, g).view(o.shape) for o in olds
    ]
    msg = D.pack_delta([(n, o.clone()) for n, o in zip(news, olds, strict=True)], 1000, backend="torch")
    assert not all(v.is_contiguous() for v in views)
    assert frac != "flip" or all(c["kind"] == "dense" for c in D.describe(msg))
    results = []
    for native in (False, True):
        if native:  # the native codec must take these views itself, not hand them to the numpy reference

            def refuse(*_a, **_k):
                raise AssertionError("row views went to the numpy reference")

            monkeypatch.setattr(N, "numpy_unpack", refuse)
        prev = N.set_native(native)
        try:
            f2, v2, _o, _p = _world(dtype, torch.Generator().manual_seed(7))
            cache: dict = {}
            for _ in range(2):  # the second call reuses the arguments kept on the cached facts
                for v, o in zip(v2, olds, strict=True):
                    v.copy_(o)
                D.unpack_delta(msg, v2, backend="torch", cache=cache)
                for v, n in zip(v2, news, strict=True):
                    assert torch.equal(bits(v), bits(n))
            results.append(f2)
        finally:
            N.set_native(prev)
    for a, b in zip(*results, strict=True):
        assert torch.equal(bits(a), bits(b))
    f = results[1]
    assert bool((bits(f[0][:, :64]) == poison).all()) and bool((bits(f[0][:, 192:]) == poison).all())
    assert bool((bits(f[1][:, 64:]) == poison).all())
    assert bool((bits(f[2][:100]) == poison).all()) and bool((bits(f[2][2900:]) == poison).all())
    assert bool((bits(f[3][:, :256]) == poison).all()) and bool((bits(f[3][:, 768:]) == poison).all())
    assert bool((bits(f[4][:, :33]) == poison).all())


@pytest.mark.parametrize("which", ["first", "last"])
def test_row_view_refused_message_writes_nothing(which):
    """A message whose first or last chunk's body disagrees with its header (its count one more): refused
    naming the destination, and no byte of any destination written (the check pass runs before any write)."""
    if N.native() is None:
        pytest.skip("the native codec is not built (pip install -e . builds it)")
    g = torch.Generator().manual_seed(8)
    full, views, olds, _poison = _world(torch.bfloat16, g)
    news = [
        steps(o.view(-1, o.shape[-1]) if o.dim() == 2 else o.view(1, -1), 0.05, g).view(o.shape) for o in olds
    ]
    msg = D.pack_delta([(n, o.clone()) for n, o in zip(news, olds, strict=True)], 1000, backend="torch")
    chunks = D.describe(msg)
    c = chunks[0] if which == "first" else chunks[-1]
    assert c["count"] > 0
    bad = msg.clone()
    bad[c["offset"] + 8 : c["offset"] + 12].view(torch.int32)[0] += 1  # the chunk's count
    before = [t.clone() for t in full]
    names = ["model.a", "model.b", "model.c", "model.d", "model.e"]
    with pytest.raises(ValueError, match="model.a" if which == "first" else "model.e"):
        D.unpack_delta(bad, views, backend="torch", names=names)
    for a, b in zip(full, before, strict=True):
        assert torch.equal(bits(a), bits(b)), "written before the check"
