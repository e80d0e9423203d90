#!/usr/bin/env bash
# Builds the three tier environments' dependencies (tests/engines/install.sh, install_sglang.sh,
# tests/vllm_cpu_tier/install.sh) one after the other, without our package (TRITON_RESHARD_DEFER_SELF=1: its
# editable install rebuilds the tree's native codec in place, under the main suite's tests). .ci/run starts this
# beside the main suite; each tier's own install later adds our package (seconds) or, where this failed,
# builds its environment again (the retry it always had).
cd "$(dirname "$0")/.."
for s in tests/engines/install.sh tests/engines/install_sglang.sh tests/vllm_cpu_tier/install.sh; do
  t0=$(date +%s)
  rc=0
  TRITON_RESHARD_DEFER_SELF=1 bash "$s" || rc=$?
  echo "prefetch: $s exited $rc after $(( $(date +%s) - t0 )) s"
done
