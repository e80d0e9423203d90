#!/usr/bin/env bash
# Builds the SGLang engine tier's environment: the real SGLang beside our package, in a venv of its own
# (sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0; vLLM 0.33 pins torch 2.14.0).
#   bash tests/engines/install_sglang.sh [VENV]      (default: .venv-sglang at the repository root)
# Exit status 3 (and the reason on stderr and in VENV/UNAVAILABLE) when a package cannot be installed at all.
# What is installed and why: ../shared/FACTS.md "SGLang on this machine" (sglang --no-deps, then only what
# its model classes and loaders import on CPU; sgl-kernel and flashinfer need a GPU and are not installed).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-sglang}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.14.1}"              # what sglang 0.5.23 pins
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.29.1}"  # torchvision that matches torch 2.14.1 (pin both)
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.19.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
ready="sglang==$SGLANG_VERSION torch==$TORCH_VERSION transformers==$TRANSFORMERS_VERSION"

unavailable() { echo "sglang tier unavailable: $*" >&2; mkdir -p "$venv"; echo "$*" >"$venv/UNAVAILABLE"; exit 3; }
# TRITON_RESHARD_DEFER_SELF=1 (.ci/run, beside the main suite): every dependency but our package, whose
# editable install rebuilds the tree's native codec in place under tests that have it loaded; the venv gets
# DEPS, and a later plain run adds our package, checks the imports and writes READY.
deps_ready() { [ -x "$venv/bin/python" ] && [ -f "$venv/DEPS" ] && [ "$(cat "$venv/DEPS")" = "$ready" ]; }

if [ -x "$venv/bin/python" ] && [ -f "$venv/READY" ] && [ "$(cat "$venv/READY")" = "$ready" ]; then
  echo "sglang env $venv is ready ($(cat "$venv/READY"))"
  # packages the tier needs may have joined requirements_sglang.txt since (pip only adds what is missing)
  "$venv/bin/pip" install -q -r "$here/requirements_sglang.txt" -c "$venv/constraints.txt" \
    || unavailable "sglang $SGLANG_VERSION's requirements do not install"
  [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ] && exit 0  # our package: added by a later plain run
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
  exit 0
fi
pip="$venv/bin/pip"
cons="$venv/constraints.txt"
if ! deps_ready; then
  rm -rf "$venv"
  python3 -m venv "$venv" || exit 1
  printf 'torch==%s\ntorchvision==%s\ntransformers==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" "$TRANSFORMERS_VERSION" >"$cons"
  "$pip" install -q --upgrade "pip>=24" setuptools wheel || exit 1
  "$pip" install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" -c "$cons" \
    || unavailable "torch==$TORCH_VERSION does not install"
  "$pip" install -q --no-deps "sglang==$SGLANG_VERSION" || unavailable "sglang==$SGLANG_VERSION does not install"
  "$pip" install -q -r "$here/requirements_sglang.txt" -c "$cons" \
    || unavailable "sglang $SGLANG_VERSION's requirements do not install"
fi
if [ -n "${TRITON_RESHARD_DEFER_SELF:-}" ]; then
  echo "$ready" >"$venv/DEPS"; echo "sglang env $venv: dependencies ready, our package deferred"; exit 0
fi
"$pip" install -q --no-deps --no-build-isolation -e "$root" || exit 1
"$venv/bin/python" - <<'PY' || unavailable "sglang does not import"
import sglang.srt.model_loader, torch, transformers, triton_reshard
import sglang
print("sglang env:", "torch", torch.__version__, "sglang", sglang.__version__, "transformers", transformers.__version__)
PY
echo "$ready" >"$venv/READY"; rm -f "$venv/DEPS"
