"""Fresh calls through the plugins against the engine's own default, per case (issue 36).

For every engine EPLB test case (vLLM 0.33's ``test_eplb_algo.py`` inputs, DeepSeek's README
example; ``tests/test_engine_eplb.py``), seeded random calls and DeepSeek-V2-Lite's real counts, the
``greedy`` policy is called through each plugin's own hook with the engine's own function as the
default, and the table prints: the engine's max/mean (mean over layers), greedy alone (our solve before
the guard), the plugin's answer, the worst layer's ratio plugin / engine, co-located layers in the
answer and the layers the guard served as the engine's (the fallback). vLLM is scored under its hash
(even split over replicas, per layer); SGLang under its static table (summed over layers, see
``runtime_hooks/engine_plugins/default_guard.py``).

    PYTHONPATH=. MOE_TRACES_DIR=../shared/traces /work/engines-venv/bin/python benchmarks/engine_default_guard.py
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class _Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _cases() -> dict:
    from engine_cases import CASES, random_cases

    cases = {k: v for k, v in CASES.items() if v[1] % v[4] == 0}
    cases.update(random_cases())
    path = Path(os.environ.get("MOE_TRACES_DIR", ROOT.parent / "shared" / "traces"))
    trace = path / "deepseek-v2-lite-chat-puffin" / "puffin_prompts_1-2000.npz"
    if trace.is_file():
        from profiling.readers import read_trace

        counts = read_trace(trace).counts().astype(int).tolist()
        cases["real_global"] = (counts, 96, 1, 4, 32)
        cases["real_hier"] = (counts, 80, 8, 2, 16)
    return cases


def _vllm(spec, w, P, groups, N, G):
    import torch
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from runtime_hooks.engine_plugins.vllm_plugin import policy_class

    weight = torch.tensor(w)
    ours = policy_class(spec, DefaultEplbPolicy).rebalance_experts(weight, P, groups, N, G).numpy()
    return ours, DefaultEplbPolicy.rebalance_experts(weight, P, groups, N, G).numpy()


def _sglang(spec, w, P, groups, N, G):
    import torch
    from sglang.srt.eplb import eplb_algorithms as algos

    from runtime_hooks.engine_plugins.sglang_plugin import make_hook

    kw = dict(
        tokens_per_expert=torch.tensor(w)[None],
        num_physical_experts=P,
        num_local_physical_experts=P // G,
        num_groups=groups,
        num_nodes=N,
        algorithm=algos.compute_algorithm("auto", groups, N),
    )
    ours = make_hook(spec)(algos.rebalance_experts, **kw)[0].numpy()
    return ours, algos.rebalance_experts(**kw)[0].numpy()


def _alone(engine: str, w, P, groups, N, G) -> np.ndarray:
    """Our greedy through the plugin's pipeline, without the guard (the groups as each plugin passes
    them: vLLM always, SGLang on its hierarchical algorithm)."""
    from runtime_hooks.engine_plugins import policy
    from runtime_hooks.engine_plugins.spec import parse_spec

    hier = engine == "vllm" or (groups and N > 1 and groups % N == 0)
    load = np.asarray(w, dtype=float)
    call = policy.EngineCall(
        engine, load, P, G, N, groups if hier else None, dispatch=policy.ENGINE_DISPATCH[engine]
    )
    topo = call.topology()
    return policy._solve(
        parse_spec("greedy"), call, topo, load, None, policy.call_groups(call, topo, load.shape[1])
    )


def _colocated(m: np.ndarray, G: int) -> int:
    per_gpu = np.sort(m.reshape(m.shape[0], G, -1), axis=2)
    return int((per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any(axis=(1, 2)).sum())


def main() -> None:
    from placement.topology import Topology
    from runtime_hooks.engine_plugins.default_guard import dispatch_peaks
    from runtime_hooks.engine_plugins.spec import parse_spec

    catch = _Catch()
    logging.getLogger("runtime_hooks.engine_plugins").addHandler(catch)
    logging.getLogger("runtime_hooks.engine_plugins").setLevel(logging.WARNING)
    spec = parse_spec("greedy")
    print(
        f"{'engine':7} {'case':26} {'engine':>7} {'alone':>7} {'plugin':>7} {'worst':>7} {'coloc':>5} fallback"
    )
    for name, (w, P, groups, N, G) in _cases().items():
        load = np.asarray(w, dtype=float)
        mean = load.sum(axis=1) / G
        for engine, call in (("vllm", _vllm), ("sglang", _sglang)):
            catch.lines.clear()
            ours, base = call(spec, w, P, groups, N, G)
            try:
                alone = _alone(engine, w, P, groups, N, G)
            except ValueError:  # a call our policy refuses (the engine answers it): no figure
                alone = None
            nodes = N if G % N == 0 else 1
            topo = Topology(G, P, nodes)
            disp = "vllm-hash" if engine == "vllm" else "sglang-static"
            maps = (("o", ours), ("b", base), ("a", base if alone is None else alone))
            pk = {k: dispatch_peaks(disp, load, m, topo) for k, m in maps}
            if alone is None:
                pk["a"] = np.full(len(load), np.nan)
            served = int(((ours == base).all(axis=1) & (_colocated(ours, G) > 0)).sum())
            fb = [line for line in catch.lines if "default map used" in line or " used" in line]
            print(
                f"{engine:7} {name:26} {np.mean(pk['b'] / mean):7.4f} {np.mean(pk['a'] / mean):7.4f} "
                f"{np.mean(pk['o'] / mean):7.4f} {np.max(pk['o'] / pk['b']):7.4f} {_colocated(ours, G):5d} "
                f"{'yes (' + str(served) + ' layers)' if fb else 'no'}"
            )


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    main()
