#!/usr/bin/env bash
# The package as a user installs a release: sdist and wheel built from a clean checkout, the wheel (not
# editable) installed into a fresh venv that cannot see the source tree, then, from outside the tree: every
# module imported, `triton-reshard --version`, a short demo, and a short refit through the public API.
# The wheel built from the sdist must equal the one built from the tree, and must hold every Python file of
# triton_reshard/ and kernels/ (tests/wheelcheck/wheel_contents.py names any that is missing).
#   bash .ci/wheel_check.sh            (exit 0: all of it held; the work folder is removed on exit)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
work="$(mktemp -d /tmp/triton-reshard-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT
t0=$SECONDS

# a clean checkout: the files git would check out (tracked, and untracked ones it does not ignore)
mkdir "$work/src"
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 tar -cf - --) | tar -xf - -C "$work/src"

python3 -m venv "$work/build-env"
"$work/build-env/bin/pip" install -q build 2>&1 | grep -v "^WARNING: Location" || true
# `python -m build` makes the sdist, then the wheel *from the sdist*; a second wheel straight from the tree
"$work/build-env/bin/python" -m build -q --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; echo "WHEEL CHECK: the sdist/wheel build failed"; exit 1; }
"$work/build-env/bin/python" -m build -q --wheel --outdir "$work/dist-tree" "$work/src" >>"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; echo "WHEEL CHECK: the wheel build from the tree failed"; exit 1; }
sdist=("$work"/dist/triton_reshard-*.tar.gz)
whl=("$work"/dist/triton_reshard-*.whl)
tree_whl=("$work"/dist-tree/triton_reshard-*.whl)
python3 "$root/tests/wheelcheck/wheel_contents.py" "$work/src" "${whl[0]}" "${tree_whl[0]}"
python3 - "${whl[0]}" "${tree_whl[0]}" <<'PY'
import hashlib, sys, zipfile
def files(p):
    with zipfile.ZipFile(p) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist() if not n.endswith("/RECORD")}
a, b = files(sys.argv[1]), files(sys.argv[2])
diff = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
if diff:
    sys.exit("WHEEL CHECK: the wheel built from the sdist differs from the one built from the tree: " + ", ".join(diff))
print(f"the sdist builds the same wheel as the tree ({len(a)} files, byte for byte)")
PY

# a fresh venv without system site-packages: only the wheel can provide triton_reshard
python3 -m venv "$work/venv"
# the CPU build of torch (on this machine's disk); the wheel's own requirements (triton, numpy) from the index
"$work/venv/bin/pip" install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
"$work/venv/bin/pip" install -q "${whl[0]}" 2>&1 | grep -v "^WARNING: Location" || true
mkdir "$work/elsewhere" && cd "$work/elsewhere"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import importlib, pkgutil, sys
from pathlib import Path
venv = Path(sys.argv[1]).resolve()
import triton_reshard
here = Path(triton_reshard.__file__).resolve()
assert venv in here.parents, f"triton_reshard imported from {here}, not from the installed wheel in {venv}"
names, failed = ["triton_reshard"], []
for m in pkgutil.walk_packages(triton_reshard.__path__, "triton_reshard."):
    names.append(m.name)
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:  # every module must import with the package's own requirements only
        failed.append(f"{name}: {type(e).__name__}: {e}")
if failed:
    sys.exit("WHEEL CHECK: modules of the installed wheel that do not import:\n  " + "\n  ".join(failed))
print(f"imported all {len(names)} modules of the installed wheel from {here.parent}")
PY
"$work/venv/bin/triton-reshard" --version
"$work/venv/bin/triton-reshard" demo --world 4 --src tp=2,pp=2 --dst tp=2,dp=2 --size-gb 0.01 --repeats 1 \
  --no-baseline --timeout 120 | tail -n 3
"$work/venv/bin/python" "$root/tests/wheelcheck/refit_smoke.py"
echo "wheel check passed in $((SECONDS - t0)) s: sdist $(du -k "${sdist[0]}" | cut -f1) KiB, wheel $(du -k "${whl[0]}" | cut -f1) KiB"
