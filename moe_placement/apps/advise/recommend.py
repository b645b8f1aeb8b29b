"""The recommendation's engine side: which option the engine can run, and the launch commands that start
it (the choice itself: :mod:`moe_placement.apps.advise.choice`).

Flag names as the engines' parsers spell them (SGLang 0.5.23 ``ServerArgs.add_cli_args``, vLLM 0.33
``engine/arg_utils.py``; ``tests/test_advise_engines.py`` checks every flag printed here against them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moe_placement.apps.advise.balance import ENGINE, NO_EPLB, RUNTIME
from moe_placement.apps.advise.engines import ENGINES, architecture_of, can_balance, can_dispatch
from moe_placement.apps.advise.options import engine_flag_value
from placement.dispatch import get_dispatch

__all__ = ["HF_IDS", "Launch", "availability", "launch"]

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


@dataclass(frozen=True)
class Launch:
    """What to run: environment, the head node's command, its flags (the EPLB part), the files it names,
    and the command of every node (``per_node[i]`` on node ``i``; ``per_node[0] == command``)."""

    env: tuple[str, ...]
    command: str
    flags: tuple[str, ...]
    files: tuple[str, ...]
    per_node: tuple[str, ...] = ()


HEAD_ADDRESS = "HEAD_IP"  # placeholder: the head node's address, the same in every node's command
SGLANG_INIT_PORT = 5000
VLLM_RPC_PORT = 13345


def _parallel(engine: str, G: int, nodes: int, per_node: int, node: int) -> list[str]:
    """The parallel layout on node ``node``: attention DP x EP over every GPU (SGLang ``--attn-dp-size``,
    the current spelling of ``--dp-size --enable-dp-attention``; vLLM data parallel with EP)."""
    if engine == "sglang":
        out = [f"--tp-size {G}", f"--attn-dp-size {G}", f"--ep-size {G}", f"--nnodes {nodes}"]
        out += [f"--node-rank {node}"]
        out += [f"--dist-init-addr {HEAD_ADDRESS}:{SGLANG_INIT_PORT}"] if nodes > 1 else []
        return out + ["--moe-a2a-backend deepep", "--deepep-mode auto"]
    out = ["--headless"] if node > 0 else []
    out += ["--tensor-parallel-size 1", f"--data-parallel-size {G}", f"--data-parallel-size-local {per_node}"]
    out += [f"--data-parallel-start-rank {node * per_node}"] if node > 0 else []
    if nodes > 1:
        out += [f"--data-parallel-address {HEAD_ADDRESS}", f"--data-parallel-rpc-port {VLLM_RPC_PORT}"]
    return out + ["--enable-expert-parallel", f"--all2all-backend {ENGINES['vllm'].deepep_modes['decode']}"]


def _tuning(engine: str, options) -> list[str]:
    """The flags that make the engine run the steps advise priced: two-batch overlap when on, and the
    prefill chunk when the user set one (the engine's own default otherwise)."""
    caps = ENGINES[engine]
    out = [caps.overlap_flag] if options.overlap == "on" else []
    if "prefill_step_tokens" in (options.pinned or ()):
        per = options.prefill_step_tokens
        out.append(f"{caps.prefill_flag} {per if caps.prefill_flag_per_rank else per * options.ep_size}")
    return out


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
    if row.kind == NO_EPLB:  # vLLM's EP without EPLB takes no redundant expert (E // G or one more per GPU)
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
    """The commands that start ``row`` on ``engine``, one per node (only ``--node-rank`` or the DP start
    rank differs; the head node's address is the placeholder :data:`HEAD_ADDRESS`)."""
    G, N = options.ep_size, options.nodes
    model = HF_IDS.get(model_name.lower(), "MODEL_PATH")
    env, flags, files = _eplb_flags(engine, row, redundant, interval, output)
    if engine == "sglang":
        head = f"python -m sglang.launch_server --model-path {model}"
    else:
        head = f"vllm serve {model}"
    tuning = _tuning(engine, options)
    nodes = tuple(
        " ".join([*env, head, *_parallel(engine, G, N, options.gpus_per_node, i), *flags, *tuning])
        for i in range(N)
    )
    return Launch(tuple(env), nodes[0], tuple(flags), tuple(files), nodes)


def greyed_reason(engine: str, model_name: str) -> str | None:
    """Why no EPLB option at all can run (the architecture), or None."""
    ok, why = can_balance(engine, architecture_of(model_name))
    return None if ok else why
