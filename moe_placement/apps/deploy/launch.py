"""The winner's launch commands per pool and the files ``plan --output`` writes (as one unit).

SGLang 0.5.23 (flag spellings of its parser; PD mode: ``--disaggregation-mode prefill|decode``,
``--disaggregation-transfer-backend``, ``--disaggregation-bootstrap-port`` on the prefill server, and the
router ``python -m sglang_router.launch_router --pd-disaggregation --prefill URL PORT --decode URL``).
Each pool's placement goes in by ``--init-expert-location`` (the SGLang expert-location file written
here). ``--chunked-prefill-size`` is the engine's whole-instance figure: SGLang divides it by the
attention-DP size, so it is the pool's tokens per rank x DP ranks.

vLLM 0.33.0: ``--kv-transfer-config`` with ``kv_role`` ``kv_producer`` (prefill) / ``kv_consumer``
(decode) on the NIXL connector; it loads no placement file at start, so the placement is served by our
plugin's from-file spec ``MOE_PLACEMENT_EPLB=file:PATH`` (docs/serving.md), taken at vLLM's first
rearrangement. Beside it goes the per-layer physical-to-logical list ``[L][P]`` that vLLM's open
initial-expert-map proposal reads (``eplb_config.initial_expert_map_path``, not in any release):
PROVISIONAL, named so.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_placement.apps.advise.engines import architecture_of, can_dispatch
from moe_placement.apps.advise.options import engine_flag_value
from moe_placement.apps.advise.recommend import HF_IDS, STATIC_STEP_INTERVAL
from moe_placement.apps.deploy.options import DISAGGREGATED, REPLICAS
from moe_placement.apps.deploy.simulator import PHASE_BOTH
from placement.dispatch import SGLANG_LP, SGLANG_STATIC

__all__ = [
    "BOOTSTRAP_PORT",
    "TRANSFER_BACKEND",
    "launch_commands",
    "output_names",
    "placement_name",
    "sglang_location_name",
    "vllm_map_name",
    "plan_files",
    "write_plan",
]

TRANSFER_BACKEND = "mooncake"  # SGLang's default --disaggregation-transfer-backend
BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
_PORTS = {PHASE_BOTH: 30000, "prefill": 30000, "decode": 30001}
# DeepEP kernels per pool: (SGLang --deepep-mode, vLLM --all2all-backend)
_DEEPEP = {
    PHASE_BOTH: ("auto", "deepep_low_latency"),
    "prefill": ("normal", "deepep_high_throughput"),
    "decode": ("low_latency", "deepep_low_latency"),
}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


def placement_name(phase: str) -> str:
    """The native placement file of a pool in ``--output`` (``prefill_placement.json``, ...)."""
    return f"{phase}_placement.json"


def sglang_location_name(phase: str) -> str:
    return f"{phase}_sglang_expert_location.json"


def vllm_map_name(phase: str) -> str:
    return f"{phase}_vllm_expert_map.provisional.json"


def output_names() -> tuple[str, ...]:
    """Every file ``plan --output`` may write (checked against the inputs before anything runs)."""
    names = ["plan.json", "plan.html", "launch.sh"]
    for ph in (PHASE_BOTH, "prefill", "decode"):
        names += [
            placement_name(ph),
            sglang_location_name(ph),
            sglang_location_name(ph) + ".meta.json",
            vllm_map_name(ph),
        ]
    return tuple(names)


def _where(output: str | None, name: str) -> str:
    return str(Path(output) / name) if output else name


def _sglang_pool(pool, sim, model, output: str | None) -> str:
    c, ph = pool.result.candidate, pool.phase
    G, dp = c.ep_size, c.attn_dp
    words = ["python -m sglang.launch_server", f"--model-path {HF_IDS.get(model.name.lower(), 'MODEL_PATH')}"]
    if ph in _KV_ROLE:
        words += [f"--disaggregation-mode {ph}", f"--disaggregation-transfer-backend {TRANSFER_BACKEND}"]
        words += [f"--disaggregation-bootstrap-port {BOOTSTRAP_PORT}"] if ph == "prefill" else []
    words += [f"--tp-size {G}"] + ([f"--dp-size {dp}", "--enable-dp-attention"] if dp > 1 else [])
    if c.num_nodes > 1:
        words += [f"--nnodes {c.num_nodes}", "--node-rank 0", f"--dist-init-addr {ph.upper()}_HEAD_IP:5000"]
    if G > 1:
        fitted = "fitted" in pool.placed and can_dispatch("sglang", "lp", architecture_of(model.name))[0]
        algo = engine_flag_value(SGLANG_LP if fitted else SGLANG_STATIC)
        words += [f"--ep-size {G}", "--moe-a2a-backend deepep", f"--deepep-mode {_DEEPEP[ph][0]}"]
        words += [f"--ep-num-redundant-experts {c.num_redundant}", f"--ep-dispatch-algorithm {algo}"]
        words += [f"--init-expert-location {_where(output, sglang_location_name(ph))}"]
    if ph != "decode":
        words += [f"--chunked-prefill-size {sim.step_tokens * dp}"]
    if ph != "prefill":
        words += [f"--max-running-requests {sim.max_seqs * dp}"]
    words += ["--host 0.0.0.0", f"--port {_PORTS[ph]}"]
    return " ".join(words)


def _vllm_pool(pool, sim, model, output: str | None) -> str:
    c, ph = pool.result.candidate, pool.phase
    env = []
    words = [f"vllm serve {HF_IDS.get(model.name.lower(), 'MODEL_PATH')}"]
    words += [f"--tensor-parallel-size {c.attn_tp}", f"--data-parallel-size {c.attn_dp}"]
    if c.num_nodes > 1:
        per_node = max(1, c.attn_dp // c.num_nodes)
        words += [f"--data-parallel-size-local {per_node}", f"--data-parallel-address {ph.upper()}_HEAD_IP"]
    if c.ep_size > 1:
        env = ["VLLM_PLUGINS=moe_placement", f"MOE_PLACEMENT_EPLB=file:{_where(output, placement_name(ph))}"]
        cfg = {
            "num_redundant_experts": c.num_redundant,
            "step_interval": STATIC_STEP_INTERVAL,
            "use_async": True,
        }
        words += ["--enable-expert-parallel", f"--all2all-backend {_DEEPEP[ph][1]}", "--enable-eplb"]
        words += [f"--eplb-config '{json.dumps(cfg, separators=(',', ':'))}'"]
    if ph in _KV_ROLE:
        kv = {"kv_connector": "NixlConnector", "kv_role": _KV_ROLE[ph]}
        words += [f"--kv-transfer-config '{json.dumps(kv, separators=(',', ':'))}'"]
    if ph != "decode":
        words += [f"--max-num-batched-tokens {sim.step_tokens}"]
    if ph != "prefill":
        words += [f"--max-num-seqs {sim.max_seqs}"]
    words += [f"--port {_PORTS[ph]}"]
    return " ".join(env + words)


def _router(result) -> str:
    pools = result.candidate.pools
    if result.kind == DISAGGREGATED:
        pre = " ".join(
            f"--prefill http://PREFILL_{i}:{_PORTS['prefill']} {BOOTSTRAP_PORT}"
            for i in range(pools[0].result.candidate.instances)
        )
        dec = " ".join(
            f"--decode http://DECODE_{i}:{_PORTS['decode']}"
            for i in range(pools[1].result.candidate.instances)
        )
        return f"python -m sglang_router.launch_router --pd-disaggregation {pre} {dec} --host 0.0.0.0 --port 8000"
    n = pools[0].result.candidate.instances
    urls = " ".join(f"http://REPLICA_{i}:{_PORTS[PHASE_BOTH]}" for i in range(n))
    return f"python -m sglang_router.launch_router --worker-urls {urls} --host 0.0.0.0 --port 8000"


def launch_commands(result, model, cluster, output: str | None) -> dict:
    """``{"sglang": [...], "vllm": [...], "router": str | None, "notes": [...]}`` for the winner."""
    sg, vl, notes = [], [], []
    for pool, sim in zip(result.candidate.pools, result.sim.pools):
        sg.append(_sglang_pool(pool, sim, model, output))
        vl.append(_vllm_pool(pool, sim, model, output))
        c = pool.result.candidate
        if c.instances > 1:
            notes.append(
                f"{pool.phase} pool: run {c.instances} instances of {c.ep_size} GPU(s) each (its own head address and port)"
            )
    router = _router(result) if result.kind in (DISAGGREGATED, REPLICAS) else None
    notes += [
        "commands are for one instance; on several nodes run one per node with its --node-rank",
        "vLLM 0.33.0 loads no placement at start: the plugin's file: spec serves it from the first rearrangement "
        f"(after step_interval/4 steps; docs/serving.md); {vllm_map_name('<phase>')} holds the per-layer "
        "physical-to-logical lists [L][P] for vLLM's open initial-expert-map proposal (PROVISIONAL: no release reads it)",
    ]
    if result.kind == DISAGGREGATED:
        notes.append(
            "vLLM serves prefill/decode pairs behind a PD proxy of your own: vllm serve starts no router"
        )
    return {"sglang": sg, "vllm": vl, "router": router, "notes": notes}


def write_plan(plan, folder: str | Path, html: str | None = None) -> list[Path]:
    """Publish :func:`plan_files` into ``folder`` as one run's output folder
    (:func:`moe_placement.base.folders.publish_folder`: the old set or the new, never a mix; a folder
    holding files ``plan`` did not write is refused). Returns the paths written."""
    from moe_placement.base.folders import publish_folder

    return publish_folder(folder, plan_files(plan, folder, html), "plan")


def plan_files(plan, folder: str | Path, html: str | None = None) -> dict[str, bytes]:
    """``{name: bytes}`` of ``plan.json``, ``plan.html`` (``html``, else rendered), ``launch.sh`` and the
    winner's placement files (names among :func:`output_names`), built in memory for ``folder``."""
    from moe_placement.apps.deploy.report import render_html
    from moe_placement.base.fileio import json_bytes
    from placement.formats import placement_files

    out = Path(folder)
    files: list[tuple[Path, bytes]] = [(out / "plan.json", json_bytes(out / "plan.json", plan.to_dict()))]
    files.append((out / "plan.html", (html if html is not None else render_html(plan)).encode()))
    best, model = plan.best, plan.model
    if best is not None:
        for pool in best.candidate.pools:
            label = pool.layout(model.num_logical_experts)
            pl = pool.result.placement.with_provenance(
                layout=label, model=model.name, phase=pool.phase, deployment=best.label, placed=pool.placed
            )
            files += placement_files(pl, out / placement_name(pool.phase), "native")
            files += placement_files(
                pl, out / sglang_location_name(pool.phase), "sglang", num_hidden_layers=model.num_layers
            )
            p2l = [[int(x) for x in row] for row in pl.physical_to_logical_map]
            files.append((out / vllm_map_name(pool.phase), (json.dumps(p2l) + "\n").encode()))
        files.append((out / "launch.sh", _script(plan).encode()))
    return {Path(path).name: data for path, data in files}


def _script(plan) -> str:
    L = plan.launch
    lines = [
        f"# {plan.model.name} on {plan.nodes} x {plan.cluster.gpus_per_node} {plan.cluster.gpu.name}: {plan.best.label}",
        "# modelled choice (moe-placement plan), not measured; see plan.json / plan.html",
        "",
        "# SGLang",
        *L["sglang"],
    ]
    if L["router"]:
        lines += ["", "# router", L["router"]]
    lines += ["", "# vLLM", *L["vllm"], ""] + [f"# note: {n}" for n in L["notes"]]
    return "\n".join(lines) + "\n"
