"""The recommendation: which option the engine can run, which pays beyond its band per GB spent, and
the launch command that starts it.

Flag names as the engines' parsers spell them (SGLang 0.5.23 ``ServerArgs.add_cli_args``, vLLM 0.33
``engine/arg_utils.py``; ``tests/test_advise_engines.py`` checks every flag printed here against them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from moe_placement.apps.advise.balance import ENGINE, NO_EPLB, RUNTIME
from moe_placement.apps.advise.engines import ENGINES, architecture_of, can_balance, can_dispatch
from moe_placement.apps.advise.options import engine_flag_value
from moe_placement.apps.advise.phases import gain
from placement.dispatch import get_dispatch

__all__ = ["GB_FLOOR", "HF_IDS", "Choice", "Launch", "availability", "choose", "launch", "net_gain"]

GB_FLOOR = 0.25  # GB per GPU: an option that spends less counts as spending this (gain per GB stays finite)
HF_IDS = {
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0924",
    "qwen1.5-moe-a2.7b": "Qwen/Qwen1.5-MoE-A2.7B-Chat",
}
SGLANG_FILE = "expert_location.json"
VLLM_FILE = "placement.json"
STATIC_STEP_INTERVAL = 100  # vLLM: the first rearrangement loads the file's map; later ones keep it


def dispatch_algorithm(engine: str, dispatch: str) -> str:
    """The engine's own name of a dispatch model (SGLang ``--ep-dispatch-algorithm``; vLLM ``hash``)."""
    if engine == "vllm":
        return "hash"
    return engine_flag_value(get_dispatch(dispatch)) or "static"


def availability(engine: str, model_name: str, row, platform: str = "cuda") -> tuple[bool, str]:
    """Whether ``engine`` can run ``row`` for the model (reason when not): the engines' table, plus lp
    only with its per-step overhead priced."""
    if row.kind == NO_EPLB:
        return True, ""
    if row.kind == RUNTIME:
        return False, f"{row.dispatch} dispatch runs in our runtime_hooks EP layer, not in {engine}"
    arch = architecture_of(model_name)
    ok, why = can_dispatch(engine, dispatch_algorithm(engine, row.dispatch), arch, platform)
    if not ok:
        return ok, why
    priced = [row.phase(ph) for ph in row.priced]
    if get_dispatch(row.dispatch).needs_step_counts and not all(p.dispatch_overhead_ms > 0 for p in priced):
        return False, f"{row.dispatch}: its per-step overhead (count all-reduce, LP per layer) is not priced"
    return True, ""


def net_gain(row, base) -> dict:
    """Per-phase whole-step gains of ``row`` over ``base`` with bands, and the net (the priced phases
    weighted alike): ``{decode: (g, band), prefill: (g, band), net, band}`` (a phase not priced: absent)."""
    g = {ph: gain(row.phase(ph), base.phase(ph)) for ph in row.priced}
    n = max(len(g), 1)
    return {
        **g,
        "net": sum(v[0] for v in g.values()) / n,
        "band": math.hypot(*(v[1] for v in g.values())) / n,
    }


@dataclass(frozen=True)
class Choice:
    row: object
    reason: str


def _pays(g: dict) -> bool:
    worse = any(g[ph][0] + g[ph][1] < 0 for ph in ("decode", "prefill") if ph in g)
    return g["net"] - g["band"] > 0 and not worse


def choose(rows, base, available: dict) -> Choice:
    """The runnable row that fits in memory and pays beyond its band with the most net gain per GB spent
    (extra replica GB per GPU over the baseline, at least ``GB_FLOOR``); else no balancing."""
    scored = []
    for r in rows:
        if r is base or not available[r.key][0] or not r.memory.fits:
            continue
        g = net_gain(r, base)
        if _pays(g):
            extra = max((r.memory.redundant_bytes - base.memory.redundant_bytes) / 1e9, GB_FLOOR)
            scored.append((g["net"] / extra, -r.redundant_per_gpu, r))
    if not scored:
        return Choice(base, "no balancing: no runnable option that fits in memory gains beyond its band")
    per_gb, _, best = max(scored, key=lambda s: (s[0], s[1]))
    return Choice(best, f"largest net whole-step gain per GB spent ({per_gb * 100:.2f}% per GB per GPU)")


@dataclass(frozen=True)
class Launch:
    """What to run: environment, the command, its flags (the EPLB part) and the files it names."""

    env: tuple[str, ...]
    command: str
    flags: tuple[str, ...]
    files: tuple[str, ...]


def _parallel(engine: str, G: int, nodes: int, per_node: int) -> list[str]:
    if engine == "sglang":
        out = [
            f"--tp-size {G}",
            f"--dp-size {G}",
            "--enable-dp-attention",
            f"--ep-size {G}",
            f"--nnodes {nodes}",
        ]
        out += ["--node-rank 0"] + (["--dist-init-addr HEAD_IP:5000"] if nodes > 1 else [])
        return out + ["--moe-a2a-backend deepep", "--deepep-mode auto"]
    out = ["--tensor-parallel-size 1", f"--data-parallel-size {G}", f"--data-parallel-size-local {per_node}"]
    out += ["--data-parallel-address HEAD_IP"] if nodes > 1 else []
    return out + ["--enable-expert-parallel", f"--all2all-backend {ENGINES['vllm'].deepep_modes['decode']}"]


def _eplb_flags(
    engine: str, row, redundant: int, interval: int | None, output: str
) -> tuple[list, list, list]:
    """``(env, flags, files)`` of the balancing part."""
    if engine == "sglang":
        flags = [f"--ep-num-redundant-experts {redundant}"] if redundant else []
        if row.kind == NO_EPLB:
            return [], flags, []
        path = f"{output}/{SGLANG_FILE}"
        flags += [f"--ep-dispatch-algorithm {dispatch_algorithm(engine, row.dispatch)}"]
        flags += [f"--init-expert-location {path}"]
        if interval is not None:
            flags += ["--enable-eplb", f"--eplb-rebalance-num-iterations {interval}"]
        return [], flags, [path]
    if row.kind == NO_EPLB and not redundant:
        return [], [], []
    if interval is not None and row.kind == ENGINE:
        cfg = {
            "num_redundant_experts": redundant,
            "window_size": interval,
            "step_interval": interval,
            "use_async": True,
        }
        return [], ["--enable-eplb", f"--eplb-config '{json.dumps(cfg)}'"], []
    path = f"{output}/{VLLM_FILE}"
    cfg = {
        "num_redundant_experts": redundant,
        "step_interval": interval or STATIC_STEP_INTERVAL,
        "use_async": True,
    }
    env = ["VLLM_PLUGINS=moe_placement", f"MOE_PLACEMENT_EPLB=file:{path}"]
    return env, ["--enable-eplb", f"--eplb-config '{json.dumps(cfg)}'"], [path]


def launch(
    engine: str, row, model_name: str, options, redundant: int, interval: int | None, output: str
) -> Launch:
    """The command that starts ``row`` on ``engine`` (run once per node: ``--node-rank`` / DP ranks vary)."""
    G, N = options.ep_size, options.nodes
    model = HF_IDS.get(model_name.lower(), "MODEL_PATH")
    env, flags, files = _eplb_flags(engine, row, redundant, interval, output)
    if engine == "sglang":
        head = f"python -m sglang.launch_server --model-path {model}"
    else:
        head = f"vllm serve {model}"
    parts = [*env, head, *_parallel(engine, G, N, options.gpus_per_node), *flags]
    return Launch(tuple(env), " ".join(parts), tuple(flags), tuple(files))


def greyed_reason(engine: str, model_name: str) -> str | None:
    """Why no EPLB option at all can run (the architecture), or None."""
    ok, why = can_balance(engine, architecture_of(model_name))
    return None if ok else why
