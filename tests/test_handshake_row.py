"""The plan handshake's row as a typed record (``execute/handshake.py``): one declaration, one codec. The codec
round-trips every value a field can hold, the wire layout is what the transport needs (the per-peer field
last), and the refusals read the decoded fields by name with their texts unchanged."""

from __future__ import annotations

from dataclasses import fields, replace
from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from triton_reshard.execute import handshake as H
from triton_reshard.execute.delta import NO_VERSION
from triton_reshard.execute.delta_cost import COST_FIELDS
from triton_reshard.execute.errors import ReshardError

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
U32 = st.integers(0, (1 << 32) - 1)

fences = st.builds(
    H.Fence,
    I64,
    I64,
    I64,
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.tuples(*[st.integers(-1, 1 << 40)] * COST_FIELDS),
)
rows = st.builds(
    H.Row,
    st.integers(0, (1 << 64) - 1).map(lambda d: f"{d:016x}"),
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 40),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, "torch", "triton"]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([H.OK, H.REJECTED, H.REFUSED]),
    st.integers(0, 1 << 20),
    fences,
    st.integers(0, 1 << 40),
)


@settings(max_examples=300, deadline=None)
@given(rows)
def test_codec_round_trips(row):
    words = H.encode(row)
    assert len(words) == H.WIDTH and all(isinstance(w, int) and -(1 << 63) <= w < (1 << 63) for w in words)
    assert H.decode(words) == row


def test_layout_is_declared_once():
    # every field declares who fills it and its width; the widths add up to the row; the per-peer field is last
    assert all(f.metadata["by"] for cls in (H.Row, H.Fence) for f in fields(cls))
    widths = [2 if f.name == "digest" else 0 if f.name == "fence" else 1 for f in fields(H.Row)]
    fence = sum(COST_FIELDS if f.name == "cost" else 1 for f in fields(H.Fence))
    assert sum(widths) + fence == H.WIDTH
    assert H.encode(H.Row(prepost=12345))[-1] == 12345
    assert H.encode(H.Row())[:2] == [0, 0]
    with pytest.raises(ValueError, match="handshake row of 3 words"):
        H.decode([0, 0, 0])
    # an unknown backend asked for (an environment variable's value) travels as "invalid"
    assert H.decode(H.encode(H.Row(backend="cuda-graphs"))).backend == "invalid"


def _link(n=2, rank=0):
    return SimpleNamespace(ranks=tuple(range(n)), rank=rank)


def _ok(**kw):
    return H.Row(
        "00000000deadbeef", 1 << 20, 4096, False, False, None, False, True, H.OK, 0, H.Fence(), 0, **kw
    )


def test_refusals_read_fields_by_name_with_unchanged_texts():
    link = _link()
    assert H._refusal(link, [_ok(), _ok()]) is None
    e = H._refusal(link, [_ok(), replace(_ok(), status=H.REFUSED)])
    assert isinstance(e, ReshardError) and str(e) == (
        "rank 0: rank(s) [1] could not plan this refit (see the error on those ranks); nothing was moved"
    )
    e = H._refusal(link, [_ok(), replace(_ok(), backend="triton", overlap=True)])
    assert str(e) == (
        "rank 0: ranks run different plans or options (plan digest by rank: {0: '00000000deadbeef', 1: "
        "'00000000deadbeef'}; (bucket_bytes, direct_min_bytes, overlap, mode, backend, delta) by rank: "
        "[(1048576, 4096, False, 'run', 'auto', False), (1048576, 4096, True, 'run', 'triton', False)]); they "
        "must agree; nothing was moved"
    )
    e = H._refusal(link, [_ok(), replace(_ok(), integrity=False)])  # one rank would skip the digest exchange
    assert str(e).endswith(
        "'run', 'auto', False)]; digest by rank: {0: True, 1: False}); they must agree; nothing was moved"
    )
    e = H._refusal(link, [_ok(), replace(_ok(), digest="ffffffff00000001")])
    assert "1: 'ffffffff00000001'" in str(e)
    # a fence or a pre-posted size may differ by rank: not an option
    assert H._refusal(link, [_ok(), replace(_ok(), prepost=64, fence=H.Fence(held=NO_VERSION))]) is None
    e = H._refusal(link, [replace(_ok(), verify=True, relays=3), replace(_ok(), verify=True)])
    assert isinstance(e, ValueError) and "(relay transfers by rank: {0: 3};" in str(e)
    e = H._refusal(link, [_ok(), replace(_ok(), status=H.REJECTED)])
    assert str(e) == (
        "rank 0: rank(s) [1] rejected their input (see the error on those ranks); nothing was moved"
    )


@settings(max_examples=300, deadline=None)
@given(rows, st.lists(st.tuples(st.booleans(), rows), min_size=1, max_size=5), st.integers(0, 1 << 40))
def test_alike_rows_pass_as_decoding_them_would(mine, others, prepost):
    """A cached refit's handshake checks the rows without decoding them (``alike``) only where decoding them
    would find no refusal and every rank's fence is this rank's; anything else goes through the decoded path."""
    me = H.encode(mine)
    rows_ = [mine] + [replace(mine, prepost=prepost) if same else other for same, other in others]
    words = [H.encode(r) for r in rows_]
    link = SimpleNamespace(rank=0, ranks=tuple(range(len(rows_))))
    if H.alike(words, me):
        assert H._refusal(link, rows_) is None
        assert all(r.fence == mine.fence for r in rows_)
    if mine.status == H.OK and mine.relays == 0 and all(same for same, _o in others):
        assert H.alike(words, me)  # a cached refit's rows: the fast path
    assert H.alike([me], me) == (mine.status == H.OK and mine.relays == 0)
