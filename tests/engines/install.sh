#!/usr/bin/env bash
# Builds the engine-tier environment: the real vLLM and Megatron-Core beside our package, in a venv of its
# own (vLLM pins its own torch; the main test environment keeps whatever torch the README's command picks).
#   bash tests/engines/install.sh [VENV]      (default: .venv-engines at the repository root)
# Exit status 3 (and the reason on stderr and in VENV/UNAVAILABLE) when a package cannot be installed at all.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-engines}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
TORCH_VERSION="${TORCH_VERSION:-2.14.0}"      # what vllm 0.33.0 pins
MCORE_VERSION="${MCORE_VERSION:-0.16.1}"      # newest megatron-core for Python 3.11
VERL_VERSION="${VERL_VERSION:-0.9.1}"         # --no-deps: its Requires-Dist pins transformers<5.11 (vLLM needs >=5.16.1)
export PIP_DISABLE_PIP_VERSION_CHECK=1
ready="vllm==$VLLM_VERSION torch==$TORCH_VERSION megatron-core==$MCORE_VERSION"

unavailable() { echo "engine tier unavailable: $*" >&2; mkdir -p "$venv"; echo "$*" >"$venv/UNAVAILABLE"; exit 3; }
# TRITON_RESHARD_DEFER_SELF=1 (.ci/run, beside the main suite): every dependency but our package, whose
# editable install rebuilds the tree's native codec in place under tests that have it loaded; the venv gets
# DEPS, and a later plain run adds our package, checks the imports and writes READY.
deps_ready() { [ -x "$venv/bin/python" ] && [ -f "$venv/DEPS" ] && [ "$(cat "$venv/DEPS")" = "$ready" ]; }

if [ -x "$venv/bin/python" ] && [ -f "$venv/READY" ] && [ "$(cat "$venv/READY")" = "$ready" ]; then
  echo "engine env $venv is ready ($(cat "$venv/READY"))"
  # verl joined the tier later: add it (and the light packages it imports, only new ones) to a ready env
  if ! "$venv/bin/python" -c "import verl.checkpoint_engine" 2>/dev/null; then
    "$venv/bin/pip" install -q -r "$here/requirements.txt" -c "$venv/constraints.txt" \
      && "$venv/bin/pip" install -q --no-deps "verl==$VERL_VERSION" \
      || echo "engine env: verl==$VERL_VERSION does not install; its tests skip" >&2
  fi
  [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ] && exit 0  # our package: added by a later plain run
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
  exit 0
fi
pip="$venv/bin/pip"
cons="$venv/constraints.txt"
if ! deps_ready; then
  rm -rf "$venv"
  python3 -m venv "$venv" || exit 1
  echo "torch==$TORCH_VERSION" >"$cons"
  "$pip" install -q --upgrade "pip>=24" setuptools wheel || exit 1
  "$pip" install -q "torch==$TORCH_VERSION" -c "$cons" || unavailable "torch==$TORCH_VERSION does not install"
  "$pip" install -q --no-deps "vllm==$VLLM_VERSION" || unavailable "vllm==$VLLM_VERSION does not install"
  "$pip" install -q -r "$here/requirements.txt" -c "$cons" || unavailable "vllm $VLLM_VERSION's requirements do not install"
  "$pip" install -q --no-deps "megatron-core==$MCORE_VERSION" || unavailable "megatron-core==$MCORE_VERSION does not install"
  "$pip" install -q --no-deps "verl==$VERL_VERSION" || unavailable "verl==$VERL_VERSION does not install"
fi
if [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ]; then
  echo "$ready" >"$venv/DEPS"; echo "engine env $venv: dependencies ready, our package deferred"; exit 0
fi
"$pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
"$venv/bin/python" - <<'PY' || unavailable "the engines do not import"
import torch, vllm, megatron.core, transformers, triton_reshard, verl.checkpoint_engine
print("engine env:", "torch", torch.__version__, "vllm", vllm.__version__, "megatron-core",
      megatron.core.__version__, "transformers", transformers.__version__, "verl", verl.__version__)
PY
echo "$ready" >"$venv/READY"; rm -f "$venv/DEPS"
