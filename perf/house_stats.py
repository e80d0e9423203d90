"""House stats of the package, read from its source (no import): module sizes, the biggest functions,
cross-module imports of `_private` names, and import circles (module-level and function-level imports).

    python perf/house_stats.py [--top N]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"triton_reshard": ROOT / "triton_reshard", "triton_reshard.kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, Path]):
    """Yield (importer, imported module, name or None, function-level?) for every import in the package."""
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"
        top = {id(n) for n in tree.body}
        for n in tree.body:  # imports under `if TYPE_CHECKING:` / try at module level count as module-level
            if isinstance(n, (ast.If, ast.Try)):
                top.update(id(c) for c in ast.walk(n))
        for node in ast.walk(tree):
            nested = id(node) not in top
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield mod, a.name, None, nested
            elif isinstance(node, ast.ImportFrom):
                target = resolve(mod, is_pkg, node)
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:
                        yield mod, sub, None, nested
                    else:
                        yield mod, target, a.name, nested


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    mods = module_files()
    sizes = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    print(f"modules: {len(mods)}, lines: {sum(sizes.values())}")
    root = sorted(m for m, p in mods.items() if p.parent == PACKAGES["triton_reshard"] and m != "triton_reshard")
    print(f"root modules/packages ({len(root)}): {', '.join(x.split('.', 1)[1] for x in root)}")
    print(f"\nbiggest modules (over 600 lines: {sum(s > 600 for s in sizes.values())}):")
    for m, s in sorted(sizes.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {s:6d}  {m}")
    print_sizes(mods, args.top)
    print_imports(mods, args.top)
    print_reach_through(mods, args.top)
    print_outside(args.top)


def print_sizes(mods: dict[str, Path], top: int) -> None:
    """The biggest functions and classes."""
    funcs = []
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                funcs.append((node.end_lineno - node.lineno + 1, kind, f"{m}:{node.name}"))
    defs = sorted((f for f in funcs if f[1] == "def"), reverse=True)
    classes = sorted((f for f in funcs if f[1] == "class"), reverse=True)
    print(f"\nbiggest functions (over 80 lines: {sum(n > 80 for n, _, _ in defs)}):")
    for n, _, name in defs[: top]:
        print(f"  {n:6d}  {name}")
    print("\nbiggest classes:")
    for n, _, name in classes[:5]:
        print(f"  {n:6d}  {name}")


def print_imports(mods: dict[str, Path], top: int) -> None:
    """Cross-module imports of _private names, import circles, function-level imports."""
    private = [(a, b, n, f) for a, b, n, f in imports(mods) if n and n.startswith("_") and not n.startswith("__")
               and b in mods and b != a]
    mod_level = [x for x in private if not x[3]]
    print(f"\ncross-module imports of _private names: {len(mod_level)} module-level, "
          f"{len(private) - len(mod_level)} function-level")
    for a, b, n, f in private[: top]:
        print(f"  {a} <- {b}.{n}{'  (in a function)' if f else ''}")

    for label, keep in (("module-level", lambda f: not f), ("module- and function-level", lambda f: True)):
        edges: dict[str, set[str]] = {}
        for a, b, _, f in imports(mods):
            if b in mods and b != a and keep(f):
                # importing a.b.c also runs a and a.b: count the package too, except a package's own children
                edges.setdefault(a, set()).add(b)
        cs = circles(edges)
        print(f"\nimport circles ({label}): {len(cs)}")
        for c in cs:
            print(f"  {' <-> '.join(x.replace('triton_reshard.', '') for x in c)}")
    func_imports = sum(1 for a, b, _, f in imports(mods) if f and b in mods)
    print(f"\nfunction-level imports of package modules: {func_imports}")


def print_reach_through(mods: dict[str, Path], top: int) -> None:
    """Private attributes reached through objects other than self / cls."""
    # x._name where x is not self / cls, and _name is not a member the same module defines (another instance
    # of its own class): reach-through into another room's privates, or into a third-party library's
    own: dict[str, set[str]] = {}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.setdefault(m, set()).add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                own.setdefault(m, set()).add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.setdefault(m, set()).add(node.id)
    ours_all = set().union(*own.values())
    reach: dict[str, list[str]] = {"ours": [], "third-party": []}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in own.get(m, ())):
                reach["ours" if node.attr in ours_all else "third-party"].append(f"{m}:{node.lineno} .{node.attr}")
    for kind, sites in reach.items():
        print(f"\nprivate attribute reach-through into {kind} objects (x._name, x not self/cls): {len(sites)}")
        for line in sorted(sites)[: top]:
            print(f"  {line}")


def print_outside(top: int) -> None:
    """Imports of _private package names from tests/, examples/ and perf/."""
    outside = []  # tests, examples, perf: imports of _private names from the package
    for d in ("tests", "examples", "perf"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("triton_reshard"):
                    outside += [f"{path.relative_to(ROOT)} <- {node.module}.{a.name}" for a in node.names
                                if a.name.startswith("_") and not a.name.startswith("__")]
    print(f"\nimports of _private package names in tests/examples/perf: {len(outside)}")
    for line in outside[: top]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
