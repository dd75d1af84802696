"""Print the package's import structure: one line per module, ``module -> imports``.

Every ``import``/``from … import`` statement in ``lade_export`` (module level and inside
functions, which are marked ``(lazy)``) is read with :mod:`ast`; nothing is executed.
Listed are the package's own modules and the heavy export-time libraries (torch,
transformers, onnx, onnxscript, tensorrt).

    python scripts/import_graph.py            # every module
    python scripts/import_graph.py --runtime  # only the run-time side: modules outside graph.py and export/
    git worktree add /tmp/before 1126a11 && python scripts/import_graph.py --root /tmp/before
                                              # another checkout (here: before the layout of issue 24)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "onnx", "onnxscript", "tensorrt")
ROOT = Path(__file__).resolve().parents[1]  # this checkout (--root reads another)
PACKAGE = "lade_export"


def module_name(path: Path, root: Path) -> str:
    """``ROOT/lade_export/a/b.py`` → ``lade_export.a.b`` (``__init__`` names its package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path, modules: set[str]) -> dict[str, bool]:
    """Imported names of interest (``modules`` of the package, :data:`HEAVY` libraries) →
    whether every import of it is inside a function."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, bool] = {}
    tree = ast.parse(path.read_text(), str(path))

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] if child.module else [f"{base}.{a.name}" for a in child.names]
            for t in targets:
                top = t.split(".")[0]
                if top == PACKAGE:
                    key = t
                    while key not in modules and "." in key:  # `from .x import Name`
                        key = key.rpartition(".")[0]
                elif top in HEAVY:
                    key = top
                else:
                    continue
                if key != name:
                    found[key] = found.get(key, True) and inner
            visit(child, inner)

    visit(tree, False)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", action="store_true",
                        help="only the run-time side (every module but lade_export.graph and lade_export.export.*); "
                             "one that pulls in " + ", ".join(HEAVY) + " when imported is marked")
    parser.add_argument("--root", type=Path, default=None, help="the checkout to read (default: this one)")
    args = parser.parse_args()
    root = ROOT if args.root is None else args.root.resolve()
    if not (root / PACKAGE).is_dir():
        parser.error(f"{args.root} has no {PACKAGE}/ folder: give a checkout of this project")
    files = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    graph = {module_name(p, root): imports_of(p, root, modules) for p in files}

    def heavy(mod, seen=()):
        """Heavy libraries a module pulls in at import time (module-level imports, transitively)."""
        out = set()
        for dep, lazy in graph.get(mod, {}).items():
            if lazy or dep in seen:
                continue
            out |= {dep} if dep in HEAVY else heavy(dep, seen + (mod,))
        parents = mod.split(".")[:-1]  # importing a.b.c runs a/__init__ and a/b/__init__
        for i in range(1, len(parents) + 1):
            parent = ".".join(parents[:i])
            if parent != mod and parent not in seen and parent in graph:
                out |= heavy(parent, seen + (mod,))
        return out

    export_side = ("lade_export.graph", "lade_export.export")
    for mod in sorted(graph):
        mark = ""
        if args.runtime:
            if any(mod == e or mod.startswith(e + ".") for e in export_side):
                continue
            pulled = heavy(mod)
            mark = f"   [imports {', '.join(sorted(pulled))} when imported: not run-time]" if pulled else ""
        deps = ", ".join(d + (" (lazy)" if lazy else "") for d, lazy in sorted(graph[mod].items()))
        print(f"{mod} -> {deps}{mark}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        sys.stderr.close()
