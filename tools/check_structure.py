"""Measure the package structure from the source (nothing is imported or run).

Checks, over ``profiling``, ``placement``, ``solver``, ``runtime_hooks`` and ``cli``:

1. Floors: each package imports only from the packages below it
   (``profiling`` -> ``placement`` -> ``solver`` -> ``runtime_hooks`` -> ``cli``), counting
   imports inside functions too; nothing imports ``cli``.
2. No import cycles between modules (any import, at module level or inside a function).
3. No function longer than ``--max-function`` lines (default 80), no module longer than
   ``--max-module`` lines (default 700).

Usage: ``python tools/check_structure.py [--root DIR] [--json]``; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

FLOORS = ("profiling", "placement", "solver", "runtime_hooks", "cli")


@dataclass
class Report:
    """What the source measures: each list holds human-readable findings."""

    upward_imports: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    long_functions: list[tuple[int, str]] = field(default_factory=list)
    long_modules: list[tuple[int, str]] = field(default_factory=list)
    modules: int = 0
    functions: int = 0

    @property
    def ok(self) -> bool:
        return not (self.upward_imports or self.cycles or self.long_functions or self.long_modules)


def module_name(root: Path, path: Path) -> str:
    """``solver/exact/model.py`` -> ``solver.exact.model``; ``__init__`` names its package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the floor packages, by dotted name."""
    found = {}
    for pkg in FLOORS:
        for path in sorted((root / pkg).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def resolve_import(node: ast.AST, current: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules an ``import`` / ``from ... import`` statement names."""
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            targets.add(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = current.split(".")
            if not is_package:
                anchor = anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        targets.add(base)
        for alias in node.names:
            targets.add(f"{base}.{alias.name}")
    resolved = set()
    for name in targets:
        # the longest known module that is the name or one of its parents
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            cand = ".".join(parts[:cut])
            if cand in known:
                resolved.add(cand)
                break
    resolved.discard(current)
    return resolved


def import_graph(root: Path, modules: dict[str, Path]) -> dict[str, set[str]]:
    """``module -> project modules it imports`` (anywhere in the file)."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= resolve_import(node, name, is_package, known)
        graph[name] = edges
    return graph


def floor_of(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that reach a higher floor, and any import of ``cli`` from outside it."""
    bad = []
    for src, dsts in sorted(graph.items()):
        for dst in sorted(dsts):
            if floor_of(dst) > floor_of(src):
                bad.append(f"{src} -> {dst}")
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        components.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def lengths(root: Path, modules: dict[str, Path], report: Report, max_function: int, max_module: int) -> None:
    """Fill the long-function and long-module findings."""
    for _name, path in modules.items():
        text = path.read_text()
        n_lines = len(text.splitlines())
        if n_lines > max_module:
            report.long_modules.append((n_lines, str(path.relative_to(root))))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                report.functions += 1
                span = node.end_lineno - node.lineno + 1
                if span > max_function:
                    report.long_functions.append(
                        (span, f"{path.relative_to(root)}:{node.lineno} {node.name}")
                    )
    report.long_functions.sort(reverse=True)
    report.long_modules.sort(reverse=True)


def measure(root: Path, max_function: int = 80, max_module: int = 700) -> Report:
    """Run every check on the tree at ``root``."""
    modules = package_modules(root)
    graph = import_graph(root, modules)
    report = Report(modules=len(modules))
    report.upward_imports = upward_imports(graph)
    report.cycles = find_cycles(graph)
    lengths(root, modules, report, max_function, max_module)
    return report


def render(report: Report, max_function: int, max_module: int) -> str:
    lines = [
        f"modules: {report.modules}, functions: {report.functions}",
        f"upward imports: {len(report.upward_imports)}",
        *(f"  {row}" for row in report.upward_imports),
        f"import cycles: {len(report.cycles)}",
        *(f"  {' <-> '.join(comp)}" for comp in report.cycles),
        f"functions over {max_function} lines: {len(report.long_functions)}",
        *(f"  {n:4d}  {where}" for n, where in report.long_functions),
        f"modules over {max_module} lines: {len(report.long_modules)}",
        *(f"  {n:4d}  {where}" for n, where in report.long_modules),
        "structure: OK" if report.ok else "structure: FAILED",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--max-function", type=int, default=80)
    ap.add_argument("--max-module", type=int, default=700)
    ap.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    args = ap.parse_args(argv)
    report = measure(args.root, args.max_function, args.max_module)
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}, indent=1))
    else:
        print(render(report, args.max_function, args.max_module))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
