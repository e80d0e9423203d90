"""What a fresh process's first refit pays (issue 44 item 4): no lazy import of ``numpy.ma`` inside a rank's first
plan, ``distinct`` equal to ``np.unique``, the binding's one-``as_strided`` views equal to slicing, and
``decompose_box`` along one dim (a rank plan's boxes) as the grid path cuts them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from triton_reshard.box import box_slices
from triton_reshard.execute.bind import sub_view
from triton_reshard.layout.fragment_table import distinct


def test_a_fresh_rank_plan_does_not_import_numpy_ma():
    """numpy 2.3's ``np.unique`` calls ``np.ma.is_masked``, whose first call imports ``numpy.ma`` (8-30 ms of CPU
    on every rank of a fresh process, inside its first plan): the layouts and a rank's plan must not call it."""
    code = textwrap.dedent("""
        import sys, torch
        from triton_reshard.plan import plan_reshard
        from triton_reshard.presets import get_config, megatron_layout
        assert "numpy.ma" not in sys.modules, "imported before the plan"
        cfg = {**get_config("small_llama"), "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 4096}
        s = megatron_layout(cfg, tp=4, pp=2, dp=1, spec="local", dtype=torch.float32)
        d = megatron_layout(cfg, tp=2, pp=1, dp=4, spec="local", dtype=torch.float32)
        for r in (0, 5):
            assert plan_reshard(s, d, rank=r).transfers
        print("numpy.ma" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "a fresh process's first plan imported numpy.ma (np.unique without return_*)"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 64, 4097])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_], ids=str)
def test_distinct_is_np_unique(n, dtype):
    rng = np.random.default_rng(n)
    a = rng.integers(0, 9, n).astype(dtype)
    want = np.unique(a)
    got = distinct(a)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(distinct(a.reshape(1, -1)), want)  # flattened, as np.unique does


def _sliced(base, start, off, size):
    extra = base.dim() - len(size)
    at = start[:extra] + tuple(a + b for a, b in zip(start[extra:], off, strict=True))
    return base[box_slices(at, (1,) * extra + tuple(size))].reshape(size)


def _bases():
    for shape in [(7,), (5, 9), (3, 4, 6), (2, 5, 9)]:
        n = int(np.prod(shape))
        yield torch.arange(2 * n, dtype=torch.float32)[3:3 + n].view(shape)  # nonzero storage offset
        yield torch.arange(n, dtype=torch.int16).view(shape[::-1]).permute(*range(len(shape) - 1, -1, -1))  # strided
        yield torch.arange(n * 2, dtype=torch.bfloat16).view(*shape[:-1], 2 * shape[-1])[..., ::2]  # a stepped view


def test_sub_view_is_the_sliced_view():
    """The same elements, shape and first address as slicing the box and dropping the extra leading dims, on
    offset, permuted and stepped bases, boxes of every rank and empty ones."""
    g = torch.Generator().manual_seed(0)

    def pick(hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=g))

    checked = 0
    for base in _bases():
        shape = tuple(base.shape)
        for nd in range(1, len(shape) + 1):
            extra = len(shape) - nd
            for _ in range(25):
                start = tuple(pick(d) for d in shape)
                off = tuple(pick(d - s + 1) for s, d in zip(start[extra:], shape[extra:], strict=True))
                size = tuple(pick(d - s - o + 1) for s, o, d in zip(start[extra:], off, shape[extra:], strict=True))
                want, got = _sliced(base, start, off, size), sub_view(base, start, off, size)
                assert got.shape == want.shape and got.dtype == want.dtype
                assert torch.equal(got, want)
                if want.numel():  # the same memory (strides of size-1 dims do not address anything)
                    assert got.data_ptr() == want.data_ptr()
                    assert [k for k, n in zip(got.stride(), size, strict=True) if n > 1] == \
                        [k for k, n in zip(want.stride(), size, strict=True) if n > 1]
                checked += 1
    assert checked > 500


def test_sub_view_outside_the_base_takes_the_slicing_path():
    base = torch.zeros(4, 6)
    with pytest.raises(RuntimeError):  # slicing clamps to 2 rows, the reshape to 3 fails: as before
        sub_view(base, (2, 0), (0, 0), (3, 6))


def _one_dim_problem(rng, nd: int, d0: int):
    """A box and up to 4 candidate boxes that cut it along dim ``d0`` only (on every other dim a candidate holds
    the whole box, or misses it)."""
    off = tuple(int(x) for x in rng.integers(0, 6, nd))
    size = tuple(int(x) for x in rng.integers(1, 7, nd))
    cands = []
    for _ in range(int(rng.integers(0, 5))):
        co = [int(off[d] - rng.integers(0, 3)) for d in range(nd)]
        cs = [size[d] + 3 for d in range(nd)]
        co[d0], cs[d0] = int(rng.integers(0, 11)), int(rng.integers(1, 9))
        if nd > 1 and rng.random() < 0.2:  # misses the box on another dim
            d = (d0 + 1) % nd
            co[d] = off[d] + size[d]
        cands.append((tuple(co), tuple(cs)))
    return off, size, cands


def test_decompose_box_cut_along_one_dim():
    """A rank plan's boxes are cut along one dim (``decompose_box``'s fast path): the pieces tile the box in order
    along that dim, each labelled with exactly the candidates that hold it, no two neighbours alike (the grid
    path's greedy merges such runs)."""
    from triton_reshard.box import contains, decompose_box

    rng = np.random.default_rng(54)
    for _ in range(3000):
        nd = int(rng.integers(1, 4))
        d0 = int(rng.integers(0, nd))
        off, size, cands = _one_dim_problem(rng, nd, d0)
        pieces = decompose_box(off, size, cands)
        at = off[d0]
        for k, (p_off, p_size, mask) in enumerate(pieces):
            assert p_off[d0] == at and p_size[d0] > 0, (off, size, cands, pieces)
            assert p_off[:d0] + p_off[d0 + 1:] == off[:d0] + off[d0 + 1:]
            assert p_size[:d0] + p_size[d0 + 1:] == size[:d0] + size[d0 + 1:]
            want = sum(1 << i for i, (c_off, c_size) in enumerate(cands) if contains(c_off, c_size, p_off, p_size))
            assert mask == want, (off, size, cands, pieces)
            assert k == 0 or pieces[k - 1][2] != mask, (off, size, cands, pieces)
            at += p_size[d0]
        assert at == off[d0] + size[d0]
