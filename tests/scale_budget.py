"""How many random layout pairs ``test_plan_scale`` needs: planted planner bugs (mutants) and the number of
examples the property draws before it catches each, over several seeds. Not a test; a measurement:

    python -m tests.scale_budget [--budget 3000] [--seeds 0 1 2]

Each mutant replaces one planner function everywhere it is bound (box geometry, routing, the lower bound, the
schedule's split), the property runs unshrunk with a fixed seed, and the index of the first failing example is
printed (``-`` when it survived the whole budget). A mutant that survives every seed at the full budget is
beyond what the property can see at any budget we would pay for.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import triton_reshard.box as box
import triton_reshard.plan.routing as routing

from .test_plan import check_plan, check_schedule, reshard_problems

_orig_intersect, _orig_split_rows, _orig_cover, _orig_held = (box.intersect, box.split_rows, routing.cover_pieces,
                                                              routing.held_numel)


def _intersect_last_dim_short(a_off, a_size, b_off, b_size):
    r = _orig_intersect(a_off, a_size, b_off, b_size)
    if r is not None and len(r[1]) >= 2 and r[1][-1] >= 5:  # only wide, multi-dim overlaps
        return r[0], r[1][:-1] + (r[1][-1] - 1,)
    return r


def _split_rows_one_too_many(sizes, itemsize, cap):
    d, rows = _orig_split_rows(sizes, itemsize, cap)
    return d, rows + 1 if d > 0 else rows  # only splits below the first dim


def _cover_drops_third_piece(box_off, box_size, cands):
    pieces = _orig_cover(box_off, box_size, cands)
    return pieces[:2] + pieces[3:] if len(pieces) >= 3 else pieces


def _held_assumes_three_disjoint(box_off, box_size, boxes):
    if len(boxes) == 3:
        return sum(math.prod(p[1]) for p in (_orig_intersect(o, s, box_off, box_size) for o, s in boxes))
    return _orig_held(box_off, box_size, boxes)


_orig_split_box = box.split_box


def _intersect_4d_third_dim(a_off, a_size, b_off, b_size):
    r = _orig_intersect(a_off, a_size, b_off, b_size)
    if r is not None and len(r[1]) == 4 and r[1][2] >= 2:  # only 4-D overlaps, two or more wide in dim 2
        return r[0], r[1][:2] + (r[1][2] - 1,) + r[1][3:]
    return r


def _split_box_drops_last_of_four(sizes, itemsize, cap):
    out = _orig_split_box(sizes, itemsize, cap)
    return out[:-1] if len(out) >= 4 else out


MUTANTS = {
    "intersect: a wide overlap one short in its last dim": (_orig_intersect, _intersect_last_dim_short),
    "split_rows: one row too many below dim 0": (_orig_split_rows, _split_rows_one_too_many),
    "cover_pieces: the third piece of a decomposition dropped": (_orig_cover, _cover_drops_third_piece),
    "held_numel: three holders taken as disjoint": (_orig_held, _held_assumes_three_disjoint),
    "intersect: 4-D overlaps one short in dim 2": (_orig_intersect, _intersect_4d_third_dim),
    "split_box: the last chunk of four or more dropped": (_orig_split_box, _split_box_drops_last_of_four),
}


def _patch(orig, new) -> list[tuple[object, str]]:
    """Bind ``new`` wherever ``orig`` is bound in our modules; returns what to restore."""
    done = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name.startswith("triton_reshard") or name.startswith("tests")):
            continue
        for attr, val in list(vars(mod).items()):
            if val is orig:
                setattr(mod, attr, new)
                done.append((mod, attr))
    return done


def first_failure(budget: int, s: int) -> int | None:
    n = [0]

    @seed(s)
    @settings(max_examples=budget, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(reshard_problems(), st.sampled_from([256, 300, 1000, 4096, 1 << 20]))
    def prop(problem, bucket):
        n[0] += 1
        plan = check_plan(*problem, rank_buckets=(bucket,))  # as test_plan_scale checks a pair
        check_schedule(plan, bucket)

    try:
        prop()
    except Exception:  # noqa: BLE001 (any failure is a catch)
        return n[0]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=3000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", default=None, help="mutants whose label starts with one of these")
    args = ap.parse_args()
    print(f"budget {args.budget} examples; seeds {args.seeds}; columns: examples drawn until the first failure")
    for label, (orig, new) in MUTANTS.items():
        if args.only and not any(label.startswith(o) for o in args.only):
            continue
        t0 = time.perf_counter()
        undo = _patch(orig, new)
        try:
            found = [first_failure(args.budget, s) for s in args.seeds]
        finally:
            for mod, attr in undo:
                setattr(mod, attr, orig)
        cells = " ".join(f"{f if f is not None else '-':>6}" for f in found)
        print(f"{label:58s} {cells}   ({len(undo)} bindings, {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
