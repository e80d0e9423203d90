"""The integration kit (``integrations/engine.py``): a plug-in written as one file on it refits for real over a
three-process loopback group; the secret is looked up once on its way to the group; the control message codec;
the control plane depends on the kit, not on SGLang's plug-in."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import warnings

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard
from triton_reshard.comm import auth
from triton_reshard.comm import secret as secret_mod
from triton_reshard.comm.group import free_port, init_refit_group
from triton_reshard.integrations import engine as kit

SECRET = "kit-test-secret-0123456789abcdef"
ROWS, COLS = 8, 4


# ---------------------------------------------------------------------------------------------------------
# a plug-in in one file: trainer rank 0 holds the checkpoint; each engine rank's loader reads half the rows of
# "w" (and no "extra"); the kit joins, exchanges the layouts, plans the pair and passes the delta options
# ---------------------------------------------------------------------------------------------------------

def _checkpoint(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(ROWS, COLS, generator=g), "extra": torch.randn(3, generator=g)}


class _Engine(torch.nn.Module):
    def __init__(self, part: int):
        super().__init__()
        self.part = part
        self.weight = torch.nn.Parameter(torch.full((ROWS // 2, COLS), float("nan")), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.weight.data.copy_(t[self.part * ROWS // 2:(self.part + 1) * ROWS // 2])


def _plugin_rank(rank: int, port: int, out) -> None:
    from triton_reshard import refit
    from triton_reshard.integrations.record import layout_from_records, record_load

    try:
        group = kit.join_group("127.0.0.1", port, rank, 3, backend="gloo", timeout=60.0, secret_env="KIT_SECRET",
                               where=f"kit plug-in rank {rank}")
        model = _Engine(rank - 1) if rank else None
        trainer = (Layout.from_placements({n: tuple(t.shape) for n, t in _checkpoint(0).items()}, [0],
                                          [Replicate()]),) if rank == 0 else None

        def engine_part(first):
            shapes = {t.name: t.shape for t in first[0].tensors}
            return record_load(dict(model.named_parameters()), model.load_weights, shapes, rank)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (src,), records = kit.exchange_layouts(group, trainer, engine_part if model is not None else None)
            src, dst = kit.plan_pair(group, src, layout_from_records(records))
        for version in (1, 2):
            ckpt = _checkpoint(version)
            params = dict(model.named_parameters()) if model is not None else {}
            sent = {t.name: ckpt[t.name] for t in src.tensors} if rank == 0 else {}
            refit(sent, params, src, dst, group=group, timeout=60.0,
                  **kit.delta_options(version, False))
            if model is not None:
                want = ckpt["w"][(rank - 1) * ROWS // 2:rank * ROWS // 2]
                assert torch.equal(model.weight.view(torch.int32), want.view(torch.int32)), (rank, version)
        out.put((rank, sorted(t.name for t in src.tensors), [str(w.message) for w in caught]))
        group.destroy()
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        out.put((rank, "error", f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_a_plugin_written_on_the_kit_refits_bit_exact(monkeypatch):
    monkeypatch.setenv("KIT_SECRET", SECRET)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_plugin_rank, args=(r, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, *rest = out.get(timeout=240)
            got[rank] = rest
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(3):
        assert got[rank][0] != "error", got[rank]
        names, caught = got[rank]
        assert names == ["w"]  # "extra": loaded by no engine rank, left out of the plan
        assert any("loaded by no engine worker" in m and "'extra'" in m for m in caught), caught


# ---------------------------------------------------------------------------------------------------------
# the secret: looked up once
# ---------------------------------------------------------------------------------------------------------

def test_the_secret_is_looked_up_once_on_the_way_to_the_group(monkeypatch, tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    reads = []
    real = secret_mod.read_secret_file
    monkeypatch.setattr(secret_mod, "read_secret_file", lambda *a, **k: reads.append(a) or real(*a, **k))
    # the group's own default names a file too: a second lookup would read it
    monkeypatch.setenv(auth.SECRET_FILE_ENV, str(f))
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    resolved = kit.plugin_secret(None, None, f, where="kit test")
    assert resolved.value == SECRET.encode() and SECRET not in repr(resolved)
    assert auth.resolve_secret(resolved) == SECRET.encode()
    assert len(reads) == 1
    group = kit.join_group("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout=30.0, secret=resolved)
    group.destroy()
    assert len(reads) == 1  # init_refit_group used the resolved secret as it is


def test_a_resolved_absent_secret_is_not_looked_up_again(monkeypatch):
    """Looked up and found nowhere (loopback: allowed): the group does not consult the environment again,
    where a short secret would be refused."""
    monkeypatch.setenv(auth.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="is 5 bytes"):
        init_refit_group("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout=30.0)
    group = init_refit_group("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout=30.0,
                             secret=auth.ResolvedSecret(None))
    group.destroy()


def test_plugin_secret_keeps_the_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KIT_SECRET", SECRET)
    monkeypatch.setenv(auth.SECRET_ENV, "y" * 20)
    assert kit.plugin_secret("x" * 20).value == b"x" * 20  # secret= first
    assert kit.plugin_secret(None, "KIT_SECRET").value == SECRET.encode()  # then where the config points
    assert kit.plugin_secret(None, "KIT_UNSET").value == b"y" * 20  # then the group's default
    monkeypatch.delenv(auth.SECRET_ENV)
    assert kit.plugin_secret(None, "KIT_UNSET").value is None
    with pytest.raises(ValueError, match=r"init_refit_group: the secret \(secret=\) is 3 bytes"):
        kit.plugin_secret("abc")


# ---------------------------------------------------------------------------------------------------------
# the small pieces
# ---------------------------------------------------------------------------------------------------------

class _OneRank:
    rank = 0


def test_plan_pair_keeps_what_both_have():
    src = Layout.from_placements({"a": (4,), "b": (2,)}, [0, 1], [Shard(0)])
    dst = Layout.from_placements({"a": (4,)}, [2], [Replicate()])
    with pytest.warns(UserWarning, match=r"1 trainer tensors are loaded by no engine worker.*\['b'\]"):
        s, d = kit.plan_pair(_OneRank(), src, dst)
    assert [t.name for t in s.tensors] == ["a"] and d is dst
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kit.plan_pair(_OneRank(), s, dst) == (s, dst)


def test_delta_options():
    assert kit.delta_options(3, True) == {"version": 3, "delta": True}
    assert kit.delta_options(3, "strict") == {"version": 3, "delta": "strict"}
    assert kit.delta_options("tag", False) == {}


def test_message_tensors_round_trip_as_data():
    nt = kit.message_tensors("ctl", {"op": "refit", "version": 3})
    (name, t), = nt
    assert name == "ctl" and t.dtype == torch.uint8 and t.dim() == 1
    assert kit.tensor_message(nt, "ctl") == ("ctl", {"op": "refit", "version": 3})
    assert kit.tensor_message(nt) == ("ctl", {"op": "refit", "version": 3})
    with pytest.raises(ValueError, match="x: expected one tensor named 'other'"):
        kit.tensor_message(nt, "other", what="x")
    with pytest.raises(ValueError, match=r"expected one tensor \(a control message\), got \['a', 'b'\]"):
        kit.tensor_message([("a", t), ("b", t)])
    with pytest.raises(ValueError, match="1-D uint8 tensor of JSON"):
        kit.tensor_message([("ctl", t.to(torch.int32))])


def test_the_control_plane_does_not_import_a_plugin():
    """control.py depends on the kit and comm/ only: importing it loads no plug-in module."""
    code = ("import sys, triton_reshard.integrations.control as c; "
            "bad = [m for m in sys.modules if m.startswith('triton_reshard.integrations.') and m.rsplit('.', 1)[1] "
            "in ('sglang', 'vllm', 'vllm_transfer', 'vllm_worker', 'vllm_trainer', 'verl')]; "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
