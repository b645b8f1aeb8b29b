"""Wall time of one rebalance call: each engine's own default against our policies through the plugins.

Shape: DeepSeek-V3 (58 MoE layers x 256 experts, 8 expert groups) on 288 slots / 32 ranks / 4 nodes
and 320 slots / 64 ranks / 8 nodes. The load is a Zipf(1) permuted per layer; the map in service is
each policy's own map for another such load (the engine default's, or our greedy's: the engines'
maps may put two replicas of an expert on one GPU, which ``migration`` does not start from). vLLM
passes it as ``old_global_expert_indices``; for SGLang the benchmark stands in for the server's
global expert location. Every call goes through
the engine's own entry (``EPLB_POLICIES``-style class for vLLM, the AROUND hook for SGLang), so the
plugins' conversions and checks are timed too. Prints median milliseconds and the ratio to the
engine's default.

Run with the engines' side environment (it needs their code)::

    PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_policy_speed.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch

from runtime_hooks.engine_plugins import sglang_plugin, vllm_plugin
from runtime_hooks.engine_plugins.spec import parse_spec

L, E, GROUPS = 58, 256, 8
SHAPES = ((288, 32, 4), (320, 64, 8))  # (slots P, ranks G, nodes N)
SPECS = ("greedy", "migration", "migration:max_moves=64")


def zipf_load(seed: int) -> np.ndarray:
    """int64 ``[L, E]``: Zipf(1) expert loads, permuted per layer."""
    rng = np.random.default_rng(seed)
    base = 1e5 / np.arange(1, E + 1)
    return np.stack([rng.permutation(base) for _ in range(L)]).round().astype(np.int64)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: imports, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def vllm_calls(P: int, G: int, N: int, load, served) -> list[tuple[str, object]]:
    """(name, call) pairs for vLLM: its default policy, then ours as the plugin installs it."""
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    weight = torch.from_numpy(load.astype(np.int32))  # [L, E] int32 on CPU, as vLLM passes it
    served_w = torch.from_numpy(served.astype(np.int32))
    old = DefaultEplbPolicy.rebalance_experts(served_w, P, GROUPS, N, G)
    calls = [("engine default", lambda: DefaultEplbPolicy.rebalance_experts(weight, P, GROUPS, N, G, old))]
    old = vllm_plugin.policy_class(parse_spec("greedy"), DefaultEplbPolicy).rebalance_experts(
        served_w, P, GROUPS, N, G
    )
    for text in SPECS:
        ours = vllm_plugin.policy_class(parse_spec(text), DefaultEplbPolicy)
        calls.append((text, lambda ours=ours: ours.rebalance_experts(weight, P, GROUPS, N, G, old)))
    return calls


def sglang_calls(P: int, G: int, N: int, load, served) -> list[tuple[str, object]]:
    """(name, call) pairs for SGLang: ``eplb_algorithms.rebalance_experts``, then our AROUND hook."""
    from sglang.srt.eplb import eplb_algorithms as algos

    algorithm = algos.compute_algorithm("auto", GROUPS, N)
    kw = dict(
        num_physical_experts=P,
        num_local_physical_experts=P // G,
        num_groups=GROUPS,
        num_nodes=N,
        algorithm=algorithm,
    )
    original = algos.rebalance_experts
    greedy = sglang_plugin.make_hook(parse_spec("greedy"))
    in_service = greedy(original, tokens_per_expert=torch.from_numpy(served)[None], **kw)[0].numpy()
    sglang_plugin._map_in_service = lambda: in_service  # stands in for the server's global metadata
    tokens = torch.from_numpy(load)[None]  # [W=1, L, E]
    calls = [("engine default", lambda: original(tokens, **kw))]
    for text in SPECS:
        hook = sglang_plugin.make_hook(parse_spec(text))
        calls.append((text, lambda hook=hook: hook(original, tokens_per_expert=tokens, **kw)))
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    load, served = zipf_load(1), zipf_load(0)
    print(f"DeepSeek-V3 shape: {L} layers x {E} experts, {GROUPS} groups; median of {args.repeats} calls")
    print(f"{'engine':<8}{'slots/ranks/nodes':<19}{'policy':<24}{'ms':>9}{'x default':>11}")
    for P, G, N in SHAPES:
        for engine, make in (("vllm", vllm_calls), ("sglang", sglang_calls)):
            base = None
            for name, fn in make(P, G, N, load, served):
                ms = median_ms(fn, args.repeats if name != "migration" else max(3, args.repeats // 2))
                base = base or ms
                print(f"{engine:<8}{f'{P}/{G}/{N}':<19}{name:<24}{ms:>9.1f}{ms / base:>11.2f}")


if __name__ == "__main__":
    main()
