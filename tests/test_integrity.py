"""Issue 46: every refit proves what it wrote. The fused hash and its keyed combine (single process), and one
spawned gloo world of 4 (``tests/integrity_cases.py``) where one rank's received bytes are corrupted in dense,
delta, MXFP8 and NVFP4 refits: every corruption is caught and named on every rank (none silent), the
destination is reported torn, and the next refit on the same group repairs it bit for bit."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from triton_reshard.execute import integrity as ig

from . import integrity_cases as ic

# -- the fused hash ----------------------------------------------------------------------------------------


def _coef(key: bytes = b"k" * 32) -> ig.Coefficients:
    return ig.Coefficients(ig.digest_key(type("G", (), {"digest_key": key})()))


def _h(buf: torch.Tensor, coef=None) -> int:
    return int(ig.partial(buf, coef or _coef()))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023, 1024, 1025, 8 * ig.ROW_WORDS * 3 + 5, 100_000])
def test_every_single_bit_flip_changes_the_hash(n):
    g = torch.Generator().manual_seed(n)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    h = _h(buf)
    assert _h(buf.clone()) == h  # a function of the bytes only
    for pos in sorted({0, n // 3, n // 2, n - 1} if n else set()):
        for bit in (0, 3, 7):
            b = buf.clone()
            b[pos] ^= 1 << bit
            assert _h(b) != h, (n, pos, bit)


def test_reordered_rows_zeroed_ranges_and_swapped_messages_change_the_hash():
    g = torch.Generator().manual_seed(1)
    row = 8 * ig.ROW_WORDS
    buf = torch.randint(0, 256, (row * 6 + 40,), dtype=torch.uint8, generator=g)
    h = _h(buf)
    swapped = buf.clone()
    swapped[:row], swapped[row : 2 * row] = buf[row : 2 * row].clone(), buf[:row].clone()
    assert _h(swapped) != h  # two rows (1 KiB chunks) in the other order
    z = buf.clone()
    z[100:132] = 0
    assert _h(z) != h  # a dropped chunk
    other = torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g)
    assert _h(other) != h


def test_unaligned_and_strided_sources_hash_as_their_bytes():
    g = torch.Generator().manual_seed(2)
    area = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    view = area[3 : 3 + 4001]  # an unaligned start: hashed through one aligned copy
    assert view.data_ptr() % 8
    assert _h(view) == _h(view.clone())


def test_coefficients_are_keyed_odd_and_do_not_change_as_they_grow():
    a, b = _coef(b"a" * 32), _coef(b"b" * 32)
    short = a.get(10, torch.device("cpu")).clone()
    long = a.get(5000, torch.device("cpu"))
    assert torch.equal(long[:10], short)
    assert bool((long & 1).all())
    assert not torch.equal(b.get(10, torch.device("cpu")), short)
    buf = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert _h(buf, a) != _h(buf, b)  # another secret, other digests


def test_keyed_pair_digest_depends_on_key_order_length_and_identity():
    def pair(key, entries, s=0, q=1):
        led = ig.Ledger(key, None, 0, "abc", None, ())
        return led._pair(s, q, entries)

    es = [(0, 100, 5), (1, 100, 7)]
    base = pair(b"x" * 32, es)
    assert 0 <= base < 1 << 63
    assert pair(b"x" * 32, list(es)) == base
    assert pair(b"y" * 32, es) != base  # keyed
    assert pair(b"x" * 32, es[::-1]) != base  # two messages in the other order
    assert pair(b"x" * 32, [(0, 101, 5), es[1]]) != base  # a longer message
    assert pair(b"x" * 32, es, 1, 0) != base  # another pair


def test_a_refit_group_keys_digests_with_its_secret_and_a_torch_group_with_the_environment(monkeypatch):
    monkeypatch.delenv("TRITON_RESHARD_SECRET", raising=False)
    monkeypatch.delenv("TRITON_RESHARD_SECRET_FILE", raising=False)
    plain = ig.digest_key(object())
    monkeypatch.setenv("TRITON_RESHARD_SECRET", "s" * 32)
    env = ig.digest_key(object())
    grp = ig.digest_key(type("G", (), {"digest_key": b"t" * 32})())
    assert len({plain, env, grp}) == 3


def test_digest_is_an_option_on_by_default():
    from triton_reshard.execute.options import EXECUTOR_OPTIONS, REFIT_OPTIONS, RefitOptions

    assert RefitOptions.of().digest is True
    assert RefitOptions.of(digest=False).digest is False
    assert "digest" in EXECUTOR_OPTIONS and "digest" in REFIT_OPTIONS


def test_the_environment_switch_turns_the_digest_off(monkeypatch):
    """``TRITON_RESHARD_DIGEST=off`` (the RL loop's ``--digest off``, inherited by the engine's workers)."""
    monkeypatch.delenv(ig.ENV_VAR, raising=False)
    assert ig.enabled()
    for off in ("off", "0", "false", "NO"):
        monkeypatch.setenv(ig.ENV_VAR, off)
        assert not ig.enabled(), off
    monkeypatch.setenv(ig.ENV_VAR, "on")
    assert ig.enabled()
    import examples.rl_loop as rl  # the option is parsed there (the engine is not started)

    assert rl.parser().parse_args(["--digest", "off"]).digest == "off"
    assert rl.parser().parse_args([]).digest == "on"


# -- one world of 4: the faults ----------------------------------------------------------------------------


@functools.cache
def _world() -> list[dict]:
    from triton_reshard.testing.launch import run_world

    with tempfile.TemporaryDirectory() as d:
        res = run_world(ic.world_main, ic.WORLD, d, timeout=400, pg_timeout=60, allow_errors=True)
        saved = [
            torch.load(os.path.join(d, f"rank{r}.pt"))
            if os.path.exists(os.path.join(d, f"rank{r}.pt"))
            else {}
            for r in range(ic.WORLD)
        ]
    for r in range(ic.WORLD):
        if not saved[r]:
            pytest.fail(f"rank {r} saved nothing: {res[r]}")
    return saved


def _scenario(name: str) -> dict[int, dict]:
    saved = _world()
    out = {}
    for r in range(ic.WORLD):
        if name not in saved[r]:
            pytest.fail(f"rank {r} has no result for {name}")
        if "crash" in saved[r][name]:
            pytest.fail(f"rank {r}, scenario {name}: {saved[r][name]['crash']}")
        out[r] = saved[r][name]
    return out


def _caught_everywhere(per: dict, key: str = "v1", receiver: int = ic.VICTIM) -> None:
    """The corrupted refit raised ReshardIntegrityError on every rank, the same pair named everywhere."""
    names = set()
    for r, res in per.items():
        f = res[key]
        assert f["error"] == "ReshardIntegrityError", (r, f)
        assert f["receiver"] == receiver and f["sender"] != receiver, (r, f)
        assert f"rank {r}: integrity check failed" in f["message"], f["message"]
        assert f"to rank {receiver}" in f["message"], f["message"]
        names.add((f["sender"], f["receiver"], f["tensor"], f["step"]))
        st = res["state"]
        assert st["torn"] == bool(f["torn"]) and st["torn_tensors"] == sorted(f["torn"]), (r, st, f)
    assert len(names) == 1, names  # every rank names the same message


@pytest.mark.slow
def test_clean_refits_compare_digests_on_every_rank():
    per = _scenario("clean")
    for r, res in per.items():
        assert res["v0"]["error"] is None and res["v1"]["error"] is None and res["v2"]["error"] is None, res
        assert res["v0_ok"] and res["v1_ok"] and res["v2_ok"], r
        assert len(res["settles"]) == 3, res["settles"]  # every refit compared
        for sent, landed, verdict, posted in res["settles"]:
            assert verdict == "ok" and sent == ic.WORLD - 1 and landed == ic.WORLD - 1, res["settles"]
            # the rows go rooted (gloo): the root sends the table to each other rank, the others their row
            assert posted == (ic.WORLD - 1 if r == 0 else 1), (r, res["settles"])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["flip", "drop", "swap"])
def test_a_message_corrupted_in_flight_is_caught_named_and_repaired(fault):
    per = _scenario(fault)
    assert per[ic.VICTIM]["fired"], per[ic.VICTIM]
    _caught_everywhere(per)
    f = per[ic.VICTIM]["v1"]
    assert f["tensor"] == "w" and f["step"] == 1, f
    assert per[ic.VICTIM]["state"]["torn"], per[ic.VICTIM]["state"]
    assert not per[ic.VICTIM]["v1_ok"]  # it really was corrupted
    for r, res in per.items():  # the next refit on the same group repairs every rank
        assert res["v2"]["error"] is None and res["v2_ok"], (r, res["v2"])
        assert res["state_after"] == {"version": 2, "torn": False, "torn_tensors": []}, res["state_after"]


@pytest.mark.slow
def test_the_triton_kernels_digest_and_catch_a_flipped_bit():
    """The Triton backend (interpreted): the packs and unpacks run the digesting kernel (its fused copies
    counted on every rank), clean refits agree on every rank, and the flipped bit is caught and repaired."""
    per = _scenario("flip_triton")
    assert per[ic.VICTIM]["fired"], per[ic.VICTIM]
    assert all(res["fused"] > 0 for res in per.values()), {r: res["fused"] for r, res in per.items()}
    for r, res in per.items():
        assert res["v0"]["error"] is None and res["v0_ok"], (r, res["v0"])
    _caught_everywhere(per)
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2_ok"], (r, res["v2"])


@pytest.mark.slow
def test_a_refit_groups_digest_rows_go_rooted_and_catch_a_flip():
    """A RefitGroup (gloo): the rows go rooted as on a torch.distributed group; the flipped bit is caught and
    named on every rank, and the next refit repairs it."""
    per = _scenario("refit_group_flip")
    _caught_everywhere(per)
    for r, res in per.items():
        assert res["v0"]["error"] is None and res["v2"]["error"] is None and res["v2_ok"], (r, res)
        assert [e[2] for e in res["settles"]] == ["ok", "mismatch", "ok"], (r, res["settles"])
        for e in res["settles"]:  # rooted: the root sends the table to each other rank, the others their row
            rounds = 2 if e[2] == "mismatch" else 1  # (a mismatch makes the localizing round too)
            assert e[3] == rounds * (ic.WORLD - 1 if r == 0 else 1), (r, res["settles"])
    assert per[ic.VICTIM]["fired"] == 1


@pytest.mark.slow
def test_a_destination_element_corrupted_after_its_unpack_is_caught():
    per = _scenario("after_unpack")
    _caught_everywhere(per, receiver=0)
    assert not per[0]["v1_ok"]
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2_ok"], (r, res["v2"])


@pytest.mark.slow
def test_without_the_digest_the_same_flip_goes_silent():
    """The control: ``digest=False`` and the same fault: every rank returns normally and the victim's
    destination is wrong (the hook corrupts; the digest is what catches it)."""
    per = _scenario("flip_digest_off")
    assert per[ic.VICTIM]["fired"]
    for res in per.values():
        assert res["v1"]["error"] is None, res["v1"]
    assert not per[ic.VICTIM]["v1_ok"]


@pytest.mark.slow
def test_a_corrupted_delta_message_is_caught_and_the_next_refit_goes_dense():
    per = _scenario("delta_flip")
    assert per[ic.VICTIM]["fired"]
    for r, res in per.items():
        assert res["v0"]["error"] is None and res["v0_ok"], (r, res["v0"])
    _caught_everywhere(per)
    assert not per[ic.VICTIM]["v1_ok"]
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2"]["mode"] == "dense-fallback", (r, res["v2"])
        assert res["v2_ok"], r


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_corrupted_quantized_message_is_caught_and_repaired(fmt):
    per = _scenario(f"{fmt}_flip")
    assert per[2]["fired"]
    _caught_everywhere(per, receiver=2)
    for r, res in per.items():
        assert res["v2"]["error"] is None, (r, res["v2"])
        assert not res["problems"], (r, res["problems"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "fp8"])
def test_the_triton_quantizers_digest_and_catch_a_flipped_bit(fmt):
    """The Triton backend (interpreted): the source ranks' quantizing packs hash in the kernels' pass (counted
    on every sender), the flipped bit in a quantized message is caught on every rank, and the repair holds the
    format's reference bytes."""
    per = _scenario(f"{fmt}_flip_triton")
    assert per[2]["fired"]
    assert all(per[r]["fused_quant"] > 0 for r in (0, 1)), {r: res["fused_quant"] for r, res in per.items()}
    _caught_everywhere(per, receiver=2)
    for r, res in per.items():
        assert res["v2"]["error"] is None, (r, res["v2"])
        assert not res["problems"], (r, res["problems"])


@pytest.mark.slow
def test_the_triton_delta_encode_hashes_its_messages_and_a_flipped_bit_is_caught():
    """The Triton backend (interpreted): version 1's delta messages are hashed in the encode kernels' pass
    (counted on every sender), the flipped bit is caught on every rank, and the next delta request goes dense
    and repairs."""
    per = _scenario("delta_flip_triton")
    assert per[ic.VICTIM]["fired"]
    assert all(res["hashed"] > 0 for res in per.values()), {r: res["hashed"] for r, res in per.items()}
    for r, res in per.items():
        assert res["v0"]["error"] is None and res["v0_ok"], (r, res["v0"])
    _caught_everywhere(per)
    assert not per[ic.VICTIM]["v1_ok"]
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2"]["mode"] == "dense-fallback", (r, res["v2"])
        assert res["v2_ok"], r


class _Rows:
    """A two-rank link for one ledger: the first call hands back this rank's row (``Captured``), later calls
    return ``table`` as every rank's rows."""

    wire, ranks = True, (0, 1)

    class Captured(Exception):
        pass

    def __init__(self, table=None):
        self.table = table

    def all_gather_row(self, row, what):
        if self.table is None:
            raise self.Captured(row)
        return self.table


def _rows(ledgers) -> list[list[int]]:
    out = []
    for led in ledgers:
        with pytest.raises(_Rows.Captured) as e:
            led.settle(_Rows())
        out.append(e.value.args[0])
    return out


def test_a_digest_row_changed_in_flight_is_refused():
    """The rows travel on the data plane: an attacker without the secret who copies the sender's digest over
    the receiver's (so that they would agree) breaks the row's keyed tag."""
    key = b"z" * 32
    sender = ig.Ledger(key, None, 0, "abc", None, ())
    receiver = ig.Ledger(key, None, 1, "abc", None, ())
    sender.sent = {1: [(0, 4096, 12345)]}
    receiver.recvd = {0: [(0, 4096, 999, (0, 0))]}  # what landed is not what was sent
    r0, r1 = _rows([sender, receiver])
    assert r0[2] != r1[1]  # S[0 -> 1] != R[1 <- 0]
    forged = list(r1)
    forged[1] = r0[2]  # the receiver's digest replaced by the sender's, the tag left as it was
    with pytest.raises(ig.ReshardIntegrityError, match=r"digest row of rank\(s\) \[1\] fails its keyed tag"):
        sender.settle(_Rows([r0, forged]))
    receiver.recvd = {0: [(0, 4096, 12345, (0, 0))]}  # a clean refit: the same rows agree
    r0, r1 = _rows([sender, receiver])
    sender.settle(_Rows([r0, r1]))
    receiver.settle(_Rows([r0, r1]))


@pytest.mark.parametrize("n", [0, 5, 8, 1024, 1031, 3 * 8 * ig.ROW_WORDS + 13])
@pytest.mark.parametrize("start", [0, 3])
def test_the_device_path_and_the_cpu_path_agree(n, start):
    """GPU ranks hash with torch ops, CPU ranks with numpy: the same value for the same bytes (mod 2**64)."""
    area = torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    buf = area[start : start + n]
    c = _coef()
    dev = ig._partial_torch(buf, c)
    assert (int(dev) & (2**64 - 1)) == ig.partial(buf, c)


@pytest.mark.slow
def test_a_corrupted_relayed_message_is_caught_and_repaired():
    per = _scenario("relay_flip")
    assert per[2]["fired"] and per[2]["peer"] in (1, 3), per[2]  # a message another engine relayed
    _caught_everywhere(per, receiver=2)
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2_ok"], (r, res["v2"])


# -- the native one-pass hash (ops/digest.py, csrc/digest.c): the same value as numpy -------------------------


def _native():
    from triton_reshard.ops import digest as nd

    fn = nd.native()
    if fn is None:
        pytest.skip("the native extension is not built (python setup.py build_ext --inplace)")
    return nd, fn


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023, 1024, 1025, 8 * ig.ROW_WORDS * 3 + 13, 100_003])
@pytest.mark.parametrize("start", [0, 5])
def test_the_native_hash_of_a_buffer_is_the_numpy_hash(n, start):
    nd, fn = _native()
    area = torch.randint(
        0, 256, (n + 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + start)
    )
    buf = area[start : start + n]
    c = _coef()
    assert nd.digest_buffer(fn, buf, c.numpy(ig._entries(n))) == ig._partial_np(buf.numpy(), c)


def test_large_in_place_sends_are_hashed_in_the_thread_and_taken_when_their_step_lands():
    """A send no fused copy hashed, of THREAD_MIN_BYTES or more, is hashed in the digest's thread (a future
    until its step lands); a small one at once; the values are the buffers' hashes."""
    _native()
    big = torch.randint(0, 256, (ig.THREAD_MIN_BYTES + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    small = big[:100].clone()
    c = _coef()
    work = type("W", (), {"steps": [(0, None), (1, None)]})()
    led = ig.Ledger(b"k", c, 0, "p", work, ())
    led.on_post(0, [(1, big), (2, small)], [])
    assert hasattr(led.sent[1][0][2], "result") and isinstance(led.sent[2][0][2], int)
    led.on_land(0)
    assert led.sent[1][0][2] == ig.partial(big, c) and led.sent[2][0][2] == ig.partial(small, c)
    led.on_post(1, [(1, big)], [])  # joined at the exchange if its step did not land first
    led._values()
    assert [e[2] for e in led.sent[1]] == [ig.partial(big, c)] * 2


def test_a_message_digested_from_its_strided_destinations_is_the_message_hash():
    """The receiver's path: a staged message landed into strided destination views (a column block, a 3-d
    slice, an unaligned piece, a piece cast on landing, padding no unpack takes) is digested from the views in
    place, equal to the hash of the message's bytes; what a destination holds after its unpack is what counts."""
    nd, fn = _native()
    g = torch.Generator().manual_seed(7)
    w = torch.zeros(40, 64)  # destination: a column block of it
    cube = torch.zeros(6, 10, 12, dtype=torch.float16)  # destination: a 3-d slice of it
    h = torch.zeros(50, dtype=torch.bfloat16)  # destination of a cast piece (received as float32)
    b = torch.zeros(33, dtype=torch.uint8)  # an unaligned piece
    dsts = [w[:, 8:40], cube[1:5, 2:9, 3:11], h[5:45], b[1:32]]
    wires = [torch.float32, torch.float16, torch.float32, torch.uint8]
    msg, pairs, at = torch.zeros(20000, dtype=torch.uint8), [], 16  # 16 bytes of padding first
    for d, wd in zip(dsts, wires, strict=True):
        es = torch.tensor([], dtype=wd).element_size()
        at = -(-at // es) * es  # each piece aligned to its element, not to the hash's 8-byte words
        nb = d.numel() * es
        r = msg[at : at + nb].view(wd).view(d.shape)
        r.copy_(
            torch.randn(d.shape, generator=g).to(wd)
            if wd != torch.uint8
            else torch.randint(0, 256, d.shape, dtype=torch.uint8, generator=g)
        )
        pairs.append((r, d))
        at += nb + 3  # gaps between the pieces
    msg[at:] = 7
    for r, d in pairs:
        d.copy_(r)
    c = _coef()
    n = msg.numel()
    rows = nd.message_rows([(msg, n)], pairs)[0]
    want = ig._partial_np(msg.numpy(), c)
    assert nd.digest_rows(fn, rows, n, c.numpy(ig._entries(n))) == want
    w[3, 10] += 1  # a destination element changed after its unpack: the in-place digest sees it
    assert nd.digest_rows(fn, rows, n, c.numpy(ig._entries(n))) != want
    five = torch.zeros((3,) * 6)[
        (slice(0, 2),) * 6
    ]  # 5 outer dimensions that do not merge: the caller copies
    assert nd.view_row(five, 0) is None
    assert nd.view_row(torch.zeros(2, 3, 2, 3, 2, 3)[..., :2], 0)[3] == 1  # these merge into one


def _pieces(g):
    """Destinations of one message: a column block, a 3-d slice, an unaligned byte piece, one large block
    (several 4 KiB copy blocks and 1 KiB hash rows), with the message's wire views at unaligned offsets."""
    w = torch.zeros(40, 64)
    cube = torch.zeros(6, 10, 12, dtype=torch.float16)
    b = torch.zeros(33, dtype=torch.uint8)
    big = torch.zeros(3000, 7)
    dsts = [w[:, 8:40], cube[1:5, 2:9, 3:11], b[1:32], big[:, 1:6]]
    msg, pairs, at = torch.zeros(120_000, dtype=torch.uint8), [], 16  # 16 bytes no copy takes first
    for d in dsts:
        es = d.element_size()
        at = -(-at // es) * es
        nb = d.numel() * es
        r = msg[at : at + nb].view(d.dtype).view(d.shape)
        r.copy_(
            torch.randn(d.shape, generator=g).to(d.dtype)
            if d.dtype != torch.uint8
            else torch.randint(0, 256, d.shape, dtype=torch.uint8, generator=g)
        )
        pairs.append((r, d))
        at += nb + 3
    msg[at:] = 7
    return msg, pairs


def test_the_fused_unpack_writes_what_torch_writes_and_hashes_the_message():
    """The receiver's fused copy (csrc/digest.c ``trd_copy_digest``): the destinations hold what ``copy_``
    writes, and the hash of what was written plus the bytes no copy took equals the message's hash."""
    nd, fn = _native()
    cfn = nd.copy_native()
    assert cfn is not None
    msg, pairs = _pieces(torch.Generator().manual_seed(8))
    want_dst = [r.clone() for r, _d in pairs]
    c = _coef()
    n = msg.numel()
    desc, gaps = nd.copy_plan(pairs, [(msg, n)], 0)
    for _r, d in pairs:
        d.fill_(float("nan") if d.dtype.is_floating_point else 0)  # poisoned
    h = nd.copy_digest(cfn, desc, ig.np.array([n], dtype=ig.np.int64), c.numpy(ig._entries(n)))
    for (_r, d), want in zip(pairs, want_dst, strict=True):
        assert torch.equal(d.view(torch.uint8) if d.dtype == torch.uint8 else d, want)
    total = (int(h[0]) + nd.digest_rows(fn, gaps[0], n, c.numpy(ig._entries(n)))) & ((1 << 64) - 1)
    assert total == ig._partial_np(msg.numpy(), c)
    msg[20] ^= 1  # a flipped bit in the message shows in the next fused copy's hash
    h2 = nd.copy_digest(cfn, desc, ig.np.array([n], dtype=ig.np.int64), c.numpy(ig._entries(n)))
    assert int(h2[0]) != int(h[0]) or nd.digest_rows(fn, gaps[0], n, c.numpy(ig._entries(n))) != total


def test_the_fused_pack_writes_the_message_and_hashes_it():
    """The sender's fused copy: source views packed into a message (its bytes as ``copy_`` packs them),
    hashed as written; cast, overlapping or non-contiguous message sides are refused (the caller copies)."""
    nd, fn = _native()
    cfn = nd.copy_native()
    msg, pairs = _pieces(torch.Generator().manual_seed(9))
    want = msg.clone()
    packs = [(d, r) for r, d in pairs]  # the destinations now are the sources
    for r, d in pairs:
        d.copy_(r)
    msg.zero_()
    msg[want.numel() - 100 :] = want[want.numel() - 100 :]  # what no pack writes, as it was
    msg[:16] = want[:16]
    c = _coef()
    n = msg.numel()
    desc, gaps = nd.copy_plan(packs, [(msg, n)], 1)
    h = nd.copy_digest(cfn, desc, ig.np.array([n], dtype=ig.np.int64), c.numpy(ig._entries(n)))
    got = (int(h[0]) + nd.digest_rows(fn, gaps[0], n, c.numpy(ig._entries(n)))) & ((1 << 64) - 1)
    for r, d in pairs:
        assert torch.equal(r, d)
    assert got == ig._partial_np(msg.numpy(), c)
    r0, d0 = pairs[0]
    assert nd.copy_plan([(d0.to(torch.float64), r0)], [(msg, n)], 1) is None  # a cast
    assert nd.copy_plan([(d0, r0), (d0, r0)], [(msg, n)], 1) is None  # the same message bytes twice
    assert nd.copy_plan([(r0, d0)], [(msg, n)], 1) is None  # the message side is strided


@pytest.fixture(params=[0, 256], ids=["portable-loop", "avx2-loop"])
def hash_lanes(request):
    """The native hash with each of its loops (``csrc/digest.c``: the portable one, the AVX2 one where the
    machine has it); the loop the machine picks is restored afterwards."""
    nd, _fn = _native()
    have = nd.lanes()
    if request.param and have != request.param and nd.lanes(request.param) != request.param:
        pytest.skip("this machine has no AVX2")
    try:
        assert nd.lanes(request.param) == request.param
        yield nd
    finally:
        nd.lanes(have)


def test_each_hash_loop_gives_the_numpy_hash_of_pieces_at_any_offset(hash_lanes):
    """Pieces of a message that start and end anywhere (inside a word, inside a 1 KiB row, across rows),
    hashed apart and summed, or as views of one call, or copied by the fused copy: the numpy hash of the
    message, with either loop."""
    nd, fn, cfn = hash_lanes, hash_lanes.native(), hash_lanes.copy_native()
    g = torch.Generator().manual_seed(61)
    c = _coef()
    for n in (5, 8, 40, 1024, 1029, 3000, 4096 * 3 + 11, 70_001):
        msg = torch.randint(0, 256, (n + 64,), dtype=torch.uint8, generator=g)[3 : 3 + n]  # unaligned
        want = ig._partial_np(msg.numpy(), c)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (6,), generator=g).tolist()})
        rows = ig.np.array([[msg.data_ptr() + a, a, z - a, 0, 1, 1, 1, 1, 0, 0, 0, 0]
                            for a, z in zip(cuts, cuts[1:], strict=False) if z > a], dtype=ig.np.int64)
        coef = c.numpy(ig._entries(n))
        assert nd.digest_rows(fn, rows, n, coef) == want, n
        assert sum(nd.digest_rows(fn, rows[k : k + 1], n, coef) for k in range(len(rows))) % (1 << 64) == want
        out = torch.zeros(n + 5, dtype=torch.uint8)[5:]  # the fused copy into an unaligned message
        pairs = [(msg[a:z], out[a:z]) for a, z in zip(cuts, cuts[1:], strict=False) if z > a]
        desc, gaps = nd.copy_plan(pairs, [(out, n)], 1)
        h = nd.copy_digest(cfn, desc, ig.np.array([n], dtype=ig.np.int64), coef)
        assert torch.equal(out, msg) and not len(gaps[0]) and int(h[0]) == want, n


def test_a_steps_messages_hash_in_one_native_call():
    """``trd_digest_many``: several messages (a step's sends, its landed receives) in one call, each the hash
    of its own bytes; the ledger hashes a step's sends that no fused copy took (delta messages, in-place
    sends) that way."""
    nd, _fn = _native()
    g = torch.Generator().manual_seed(62)
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1, 1023, 1024, 9000, 300_001)]
    c = _coef()
    want = [ig._partial_np(b.numpy(), c) for b in bufs]
    coef = c.numpy(max(ig._entries(b.numel()) for b in bufs))
    assert nd.digest_many([nd.buffer_rows(b) for b in bufs], [b.numel() for b in bufs], coef) == want
    work = type("W", (), {"steps": [(0, None)]})()
    led = ig.Ledger(b"k", c, 0, "p", work, ())
    led.on_post(0, [(1, b) for b in bufs], [])
    assert [e[2] for e in led.sent[1]] == want
