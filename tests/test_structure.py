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


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in check.FLOORS:
        (tmp_path / pkg).mkdir()
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
            "cli/main.py": "def main():\n    from solver.greedy import model\n",
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
    root = _tree(tmp_path, {"runtime_hooks/x.py": "import cli.main\n", "cli/main.py": "x = 1\n"})
    assert check.measure(root).upward_imports == ["runtime_hooks.x -> cli.main"]


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
