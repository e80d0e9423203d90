"""The native delta unpack into row views (2-D, unit inner stride: a column block of a row-major tensor, as a
received box is in a destination's local tensor when the source splits that tensor along its columns). Such
destinations went to the numpy reference (4.7 s of a 5.1 s worker refit in the RL loop at 12 % changed); now
they are staged through contiguous buffers for the native codec. Same values as the numpy codec, poison around
the blocks untouched, a refused message writes nothing."""

from __future__ import annotations

import pytest
import torch

from triton_reshard.ops import delta as D
from triton_reshard.ops import delta_native as N

INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def steps(old: torch.Tensor, frac: float, g: torch.Generator) -> torch.Tensor:
    new = old.clone()
    b = bits(new)
    m = torch.rand(old.shape, generator=g) < frac
    b[m] += torch.randint(-2, 2, old.shape, generator=g).to(b.dtype)[m]
    b[0, 0] ^= torch.tensor(-(1 << (8 * old.element_size() - 1)), dtype=b.dtype)  # a sign flip: a raw block
    return new


def _world(dtype: torch.dtype, g: torch.Generator):
    """Two row-major destination tensors inside poison; the message's views are column blocks of them plus one
    contiguous tensor."""
    poison = -1 if dtype.itemsize > 1 else 0x5A
    full = [
        torch.empty(96, 256, dtype=dtype),
        torch.empty(40, 128, dtype=dtype),
        torch.empty(3000, dtype=dtype),
    ]
    for t in full:
        bits(t).fill_(poison)
    views = [full[0][:, 64:192], full[1][:, :64], full[2][100:2900]]
    olds = [(torch.randn(v.shape, generator=g) * 4).to(dtype) for v in views]
    for v, o in zip(views, olds, strict=True):
        v.copy_(o)
    return full, views, olds, poison


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("frac", [0.01, 0.12, 1.0])
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
            for _ in range(2):  # the second call reuses the staging kept on the cached facts
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


def test_row_view_refused_message_writes_nothing():
    if N.native() is None:
        pytest.skip("the native codec is not built (pip install -e . builds it)")
    g = torch.Generator().manual_seed(8)
    full, views, olds, _poison = _world(torch.bfloat16, g)
    news = [
        steps(o.view(-1, o.shape[-1]) if o.dim() == 2 else o.view(1, -1), 0.05, g).view(o.shape) for o in olds
    ]
    msg = D.pack_delta([(n, o.clone()) for n, o in zip(news, olds, strict=True)], 1000, backend="torch")
    c = D.describe(msg)[0]
    bad = msg.clone()
    bad[c["offset"] + 8 : c["offset"] + 12].view(torch.int32)[0] += 1  # the first chunk's count
    before = [t.clone() for t in full]
    with pytest.raises(ValueError, match="model.a"):
        D.unpack_delta(bad, views, backend="torch", names=["model.a", "model.b", "model.c"])
    for a, b in zip(full, before, strict=True):
        assert torch.equal(bits(a), bits(b)), "written before the check"
