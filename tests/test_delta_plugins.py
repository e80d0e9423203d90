"""The plug-ins pass ``version=`` / ``delta=`` through to ``refit`` (issue 24), checked on our side with
``refit`` replaced by a recorder (the engine tiers run the real engines; these run without them)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from triton_reshard import Layout, Replicate
from triton_reshard.integrations import sglang as sg
from triton_reshard.integrations import verl as vr
from triton_reshard.integrations import vllm_transfer as vt
from triton_reshard.integrations import vllm_worker

LAYOUT = Layout.from_placements({"w": (4, 3)}, [0], [Replicate()])


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kw):
        self.calls.append(kw)
        return types.SimpleNamespace(recv_bytes=0, sent_bytes=0, mode="delta")


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    for mod in (sg, vr, vllm_worker):  # each plug-in module that calls refit (vllm_transfer re-exports)
        monkeypatch.setattr(mod, "refit", r)
    return r


def test_sglang_trainer_and_engine_pass_delta(rec, monkeypatch):
    tr = object.__new__(sg.SGLangTrainer)
    tr.rank, tr.src_layout, tr.dst_layout, tr.group, tr.timeout, tr.bucket_bytes = 1, LAYOUT, LAYOUT, None, 5.0, 1024
    tr.send_weights({}, version=7, delta=True)
    assert rec.calls[-1]["version"] == 7 and rec.calls[-1]["delta"] is True
    tr.send_weights({}, version=8)
    assert rec.calls[-1]["delta"] is False
    # the engine side reads delta from the control message (JSON data, never unpickled)
    loader = types.ModuleType("sglang.srt.model_loader.loader")
    loader.post_load_weights = lambda model: None
    monkeypatch.setitem(sys.modules, "sglang.srt.model_loader.loader", loader)
    model = torch.nn.Linear(3, 4, bias=False)
    monkeypatch.setitem(sg._ENGINES, id(model), sg._EngineState(None, LAYOUT, LAYOUT, 5.0, 1024))
    monkeypatch.setattr(sg, "_tp_rank", lambda: 0)
    sg.receive_weights(model, sg.encode_control({"op": "refit", "version": 9, "delta": "strict"}))
    assert rec.calls[-1]["version"] == 9 and rec.calls[-1]["delta"] == "strict"
    sg.receive_weights(model, sg.encode_control({"op": "refit", "version": 10}))
    assert rec.calls[-1]["delta"] is False


def test_vllm_update_info_and_worker_extension_pass_delta(rec):
    assert vt._delta_kwargs(vt.ReshardUpdateInfo(version=3, delta=True)) == {"version": 3, "delta": True}
    assert vt._delta_kwargs(vt.ReshardUpdateInfo(version="tag")) == {}  # dense: the tag stays vLLM's
    ext = object.__new__(vt.RefitWorkerExtension)
    ext._tr_layouts, ext._tr_group, ext._tr_timeout = (LAYOUT, LAYOUT), None, 5.0
    ext._model = lambda: torch.nn.Linear(3, 4, bias=False)
    ext.refit_from_trainer(version=4, delta=True)
    assert rec.calls[-1]["version"] == 4 and rec.calls[-1]["delta"] is True


def test_verl_delta_keeps_receive_buffers_and_passes_steps(rec):
    with pytest.raises(ValueError, match="delta='always'"):
        vr.TritonReshardCheckpointEngine(1024, delta="always")
    eng = vr.TritonReshardCheckpointEngine(1024, delta=True, device="cpu")
    eng.rank = 0
    a = eng._buffers(LAYOUT, torch.device("cpu"))
    b = eng._buffers(LAYOUT, torch.device("cpu"))
    assert a["w"] is b["w"]  # a delta lands on the previous version: the same buffers every update
    eng._version = 12
    eng._refit({}, a, LAYOUT, LAYOUT)
    assert rec.calls[-1]["version"] == 12 and rec.calls[-1]["delta"] is True
    dense = vr.TritonReshardCheckpointEngine(1024, device="cpu")
    dense.rank = 0
    assert dense._buffers(LAYOUT, torch.device("cpu"))["w"] is not dense._buffers(LAYOUT, torch.device("cpu"))["w"]
    dense._refit({}, a, LAYOUT, LAYOUT)
    assert "delta" not in rec.calls[-1] and "version" not in rec.calls[-1]


def test_bad_delta_options_are_refused_on_the_trainer_before_any_engine_call(rec):
    """Issue 42: ``delta=True`` with a tag for a version reached the engine (which paused and began its reload)
    before the workers refused it. The kit's ``delta_options`` applies ``refit``'s own rule, so every plug-in's
    trainer side refuses it before it calls the engine; the update info refuses it where it is built."""
    from triton_reshard.integrations import engine as kit

    with pytest.raises(TypeError, match="needs an int version="):
        kit.delta_options("step-0", True)
    with pytest.raises(ValueError, match="delta must be False, True, 'strict' or 'auto'"):
        kit.delta_options(3, "yes")
    with pytest.raises(TypeError, match="needs an int version="):
        vt.ReshardUpdateInfo(version="step-0", delta=True)
    with pytest.raises(ValueError, match="method must be 'reshard' or 'broadcast'"):
        vt.ReshardUpdateInfo(version=1, method="gather")
    tr = object.__new__(sg.SGLangTrainer)
    tr.rank, tr.src_layout, tr.dst_layout, tr.group, tr.timeout, tr.bucket_bytes = 0, LAYOUT, LAYOUT, None, 5.0, 1024
    posted = []
    tr._post = lambda msg: posted.append(msg)  # the engine's update session (rank 0): must not be opened
    with pytest.raises(TypeError, match="needs an int version="):
        tr.send_weights({}, version="step-0", delta=True)
    assert posted == [] and rec.calls == []
