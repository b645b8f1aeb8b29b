"""``moe-placement calibrate`` on real gloo ranks: the preset it writes is read by ``evaluate``, ``layout``
and ``advise``, which report it measured and price its measured link; the skew sweep reports how time
follows the busiest receiver; bad input is one line with nothing written; SIGTERM stops every rank;
torchrun's ranks run it without a spawn."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from moe_placement.cli.main import main
from placement.cost.calibration import fit_link
from placement.cost.hardware import LinkSpec, cluster_preset
from placement.cost.modelspec import load_model

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"latency_us", "bytes_per_s", "skew_slope", "skew_r2"}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """OLMoE's shapes with 3 MoE layers (a trace of 3 layers fits it), calibrated on 4 gloo ranks in 2
    groups of 2 with --quick; a synthetic trace and a 4-GPU placement of it."""
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    d = tmp_path_factory.mktemp("calibrate")
    spec = dataclasses.asdict(load_model("olmoe-1b-7b"))
    spec.update(name="olmoe-3l", num_layers=4, moe_layer_ids=[1, 2, 3])
    model = d / "olmoe3.json"
    model.write_text(json.dumps(spec))
    preset = d / "preset.json"
    t0 = time.perf_counter()
    argv = ["calibrate", "--model", str(model), "--ranks", "4", "--gpus-per-node", "2", "--backend", "gloo"]
    rc, out, err = _run([*argv, "--quick", "--output", str(preset), "--json"])
    seconds = time.perf_counter() - t0
    assert rc == 0, err
    trace = d / "t.npz"
    write_trace(
        synthetic_trace(
            num_tokens=12000, num_layers=3, num_logical_experts=64, top_k=8, num_prompts=160, skew=1.0, seed=3
        ),
        trace,
    )
    pl = d / "pl.json"
    assert (
        _run(["solve", "--trace", str(trace), "--ep-size", "4", "--num-redundant", "4", "-o", str(pl)])[0]
        == 0
    )
    return {
        "summary": json.loads(out),
        "stderr": err,
        "preset": preset,
        "model": model,
        "trace": trace,
        "placement": pl,
        "seconds": seconds,
        "dir": d,
    }


def test_summary_holds_the_contract_and_a_progress_line_per_stage(calibrated):
    s = calibrated["summary"]
    assert calibrated["seconds"] < 60  # a couple of minutes is the bound; --quick on 4 ranks is seconds
    for phase in ("decode", "prefill"):
        a = s["a2a"][phase]
        assert KEYS <= set(a) and a["link"] == "intra" and a["bytes_per_s"] > 0 and a["latency_us"] >= 0
        assert set(a["links"]) == {"intra", "inter"} and a["skew_r2"] <= 1.0
    assert set(s) >= {"a2a", "gemm", "measured_on", "versions"}
    mo, v = s["measured_on"], s["versions"]
    assert (mo["backend"], mo["ranks"], mo["nodes"], mo["inter_network"]) == ("gloo", 4, 2, False)
    assert v["torch"] and v["python"] and v["nccl"] is None and "deep_ep" in v and "vllm" in v
    stages = [
        ln.split(":")[1].strip() for ln in calibrated["stderr"].splitlines() if ln.startswith("calibrate: ")
    ]
    assert stages == ["a2a decode", "a2a prefill", "allreduce", "gemm", "launch", "deep_ep"]
    # what a CPU cannot measure is skipped with its reason, and the CPU GEMM is not applied to a GPU preset
    assert "no CUDA device" in s["launch"]["skipped"] and "gloo" in s["deep_ep"]["skipped"]
    assert s["gemm"]["device_type"] == "cpu" and s["gemm"]["applied"] is False and "CPU" in s["gemm"]["why"]


def test_preset_applies_the_measured_intra_link_and_says_what_inter_was(calibrated):
    s, d = calibrated["summary"], json.loads(calibrated["preset"].read_text())
    prov = d["provenance"]
    assert prov["measured"] == s["measured"] == ["a2a_intra"]
    assert "inter" not in d and not {"eta_compute", "eta_memory", "gemm_overhead"} & set(
        d
    )  # no CPU figure priced
    intra, fit = d["intra"], s["a2a"]
    assert intra["bandwidth"] == fit["decode"]["links"]["intra"]["bytes_per_s"]
    assert intra["latency"] == pytest.approx(fit["decode"]["links"]["intra"]["latency_us"] / 1e6)
    assert intra["normal_bandwidth"] == fit["prefill"]["links"]["intra"]["bytes_per_s"]
    assert intra["allreduce_latency"] > 0
    assert s["a2a_links"]["inter"]["applied"] is False and "not a network" in s["a2a_links"]["inter"]["why"]
    cl = cluster_preset(str(calibrated["preset"]))
    assert cl.measured and cl.intra.bandwidth == intra["bandwidth"] and cl.inter.name == "rdma"
    # the repeats and their spread are in the preset
    rows = prov["samples"]
    assert rows and all(len(r["seconds"]) == 3 and r["min"] <= r["median"] <= r["p90"] for r in rows)
    assert set(prov["spread"]) >= {"all_to_all_single/intra/decode", "all_to_all_single/inter/prefill"}


def test_skew_sweep_reports_time_against_the_busiest_receiver(calibrated):
    rows = json.loads(calibrated["preset"].read_text())["provenance"]["samples"]
    s = calibrated["summary"]["a2a"]
    for phase in ("decode", "prefill"):
        for link in ("intra", "inter"):
            mine = [r for r in rows if (r["link"], r["phase"]) == (link, phase)]
            skewed = [r for r in mine if r["skew"] > 1]
            assert skewed and all(r["busiest_bytes"] >= 2.4 * r["mean_recv_bytes"] for r in skewed)
            # the reported R^2 is the least squares of time against the busiest receiver's bytes
            groups = {(r["op"], r["step_tokens"]) for r in mine}
            gid = {g: i for i, g in enumerate(sorted(groups))}
            f = fit_link(
                np.array([r["busiest_bytes"] for r in mine]),
                np.array([r["mean_recv_bytes"] for r in mine]),
                np.array([r["seconds"] for r in mine]),
                np.array([gid[(r["op"], r["step_tokens"])] for r in mine]),
            )
            got = s[phase]["links"][link]
            assert got["skew_r2"] == pytest.approx(f.r2) and got["skew_slope"] == pytest.approx(f.skew_slope)


def test_evaluate_and_layout_price_the_measured_link_and_say_measured(calibrated):
    pl, trace, model, preset = (str(calibrated[k]) for k in ("placement", "trace", "model", "preset"))
    runs = {}
    for hw in ("h200", preset):
        rc, out, err = _run(["evaluate", pl, trace, "--model", model, "--hardware", hw, "--json"])
        assert rc == 0, err
        runs[hw] = json.loads(out)
    assert runs["h200"]["hardware"] == {"preset": "h200", "measured": False, "measured_parts": []}
    assert runs[preset]["hardware"] == {"preset": preset, "measured": True, "measured_parts": ["a2a_intra"]}
    # the step time is the h200 preset with the measured intra link: the same numbers, and far slower a2a
    from placement.cost.step_time import step_time
    from placement.formats import read_placement
    from placement.steps import make_steps
    from profiling.readers import read_trace

    intra = json.loads(calibrated["preset"].read_text())["intra"]
    link = LinkSpec(
        "m",
        intra["bandwidth"],
        intra["latency"],
        1e9,
        normal_bandwidth=intra["normal_bandwidth"],
        normal_latency=intra["normal_latency"],
        allreduce_latency=intra["allreduce_latency"],
    )
    tr, p = read_trace(trace), read_placement(pl)
    cl = dataclasses.replace(cluster_preset("h200", gpus_per_node=4), intra=link)
    want = step_time(p, tr, make_steps(tr, 4, "decode", None), "even", load_model(model), cl)
    got = runs[preset]["step_time"]
    assert got["a2a_ms"] == pytest.approx(want.a2a_ms) and got["whole_ms"] == pytest.approx(want.whole_ms)
    assert got["a2a_ms"] > 10 * runs["h200"]["step_time"]["a2a_ms"]
    # layout: measured unless --intra-link names another link, and the same layout costs more over gloo
    plans = {}
    for name, extra in (
        ("h200", ["--hardware", "h200"]),
        ("preset", ["--hardware", preset]),
        ("named", ["--hardware", preset, "--intra-link", "nvlink4"]),
    ):
        rc, out, err = _run(
            [
                "layout",
                "--model",
                model,
                "--nodes",
                "1",
                "--gpus-per-node",
                "4",
                "--json",
                "--no-phase-compare",
                *extra,
            ]
        )
        assert rc == 0, err
        plans[name] = json.loads(out)
    assert plans["preset"]["hardware"]["measured"] and plans["preset"]["hardware"]["measured_parts"] == [
        "a2a_intra"
    ]
    assert not plans["h200"]["hardware"]["measured"] and not plans["named"]["hardware"]["measured"]

    def ep4(plan):
        return next(
            r["step_time_ms"] for r in plan["results"] if r["ep_size"] == 4 and r["num_redundant"] == 0
        )

    assert ep4(plans["preset"]) > 2 * ep4(plans["h200"]) and ep4(plans["named"]) == pytest.approx(
        ep4(plans["h200"])
    )


def test_advise_reports_measured_only_for_a_measured_preset(calibrated):
    hand = calibrated["dir"] / "hand.json"
    hand.write_text(json.dumps({"base": "h200", "eta_compute": 0.5}))  # a JSON preset that measured nothing
    args = [
        "advise",
        "--trace",
        str(calibrated["trace"]),
        "--model",
        str(calibrated["model"]),
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--engine",
        "sglang",
        "--quick",
        "--decode-batch",
        "8",
        "--prefill-chunk",
        "64",
        "--json",
    ]
    got = {}
    for hw in (str(calibrated["preset"]), str(hand)):
        rc, out, err = _run([*args, "--hardware", hw])
        assert rc == 0, err
        got[hw] = json.loads(out)
    measured = got[str(calibrated["preset"])]
    assert measured["context"]["calibrated"] is True and "measured (a2a_intra" in measured["assumptions"][0]
    assert got[str(hand)]["context"]["calibrated"] is False  # before: any *.json was called calibrated


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ranks", "1"], "--ranks"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--backend", "nccl"], "needs CUDA"),
        (["--gpus-per-node", "3"], "must divide"),
        (["--output", "{d}/missing/p.json"], "does not exist"),
        (["--output", "{d}/p.txt"], ".json"),
        (["--output", "{model}"], "is the input"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, argv, needle):
    model = tmp_path / "m.json"
    model.write_text(json.dumps(dataclasses.asdict(load_model("olmoe-1b-7b"))))
    before = model.read_bytes()
    argv = [a.format(d=tmp_path, model=model) for a in argv]
    base = {"--model": str(model), "--ranks": "4", "--backend": "gloo", "--output": str(tmp_path / "p.json")}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    rc, out, err = _run(["calibrate", *[x for kv in base.items() for x in kv], "--quick"])
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"] and model.read_bytes() == before


def test_torchrun_ranks_refuse_a_different_ranks_flag(tmp_path, monkeypatch):
    (
        monkeypatch.setenv("RANK", "0"),
        monkeypatch.setenv("WORLD_SIZE", "2"),
        monkeypatch.setenv("LOCAL_RANK", "0"),
    )
    rc, _, err = _run(
        [
            "calibrate",
            "--model",
            "olmoe-1b-7b",
            "--backend",
            "gloo",
            "--ranks",
            "4",
            "--output",
            str(tmp_path / "p.json"),
        ]
    )
    assert rc == 2 and "WORLD_SIZE=2" in err and not (tmp_path / "p.json").exists()


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_the_ranks_are_torchruns(tmp_path):
    out = tmp_path / "p.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "moe_placement",
        "calibrate",
        "--model",
        "olmoe-1b-7b",
        "--backend",
        "gloo",
        "--quick",
        "--output",
        str(out),
        "--json",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # a rank stuck in rendezvous ignores SIGTERM: end the whole session
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    s = json.loads(stdout)  # rank 0 alone prints
    assert (s["measured_on"]["ranks"], s["measured_on"]["gpus_per_node"]) == (2, 2)  # LOCAL_WORLD_SIZE
    assert s["measured"] == ["a2a_intra"] and cluster_preset(str(out)).measured


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(x) for x in (task / "children").read_text().split()]
                todo += [k for k in kids if k not in found]
                found.update(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to list the ranks")
def test_sigterm_stops_every_rank_and_writes_nothing(tmp_path):
    out = tmp_path / "p.json"
    cmd = [
        sys.executable,
        "-m",
        "moe_placement",
        "calibrate",
        "--model",
        "deepseek-v3",
        "--ranks",
        "3",
        "--backend",
        "gloo",
        "--output",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env(), cwd=tmp_path
    )
    lines, started = [], threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip())
            started.set() if line.startswith("calibrate: a2a") else None

    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(120), lines
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 3, ranks  # the forkserver and its ranks
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rc == 143 and not [p for p in ranks if _alive(p)], lines[-3:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no preset, no temporary file


def test_device_paths_say_why_they_are_skipped_on_a_cpu():
    import torch

    from runtime_hooks.calibrate_deepep import skip_reason
    from runtime_hooks.calibrate_kernels import cuda_graph_launch, gemm_dtype, versions

    assert skip_reason("gloo", {}) and "gloo" in skip_reason("gloo", {})
    if not torch.cuda.is_available():
        assert skip_reason("nccl", {}) == "no CUDA device"
    assert skip_reason("nccl", None) == "not requested"
    assert "no CUDA device" in cuda_graph_launch(torch.device("cpu"))["skipped"]
    assert gemm_dtype(torch.device("cpu")) == ("fp32", 4.0)  # a CPU's GEMM is never passed off as FP8
    v = versions("gloo")
    assert (
        v["torch"] == torch.__version__ and v["backend"] == "gloo" and set(v) >= {"deep_ep", "sglang", "vllm"}
    )
