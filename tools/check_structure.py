"""Measure the package structure from the source (nothing is imported or run).

Checks, over the floors (``moe_placement/base``, ``profiling``, ``placement``, ``solver``, ``runtime_hooks``,
``moe_placement/apps``, ``moe_placement/cli``):

1. Floors: each package imports only from the packages below it
   (``moe_placement.base`` -> ``profiling`` -> ``placement`` -> ``solver`` -> ``runtime_hooks`` ->
   ``moe_placement.apps`` -> ``moe_placement.cli``), counting imports inside functions too; nothing
   imports the CLI.
2. No import cycles between modules (any import, at module level or inside a function).
3. No function longer than ``--max-function`` lines (default 80), no module longer than
   ``--max-module`` lines (default 700).
4. No dispatch-model name spelled outside ``placement/dispatch/``: a string constant (docstrings
   excepted; f-string parts count) equal to a name registered there. The names are read from the
   ``register(DispatchModel("name", ...))`` calls in ``placement/dispatch/*.py``, so a new model
   extends the check.
5. No solver-name branch in ``moe_placement/cli/``: a comparison (``==``, ``in``, ...) or ``case`` against a string
   that is a key of the ``SOLVERS`` dict literal in ``solver/api.py``.
6. The counts of issue 35's table (``tools/structure_counts.py``): the enforced rows (exception roots,
   own-module ImportError fallbacks, references outside the repository, README size and deprecated
   flags) fail over their limits; the others are report-only until ``--enforce-all``.

Files in ``_LITERAL_PENDING`` still hold such literals and are only warned about (the list empties as
they are moved onto the registries).

Usage: ``python tools/check_structure.py [--root DIR] [--json] [--counts] [--enforce-all]``; ``--counts``
prints the table with each row's first findings; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structure_counts  # noqa: E402  (a sibling file of this script, not a package)

FLOORS = structure_counts.FLOORS  # folders, bottom first
CLI_PACKAGE = structure_counts.CLI_PACKAGE
DISPATCH_PACKAGE = "placement/dispatch"  # the one place dispatch-model names are spelled
SOLVER_REGISTRY = "solver/api.py"  # holds the SOLVERS dict literal

# Files that still spell registry names (checks 4 and 5): warned about, not failed. Empty it as they move.
_LITERAL_PENDING: tuple[str, ...] = ()


@dataclass
class Report:
    """What the source measures: each list holds human-readable findings."""

    upward_imports: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    long_functions: list[tuple[int, str]] = field(default_factory=list)
    long_modules: list[tuple[int, str]] = field(default_factory=list)
    dispatch_literals: list[str] = field(default_factory=list)
    solver_branches: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    counts: dict[str, list[str]] = field(default_factory=dict)
    over_limit: list[str] = field(default_factory=list)
    modules: int = 0
    functions: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.upward_imports
            or self.cycles
            or self.long_functions
            or self.long_modules
            or self.dispatch_literals
            or self.solver_branches
            or self.over_limit
        )


def module_name(root: Path, path: Path) -> str:
    """``solver/exact/model.py`` -> ``solver.exact.model``; ``__init__`` names its package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the floor packages, by dotted name."""
    found = {}
    for path in structure_counts.floor_files(root):
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
        tree = structure_counts._parse(path)
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= resolve_import(node, name, is_package, known)
        graph[name] = edges
    return graph


def floor_of(module: str) -> int:
    """Index in :data:`FLOORS` of the floor holding ``module``; the distribution package's own
    ``__init__``/``__main__`` count as the top floor."""
    for i, floor in enumerate(FLOORS):
        dotted = floor.replace("/", ".")
        if module == dotted or module.startswith(dotted + "."):
            return i
    return len(FLOORS) - 1


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
        for node in ast.walk(structure_counts._parse_text(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                report.functions += 1
                span = node.end_lineno - node.lineno + 1
                if span > max_function:
                    report.long_functions.append(
                        (span, f"{path.relative_to(root)}:{node.lineno} {node.name}")
                    )
    report.long_functions.sort(reverse=True)
    report.long_modules.sort(reverse=True)


def _call_name(node: ast.AST) -> str:
    """``f`` for ``f(...)`` and ``m.f(...)``; ``""`` for anything else."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id
        if isinstance(func, ast.Attribute):
            return func.attr
    return ""


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def registered_dispatch_names(root: Path) -> set[str]:
    """Names in the ``register(DispatchModel("name", ...))`` calls of ``placement/dispatch/*.py``."""
    names = set()
    for path in sorted((root / DISPATCH_PACKAGE).glob("*.py")):
        for node in ast.walk(structure_counts._parse(path)):
            if _call_name(node) != "register" or not node.args or _call_name(node.args[0]) != "DispatchModel":
                continue
            model = node.args[0]
            first = model.args[0] if model.args else None
            given = {kw.arg: kw.value for kw in model.keywords}
            name = _string(first) if first is not None else _string(given.get("name"))
            if name is not None:
                names.add(name)
    return names


def solver_names(root: Path) -> set[str]:
    """String keys of the dict literal assigned to ``SOLVERS`` in ``solver/api.py`` (empty if none)."""
    path = root / SOLVER_REGISTRY
    if not path.exists():
        return set()
    names = set()
    for node in ast.walk(structure_counts._parse(path)):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Dict) and any(
            isinstance(t, ast.Name) and t.id == "SOLVERS" for t in targets
        ):
            names |= {k for k in map(_string, value.keys) if k is not None}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring constant (module, class, function) in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and _string(first.value) is not None:
                found.add(id(first.value))
    return found


def dispatch_literals(root: Path, modules: dict[str, Path], names: set[str]) -> list[str]:
    """``path:line 'name'`` for each string constant equal to a dispatch name outside the registry."""
    found = []
    for path in modules.values():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(DISPATCH_PACKAGE + "/"):
            continue
        tree = structure_counts._parse(path)
        skip = _docstrings(tree)
        hits = sorted(
            (n.lineno, n.value) for n in ast.walk(tree) if _string(n) in names and id(n) not in skip
        )
        found += [f"{rel}:{line} {value!r}" for line, value in hits]
    return found


def _compared_strings(node: ast.AST) -> list[str]:
    """The strings a comparison operand spells: a constant, or the constants of a tuple, list or set."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for s in map(_string, node.elts) if s is not None]
    value = _string(node)
    return [] if value is None else [value]


def solver_branches(root: Path, names: set[str]) -> list[str]:
    """``path:line 'name'`` for each comparison or ``case`` in ``moe_placement/cli/`` against a solver name."""
    found = []
    for path in sorted((root / CLI_PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        hits = []
        for node in ast.walk(structure_counts._parse(path)):
            if isinstance(node, ast.Compare):
                spelled = [
                    s for operand in (node.left, *node.comparators) for s in _compared_strings(operand)
                ]
            elif isinstance(node, ast.MatchValue):
                spelled = _compared_strings(node.value)
            else:
                continue
            hits += [(node.lineno, s) for s in spelled if s in names]
        found += [f"{rel}:{line} {value!r}" for line, value in sorted(hits)]
    return found


def _split_pending(findings: list[str], pending: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(findings in files not in ``pending``, findings in pending files)."""
    waived = [f for f in findings if f.split(":", 1)[0] in pending]
    return [f for f in findings if f not in waived], waived


def measure(
    root: Path,
    max_function: int = 80,
    max_module: int = 700,
    pending: tuple[str, ...] | None = None,
    enforce_all: bool = False,
) -> Report:
    """Run every check on the tree at ``root``; ``pending`` (default ``_LITERAL_PENDING``) files only warn;
    ``enforce_all``: the report-only counts fail over their limits too."""
    pending = _LITERAL_PENDING if pending is None else pending
    modules = package_modules(root)
    graph = import_graph(root, modules)
    report = Report(modules=len(modules))
    report.upward_imports = upward_imports(graph)
    report.cycles = find_cycles(graph)
    lengths(root, modules, report, max_function, max_module)
    literals, waived = _split_pending(
        dispatch_literals(root, modules, registered_dispatch_names(root)), pending
    )
    branches, waived_branches = _split_pending(solver_branches(root, solver_names(root)), pending)
    report.dispatch_literals, report.solver_branches = literals, branches
    report.pending = waived + waived_branches
    report.counts = structure_counts.measure_counts(root)
    report.over_limit = structure_counts.over_limit(report.counts, enforce_all)
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
        f"dispatch-name literals outside {DISPATCH_PACKAGE}/: {len(report.dispatch_literals)}",
        *(f"  {row}" for row in report.dispatch_literals),
        f"solver-name branches in moe_placement/cli/: {len(report.solver_branches)}",
        *(f"  {row}" for row in report.solver_branches),
        *(
            [f"warning: {len(report.pending)} registry names still spelled in _LITERAL_PENDING files"]
            if report.pending
            else []
        ),
        *(f"  {row}" for row in report.pending),
        f"counts over their limits: {len(report.over_limit)} (--counts prints the table)",
        *(
            f"  {key}: {structure_counts.value(key, report.counts[key]):g}; {report.counts[key][:3]}"
            for key in report.over_limit
        ),
        "structure: OK" if report.ok else "structure: FAILED",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--max-function", type=int, default=80)
    ap.add_argument("--max-module", type=int, default=700)
    ap.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    ap.add_argument("--counts", action="store_true", help="print issue 35's table of counts first")
    ap.add_argument("--enforce-all", action="store_true", help="fail on the report-only counts too")
    args = ap.parse_args(argv)
    report = measure(args.root, args.max_function, args.max_module, enforce_all=args.enforce_all)
    if args.counts and not args.json:
        print(structure_counts.render_counts(report.counts))
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}, indent=1))
    else:
        print(render(report, args.max_function, args.max_module))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
