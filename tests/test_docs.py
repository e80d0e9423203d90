"""The README and docs/ as a newcomer reads them: every Python block is complete (it compiles, imports what it
uses, and its ``triton_reshard`` imports exist), the self-contained ones run, and every relative link points to
a file and heading that exist. Issue 22: the presets snippet used ``torch`` without importing it."""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))

# Names a snippet may use without defining them: the caller's own objects, which the text around the
# snippet names (the job's ranks, rendezvous address, its model, layouts and tensors). Anything else a
# snippet uses (a module like ``torch``, one of our functions) must be imported or defined in it.
PLACEHOLDERS = {
    "HOST", "PORT", "SECRET", "T", "W", "offset", "local_rank", "rank", "client", "local_tensors", "model", "hf_config",
    "train_layout", "infer_layout", "train_tensors", "vllm_model", "g", "TP", "step", "sglang_engine",
}


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def python_blocks() -> list[tuple[str, int, str]]:
    """``(file, line, code)`` of every ```python block of the README and docs/."""
    out = []
    for path in DOCS:
        text = _read(path)
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            out.append((path, text[:m.start()].count("\n") + 1, m.group(1)))
    return out


BLOCKS = python_blocks()


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads but never binds (imports, assignments, defs, arguments, comprehension targets)."""
    bound, loaded = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound


def test_the_docs_have_python_blocks_and_the_two_commands():
    assert len(BLOCKS) >= 10, [(f, n) for f, n, _ in BLOCKS]
    readme = _read("README.md").splitlines()
    for cmd in ('pip install -e ".[test]" && triton-reshard demo', 'pip install -e ".[test]" && pytest'):
        assert any(line.strip().startswith(cmd) for line in readme), cmd


@pytest.mark.parametrize(("path", "line", "code"), BLOCKS, ids=[f"{f}:{n}" for f, n, _ in BLOCKS])
def test_every_python_block_is_complete(path, line, code):
    tree = ast.parse(code, filename=f"{path}:{line}")
    missing = free_names(tree) - PLACEHOLDERS
    assert not missing, f"{path}:{line} uses {sorted(missing)} without importing or defining them"
    for node in ast.walk(tree):  # our own imports exist, by the names the docs give
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("triton_reshard"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                assert hasattr(mod, a.name) or importlib.util.find_spec(f"{node.module}.{a.name}"), \
                    f"{path}:{line}: {node.module} has no {a.name}"


def test_the_presets_snippets_run():
    """The README's and docs/presets.md's preset blocks run as written (no process group needed)."""
    import torch

    from triton_reshard import Layout

    ran = 0
    for path, line, code in BLOCKS:
        if "get_config(" not in code:
            continue
        ns: dict = {}
        exec(compile(code, f"{path}:{line}", "exec"), ns)
        train, infer = ns["train"], ns["infer"]
        assert isinstance(train, Layout) and isinstance(infer, Layout)
        assert list(train.ranks) == list(range(8)) and list(infer.ranks) == list(range(8, 16))
        assert {s.dtype for s in infer.specs.values()} == {torch.bfloat16}
        ran += 1
    assert ran >= 2  # README and docs/presets.md


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _read(path), re.M)}


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_point_to_files_and_headings_that_exist(path):
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        assert os.path.exists(os.path.join(ROOT, dest)), f"{path}: link to {target}: no {dest}"
        if anchor and dest.endswith(".md"):
            assert anchor in _anchors(dest), f"{path}: link to {target}: no heading #{anchor} in {dest}"


@pytest.mark.slow
def test_the_api_example_runs_under_torchrun(tmp_path):
    """The README's API block, as its first line says: ``torchrun --nproc-per-node 8 example.py``."""
    code = next(c for f, _n, c in BLOCKS if f == "README.md" and "torchrun --nproc-per-node 8" in c)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    # its own process group: on a timeout the workers go too (killing torchrun alone left 8 orphans behind)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                          str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=400)
    finally:
        if p.poll() is None or p.returncode != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert re.search(r"^Plan\(.*\) True$", out, re.M), out
