"""advise's engine table (``moe_placement/apps/advise/engines.py``) and the flags it prints, checked against the
engines' own code: SGLang 0.5.23 and vLLM 0.33.0 in the side environment (``MOE_ENGINES_PYTHON`` or
``<repo>/.engines-venv/bin/python``). The engines' source is read (``ast``), not run, except SGLang's
argument parser, which is built in the side environment to list every flag it accepts."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_engine_plugins import _engines_python  # one skip reason, naming no machine path

from moe_placement.apps.advise.balance import ENGINE, NO_EPLB, OURS
from moe_placement.apps.advise.engines import (
    _SGLANG_EPLB,
    _SGLANG_LP,
    _VLLM_EPLB,
    ENGINES,
    architecture_of,
    can_dispatch,
)
from moe_placement.apps.advise.options import AdviseOptions
from moe_placement.apps.advise.recommend import launch

ROOT = Path(__file__).resolve().parents[1]


def _package_dir(name: str) -> Path:
    """Where the side environment keeps package ``name`` (found without importing it)."""
    code = f"import importlib.util as u; print(list(u.find_spec({name!r}).submodule_search_locations)[0])"
    out = subprocess.run([str(_engines_python()), "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode:
        pytest.skip(f"{name} is not importable in the engines environment: {out.stderr.strip()[-200:]}")
    return Path(out.stdout.strip())


def _version(pkg: Path) -> str:
    dist = sorted(pkg.parent.glob(f"{pkg.name}-*.dist-info"))
    return dist[0].name[len(pkg.name) + 1 : -len(".dist-info")] if dist else ""


def _classes(folder: Path) -> tuple[dict[str, set[str]], dict[str, set[str]], list[ast.Module]]:
    """Per class name: its base names and the methods it defines, over every module of ``folder``."""
    bases: dict[str, set[str]] = {}
    methods: dict[str, set[str]] = {}
    trees = []
    for f in sorted(folder.glob("*.py")):
        tree = ast.parse(f.read_text())
        trees.append(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
                methods.setdefault(node.name, set()).update(
                    n.name for n in node.body if isinstance(n, ast.FunctionDef)
                )
    return bases, methods, trees


def _inherits(cls: str, bases: dict, has, seen: tuple = ()) -> bool:
    return has(cls) or any(
        _inherits(b, bases, has, (*seen, cls)) for b in bases.get(cls, ()) if b not in seen
    )


def test_sglang_eplb_architectures_match_its_model_classes():
    pkg = _package_dir("sglang")
    assert _version(pkg) == ENGINES["sglang"].version
    bases, methods, trees = _classes(pkg / "srt" / "models")
    entries = set()
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", "") == "EntryClass" for t in node.targets
            ):
                v = node.value
                entries |= {
                    i.id
                    for i in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])
                    if isinstance(i, ast.Name)
                }
    key = "get_model_config_for_expert_location"
    found = {e for e in entries if _inherits(e, bases, lambda c: key in methods.get(c, set()))}
    assert found == _SGLANG_EPLB
    assert "MixtralForCausalLM" in entries and "MixtralForCausalLM" not in found
    assert key in (pkg / "srt" / "eplb" / "expert_location.py").read_text()


def test_sglang_lp_dispatch_architectures_platform_and_choices():
    pkg = _package_dir("sglang")
    src = (pkg / "srt" / "eplb" / "lplb_solver.py").read_text()
    node = next(
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_LPLB_SUPPORTED_MODEL_ARCHS"
    )
    archs = {
        c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
    }
    assert archs == _SGLANG_LP
    assert "cuda_solver" in src  # the LP runs in a CUDA kernel: lp is CUDA-only
    assert ENGINES["sglang"].dispatch_platforms["lp"] == ("cuda",)
    exec_src = (pkg / "srt" / "arg_groups" / "fields" / "exec_.py").read_text()
    assert 'Literal["static", "dynamic", "fake", "lp"]' in exec_src
    assert set(ENGINES["sglang"].dispatch_platforms) == {"static", "dynamic", "fake", "lp"}
    assert "`low_latency` for decode batch and `normal` for prefill batch" in exec_src
    assert dict(ENGINES["sglang"].deepep_modes) == {"decode": "low_latency", "prefill": "normal"}
    # (experts + redundant) % EP ranks == 0
    assert (
        "assert num_physical_experts % ep_size == 0"
        in (pkg / "srt" / "eplb" / "expert_location.py").read_text()
    )
    ok, why = can_dispatch("sglang", "lp", "Qwen3MoeForCausalLM")
    assert not ok and "Qwen3MoeForCausalLM" in why
    assert can_dispatch("sglang", "lp", "DeepseekV2ForCausalLM") == (True, "")
    assert not can_dispatch("sglang", "lp", "DeepseekV2ForCausalLM", platform="rocm")[0]


def test_vllm_eplb_architectures_and_async_match_its_code():
    pkg = _package_dir("vllm")
    assert _version(pkg) == ENGINES["vllm"].version
    models = pkg / "model_executor" / "models"
    bases, _, _ = _classes(models)
    archs = {}
    for node in ast.walk(ast.parse((models / "registry.py").read_text())):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) >= 2:
                    if isinstance(v.elts[1], ast.Constant):
                        archs[k.value] = v.elts[1].value
    found = {a for a, c in archs.items() if _inherits(c, bases, lambda x: x == "MixtureOfExperts")}
    assert found == _VLLM_EPLB
    parallel = (pkg / "config" / "parallel.py").read_text()
    assert "use_async: bool = True" in parallel and ENGINES["vllm"].async_rebalance
    assert "enable_expert_parallel must be True to use EPLB" in parallel
    assert architecture_of("mixtral-8x7b") in _VLLM_EPLB and architecture_of("olmoe-1b-7b") not in _VLLM_EPLB


def _printed(engine: str) -> tuple[set[str], list[dict]]:
    """Every flag and every --eplb-config JSON the launch commands print, over the cases advise builds."""
    flags: set[str] = set()
    configs: list[dict] = []
    prices = SimpleNamespace(dispatch_overhead_ms=0.1)
    for kind, dispatch in (
        (NO_EPLB, "even"),
        (ENGINE, f"{engine}-{'static' if engine == 'sglang' else 'hash'}"),
        (OURS, "sglang-dynamic" if engine == "sglang" else "vllm-hash"),
    ):
        row = SimpleNamespace(kind=kind, dispatch=dispatch, decode=prices, redundant_per_gpu=1)
        for nodes, interval, redundant in ((1, None, 0), (4, 3000, 32)):
            opts = AdviseOptions(engine=engine, nodes=nodes)
            cmd = launch(engine, row, "deepseek-v3", opts, redundant, interval, "out").command
            flags |= {w for w in cmd.split() if w.startswith("--")}
            if "--eplb-config '" in cmd:
                configs.append(json.loads(cmd.split("--eplb-config '")[1].split("'")[0]))
    return flags, configs


def test_every_vllm_flag_printed_exists_in_its_parser():
    pkg = _package_dir("vllm")
    src = (pkg / "engine" / "arg_utils.py").read_text()
    flags, configs = _printed("vllm")
    assert {"--enable-expert-parallel", "--data-parallel-size", "--enable-eplb", "--eplb-config"} <= flags
    missing = [f for f in flags if f'"{f}"' not in src]
    assert not missing, missing
    tree = ast.parse((pkg / "config" / "parallel.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "EPLBConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert configs and all(set(c) <= fields for c in configs), (configs, fields)


def _commands(engine: str) -> list[str]:
    """Every node's command advise prints, over its cases: each kind of row, one node and four, with and
    without a periodic rebalance, two-batch overlap on, a prefill chunk set by the user."""
    out = []
    prices = SimpleNamespace(dispatch_overhead_ms=0.1)
    for kind, dispatch in (
        (NO_EPLB, "even"),
        (ENGINE, f"{engine}-{'static' if engine == 'sglang' else 'hash'}"),
        (OURS, "sglang-dynamic" if engine == "sglang" else "vllm-hash"),
    ):
        row = SimpleNamespace(kind=kind, dispatch=dispatch, decode=prices, redundant_per_gpu=1)
        for nodes, interval, redundant, extra in (
            (1, None, 0, {}),
            (4, 3000, 32, {"overlap": "on", "prefill_step_tokens": 512}),
        ):
            opts = AdviseOptions(engine=engine, nodes=nodes, **extra).resolved(141e9)
            out += launch(engine, row, "deepseek-v3", opts, redundant, interval, "/abs/out").per_node
    return out


_PARSE = """
import json, shlex, sys
engine, commands = json.loads(sys.stdin.read())
if engine == "sglang":
    import argparse
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    head = ["python", "-m", "sglang.launch_server"]
else:
    try:
        import cachetools, cloudpickle  # imported by vllm.engine.arg_utils' chain: missing, fail fast
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser(exit_on_error=False)
        AsyncEngineArgs.add_cli_args(parser)  # a CUDA build of vLLM on a machine without a device raises here
    except (ImportError, RuntimeError) as exc:  # the side environment cannot build vLLM's parser
        print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(0)
    # what `vllm serve` adds on top (vllm/entrypoints/common/cli_args.py make_arg_parser)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--headless", action="store_true")
    head = ["vllm", "serve"]
deprecated = {o for a in parser._actions for o in a.option_strings
              if "deprecat" in (type(a).__name__ + " " + str(a.help or "")).lower()}
result = []
for cmd in commands:
    words = shlex.split(cmd)
    argv = words[words.index(head[-1]) + 1:]
    try:
        parser.parse_args(argv)
        error = ""
    except BaseException as exc:  # argparse exits or raises ArgumentError
        error = f"{type(exc).__name__}: {exc}"
    used = sorted(w for w in argv if w in deprecated)
    result.append({"command": cmd, "error": error, "deprecated": used})
print(json.dumps(result))
"""


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_command_parses_with_the_engines_own_parser_and_no_flag_is_deprecated(engine):
    """Each node's command, split as a shell would, is parsed by the engine's own parser (SGLang's
    ServerArgs.add_cli_args, vLLM's `vllm serve` parser: FlexibleArgumentParser with AsyncEngineArgs):
    every flag exists and takes its value, and none is one the pinned version marks deprecated
    (--enable-dp-attention was)."""
    py = _engines_python()
    _package_dir(engine)
    commands = _commands(engine)
    assert any("--node-rank 3" in c or "--data-parallel-start-rank 24" in c for c in commands)
    if engine == "sglang":
        printed = {w for c in commands for w in c.split() if w.startswith("--")}
        assert {"--nnodes", "--init-expert-location", "--ep-dispatch-algorithm", "--enable-eplb"} <= printed
    out = subprocess.run(
        [str(py), "-c", _PARSE],
        input=json.dumps([engine, commands]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(result, dict):
        pytest.skip(
            f"vLLM's argument parser cannot be built in the engines environment: {result['import_error']}"
        )
    bad = [r for r in result if r["error"] or r["deprecated"]]
    assert not bad, bad[:3]


def test_every_vllm_command_flag_is_current_in_its_source():
    """Without importing vLLM: every flag of every node's command is declared by vLLM 0.33's parsers
    (engine/arg_utils.py; --headless by the serve parser), none is one its deprecation messages name,
    and the all-to-all backend is one of its choices."""
    pkg = _package_dir("vllm")
    engine_src = (pkg / "engine" / "arg_utils.py").read_text()
    serve_src = (pkg / "entrypoints" / "common" / "cli_args.py").read_text()
    flags = {w for c in _commands("vllm") for w in c.split() if w.startswith("--")}
    assert {"--headless", "--data-parallel-start-rank", "--enable-dbo", "--max-num-batched-tokens"} <= flags
    missing = [f for f in flags if f'"{f}"' not in engine_src + serve_src]
    assert not missing, missing
    deprecated = [
        f for f in flags if f"{f} is deprecated" in engine_src or f"({f}) is deprecated" in engine_src
    ]
    assert not deprecated, deprecated
    backend = ENGINES["vllm"].deepep_modes["decode"]
    assert f'"{backend}"' in (pkg / "config" / "parallel.py").read_text()
