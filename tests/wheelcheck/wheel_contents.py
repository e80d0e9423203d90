"""What a built wheel of triton_reshard must hold, checked against the source tree.

Used by ``tests/test_packaging.py`` (main suite: a wheel built from a copy of the tree) and by
``.ci/wheel_check.sh`` (CI: sdist and wheel built from a clean checkout, installed into a fresh venv). Only the
standard library: it runs in any interpreter, with or without the package installed.

    python tests/wheelcheck/wheel_contents.py ROOT WHEEL [WHEEL ...]   # exit 1 naming each missing file
"""

from __future__ import annotations

import configparser
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGE = "triton_reshard"
KERNELS_DIR = "kernels"  # installs as triton_reshard/kernels (triton_reshard/kernels links to it)


def tree_files(root: Path) -> set[str]:
    """The installed paths every Python file of the tree must have in a wheel."""
    root = Path(root)
    out = set()
    for top, dest in ((PACKAGE, PACKAGE), (KERNELS_DIR, f"{PACKAGE}/kernels")):
        for p in (root / top).rglob("*.py"):
            rel = p.relative_to(root / top)
            if "__pycache__" in rel.parts:
                continue
            out.add(f"{dest}/{rel.as_posix()}")
    return out


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if not n.endswith("/")}


def wheel_entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    with zipfile.ZipFile(wheel) as z:
        name = next((n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        if name is None:
            return {}
        cp = configparser.ConfigParser(delimiters=("=",))
        cp.optionxform = str  # keep the names' case
        cp.read_string(z.read(name).decode())
    return {s: {k: v.strip() for k, v in cp[s].items()} for s in cp.sections()}


def declared_entry_points(root: Path) -> dict[str, dict[str, str]]:
    """The console scripts and entry points pyproject.toml declares, as a wheel's entry_points.txt says them."""
    project = tomllib.loads((Path(root) / "pyproject.toml").read_text())["project"]
    out = {}
    if project.get("scripts"):
        out["console_scripts"] = dict(project["scripts"])
    for group, eps in project.get("entry-points", {}).items():
        out[group] = dict(eps)
    return out


def problems(root: Path, wheel: Path) -> list[str]:
    """Every way the wheel falls short of the tree, one line each (empty: it holds everything)."""
    have = wheel_files(wheel)
    out = [f"{wheel.name}: {path} is in the source tree but not in the wheel"
           for path in sorted(tree_files(root) - have)]
    got, want = wheel_entry_points(wheel), declared_entry_points(root)
    for group, eps in sorted(want.items()):
        for name, target in sorted(eps.items()):
            if got.get(group, {}).get(name) != target:
                out.append(f"{wheel.name}: entry point [{group}] {name} = {target} is declared in pyproject.toml "
                           f"but the wheel says {got.get(group, {}).get(name)!r}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    root, wheels = Path(argv[0]), [Path(w) for w in argv[1:]]
    bad = [line for w in wheels for line in problems(root, w)]
    for line in bad:
        print("MISSING FROM WHEEL:", line)
    if not bad:
        for w in wheels:
            n = len(tree_files(root))
            print(f"{w.name}: all {n} Python files of the tree and every declared entry point are in it "
                  f"({w.stat().st_size / 1024:.0f} KiB, {len(wheel_files(w))} files)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
