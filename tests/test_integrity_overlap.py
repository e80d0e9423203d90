"""The digest exchange of a delta refit runs while the last step's apply does (issue 46, ``StepLoop.apply``): in
a gloo world of 4, delta refits of 8 steps post the round before the last step's delta messages are applied,
and the guarantee holds: a value flipped in the victim's LAST step is named on every rank (the same message),
a last-step message whose header breaks the decode (after the round was posted) is named on every rank too
(not a timeout on its peers), and the next refit goes dense and repairs (``tests/integrity_overlap_cases.py``)."""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from . import integrity_overlap_cases as oc


@functools.cache
def _world() -> list[dict]:
    from triton_reshard.testing.launch import run_world

    with tempfile.TemporaryDirectory() as d:
        res = run_world(oc.world_main, oc.WORLD, d, timeout=400, pg_timeout=60, allow_errors=True)
        path = [os.path.join(d, f"rank{r}.pt") for r in range(oc.WORLD)]
        saved = [torch.load(p) if os.path.exists(p) else {} for p in path]
    for r in range(oc.WORLD):
        if not saved[r]:
            pytest.fail(f"rank {r} saved nothing: {res[r]}")
    return saved


def _scenario(name: str) -> dict[int, dict]:
    out = {}
    for r, saved in enumerate(_world()):
        if "crash" in saved.get(name, {"crash": "no result"}):
            pytest.fail(f"rank {r}, scenario {name}: {saved.get(name, {}).get('crash', 'no result')}")
        out[r] = saved[name]
    return out


def _refits(events: list) -> list[list]:
    """The events split per refit (each starts with ``("refit",)``)."""
    out: list[list] = []
    for e in events:
        if e == ("refit",):
            out.append([])
        else:
            out[-1].append(e)
    return out


def _named_everywhere(per: dict) -> tuple:
    names = set()
    for r, res in per.items():
        f = res["v1"]
        assert f["error"] == "ReshardIntegrityError", (r, f)
        assert f["receiver"] == oc.VICTIM and f["sender"] != oc.VICTIM, (r, f)
        assert f"rank {r}: integrity check failed" in f["message"], f["message"]
        assert res["state"]["torn"], (r, res["state"])
        names.add((f["sender"], f["receiver"], f["tensor"], f["step"]))
    assert len(names) == 1, names  # every rank names the same message
    return names.pop()


def _repaired(per: dict) -> None:
    for r, res in per.items():
        assert res["v2"]["error"] is None and res["v2"]["mode"] == "dense-fallback" and res["v2_ok"], (r, res)
        assert res["v3"]["error"] is None and res["v3"]["mode"] == "delta" and res["v3_ok"], (r, res)


@pytest.mark.slow
def test_a_delta_refits_digest_round_is_posted_before_its_last_apply():
    """Clean delta refits: bit-exact, and on every rank the digest round goes on the wire after every step but
    the last was applied and before the last step's messages are: the round overlaps that apply. Its
    messages are the rooted round's (the root sends the table to each other rank, the others their row)."""
    per = _scenario("clean")
    for r, res in per.items():
        for v in range(4):
            assert res[f"v{v}"]["error"] is None and res[f"v{v}_ok"], (r, v, res[f"v{v}"])
        assert [res[f"v{v}"]["mode"] for v in (1, 2, 3)] == ["delta"] * 3, r
        for events in _refits(res["events"])[1:]:  # the delta refits
            assert events.count(("round",)) == 1, (r, events)
            at = events.index(("round",))
            before, after = events[:at], events[at + 1 :]
            assert before and all(e == ("apply", False) for e in before), (r, events)  # steps 1..7 applied
            assert after and all(e == ("apply", True) for e in after), (r, events)  # the last step's after it
        assert res["posts"] == [oc.WORLD - 1 if r == 0 else 1] * 4, (r, res["posts"])


@pytest.mark.slow
def test_a_value_flipped_in_the_last_step_is_named_on_every_rank():
    per = _scenario("last_flip")
    assert per[oc.VICTIM]["fired"] == 1 and per[oc.VICTIM]["step"] == 8, per[oc.VICTIM]
    _sender, _receiver, _tensor, step = _named_everywhere(per)
    assert step == per[oc.VICTIM]["step"]  # the corrupted message is the last step's
    assert not per[oc.VICTIM]["v1_ok"]  # it really was corrupted (the decode accepted the flipped value)
    _repaired(per)


@pytest.mark.slow
def test_a_last_step_message_that_breaks_the_decode_is_named_on_every_rank():
    """The victim's decode refuses the message after the round was posted: it waits for the verdict, so every
    rank raises the integrity error naming that message (its cause on the victim: the decode's ValueError),
    where its peers would otherwise wait for a row that never comes until their timeout."""
    per = _scenario("bad_header")
    assert per[oc.VICTIM]["fired"] == 1, per[oc.VICTIM]
    _sender, _receiver, _tensor, step = _named_everywhere(per)
    assert step == per[oc.VICTIM]["step"]
    assert per[oc.VICTIM]["v1"]["context"] == "ValueError", per[oc.VICTIM]["v1"]
    _repaired(per)


@pytest.mark.slow
def test_an_apply_failing_on_a_verified_message_leaves_the_peers_done_and_the_group_usable():
    """The victim's last apply raises (a bug, not corruption) after the round was posted: the round proves every
    message, so the peers return normally with their destinations right; the victim raises the abort, saying its
    peers finished and the group is usable (not "left waiting"), with its destination torn; and the next refit
    on the same group goes dense on every rank (the victim's snapshot dropped) and repairs it."""
    per = _scenario(oc.APPLY_RAISES)
    victim = per[oc.VICTIM]
    assert victim["fired"] == 1, victim
    f = victim["v1"]
    assert f["error"] == "ReshardAbortedError", f
    assert "peers finished and returned" in f["message"] and "still usable" in f["message"], f["message"]
    assert "left waiting" not in f["message"] and "unusable" not in f["message"], f["message"]
    assert f["context"] == "RuntimeError" and f["torn"] and victim["state"]["torn"], (f, victim["state"])
    assert not victim["v1_ok"]  # the apply really did not finish
    for r, res in per.items():
        if r != oc.VICTIM:
            assert res["v1"]["error"] is None and res["v1"]["mode"] == "delta" and res["v1_ok"], (r, res["v1"])
    _repaired(per)
