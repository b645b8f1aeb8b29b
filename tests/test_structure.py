"""The package structure (floors, cycles, lengths) measured from the source by tools/check_structure.py."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_structure", ROOT / "tools" / "check_structure.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_structure"] = mod
    spec.loader.exec_module(mod)
    return mod


check = _checker()


def _tree(tmp_path: Path, files: dict[str, str], filler: bool = False) -> Path:
    """A package tree holding ``files``; ``filler`` adds a 600-line module outside solver/ so that a small
    tree's solver share stays under its limit."""
    if filler:
        files = {**files, "moe_placement/cli/filler.py": "x = 1\n" * 600}
    for pkg in check.FLOORS:
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def test_repository_passes():
    report = check.measure(ROOT)
    assert report.modules > 40
    assert report.ok, check.render(report, 80, 700)


def test_clean_tree_passes(tmp_path):
    root = _tree(
        tmp_path,
        {
            "profiling/trace.py": "import numpy\n",
            "placement/model.py": "from profiling.trace import numpy\n",
            "solver/greedy.py": "from placement import model\nfrom profiling import trace\n",
            "moe_placement/cli/main.py": "def main():\n    from solver.greedy import model\n",
        },
    )
    assert check.measure(root).ok


def test_upward_import_inside_a_function_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "profiling/plots.py": "def f():\n    from placement.metrics import par\n",
            "placement/metrics.py": "par = 1\n",
        },
    )
    report = check.measure(root)
    assert report.upward_imports == ["profiling.plots -> placement.metrics"]
    assert not report.ok


def test_importing_the_cli_is_upward(tmp_path):
    root = _tree(
        tmp_path,
        {"runtime_hooks/x.py": "import moe_placement.cli.main\n", "moe_placement/cli/main.py": "x = 1\n"},
    )
    assert check.measure(root).upward_imports == ["runtime_hooks.x -> moe_placement.cli.main"]


@pytest.mark.parametrize("style", ["absolute", "relative"])
def test_cycle_is_found(tmp_path, style):
    imp_b = "from solver.b import y" if style == "absolute" else "from .b import y"
    imp_a = "from solver.a import x" if style == "absolute" else "from . import a"
    root = _tree(
        tmp_path, {"solver/a.py": f"x = 1\ndef f():\n    {imp_b}\n", "solver/b.py": f"{imp_a}\ny = 2\n"}
    )
    report = check.measure(root)
    assert report.cycles == [["solver.a", "solver.b"]]
    assert not report.ok


def test_long_function_and_module_are_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    root = _tree(tmp_path, {"solver/long.py": f"def long_one():\n{body}\n\ndef short():\n    return 1\n"})
    report = check.measure(root, max_function=80, max_module=50)
    assert [where.split()[-1] for _, where in report.long_functions] == ["long_one"]
    assert report.long_functions[0][0] == 81
    assert [where for _, where in report.long_modules] == ["solver/long.py"]


def test_command_line_exit_codes(tmp_path, capsys):
    clean = _tree(tmp_path, {})
    assert check.main(["--root", str(clean)]) == 0
    (clean / "placement" / "up.py").write_text("import solver\n")
    assert check.main(["--root", str(clean)]) == 1
    assert "placement.up -> solver" in capsys.readouterr().out


REGISTRY = """
    from placement.dispatch.registry import DispatchModel, register

    MINE = register(DispatchModel("mine", "a test model", choices))
    OTHER = register(DispatchModel(name="other-one", models="keyword name", choices=choices))
    X = DispatchModel("never-registered", "not registered", choices)
    # a comment spelling "mine" is fine
    assert "mine" != "other-one"  # the registry itself may spell its names
    """


def _dispatch_tree(tmp_path: Path, files: dict[str, str], filler: bool = False) -> Path:
    """A tree whose ``placement/dispatch/`` registers ``mine`` and ``other-one``, plus ``files``."""
    root = _tree(tmp_path, files, filler)
    (root / "placement" / "dispatch").mkdir()
    (root / "placement" / "dispatch" / "__init__.py").write_text("")
    (root / "placement" / "dispatch" / "mine.py").write_text(textwrap.dedent(REGISTRY))
    return root


def test_dispatch_names_are_read_from_the_register_calls(tmp_path):
    root = _dispatch_tree(tmp_path, {})
    assert check.registered_dispatch_names(root) == {"mine", "other-one"}
    assert check.measure(root).ok


def test_dispatch_name_literal_outside_the_registry_is_found(tmp_path):
    root = _dispatch_tree(
        tmp_path,
        {
            "solver/x.py": '''
                """Docstrings may say "mine"."""

                def f(d, x):
                    """mine"""
                    # "mine" in a comment
                    if d == "mine":
                        return f"{x}" f"mine"
                    return {"never-registered": 1, "mine-ish": 2}
                ''',
            "moe_placement/cli/y.py": 'CHOICES = ("other-one",)\nDEFAULT = "ours"\n',
            "profiling/z.py": 'NOTE = "mine"\n',
        },
    )
    report = check.measure(root)
    assert report.dispatch_literals == [
        "profiling/z.py:1 'mine'",
        "solver/x.py:7 'mine'",
        "solver/x.py:8 'mine'",  # an f-string part
        "moe_placement/cli/y.py:1 'other-one'",
    ]
    assert not report.ok
    assert "dispatch-name literals outside placement/dispatch/: 4" in check.render(report, 80, 700)


def test_registering_a_model_extends_the_literal_check(tmp_path):
    root = _dispatch_tree(tmp_path, {"runtime_hooks/a.py": 'X = "newcomer"\n'})
    assert check.measure(root).ok
    (root / "placement" / "dispatch" / "newcomer.py").write_text(
        "from placement.dispatch.registry import DispatchModel, register\n"
        'NEW = register(DispatchModel("newcomer", "added later", choices, needs_step_counts=True))\n'
    )
    assert check.measure(root).dispatch_literals == ["runtime_hooks/a.py:1 'newcomer'"]


SOLVER_API = """
    from solver.spec import SolverSpec

    SOLVERS: dict[str, SolverSpec] = {
        "greedy": SolverSpec("solver.greedy"),
        "fancy": SolverSpec("solver.fancy"),
    }
    OTHER = {"not-a-solver": 1}
    """


def test_solver_names_are_the_keys_of_the_solvers_dict(tmp_path):
    root = _tree(tmp_path, {"solver/api.py": SOLVER_API})
    assert check.solver_names(root) == {"greedy", "fancy"}
    (root / "solver" / "api.py").write_text("SOLVERS = {}\n")
    assert check.solver_names(root) == set()


def test_solver_name_branch_in_the_cli_is_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "solver/api.py": SOLVER_API,
            "solver/greedy.py": 'def f(name):\n    return name == "greedy"\n',  # outside cli: allowed
            "moe_placement/cli/solve.py": """
                from solver.api import SOLVERS

                def f(name, args):
                    spec = SOLVERS["greedy"]  # a lookup, not a branch
                    if name == "fancy":
                        return spec
                    if "greedy" != name or args.x in ("cpsat", "greedy"):
                        return None
                    match name:
                        case "fancy":
                            return 1
                    return name == "not-a-solver"
                """,
        },
    )
    report = check.measure(root)
    assert report.solver_branches == [
        "moe_placement/cli/solve.py:6 'fancy'",
        "moe_placement/cli/solve.py:8 'greedy'",
        "moe_placement/cli/solve.py:8 'greedy'",
        "moe_placement/cli/solve.py:11 'fancy'",
    ]
    assert not report.ok
    assert "solver-name branches in moe_placement/cli/: 4" in check.render(report, 80, 700)


def test_pending_files_only_warn(tmp_path, capsys):
    root = _dispatch_tree(
        tmp_path,
        {
            "solver/api.py": SOLVER_API,
            "solver/old.py": 'D = "mine"\n',
            "moe_placement/cli/main.py": 'def f(n):\n    return n == "fancy"\n',
        },
        filler=True,
    )
    assert not check.measure(root, pending=()).ok
    report = check.measure(root, pending=("solver/old.py", "moe_placement/cli/main.py"))
    assert report.ok
    assert report.pending == ["solver/old.py:1 'mine'", "moe_placement/cli/main.py:2 'fancy'"]
    assert "warning: 2 registry names still spelled in _LITERAL_PENDING files" in check.render(
        report, 80, 700
    )
    # a pending file covers only itself
    (root / "runtime_hooks" / "new.py").write_text('D = "other-one"\n')
    assert check.measure(root, pending=("solver/old.py", "moe_placement/cli/main.py")).dispatch_literals == [
        "runtime_hooks/new.py:1 'other-one'"
    ]


def test_pending_list_names_only_files_that_still_spell_names():
    """The allow-list shrinks: every file in it still holds a literal (drop it once it is clean)."""
    pending = check.measure(ROOT, pending=check._LITERAL_PENDING).pending
    spelled = {row.split(":", 1)[0] for row in pending}
    assert spelled == set(check._LITERAL_PENDING)


# ---------------------------------------------------------------------------------------------
# issue 35's counts (tools/structure_counts.py), each with planted violations
# ---------------------------------------------------------------------------------------------
counts = check.structure_counts

MODELS = """
    from placement.dispatch.registry import DispatchModel, register

    EVEN = register(DispatchModel("even", "split evenly", choices))
    LOCAL = register(DispatchModel(name="local", models="own GPU first", choices=choices))
    HELPER = make_something()
    if EVEN is LOCAL:  # inside the registry: allowed
        pass
    """


def test_dispatch_branches_count_each_comparison_against_one_model(tmp_path):
    root = _tree(
        tmp_path,
        {
            "solver/x.py": """
                from placement import dispatch as d

                def f(model, name):
                    if model is EVEN:
                        return 1
                    if model is not EVEN and model is not LOCAL:
                        return 2
                    if name == LOCAL.name or name in (EVEN.name, "other"):
                        return 3
                    if d.EVEN is model or name == "local":
                        return 4
                    g(EVEN, LOCAL.name)  # passing a model is asking it, not branching
                    return model.needs_step_counts and name != "unregistered"
                """,
        },
    )
    (root / "placement" / "dispatch").mkdir()
    (root / "placement" / "dispatch" / "ideal.py").write_text(textwrap.dedent(MODELS))
    assert counts.dispatch_constants(root) == ({"EVEN", "LOCAL"}, {"even", "local"})
    assert counts.dispatch_branches(root) == [
        "solver/x.py:5",
        "solver/x.py:7",
        "solver/x.py:7",
        "solver/x.py:9",
        "solver/x.py:9",
        "solver/x.py:11",
        "solver/x.py:11",
    ]


def test_wide_functions_count_named_parameters_but_not_self(tmp_path):
    root = _tree(
        tmp_path,
        {
            "profiling/w.py": """
                def nine(a, b, c, d, e, f, g, h, i):
                    pass

                def eight_and_star(a, b, c, d, e, f, g, h, *args, **kwargs):
                    pass

                def keyword_only(a, /, b, *, c, d, e, f, g, h, i):
                    pass

                class K:
                    def method(self, a, b, c, d, e, f, g, h):
                        pass

                    def wide(self, a, b, c, d, e, f, g, h, i):
                        pass
                """,
        },
    )
    assert counts.wide_functions(root) == [
        "profiling/w.py:2 nine (9)",
        "profiling/w.py:8 keyword_only (9)",
        "profiling/w.py:15 wide (9)",
    ]


def test_step_tokens_aliases_and_policy_words_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "placement/m.py": '''
                """A docstring may say policy and batch_tokens."""

                def f(step_tokens, batch_per_rank=4):
                    run(decode_batch=step_tokens)
                    return args.decode_batch, args.batch_tokens, ["policy"]
                ''',
        },
    )
    (root / "runtime_hooks" / "engine_plugins").mkdir()
    (root / "runtime_hooks" / "engine_plugins" / "p.py").write_text("policy = 1\n")  # the plugins' word
    assert counts.step_tokens_names(root) == [
        "placement/m.py:4 batch_per_rank",
        "placement/m.py:5 decode_batch",
        "placement/m.py:6 batch_tokens",  # args.decode_batch is advise's per-phase flag: allowed
    ]
    assert counts.policy_words(root) == ["placement/m.py:6 'policy'"]


def test_word_rows_skip_hidden_deprecated_aliases_and_documented_keys_only(tmp_path):
    root = _tree(
        tmp_path,
        {
            "moe_placement/cli/c.py": """
                def add(p):
                    p.add_argument("--policy", help=argparse.SUPPRESS, action=DeprecatedAlias, new="--dispatch")
                    p.add_argument("--policy-shown", help="deprecated", action=DeprecatedAlias, new="--x")
                    p.add_argument("--policy-hidden", help=argparse.SUPPRESS)
                    out = {"policy": 1, "greedy_policy": 2, "batch_per_rank": 3, "my_policy": 4}
                    return out["policy"], out.get("policy"), out["batch_tokens"]
                """,
        },
    )
    # the hidden deprecated alias and the documented keys (dict keys, subscripts) are skipped; a shown
    # or a merely hidden flag, an undocumented key and the same word as a call argument are not
    assert counts.policy_words(root) == [
        "moe_placement/cli/c.py:4 '--policy-shown'",
        "moe_placement/cli/c.py:5 '--policy-hidden'",
        "moe_placement/cli/c.py:6 'my_policy'",
        "moe_placement/cli/c.py:7 'policy'",
    ]
    assert counts.step_tokens_names(root) == ["moe_placement/cli/c.py:7 batch_tokens"]
    assert counts.deprecated_flags(root) == {"--policy", "--policy-shown"}


EXCEPTIONS = """
    class Base(Exception):
        pass

    class BadInput(Base, ValueError):
        pass

    class Loose(RuntimeError):
        pass

    class _Signal(Exception):  # private control flow: not part of the family
        pass

    class NotAnError:
        pass

    class Deeper(BadInput):
        pass
    """


def test_exception_roots_are_enforced(tmp_path):
    root = _tree(tmp_path, {"moe_placement/base/errors.py": EXCEPTIONS})
    assert counts.exception_roots(root) == [
        "moe_placement/base/errors.py:2 Base",
        "moe_placement/base/errors.py:8 Loose",
    ]
    report = check.measure(root)
    assert report.over_limit == ["exception_roots"] and not report.ok
    (root / "moe_placement/base" / "errors.py").write_text(
        textwrap.dedent(EXCEPTIONS).replace("Loose(RuntimeError)", "Loose(Base, RuntimeError)")
    )
    assert counts.exception_roots(root) == ["moe_placement/base/errors.py:2 Base"]
    assert check.measure(root).ok


def test_import_fallbacks_around_own_modules_are_enforced(tmp_path):
    root = _tree(
        tmp_path,
        {
            "moe_placement/cli/a.py": """
                try:
                    import torch  # a third-party extra: fine
                except ImportError:
                    torch = None

                def f():
                    try:
                        from solver.exact import x
                    except ImportError:
                        x = None
                    try:
                        from . import b
                    except (OSError, ModuleNotFoundError):
                        b = None
                    try:
                        from solver import y
                    except ValueError:
                        y = None
                """,
        },
    )
    assert counts.import_fallbacks(root) == ["moe_placement/cli/a.py:8", "moe_placement/cli/a.py:12"]
    assert check.measure(root).over_limit == ["import_fallbacks"]


def test_outside_references_but_not_citations_are_enforced(tmp_path):
    root = _tree(
        tmp_path,
        {
            "solver/r.py": '''
                """Costs as in ../shared/docs/costmodel.md.

                82 ns per assignment (DeepGEMM README, H800); SGLang's rule (``srt/eplb/x.py``);
                https://arxiv.org/abs/2401.06066 is the paper.
                """

                # numbers from the shared docs/costmodel.md
                def f():
                    """For how this works see vLLM's code."""
                    return "../shared/docs/x.md is a string, not prose"

                # defined in docs/present.md; docs/missing.md is not in the repository
                ''',
        },
        filler=True,
    )
    (root / "docs").mkdir()
    (root / "docs" / "present.md").write_text("# here\n")
    assert counts.outside_references(root) == [
        "solver/r.py:2 '../shared/'",
        "solver/r.py:8 'docs/costmodel.md'",
        "solver/r.py:8 'shared docs'",
        'solver/r.py:10 "see vLLM\'s code"',
        "solver/r.py:13 'docs/missing.md'",
    ]
    assert check.measure(root).over_limit == ["outside_references"]


def test_readme_size_and_deprecated_flags_are_enforced(tmp_path):
    root = _tree(
        tmp_path,
        {
            "moe_placement/cli/common.py": """
                def add(p):
                    p.add_argument("--dispatch", help="how tokens pick a replica")
                    p.add_argument("--policy", dest="dispatch", help="deprecated alias of --dispatch")
                    p.add_argument("--old-flag", help=f"{'Deprecated'}: use --new-flag")
                """,
        },
        filler=True,
    )
    assert counts.deprecated_flags(root) == {"--policy", "--old-flag"}
    (root / "README.md").write_text("run --dispatch local\nnot --policy-file\n")
    assert counts.readme_deprecated(root) == [] and counts.readme_lines(root) == ["2"]
    (root / "README.md").write_text("x\n" * 150 + "run --policy local\n")
    assert counts.readme_deprecated(root) == ["README.md:151 --policy"]
    # the shown (not hidden) --policy is a "policy" word as well
    assert check.measure(root).over_limit == ["policy_words", "readme_lines", "readme_deprecated"]


# issue 45's counts: an install that collides with nothing, a bottom floor, families as packages, lists
# defined once, docs that name only existing paths; each planted in a small tree


def test_installed_packages_beyond_the_specified_five_are_enforced(tmp_path):
    root = _tree(tmp_path, {}, filler=True)
    (root / "pyproject.toml").write_text('[tool.setuptools]\npackages = { find = { include = ["*"] } }\n')
    assert counts.installed_packages(root) == []  # the floors' packages: the four and moe_placement
    (root / "cli").mkdir()
    (root / "cli" / "__init__.py").write_text("")
    assert counts.installed_packages(root) == ["cli/ is installed as a top-level package"]
    assert check.measure(root).over_limit == ["installed_packages"]
    (root / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = { find = { include = ["placement*", "moe_placement*"] } }\n'
    )
    assert counts.installed_packages(root) == []


def test_shared_utilities_outside_the_bottom_floor_are_enforced(tmp_path):
    root = _tree(tmp_path, {}, filler=True)
    (root / "solver" / "exact").mkdir()
    (root / "solver" / "exact" / "options.py").write_text("x = 1\n")
    assert counts.shared_outside_base(root) == []  # a solver's own options module is not shared code
    (root / "profiling" / "fileio.py").write_text("def atomic_write(): ...\n")
    assert counts.shared_outside_base(root) == ["profiling/fileio.py"]
    assert check.measure(root).over_limit == ["shared_outside_base"]


def test_families_spelled_as_file_prefixes_are_enforced(tmp_path):
    root = _tree(tmp_path, {"solver/migration_slots.py": "", "placement/step_balance.py": ""}, filler=True)
    assert counts.family_prefixes(root) == []  # one module per prefix is a name, not a family
    (root / "solver" / "migration_search.py").write_text("")
    assert counts.family_prefixes(root) == ["solver/migration_*.py (2 modules)"]
    assert check.measure(root).over_limit == ["family_prefixes"]


def test_a_second_phase_list_or_gpu_name_is_enforced(tmp_path):
    hardware = 'GPUS = {"h100": 1, "h200": 2}\nDEFAULT_HARDWARE = "h200"\n'
    root = _tree(
        tmp_path,
        {
            "placement/steps.py": 'PHASES = ("decode", "prefill")\n',
            "placement/cost.py": '"""Priced on h200 by default."""\n',
            "solver/x.py": 'def f():\n    """h100 in a docstring is prose."""\n',
        },
        filler=True,
    )
    (root / "placement" / "cost").mkdir()
    (root / "placement" / "cost" / "hardware.py").write_text(hardware)
    assert counts.phase_definitions(root) == ["placement/steps.py:1"]
    assert counts.hardware_literals(root) == []
    assert check.measure(root).ok
    (root / "solver" / "y.py").write_text('ORDER = ("prefill", "decode")\nGPU = "h100"\n')
    assert counts.phase_definitions(root) == ["placement/steps.py:1", "solver/y.py:1"]
    assert counts.hardware_literals(root) == ["solver/y.py:2 'h100'"]
    assert check.measure(root).over_limit == ["phase_definitions", "hardware_literals"]


def test_fmt_skips_are_enforced(tmp_path):
    root = _tree(tmp_path, {"solver/x.py": 's = "# fmt: skip in a string is prose"\n'}, filler=True)
    assert counts.fmt_skips(root) == [] and check.measure(root).ok
    (root / "solver" / "y.py").write_text("a = [1,  2]  # fmt: skip\n# fmt: off\nb = 1\n# fmt: on\n")
    assert counts.fmt_skips(root) == ["solver/y.py:1", "solver/y.py:2"]
    assert check.measure(root).over_limit == ["fmt_skips"]


def test_paths_named_in_docs_must_exist(tmp_path):
    root = _tree(tmp_path, {"solver/greedy.py": ""}, filler=True)
    (root / "docs").mkdir()
    (root / "docs" / "a.md").write_text(
        "See `solver/greedy.py`, `solver/*.py`, https://github.com/o/r/blob/main/solver/gone.py and\n"
        "vllm-project/vllm/tests/x.py (another project's file).\n"
    )
    assert counts.missing_doc_paths(root) == []
    (root / "README.md").write_text("Run `benchmarks/nope.py` over `placement/dispatch/*.py`.\n")
    assert counts.missing_doc_paths(root) == [
        "README.md:1 benchmarks/nope.py",
        "README.md:1 placement/dispatch/*.py",
    ]
    assert check.measure(root).over_limit == ["missing_doc_paths"]


def test_solver_share_is_enforced(tmp_path, capsys):
    root = _tree(tmp_path, {"solver/s.py": "x = 1\n" * 60, "profiling/p.py": "y = 2\n" * 40})
    assert counts.solver_share(root) == ["60"]
    assert check.measure(root).over_limit == ["solver_share"]
    assert check.main(["--root", str(root), "--counts"]) == 1
    out = capsys.readouterr().out
    assert "solver_share            60    35 enforced" in out


def test_every_row_of_issue_35_is_enforced():
    assert all(row.enforced for row in counts.ROWS)


def test_the_exception_family_has_one_root_and_keeps_old_import_paths():
    from moe_placement.base import errors
    from moe_placement.base.fileio import InputFileError
    from moe_placement.cli.common import CliError
    from runtime_hooks.engine_plugins.policy import PolicyError
    from runtime_hooks.engine_plugins.spec import SpecError
    from runtime_hooks.launcher import WorkerError, WorkerTimeout

    assert PolicyError is errors.EngineCallError  # the plugins' name for it: callers catch either
    old_paths = [CliError, InputFileError, PolicyError, SpecError, WorkerError, WorkerTimeout]
    assert sorted(c.__name__ for c in old_paths) == sorted(set(errors.__all__) - {"MoePlacementError"})
    assert all(getattr(errors, c.__name__) is c for c in old_paths)
    assert all(issubclass(c, errors.MoePlacementError) for c in old_paths)
    for cls, builtin in [
        (InputFileError, ValueError),
        (WorkerError, RuntimeError),
        (WorkerTimeout, TimeoutError),
    ]:
        assert issubclass(cls, builtin)
    err = WorkerTimeout([1, 3], 2.0)
    assert err.ranks == [1, 3] and "2.0 s" in str(err)


def test_inspect_plot_without_matplotlib_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """The ImportError fallback is gone: a missing viz extra is checked up front, as bad input."""
    import importlib.util

    from moe_placement.cli.main import main
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    path = tmp_path / "t.npz"
    write_trace(
        synthetic_trace(num_tokens=200, num_layers=2, num_logical_experts=8, top_k=2, num_prompts=4), path
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    assert main(["inspect", str(path), "--plot", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moe-placement: error: --plot needs the viz extra: pip install matplotlib"]


# Outside solver/, a placement comes from solver.api (solve, run): no module imports a solver's own
# placement function. The one exception places as the engine itself would (not our solver): the engine
# default guard's parity greedy, which reproduces vLLM's and SGLang's built-in balancer.
_PLACING = ("greedy_placement", "solve_exact", "solve_locality", "solve_migration", "solve_weighted")
_ENGINE_PARITY = {("runtime_hooks/engine_plugins/default_guard.py", "greedy_placement")}


def _placing_imports(root: Path) -> set[tuple[str, str]]:
    """``(file, name)`` for each import of a placing function from a solver module outside solver/."""
    import ast

    found = set()
    for pkg in ("profiling", "placement", "runtime_hooks", "moe_placement"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("solver."):
                    if node.module == "solver.api":
                        continue
                    rel = path.relative_to(root).as_posix()
                    found |= {(rel, a.name) for a in node.names if a.name.startswith(_PLACING)}
    return found


def test_placements_outside_solver_come_from_solver_api():
    assert _placing_imports(ROOT) <= _ENGINE_PARITY


def test_a_placing_import_outside_solver_is_found(tmp_path):
    tree = _tree(
        tmp_path, {"moe_placement/apps/sim.py": "def f():\n    from solver.greedy import greedy_placement\n"}
    )
    (tree / "moe_placement/apps" / "ok.py").write_text("from solver.api import solve\n")
    assert _placing_imports(tree) == {("moe_placement/apps/sim.py", "greedy_placement")}


# One traffic model: all-to-all bytes are counted in placement/cost/ only. Outside it no module reads a
# token's payload (dispatch_bytes_per_token / combine_bytes_per_token), spells the FP8 scales' bytes
# (``d / 128 * 4``), or imports a private helper of the cost package; the public functions
# (placement.cost.traffic.traffic_bytes, payload_bytes, counted_loads, ...) are what callers use.
_PAYLOADS = {"dispatch_bytes_per_token", "combine_bytes_per_token"}
_BYTE_PACKAGES = ("profiling", "placement", "solver", "runtime_hooks", "moe_placement", "benchmarks", "tools")


def _is_scale_bytes(node) -> bool:
    """``x / 128 * 4``: the bytes of FP8's per-128-element scales."""
    import ast

    def const(n, v):
        return isinstance(n, ast.Constant) and n.value == v

    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and const(node.right, 4)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.Div)
        and const(node.left.right, 128)
    )


def _a2a_byte_sites(root: Path) -> list[str]:
    """``file:line what`` for each place outside placement/cost/ that computes all-to-all bytes itself."""
    import ast

    found = []
    for pkg in _BYTE_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("placement/cost/"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
                if name in _PAYLOADS:
                    found.append(f"{rel}:{node.lineno} {name}")
                elif _is_scale_bytes(node):
                    found.append(f"{rel}:{node.lineno} FP8 scale bytes")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("placement.cost"):
                    found += [f"{rel}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_all_to_all_bytes_are_counted_in_the_cost_package_only():
    assert _a2a_byte_sites(ROOT) == []


def test_a_byte_count_outside_the_cost_package_is_found(tmp_path):
    tree = _tree(
        tmp_path,
        {
            "moe_placement/apps/sim.py": "def f(m, n):\n    return n * m.dispatch_bytes_per_token\n",
            "solver/own.py": "def g(d):\n    return d * 1 + d / 128 * 4\n",
            "runtime_hooks/h.py": "from placement.cost.traffic import _distinct\n",
            "placement/ok.py": "from placement.cost.traffic import traffic_bytes\nx = 7 / 128 * 2\n",
        },
    )
    (tree / "placement" / "cost").mkdir()
    (tree / "placement" / "cost" / "traffic.py").write_text(
        "def f(m):\n    return m.dispatch_bytes_per_token\n"
    )
    assert _a2a_byte_sites(tree) == [
        "solver/own.py:2 FP8 scale bytes",
        "runtime_hooks/h.py:1 _distinct",
        "moe_placement/apps/sim.py:2 dispatch_bytes_per_token",
    ]
