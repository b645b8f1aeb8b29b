"""The structure counts (issues 35 and 45), measured from the source (nothing of the project is imported).

Each row is a function ``root -> list of findings`` (one ``"path:line what"`` string per finding; the
solver share and the README line count are one-element lists holding a number) and a limit. A row is
*enforced* (``tools/check_structure.py`` fails when it is over its limit) or *report-only* (printed by
``--counts``; ``--enforce-all`` enforces them too). Every row is enforced now that issue 35's counts are
within their limits.

Rows:

- ``dispatch_branches``: comparisons outside ``placement/dispatch/`` against one particular dispatch
  model: its constant (``model is EVEN``), its name (``== BALANCED.name``) or a string equal to a
  registered name. Each comparison counts once (``a is not EVEN and a is not LOCAL`` is two).
- ``wide_functions``: functions with more than 8 named parameters (``self``/``cls`` not counted).
- ``step_tokens_names``: other spellings of "tokens per rank per step" than ``step_tokens``
  (identifiers in :data:`STEP_TOKENS_ALIASES`). Advise's per-phase flags ``--decode-batch`` and
  ``--prefill-chunk`` are allowed (their ``args.`` attributes are not counted).
- ``policy_words``: identifiers and non-docstring strings holding "polic" outside
  ``runtime_hooks/engine_plugins/`` (where the engines call their hook a policy).

- ``exception_roots``: public exception classes of the project whose bases hold no project exception.
- ``import_fallbacks``: ``try`` blocks that import one of the project's own packages and catch
  ``ImportError`` (the project is always installed whole; an optional third-party extra is fine).
- ``outside_references``: docstrings and comments that send the reader to a file outside the
  repository (``../shared/docs/...``, "shared docs/...", an absolute path, a ``docs/NAME.md`` page
  the repository's ``docs/`` does not hold) or to another project's code to learn how ours works
  ("see vLLM's code"). Naming the source of a figure or of a fact about an engine
  (a URL, a paper, an engine's file) is a citation and is allowed.
- ``solver_share``: percent of the package lines (``profiling`` ... ``cli``) under ``solver/``.
- ``readme_lines`` / ``readme_deprecated``: README.md's line count, and the deprecated CLI flags (those
  whose ``add_argument`` help says "deprecated", or which are hidden deprecated aliases) it still shows.

Issue 45's rows:

- ``installed_packages``: top-level packages ``pyproject.toml`` installs beyond the four specified and
  ``moe_placement``.
- ``shared_outside_base``: a module named like the shared floor's (errors, options, fileio, limits,
  textparse) at the top of another floor.
- ``family_prefixes``: a module name prefix shared by two modules of one folder of solver/ or placement/.
- ``phase_definitions``: assignments of the phase list ``("decode", "prefill")``; at most one.
- ``hardware_literals``: a GPU preset name spelled as a string outside ``placement/cost/hardware.py``.
- ``fmt_skips``: ``# fmt: skip`` / ``# fmt: off`` comments (code packed to fit a limit).
- ``missing_doc_paths``: repository paths named in README.md and docs/*.md that do not exist.

Both word rows skip (a) the option strings of a hidden deprecated alias: an ``add_argument`` whose
``help`` is ``argparse.SUPPRESS`` and whose ``action`` is ``DeprecatedAlias`` (``--policy``), and
(b) the public keys of :data:`PUBLIC_KEYS` where they are a dict literal's key or a subscript, and (c) the
public option strings of :data:`PUBLIC_FLAGS` wherever they are spelled.
"""

from __future__ import annotations

import ast
import builtins
import functools
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The floors as folders, bottom first; the distribution's own package holds the bottom and the two top ones.
FLOORS = (
    "moe_placement/base",
    "profiling",
    "placement",
    "solver",
    "runtime_hooks",
    "moe_placement/apps",
    "moe_placement/cli",
)
PACKAGES = ("moe_placement", "profiling", "placement", "solver", "runtime_hooks")  # installed top-level
CLI_PACKAGE = "moe_placement/cli"
DISPATCH_PACKAGE = "placement/dispatch"
PLUGINS_PACKAGE = "runtime_hooks/engine_plugins"
MAX_PARAMETERS = 8
STEP_TOKENS_ALIASES = frozenset(
    {
        "batch_tokens",
        "batch_tokens_per_gpu",
        "batch_per_rank",
        "max_batch_per_rank",
        "decode_batch",
        "tokens_per_step",
        "tokens_per_rank",
        "DEFAULT_BATCH_TOKENS",
    }
)
PER_PHASE_FLAGS = frozenset({"decode_batch", "prefill_chunk"})  # allowed as ``args.<name>`` (advise)
# Public keys that keep an old word: a string equal to one of these, used as a dict literal's key or a
# subscript (``d["policy"]``), is not counted. Each is documented where the comment says.
PUBLIC_KEYS = frozenset(
    {
        "policy",  # evaluate/validate --json and placement files' params: docs/cli.md, docs/formats.md
        "greedy_policy",  # exact solver's params in placement files: docs/formats.md
        "batch_tokens_per_gpu",  # params.decode_cost in placement files: docs/formats.md
        "batch_per_rank",  # layout --json: docs/cli.md (layout)
        "max_batch_per_rank",  # layout --json, per result: docs/cli.md (layout)
        "policies",  # route --json, the routing rules' figures: docs/cli.md (route)
    }
)
# Public option strings that keep an old word, exempt wherever they are spelled (issue 43 named the flag).
PUBLIC_FLAGS = frozenset({"--policies"})  # route: the routing rules to compare, docs/cli.md (route)
DEPRECATED_ACTION = (
    "DeprecatedAlias"  # moe_placement.cli.common's action for an old spelling of an option (it warns)
)
_OUTSIDE = re.compile(
    r"\.\./[\w.-]+/|\bshared[ /]docs?\b|\bshared/traces/\S+\.md|(?<![\w.])/(?:work|tmp|home|root)/"
    r"|\b[Ss]ee (?:the )?[\w-]+'s (?:own )?(?:code|source|implementation)",
)
_DOC_LINK = re.compile(r"(?<![\w./])docs/[\w.-]+\.md")
_BUILTIN_EXCEPTIONS = frozenset(
    n
    for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
)


@dataclass(frozen=True)
class Row:
    """One row of the table: what it counts, its limit, whether check_structure fails over it."""

    key: str
    what: str
    limit: float
    enforced: bool
    count: Callable[[Path], list[str]]


def top_files(root: Path) -> list[Path]:
    """The distribution package's own ``__init__`` and ``__main__`` (they sit with the top floor)."""
    return [p for p in (root / "moe_placement" / n for n in ("__init__.py", "__main__.py")) if p.exists()]


def floor_files(root: Path) -> list[Path]:
    return [p for pkg in FLOORS for p in sorted((root / pkg).rglob("*.py"))] + top_files(root)


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _parse(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per content (every row and check walks the same trees; none
    changes them)."""
    text = path.read_text()
    return _parse_text(text, str(path))


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def _docstring_ids(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


# ---------------------------------------------------------------------------------------------
# dispatch branches
# ---------------------------------------------------------------------------------------------
def dispatch_constants(root: Path) -> tuple[set[str], set[str]]:
    """(constant names, model names) of the ``NAME = register(DispatchModel("name", ...))`` lines."""
    constants, names = set(), set()
    for path in sorted((root / DISPATCH_PACKAGE).glob("*.py")):
        for node in ast.walk(_parse(path)):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            call = node.value
            if not (isinstance(call.func, ast.Name) and call.func.id == "register" and call.args):
                continue
            model = call.args[0]
            if not isinstance(model, ast.Call):
                continue
            constants |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            first = model.args[0] if model.args else {k.arg: k.value for k in model.keywords}.get("name")
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return constants, names


def _names_a_model(node: ast.AST, constants: set[str], names: set[str]) -> bool:
    """``EVEN``, ``mod.EVEN``, ``EVEN.name``, ``"even"``, or a tuple/list/set holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_model(e, constants, names) for e in node.elts)
    if isinstance(node, ast.Attribute) and node.attr == "name":
        node = node.value
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr in constants
    return isinstance(node, ast.Constant) and node.value in names


def dispatch_branches(root: Path) -> list[str]:
    constants, names = dispatch_constants(root)
    found = []
    for path in floor_files(root):
        rel = _rel(root, path)
        if rel.startswith(DISPATCH_PACKAGE + "/"):
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Compare):
                operands = (node.left, *node.comparators)
            elif isinstance(node, ast.MatchValue):
                operands = (node.value,)
            else:
                continue
            if any(_names_a_model(o, constants, names) for o in operands):
                found.append((rel, node.lineno))
    return [f"{rel}:{line}" for rel, line in sorted(found)]


# ---------------------------------------------------------------------------------------------
# wide functions
# ---------------------------------------------------------------------------------------------
def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    """Named parameters (positional-only, ordinary, keyword-only); a method's first one is not counted."""
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    first = (a.posonlyargs + a.args)[:1]
    if in_class and first and first[0].arg in ("self", "cls"):
        n -= 1
    return n


def wide_functions(root: Path) -> list[str]:
    found = []
    for path in floor_files(root):
        tree = _parse(path)
        methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = parameter_count(node, id(node) in methods)
                if n > MAX_PARAMETERS:
                    found.append(f"{_rel(root, path)}:{node.lineno} {node.name} ({n})")
    return found


# ---------------------------------------------------------------------------------------------
# words: step-tokens aliases and "policy"
# ---------------------------------------------------------------------------------------------
def _is_hidden_alias(call: ast.Call) -> bool:
    """``add_argument(..., help=argparse.SUPPRESS, action=DeprecatedAlias)``: an old spelling kept hidden."""
    if _base_name(call.func) != "add_argument":
        return False
    kw = {k.arg: k.value for k in call.keywords}
    help_, action = kw.get("help"), kw.get("action")
    return (
        isinstance(help_, ast.Attribute)
        and help_.attr == "SUPPRESS"
        and action is not None
        and _base_name(action) == DEPRECATED_ACTION
    )


def _exempt_strings(tree: ast.AST) -> set[int]:
    """Ids of the string constants the word rows skip: hidden deprecated option strings, public keys."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_hidden_alias(node):
            found |= {
                id(a) for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")
            }
        keys = (
            node.keys
            if isinstance(node, ast.Dict)
            else [node.slice]
            if isinstance(node, ast.Subscript)
            else []
        )
        found |= {id(k) for k in keys if isinstance(k, ast.Constant) and k.value in PUBLIC_KEYS}
        if isinstance(node, ast.Constant) and node.value in PUBLIC_FLAGS:
            found.add(id(node))
    return found


def _words(tree: ast.AST):
    """``(line, text, is_args_attribute)`` for every identifier and non-docstring string of ``tree``
    (the strings of :func:`_exempt_strings` left out)."""
    skip = _docstring_ids(tree) | _exempt_strings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id, False
        elif isinstance(node, ast.Attribute):
            on_args = isinstance(node.value, ast.Name) and node.value.id == "args"
            yield node.lineno, node.attr, on_args
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg, False
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg, False
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name, False
        elif isinstance(node, ast.alias):
            yield node.lineno, node.asname or node.name, False
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value, False


def step_tokens_names(root: Path) -> list[str]:
    found = []
    for path in floor_files(root):
        for line, text, on_args in _words(_parse(path)):
            if text in STEP_TOKENS_ALIASES and not (on_args and text in PER_PHASE_FLAGS):
                found.append((_rel(root, path), line, text))
    return [f"{rel}:{line} {text}" for rel, line, text in sorted(found)]


def policy_words(root: Path) -> list[str]:
    found = []
    for path in floor_files(root):
        rel = _rel(root, path)
        if rel.startswith(PLUGINS_PACKAGE + "/"):
            continue
        for line, text, _ in _words(_parse(path)):
            if "polic" in text.lower():
                found.append((rel, line, text[:40]))
    return [f"{rel}:{line} {text!r}" for rel, line, text in sorted(found)]


# ---------------------------------------------------------------------------------------------
# exceptions and import fallbacks
# ---------------------------------------------------------------------------------------------
def _base_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def exception_roots(root: Path) -> list[str]:
    """Public exception classes none of whose bases is a project exception. A class deriving only from
    ``BaseException``, ``KeyboardInterrupt`` or ``SystemExit`` is a control-flow signal (``moe_placement.cli.main``'s
    ``Terminated`` for SIGTERM must not be caught by ``except Exception``), not an error family."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in floor_files(root):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where = f"{_rel(root, path)}:{node.lineno} {node.name}"
                classes.setdefault(node.name, (where, [_base_name(b) for b in node.bases]))
    project: set[str] = set()
    changed = True
    while changed:  # fixpoint: a class deriving from a builtin exception or from a project exception
        changed = False
        for name, (_, bases) in classes.items():
            if name not in project and any(b in _BUILTIN_EXCEPTIONS or b in project for b in bases):
                project.add(name)
                changed = True
    signals = {"BaseException", "KeyboardInterrupt", "SystemExit"}
    return sorted(
        classes[n][0]
        for n in project
        if not any(b in project for b in classes[n][1]) and not set(classes[n][1]) <= signals
    )


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(_base_name(t) in ("ImportError", "ModuleNotFoundError") for t in types if t is not None)


def _imports_project(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] in PACKAGES for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] in PACKAGES
            ):
                return True
    return False


def import_fallbacks(root: Path) -> list[str]:
    found = []
    for path in floor_files(root):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers)):
                if _imports_project(node.body):
                    found.append(f"{_rel(root, path)}:{node.lineno}")
    return found


# ---------------------------------------------------------------------------------------------
# references outside the repository
# ---------------------------------------------------------------------------------------------
def _prose(path: Path):
    """``(line, text)`` of every comment and docstring of ``path``."""
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                start = node.body[0].lineno
                for i, line in enumerate(doc.splitlines()):
                    yield start + i, line


def outside_references(root: Path) -> list[str]:
    found = []
    for path in floor_files(root):
        for line, text in _prose(path):
            match = _OUTSIDE.search(text)
            if match:
                found.append((_rel(root, path), line, match.group(0)))
            for doc in _DOC_LINK.findall(text):  # a docs/ page the repository does not have
                if not (root / doc).is_file():
                    found.append((_rel(root, path), line, doc))
    return [f"{rel}:{line} {text!r}" for rel, line, text in sorted(set(found))]


# ---------------------------------------------------------------------------------------------
# sizes: solver share, README
# ---------------------------------------------------------------------------------------------
def solver_share(root: Path) -> list[str]:
    lines = {p: len(p.read_text().splitlines()) for p in floor_files(root)}
    total = sum(lines.values()) or 1
    solver = sum(n for p, n in lines.items() if _rel(root, p).startswith("solver/"))
    return [f"{100.0 * solver / total:.0f}"]


def readme_lines(root: Path) -> list[str]:
    path = root / "README.md"
    return [str(len(path.read_text().splitlines()) if path.exists() else 0)]


def deprecated_flags(root: Path) -> set[str]:
    """Flags of ``cli/`` whose ``add_argument(..., help=...)`` calls them deprecated, or which are hidden
    deprecated aliases (``help=argparse.SUPPRESS, action=DeprecatedAlias``)."""
    flags = set()
    for path in sorted((root / CLI_PACKAGE).rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if not (isinstance(node, ast.Call) and _base_name(node.func) == "add_argument"):
                continue
            help_ = {k.arg: k.value for k in node.keywords}.get("help")
            text = ast.unparse(help_) if help_ is not None else ""
            if "deprecated" in text.lower() or _is_hidden_alias(node):
                flags |= {
                    a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")
                }
    return flags


def readme_deprecated(root: Path) -> list[str]:
    path = root / "README.md"
    if not path.exists():
        return []
    flags = deprecated_flags(root)
    found = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        found += [f"README.md:{i} {f}" for f in sorted(flags) if re.search(rf"{re.escape(f)}(?![\w-])", line)]
    return found


SPECIFIED_PACKAGES = (
    "placement",
    "profiling",
    "solver",
    "runtime_hooks",
)  # the four the project was specified with
DISTRIBUTION_PACKAGE = "moe_placement"  # the one package named for the distribution
BASE_MODULES = ("errors", "options", "fileio", "limits", "textparse")  # the shared floor's modules
FAMILY_ROOTS = ("solver", "placement")  # where a family of modules must be a package, not a file prefix
GPU_NAMES_SOURCE = "placement/cost/hardware.py"  # the one place GPU preset names are spelled
_PATH_IN_DOCS = re.compile(
    r"(?<![\w./:-])((?:moe_placement|placement|profiling|solver|runtime_hooks|benchmarks|tests|tools|notebooks"
    r"|docs|\.ci)/[\w./*-]*[\w/*])"
)


def installed_packages(root: Path) -> list[str]:
    """Top-level packages ``pyproject.toml`` installs beyond the four specified and the distribution's own."""
    import fnmatch

    import tomllib

    path = root / "pyproject.toml"
    if not path.exists():
        return []
    find = tomllib.loads(path.read_text()).get("tool", {}).get("setuptools", {}).get("packages", {})
    include = find.get("find", {}).get("include", ["*"]) if isinstance(find, dict) else list(find)
    tops = sorted(d.name for d in root.iterdir() if (d / "__init__.py").exists())
    installed = [d for d in tops if any(fnmatch.fnmatch(d, pat) for pat in include)]
    allowed = set(SPECIFIED_PACKAGES) | {DISTRIBUTION_PACKAGE}
    return [f"{d}/ is installed as a top-level package" for d in installed if d not in allowed]


def shared_outside_base(root: Path) -> list[str]:
    """Modules named like the shared floor's (errors, options, fileio, ...) at the top of another floor."""
    base = root / FLOORS[0]
    return [
        _rel(root, p)
        for p in floor_files(root)
        if p.stem in BASE_MODULES and _rel(root, p.parent) in FLOORS and p.parent != base
    ]


def family_prefixes(root: Path) -> list[str]:
    """Module name prefixes (``migration_`` in ``migration_slots.py``) shared by two or more modules of one
    folder of solver/ or placement/: a family that should be a package."""
    found = []
    for top in FAMILY_ROOTS:
        for folder in sorted({p.parent for p in (root / top).rglob("*.py")}):
            stems = [p.stem for p in folder.glob("*.py") if "_" in p.stem and not p.stem.startswith("_")]
            prefixes: dict[str, list[str]] = {}
            for s in stems:
                prefixes.setdefault(s.split("_")[0], []).append(s)
            found += [
                f"{_rel(root, folder)}/{pre}_*.py ({len(v)} modules)"
                for pre, v in sorted(prefixes.items())
                if len(v) >= 2
            ]
    return found


def _tuple_of_strings(node: ast.AST) -> tuple[str, ...] | None:
    if isinstance(node, ast.Tuple) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return tuple(e.value for e in node.elts)
    return None


def phase_definitions(root: Path) -> list[str]:
    """Assignments of the phase list ``("decode", "prefill")`` (in any order) in the packages."""
    found = []
    for path in floor_files(root):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                value = _tuple_of_strings(node.value)
                if value is not None and sorted(value) == ["decode", "prefill"]:
                    found.append(f"{_rel(root, path)}:{node.lineno}")
    return found


def _gpu_names(root: Path) -> set[str]:
    """GPU preset names: the string keys of the ``GPUS`` dict literal in :data:`GPU_NAMES_SOURCE`."""
    path = root / GPU_NAMES_SOURCE
    names: set[str] = set()
    if not path.exists():
        return names
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "GPUS":
            value = node.value
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "GPUS" for t in node.targets
        ):
            value = node.value
        else:
            continue
        if isinstance(value, ast.Dict):
            names |= {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


def hardware_literals(root: Path) -> list[str]:
    """GPU preset names spelled as strings (docstrings excepted) outside :data:`GPU_NAMES_SOURCE`: a
    second default, or a list of names typed by hand (read them from ``placement.cost.hardware``)."""
    names = _gpu_names(root)
    found = []
    for path in floor_files(root):
        rel = _rel(root, path)
        if rel == GPU_NAMES_SOURCE:
            continue
        tree = _parse(path)
        skip = _docstring_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    return found


def fmt_skips(root: Path) -> list[str]:
    """``# fmt: skip`` / ``# fmt: off`` comments in the repository's Python files (code packed to fit a
    limit); comments only, as the tokenizer sees them (a string that spells one is not counted)."""
    found = []
    for top in (*FLOORS, "benchmarks", "tests", "tools", "notebooks"):
        for path in sorted((root / top).rglob("*.py")):
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            for tok in tokens:
                if tok.type == tokenize.COMMENT and re.match(r"#\s*fmt:\s*(skip|off)\b", tok.string):
                    found.append(f"{_rel(root, path)}:{tok.start[0]}")
    return found


def missing_doc_paths(root: Path) -> list[str]:
    """Repository paths named in README.md and docs/*.md that do not exist (globs must match something)."""
    found = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not doc.exists():
            continue
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for m in _PATH_IN_DOCS.finditer(line):
                p = m.group(1)
                ok = any(root.glob(p)) if "*" in p else (root / p).exists()
                if not ok:
                    found.append(f"{_rel(root, doc)}:{i} {p}")
    return found


ROWS: tuple[Row, ...] = (
    Row(
        "dispatch_branches",
        "branches on one dispatch model outside the registry",
        0,
        True,
        dispatch_branches,
    ),
    Row("wide_functions", f"functions with more than {MAX_PARAMETERS} parameters", 5, True, wide_functions),
    Row("step_tokens_names", "other names for tokens per rank per step", 0, True, step_tokens_names),
    Row("policy_words", '"policy" outside runtime_hooks/engine_plugins/', 0, True, policy_words),
    Row("exception_roots", "exception classes that start a family", 1, True, exception_roots),
    Row("import_fallbacks", "ImportError fallbacks around our own modules", 0, True, import_fallbacks),
    Row("outside_references", "prose sending the reader outside the repo", 0, True, outside_references),
    Row("solver_share", "solver/ share of the package lines (%)", 35, True, solver_share),
    Row("readme_lines", "README.md lines", 150, True, readme_lines),
    Row("readme_deprecated", "deprecated flags shown in README.md", 0, True, readme_deprecated),
    Row(
        "installed_packages",
        "top-level packages beyond the specified four and moe_placement",
        0,
        True,
        installed_packages,
    ),
    Row(
        "shared_outside_base",
        "shared-utility modules outside moe_placement/base/",
        0,
        True,
        shared_outside_base,
    ),
    Row("family_prefixes", "solver/placement families spelled as a file prefix", 0, True, family_prefixes),
    Row("phase_definitions", "definitions of the phase list", 1, True, phase_definitions),
    Row(
        "hardware_literals",
        "GPU preset names spelled outside placement/cost/hardware.py",
        0,
        True,
        hardware_literals,
    ),
    Row("fmt_skips", "# fmt: skip / off used to fit a limit", 0, True, fmt_skips),
    Row("missing_doc_paths", "repository paths named in docs that do not exist", 0, True, missing_doc_paths),
)
_SCALAR = ("solver_share", "readme_lines")  # rows whose one finding is the number itself


def value(key: str, findings: list[str]) -> float:
    """The row's number: the figure for the size rows, else how many findings."""
    return float(findings[0]) if key in _SCALAR else float(len(findings))


def measure_counts(root: Path) -> dict[str, list[str]]:
    return {row.key: row.count(root) for row in ROWS}


def over_limit(counts: dict[str, list[str]], enforce_all: bool = False) -> list[str]:
    """Keys of the enforced rows (every row with ``enforce_all``) whose number is over the limit."""
    return [r.key for r in ROWS if (r.enforced or enforce_all) and value(r.key, counts[r.key]) > r.limit]


def render_counts(counts: dict[str, list[str]], first: int = 4) -> str:
    """The table: number, limit, enforced or report-only, what, and the first few places."""
    out = [f"{'row':20s} {'now':>5s} {'limit':>5s} {'':11s} what / where (first {first})"]
    for r in ROWS:
        findings = counts[r.key]
        n = value(r.key, findings)
        mode = "enforced" if r.enforced else "report-only"
        out.append(f"{r.key:20s} {n:5g} {r.limit:5g} {mode:11s} {r.what}")
        if r.key not in _SCALAR:
            out += [f"{'':44s}{f}" for f in findings[:first]]
            if len(findings) > first:
                out.append(f"{'':44s}... {len(findings) - first} more")
    return "\n".join(out)
