"""``moe-placement plan`` on the command line: the ``--json`` contract, the files ``--output`` writes as
one unit, one-line errors (exit 2), the HTML report in a real browser, and the launch flags against the
engines' own parsers (skipped when the engines' side environment is absent)."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from moe_placement.cli.main import main
from placement.formats import detect_format, read_placement

SPLIT = ["plan", "--model", "mixtral-8x7b", "--nodes", "2", "--gpus-per-node", "2", "--quick"]
SPLIT += ["--prompt-len", "8192", "--output-len", "1024", "--ttft-ms", "10000", "--tpot-ms", "25"]
SPLIT += ["--requests", "100", "--max-requests", "2000"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One ``plan --json --output`` run: (stdout JSON, stderr, the output folder)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("plan") / "out"
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = main([*SPLIT, "--output", str(out), "--json"])
    assert rc == 0, se.getvalue()
    return json.loads(so.getvalue()), se.getvalue(), out


def test_json_has_the_documented_contract(written):
    d, _, out = written
    assert {"deployments", "best", "reason", "assumptions", "warnings", "hardware"} <= set(d)
    assert d["hardware"] == {"preset": "h200", "measured": False, "measured_parts": []}
    for dep in d["deployments"]:
        assert {
            "kind",
            "gpus",
            "pools",
            "goodput_rps_per_gpu",
            "ttft_ms",
            "tpot_ms",
            "breakdown",
            "met_targets",
        } <= set(dep)
        assert set(dep["breakdown"]) == {
            "prefill_ms",
            "decode_step_ms",
            "handoff_ms",
            "handoff_bytes_per_request",
        }
        assert set(dep["ttft_ms"]) == set(dep["tpot_ms"]) == {"p50", "p90", "p99"}
        assert sum(p["gpus"] for p in dep["pools"]) == dep["gpus"] == 4
        for pool in dep["pools"]:
            assert {"phase", "gpus", "layout", "placement_file", "dispatch"} <= set(pool)
            assert pool["phase"] in ({"both"} if dep["kind"] != "disaggregated" else {"prefill", "decode"})
    rates = [r["goodput_rps_per_gpu"] for r in d["deployments"]]
    assert rates == sorted(rates, reverse=True) and d["best"] == d["deployments"][0]["label"]
    assert json.loads((out / "plan.json").read_text()) == d  # the file is what --json printed


def test_output_holds_each_pools_placement_in_every_format_named(written):
    d, _, out = written
    best = d["deployments"][0]
    script = (out / "launch.sh").read_text()
    for pool in best["pools"]:
        native = pool["placement_file"]
        assert native == str(out / f"{pool['phase']}_placement.json")
        pl = read_placement(native)
        sg = out / f"{pool['phase']}_sglang_expert_location.json"
        assert detect_format(sg) == "sglang"
        if pool["ep_size"] > 1:  # a one-GPU instance holds every expert: no placement flag
            assert f"--init-expert-location {sg}" in script
        vllm = json.loads((out / f"{pool['phase']}_vllm_expert_map.provisional.json").read_text())
        assert np.array_equal(np.array(vllm), pl.physical_to_logical_map)  # [L][P], MoE layers in order
    if best["kind"] == "disaggregated":
        for flag in ("--disaggregation-mode prefill", "--disaggregation-mode decode", "--pd-disaggregation"):
            assert flag in script
        assert '"kv_role":"kv_producer"' in script and '"kv_role":"kv_consumer"' in script


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--prompt-len", "40000"], "longer than the model's context: prompt 40000"),
        (["--gpus-per-node", "1", "--model", "deepseek-v3"], "too small to hold deepseek-v3"),
        (["--inter-link", "25"], "write a number with its unit"),
        (["--deployments", "co-located,pipelined"], "DeployOptions.deployments"),
        (["--layout-steps", "-2"], "--layout-steps"),
        (["--route", "fastest"], "--route"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, extra, needle):
    args = ["plan", "--model", "mixtral-8x7b", "--nodes", "1", "--gpus-per-node", "2", "--quick", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_targets_nothing_meets_exit_0_with_a_warning_and_the_closest(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "2", "--quick"]
    args += ["--prompt-len", "4096", "--output-len", "16", "--ttft-ms", "1", "--tpot-ms", "0.01", "--json"]
    assert main(args) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    assert d["best"] is None and d["closest"] is not None and "no deployment meets the targets" in cap.err


def test_plan_report_renders_in_headless_chromium(written, tmp_path):
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium): the screenshot test needs it")
    _, _, out = written
    page = (out / "plan.html").read_text()
    assert page.count("<svg") == 3  # inline figures
    assert not any(tag in page for tag in ("<script", "<link", "<img", 'src="http'))  # nothing fetched
    shot = tmp_path / "shot.png"
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--screenshot={shot}",
        "--window-size=1200,2600",
    ]
    subprocess.run([*cmd, (out / "plan.html").as_uri()], check=True, capture_output=True, timeout=120)
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)[..., :3]  # [H, W, 3] floats in 0..1
    assert img.std() > 0.05 and float((img.min(axis=2) < 0.9).mean()) > 0.03
    lower = img[img.shape[0] // 2 :]  # the plots are drawn, not only the text at the top
    assert float((lower.min(axis=2) < 0.9).mean()) > 0.02


@pytest.mark.slow  # builds SGLang's parser in the engines' environment (seconds of imports)
def test_every_sglang_flag_of_the_launch_commands_exists_in_its_parser(written):
    from test_engine_plugins import _engines_python

    py = _engines_python()
    code = (
        "import argparse, json\nfrom sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "print(json.dumps(sorted(o for a in p._actions for o in a.option_strings)))"
    )
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300)
    if res.returncode:
        pytest.skip(f"SGLang's parser is not importable in the engines environment: {res.stderr[-200:]}")
    accepted = set(json.loads(res.stdout.strip().splitlines()[-1]))
    d, _, _ = written
    flags = {w for cmd in d["launch"]["sglang"] for w in cmd.split() if w.startswith("--")}
    assert {"--init-expert-location", "--chunked-prefill-size"} <= flags
    assert flags <= accepted, sorted(flags - accepted)


@pytest.mark.slow  # finds vLLM in the engines' environment (a subprocess)
def test_every_vllm_flag_and_kv_transfer_key_exists_in_vllm(written):
    from test_advise_engines import _package_dir

    pkg = _package_dir("vllm")
    src = (pkg / "engine" / "arg_utils.py").read_text()
    d, _, _ = written
    cmds = d["launch"]["vllm"]
    flags = {w for cmd in cmds for w in cmd.split() if w.startswith("--")}
    assert {"--enable-expert-parallel", "--data-parallel-size"} <= flags
    frontend = (pkg / "entrypoints" / "common" / "cli_args.py").read_text()  # FrontendArgs: --host, --port
    fields = {ln.split(":")[0].strip() for ln in frontend.splitlines() if ln.startswith("    ") and ":" in ln}
    assert [f for f in flags if f'"{f}"' not in src and f[2:].replace("-", "_") not in fields] == []
    configs = [
        json.loads(c.split("--kv-transfer-config '")[1].split("'")[0])
        for c in cmds
        if "--kv-transfer-config" in c
    ]
    kv_src = (pkg / "config" / "kv_transfer.py").read_text()
    for cfg in configs:  # keys of KVTransferConfig, the role one of its literals
        assert all(f"{k}:" in kv_src for k in cfg) and f'"{cfg["kv_role"]}"' in kv_src, cfg


def test_the_issue_example_shows_in_the_plans_breakdown(capsys):
    """Mixtral-8x7B is the example's shape (32 layers, 8 KV heads x 128, BF16): an 8192-token prompt
    hands off 1 GiB; over a link given as 200 Gbit/s, sent after the prefill, 42.9 ms + the fixed cost."""
    from placement.cost.hardware import KV_HANDOFF_FIXED_S

    args = ["plan", "--model", "mixtral-8x7b", "--nodes", "2", "--gpus-per-node", "2", "--quick", "--json"]
    args += [
        "--prompt-len",
        "8192",
        "--output-len",
        "16",
        "--inter-link",
        "200Gbit/s",
        "--kv-streaming",
        "none",
    ]
    assert main([*args, "--deployments", "disaggregated", "--rate", "0.05", "--ttft-ms", "60000"]) == 0
    d = json.loads(capsys.readouterr().out)["deployments"][0]
    b = d["breakdown"]
    assert b["handoff_bytes_per_request"] == 1 << 30 and d["handoff"]["link_bytes_per_s"] == 25e9
    assert b["handoff_ms"] == pytest.approx((1 << 30) / 25e9 * 1e3 + KV_HANDOFF_FIXED_S[1] * 1e3, rel=1e-9)
