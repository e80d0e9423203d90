"""Real multi-process gloo runs (worlds of 2, 4 and 8 ranks), compared bit for bit with slices of the global
tensors that ``tests/dist_cases.py`` computes itself (nested ``torch.chunk``, plain indexing), never through
``Layout.shard``. One world is spawned per world size and runs every case of that size (``world_results`` is
cached for the session); each test below only reads its case's per-rank report.

Every case runs four times on every rank: fresh poisoned destination tensors; the same tensors re-poisoned
with new source data written in place (cached views and buffers reused); fresh tensors with a third data set,
every contiguous chunk a direct message sent or received in place; the same in column-major tensors, where
the direct messages are staged instead.
"""

from __future__ import annotations

import pytest

from . import dist_cases as dc

pytestmark = pytest.mark.slow


def _world(world: int) -> list[dict]:
    results = dc.world_results(world)
    failed = {r: v for r, v in enumerate(results) if not isinstance(v, dict)}
    if failed:
        pytest.fail(f"world of {world} ranks failed: " + "\n".join(f"rank {r}: {v}" for r, v in failed.items()))
    return results


def _problems(entries: list[dict]) -> str:
    return "\n".join(p for e in entries for p in e["problems"])


CASE_PARAMS = [
    pytest.param(c.world, c.id, id=f"w{c.world}-{c.id}") for c in sorted(dc.CASES.values(), key=lambda c: c.world)
]


@pytest.mark.parametrize(("world", "case_id"), CASE_PARAMS)
def test_reshard_bit_exact(world, case_id):
    case = dc.CASES[case_id]
    entries = [r["cases"][case_id] for r in _world(world)]
    problems = _problems(entries)
    assert not problems, problems
    ran = [e for e in entries if not e.get("skipped")]
    if case.group_ranks is None:
        assert len(ran) == world
    else:
        assert len(ran) == len(case.group_ranks)
    for e in ran:
        assert len(e["steps"]) == 4  # four runs per rank
        if case.multi_step:
            assert min(e["steps"]) > 1, f"bucket of {case.bucket_bytes} B should need several steps, got {e['steps']}"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_direct_messages_move_in_place(world):
    """Run 3 (every contiguous chunk a direct message) moves bytes in place; run 4 (column-major tensors)
    moves fewer in place, and only 1-D tensors' (the others are staged); run 1 (default threshold) none."""
    runs = [r["cases"][c]["in_place_bytes"] for r in _world(world) for c in r["cases"] if "in_place_bytes" in r["cases"][c]]
    assert runs and all(x[0] == 0 for x in runs)
    assert sum(x[2] for x in runs) > 0
    assert sum(x[3] for x in runs) < sum(x[2] for x in runs)


def test_catalogue_covers_the_issue():
    """The case list itself: every world size, 1-D to 5-D, the dtypes, and the topologies the issue asks for."""
    ids = set(dc.CASES)
    assert {c.world for c in dc.CASES.values()} == {2, 4, 8}
    ndims = {len(s) for c in dc.CASES.values() for d in c.src for s, _ in d.specs().values()}
    assert ndims >= {1, 2, 3, 4, 5}
    dtypes = {dt for c in dc.CASES.values() for d in c.src + c.dst for _, dt in d.specs().values()}
    import torch

    assert dtypes >= {torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.bool}
    for needed in ("pp2xtp2-to-tp4", "pp4xtp2-to-tp8", "dp2xtp2-replicas-to-tp4", "disagg-tp4-0-3-to-tp2x2-4-7",
                   "fused-qkv", "per-expert-tp-to-stacked", "uneven-empty-shards", "small-bucket-w8"):
        assert needed in ids
    # disaggregated: source and destination rank sets disjoint
    c = dc.CASES["disagg-tp4-0-3-to-tp2x2-4-7"]
    assert set(dc.side_ranks(c.src, 8)).isdisjoint(dc.side_ranks(c.dst, 8))


def _mesh_id(mesh) -> str:
    if isinstance(mesh[0], list):
        return ".".join("".join(str(r) for r in row) for row in mesh)
    return "".join(str(r) for r in mesh)


def _pl_id(pl) -> str:
    return "".join(f"S{p.dim}" if isinstance(p, dc.Shard) else "R" for p in pl)


DTENSOR_PARAMS = [
    pytest.param(world, item, id=f"w{world}-mesh{_mesh_id(item[0])}-{'x'.join(map(str, item[1]))}-"
                                 f"{_pl_id(item[2])}-to-{_pl_id(item[3])}")
    for world, items in sorted(dc.DTENSOR_ITEMS.items()) for item in items
]


@pytest.mark.parametrize(("world", "item"), DTENSOR_PARAMS)
def test_matches_dtensor(world, item):
    """Layout.from_placements(...).shard() == distribute_tensor(...).to_local(), and our reshard ==
    DTensor.redistribute(...).to_local(), on every rank."""
    entries = [r["dtensor"][dc.dtensor_item_id(item)] for r in _world(world)]
    problems = _problems(entries)
    assert not problems, problems


@pytest.mark.parametrize(
    ("world", "sides"),
    [pytest.param(w, sides, id=f"w{w}-{'colocated' if sides[0] == sides[1] else 'disaggregated'}")
     for w, all_sides in sorted(dc.REFIT_SIDES.items()) for sides in all_sides],
)
def test_refit_named_parameters(world, sides):
    """refit() into a TinyModel's named_parameters() (requires_grad leaves), twice with different data."""
    src_ranks, dst_ranks = sides
    entries = [r["refit"][f"src{src_ranks}-dst{dst_ranks}"] for r in _world(world)]
    problems = _problems(entries)
    assert not problems, problems


@pytest.fixture(scope="module")
def triton_world():

    from triton_reshard.testing.launch import run_world

    return run_world(dc.world_main_triton, 4, dc.case_ids(4), timeout=600, pg_timeout=120, allow_errors=True,
                     env={"TRITON_INTERPRET": "1", "TRITON_RESHARD_BACKEND": "triton"})


def test_reshard_with_triton_backend(triton_world):
    """The world-4 cases again, with every pack/unpack/local copy through the Triton kernel (interpreter)."""
    failed = {r: v for r, v in enumerate(triton_world) if not isinstance(v, dict)}
    assert not failed, failed
    ran = 0
    for res in triton_world:
        for cid, e in res["cases"].items():
            assert not e["problems"], f"{cid}: " + "\n".join(e["problems"])
            ran += 1
    assert ran >= 4 * 5


def test_triton_launches_per_copy_list_are_constant(triton_world):
    """One launch per dtype group for a whole copy list (pack, unpack or local), however many slices it has."""
    calls = [c for res in triton_world for c in res["calls"]]
    assert calls, "the Triton backend was never used"
    for pairs, launches, groups in calls:
        assert launches <= groups, (pairs, launches, groups)
    # the lists really batch several slices into one launch: fewer launches than slices overall (a step packs
    # one message per direction, by the pair rule of plan/local.py: lists of a few slices on these small cases)
    assert max(pairs for pairs, _, _ in calls) >= 3
    assert sum(launches for _, launches, _ in calls) < sum(pairs for pairs, _, _ in calls) / 2
