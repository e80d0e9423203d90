#!/usr/bin/env bash
# GPU check of the copy kernels and the delta codec, in one go (< 10 minutes on one H100/H200-class GPU):
#   1. the `gpu`-marked kernel tests (compiled kernel on CUDA, large sizes, all casts, autotuning, > 2^31; the
#      delta codec's v2 kernels: the CPU codec's bytes on adversarial cases, bit-exact apply),
#   2. perf/autotune.py on the Llama-3-8B preset (chosen configs and their GB/s),
#   3. perf/bench_kernels.py (Triton vs per-slice torch vs a plain-copy ceiling),
#   4. perf/bench_delta_gpu.py (the Triton delta codec, format v2 and v1, on the 125M Llama's bf16 weights:
#      pack and apply against one dense copy, bit-exact, v2 bytes equal to the CPU codec's; exit 1 if not).
# Needs only torch + triton (+ pytest for part 1; installed if missing and a network is there, else part 1 is
# skipped). Every part runs under `timeout`; a failing part does not stop the others.
#
#   bash perf/gpu_check.sh OUTDIR
#
# OUTDIR receives: env.txt, tests.log, tests.xml, autotune.log, autotune.json, bench.log, bench.json,
# delta.log, delta.json, summary.txt (the exit status of every part).
set -u
OUT=${1:?usage: perf/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

{
  date
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi failed"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__)"
} >"$OUT/env.txt" 2>&1

timeout 120 $PY -m pip install -q -e . --no-deps >>"$OUT/env.txt" 2>&1 || echo "pip install -e . failed (using the tree as is)" >>"$OUT/env.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import pytest" 2>/dev/null; then
  timeout 60 $PY -m pip install -q pytest hypothesis >>"$OUT/env.txt" 2>&1 || echo "pytest not installable (no network?)" >>"$OUT/env.txt"
fi

status() { echo "$1: exit $2" >>"$OUT/summary.txt"; }
: >"$OUT/summary.txt"

# 1. gpu tests (~52 one-config compiles for the cast matrix, a few autotuned ones; the delta v2 kernels for 4
#    element sizes against the CPU codec's bytes)
if $PY -c "import pytest" 2>/dev/null; then
  timeout 270 $PY -m pytest tests/test_kernels.py tests/test_delta_triton_v2.py -m gpu -q -rA -p no:cacheprovider \
    --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1
  status "gpu tests" $?
else
  echo "pytest missing: gpu tests not run" >"$OUT/tests.log"
  status "gpu tests" skipped
fi

# 2. autotune on the Llama-3-8B TP4 -> TP2 lists
timeout 90 $PY perf/autotune.py --presets llama3-8b --repeats 10 --out "$OUT/autotune.json" >"$OUT/autotune.log" 2>&1
status "autotune" $?

# 3. benchmark (all 32 layers of the TP scenario, 10,000 tiny regions, huge regions)
timeout 150 $PY perf/bench_kernels.py --device cuda --repeats 10 --out "$OUT/bench.json" >"$OUT/bench.log" 2>&1
status "bench" $?

# 4. the delta codec (first launches compile ~10 kernels; the CPU codec's bytes are computed once per fraction)
timeout 120 $PY perf/bench_delta_gpu.py --device cuda --repeats 5 --out "$OUT/delta.json" >"$OUT/delta.log" 2>&1
status "delta codec" $?

cat "$OUT/summary.txt"
tail -n 12 "$OUT/bench.log"
tail -n 4 "$OUT/delta.log"
