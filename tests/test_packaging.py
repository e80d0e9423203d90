"""A wheel built from the tree holds every module, the console script and the plug-in entry points.

``pip install -e`` puts the source tree on the path, so a package left out of the packaged list goes unseen
there; once ``triton_reshard.layout`` was missing from every built wheel. This builds a real wheel (pip, the
project's own build backend) from a copy of the tree and compares. The installed-wheel check (fresh venv,
import of every module, the CLI and a refit from outside the tree) is ``.ci/wheel_check.sh``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.wheelcheck.wheel_contents import declared_entry_points, problems, tree_files, wheel_entry_points

ROOT = Path(__file__).resolve().parents[1]


def _copy_tree(dst: Path) -> None:
    """The files git would check out (tracked and untracked-not-ignored, symlinks as symlinks), or the tree less
    caches without git."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout
        files = [f for f in out.decode().split("\0") if f and ((ROOT / f).is_file() or (ROOT / f).is_symlink())]
    except (OSError, subprocess.CalledProcessError):
        skip = {"__pycache__", ".git", "build", "dist", ".pytest_cache", ".hypothesis"}
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if (p.is_file() or p.is_symlink()) and not skip & set(p.relative_to(ROOT).parts)
                 and not any(part.startswith(".venv") or part.endswith(".egg-info") for part in p.parts)]
    for f in files:
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / f).is_symlink():  # as git checks it out (triton_reshard/kernels/copy.py -> ../../kernels/copy.py)
            (dst / f).symlink_to(Path((ROOT / f).readlink()))
        else:
            shutil.copy2(ROOT / f, dst / f)


def _setuptools_builds_wheels() -> bool:
    """This interpreter's setuptools can be the build backend as it is: pyproject's ``setuptools>=64``, and
    ``bdist_wheel`` built in (70.1+; older ones need the ``wheel`` package)."""
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of a copy of the tree, for what it holds (files, entry points). Without the optional C codec
    (``CC=false``: setup.py's OptionalBuildExt swallows the compile failure, as it would any) and, where this
    interpreter's setuptools can build it, without an isolated build environment: the compile and the
    isolation were ~4/5 of this fixture (~120 s of CI's suite) and checked nothing here. The real wheel, codec
    and isolated build, from the sdist, is ``.ci/wheel_check.sh``'s, run right after the suite in CI."""
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("dist")
    _copy_tree(src)
    iso = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *iso, "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "CC": "false"})
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (whl,) = out.glob("triton_reshard-*.whl")
    return whl


def test_wheel_holds_every_module_and_entry_point(wheel):
    assert problems(ROOT, wheel) == []


def test_every_subpackage_of_the_tree_is_a_package_in_the_wheel(wheel):
    """Every folder of Python files in the tree arrives with its __init__.py (the layout package did not)."""
    want = {p.rsplit("/", 1)[0] for p in tree_files(ROOT) if p.endswith("/__init__.py")}
    assert {"triton_reshard", "triton_reshard/layout", "triton_reshard/kernels", "triton_reshard/plan"} <= want
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert sorted(d for d in want if f"{d}/__init__.py" not in names) == []


def test_wheel_entry_points_are_the_declared_ones(wheel):
    got = wheel_entry_points(wheel)
    assert got["console_scripts"]["triton-reshard"] == "triton_reshard.tools.cli:main"
    assert "triton_reshard" in got["vllm.general_plugins"]
    assert "triton_reshard" in got["sglang.srt.plugins"]
    assert {g: got.get(g) for g in declared_entry_points(ROOT)} == declared_entry_points(ROOT)


def test_the_check_names_a_dropped_subpackage(wheel, tmp_path):
    """The comparison itself fails, by file name, on a wheel that lost a subpackage (as the old list did)."""
    cut = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(cut, "w") as zout:
        for item in zin.infolist():
            if not item.filename.startswith("triton_reshard/layout/"):
                zout.writestr(item, zin.read(item.filename))
    lines = problems(ROOT, cut)
    assert lines and all("triton_reshard/layout/" in line for line in lines)
    assert any(line.endswith("triton_reshard/layout/__init__.py is in the source tree but not in the wheel")
               for line in lines)


def test_a_checkout_on_the_path_imports_its_own_kernels():
    """The kernels are the package triton_reshard.kernels wherever triton_reshard comes from: a checkout on
    PYTHONPATH finds its own kernels/ (no install, no package-dir remap, no other tree's editable finder)."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {str(ROOT)!r}); "
            "import triton_reshard, triton_reshard.kernels.copy as k; print(triton_reshard.__file__); print(k.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    pkg, kern = (Path(p).resolve() for p in out.stdout.split())
    assert pkg == ROOT / "triton_reshard" / "__init__.py" and kern == ROOT / "kernels" / "copy.py"


def test_no_top_level_folder_shadows_another_distribution():
    """A regular package at the repository root is imported by anything run from the root (pytest, the examples)
    in place of an installed distribution of the same name (issue 42: our ``kernels/`` hid Hugging Face's
    ``kernels``, which transformers imports). Only ``triton_reshard`` and ``tests`` may be packages there, and
    every kernel file of ``kernels/`` is linked from the package ``triton_reshard.kernels``."""
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["tests", "triton_reshard"]
    kern = ROOT / "triton_reshard" / "kernels"
    assert (kern / "__init__.py").is_file() and not (kern / "__init__.py").is_symlink()
    for f in sorted((ROOT / "kernels").glob("*.py")):
        link = kern / f.name
        assert link.is_file() and link.resolve() == f.resolve(), f"{link} must link to {f}"


_SHADOW_PROBE = """
import importlib.util, sys
sys.path.insert(0, {root!r})  # the repository root first, as pytest and `python examples/...` have it
import kernels
print("KERNELS", getattr(kernels, "__file__", None))
import triton_reshard.kernels.copy as k
print("OURS", k.__file__)
if importlib.util.find_spec("transformers") is not None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg)
    print("MODEL", sum(p.numel() for p in m.parameters()))
"""


def test_the_root_does_not_shadow_hugging_face_kernels():
    """From the repository root (first on sys.path), ``import kernels`` gives Hugging Face's package when it is
    installed (transformers >= 5.25 requires it), a transformers model builds, and our kernels are
    ``triton_reshard.kernels``."""
    import importlib.metadata as md
    import importlib.util

    out = subprocess.run([sys.executable, "-c", _SHADOW_PROBE.format(root=str(ROOT))], capture_output=True,
                         text=True, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    ours = Path(lines["OURS"]).resolve()
    assert ours == ROOT / "kernels" / "copy.py"
    got = lines["KERNELS"]
    try:
        md.distribution("kernels")
        installed = True
    except md.PackageNotFoundError:
        installed = False
    if installed:  # Hugging Face's package (from site-packages, even a venv inside the repository), not our kernels/
        assert got != "None" and (ROOT / "kernels") not in Path(got).resolve().parents, got
    else:  # nothing else named kernels: at most our folder as a namespace portion, never a regular package
        assert got == "None", got
    if importlib.util.find_spec("transformers") is not None:
        assert int(lines["MODEL"]) > 0
