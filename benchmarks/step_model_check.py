"""Check the step-time model (placement/cost) against published measurements: modelled next to
published, and their ratio.

Run:
    PYTHONPATH=. python benchmarks/step_model_check.py [--json out.json] [--max-steps 40]

Rows (sources next to each figure below):

- ``deepep-ll``: DeepEP low-latency dispatch and combine, microseconds (H800 + CX7, 128 tokens per
  GPU, DeepSeek-V3 hidden 7168, top-8, FP8 dispatch, BF16 combine), uniform routing; ``deepep-ll-nvl``:
  the same kernels once intra-node traffic goes over NVLink (H20, EP16-EP64).
- ``deepep-normal``: DeepEP normal (node-deduplicated) kernels, logical GB/s (bytes a token would
  carry to every node it needs, including its own, over the kernel's time), uniform routing.
- ``deepgemm``: DeepGEMM grouped FP8 GEMMs on H800, microseconds.
- ``gain``: whole-step gains of load balancing, on the shared DeepSeek-V2-Lite chat trace (the only
  per-token DeepSeek routing here) priced with DeepSeek-V3's layer sizes (hidden 7168, expert 2048,
  FP8, MLA, 61 layers) and the trace's 64 experts, top-6, on H100 nodes (8 GPUs, CX7 RDMA):
  ``none`` is the one-expert-per-slot map with an even split, ``static`` the greedy map with 16
  redundant slots (1.25 slots per expert, as DeepSeek-V3's 320 on 256) and an even split, ``balanced``
  the same map with the per-step ``balanced`` split. Decode: continuous batching over the trace's
  prompts (``placement.steps``, context 2048 as SGLang's 2000-token-input runs); prefill: chunks of
  consecutive tokens. Published figures are ranges; the ratio is to the range's middle and ``within``
  says whether the modelled gain lies inside the range.
- ``overhead``: the per-step split's share of the decode step against SGLang's 1.0-1.6% for its LP.
- ``rebalance``: the weight copy of a whole rearrangement (``move_time``) against vLLM's 0.65-1.7 s
  and SGLang's ~1.8 s measured stalls.

- ``fit``: the all-to-all constant sets (``placement/cost/ranges.py``) re-derived from the DeepEP
  tables: every (latency, bandwidth) on a grid that reproduces every figure of each table within
  ``FIT_TOLERANCE``, and the low / central / high sets picked from it (:func:`derive_sets`), with each
  set's largest error per table. ``tests/test_ranges.py`` asserts the stored sets are these.

Output: one table (``--json``: the rows, the settings, the greedy baseline's figures and the fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.cost.hardware import GPUS, cluster_preset  # noqa: E402
from placement.cost.modelspec import load_model  # noqa: E402
from placement.cost.primitives import a2a_time, gemm_time  # noqa: E402
from placement.cost.traffic import payload_bytes, traffic_bytes  # noqa: E402

DSV3 = load_model("deepseek-v3")
DISPATCH_BYTES, COMBINE_BYTES = payload_bytes(DSV3.hidden_size)  # FP8 + scales, BF16 (7,392 and 14,336)

# deepseek-ai/DeepEP README.md (V1, now docs/legacy.md), "Low-latency kernels with pure RDMA":
# (EP, dispatch us, combine us).
DEEPEP_LOW_LATENCY = [
    (8, 77, 114),
    (16, 118, 195),
    (32, 155, 273),
    (64, 173, 314),
    (128, 192, 369),
    (256, 194, 360),
]
# deepseek-ai/DeepEP, the pull request that sends the low-latency kernels' intra-node traffic over
# NVLink (H20, CX7 400 Gb/s, 128 tokens per rank, hidden 7168, top-8): (EP, dispatch us, combine us).
DEEPEP_LOW_LATENCY_NVLINK = [(16, 119, 199), (32, 157, 280), (64, 176, 318)]
# deepseek-ai/DeepEP README.md: V1 internode EP32 58/57 GB/s, EP64 51/50 (4096 tokens); V2 SM90 CX7
# EP 8x4 61/61 GB/s (8192 tokens). (EP, tokens, dispatch GB/s, combine GB/s).
DEEPEP_NORMAL = [(32, 4096, 58, 57), (64, 4096, 51, 50), (32, 8192, 61, 61)]
# deepseek-ai/DeepGEMM README.md ("Performance", H800, NVCC 12.8), grouped contiguous FP8 GEMMs:
# (groups, M per group, N, K, TFLOPS).
DEEPGEMM_GROUPED = [
    (4, 8192, 4096, 7168, 1297),
    (4, 8192, 7168, 2048, 1099),
    (8, 4096, 4096, 7168, 1288),
    (8, 4096, 7168, 2048, 1093),
    (1, 1024, 4096, 7168, 1233),
    (1, 1024, 7168, 2048, 925),
    (2, 512, 4096, 7168, 1040),
    (2, 512, 7168, 2048, 916),
    (4, 256, 4096, 7168, 932),
    (4, 256, 7168, 2048, 815),
]
# Gains of load balancing, percent of whole-step throughput (costmodel.md, "What has been measured
# elsewhere"): name -> (phase, comparison, low, high, source).
PUBLISHED_GAINS = {
    "decode balanced over none": (
        "decode",
        ("none", "balanced"),
        2.6,
        7.0,
        "SGLang DeepEP waterfill +2.6-4.3%; vLLM-Ascend EPLB TPOT -7%",
    ),
    "decode static EPLB over none": (
        "decode",
        ("none", "static"),
        7.5,
        7.5,
        "vLLM-Ascend EPLB TPOT -7% (= +7.5% throughput)",
    ),
    "decode balanced over static": (
        "decode",
        ("static", "balanced"),
        2.6,
        4.3,
        "SGLang DeepEP waterfill +2.6-4.3%, if its baseline is the static dispatch (not stated)",
    ),
    "prefill balanced over none": (
        "prefill",
        ("none", "balanced"),
        5.0,
        18.0,
        "SGLang EPLB +4.9-13.5%, large-scale EP prefill +18%",
    ),
    "prefill static EPLB over none": (
        "prefill",
        ("none", "static"),
        4.9,
        13.5,
        "SGLang static EPLB +4.9-13.5% over none",
    ),
    "prefill balanced over static": (
        "prefill",
        ("static", "balanced"),
        0.8,
        7.3,
        "SGLang LP dispatch +0.8-7.3% over static",
    ),
}
SGLANG_LP_OVERHEAD = (1.0, 1.6)  # percent of the step, SGLang's reported cost of its LP dispatch


def _row(check: str, config: str, modelled: float, published: float, unit: str, source: str, **extra) -> dict:
    return {
        "check": check,
        "config": config,
        "modelled": float(modelled),
        "published": float(published),
        "ratio": float(modelled / published) if published else float("nan"),
        "unit": unit,
        "source": source,
        **extra,
    }


def _uniform_bytes(ep: int, tokens: int, kernel: str, payload: float, k: int = 8):
    """The busiest GPU's ``(NVLink, RDMA)`` bytes of one all-to-all with uniform routing."""
    pair = np.full((1, ep, ep), tokens * k / ep)
    send, recv = traffic_bytes(pair, np.full((1, ep), float(tokens)), 8, k, kernel, payload)
    busiest = np.maximum(send, recv)[0]  # [G, 2]
    return busiest[:, 0], busiest[:, 1]


def _ll_cluster(table) -> object:
    """The cluster a low-latency table was measured on: H800 nodes (legacy), Hopper NVLink 4 (H20)."""
    return cluster_preset("h800" if table is DEEPEP_LOW_LATENCY else "h100")


def deepep_low_latency_rows() -> list[dict]:
    """Dispatch and combine microseconds of DeepEP's low-latency kernels, both published tables."""
    rows = []
    for check, table, src in (
        ("deepep-ll", DEEPEP_LOW_LATENCY, "DeepEP README, low-latency table (H800)"),
        ("deepep-ll-nvl", DEEPEP_LOW_LATENCY_NVLINK, "DeepEP NVLink low-latency PR (H20)"),
    ):
        cl = _ll_cluster(table)
        for ep, disp_us, comb_us in table:
            nodes = max(ep // 8, 1)
            for what, payload, pub in (
                ("dispatch", DISPATCH_BYTES, disp_us),
                ("combine", COMBINE_BYTES, comb_us),
            ):
                nvl, rdma = _uniform_bytes(ep, 128, "low_latency", payload)
                t = float(a2a_time(cl, nvl, rdma, nodes, ep, "low_latency").max()) * 1e6
                rows.append(_row(check, f"EP{ep} {what}, 128 tokens/GPU", t, pub, "us", src))
    return rows


def deepep_normal_rows() -> list[dict]:
    """Logical GB/s of DeepEP's normal kernels (bytes to every node a token needs, incl. its own)."""
    cl = cluster_preset("h800")
    rows = []
    for ep, tokens, disp, comb in DEEPEP_NORMAL:
        nodes = ep // 8
        nodes_hit = nodes * (1 - (1 - 1 / nodes) ** 8)  # distinct nodes per token, incl. its own
        for what, payload, pub in (
            ("dispatch", DISPATCH_BYTES, disp),
            ("combine", COMBINE_BYTES, comb),
        ):
            nvl, rdma = _uniform_bytes(ep, tokens, "normal", payload)
            t = float(a2a_time(cl, nvl, rdma, nodes, ep, "normal").max())
            gbs = tokens * nodes_hit * payload / t / 1e9
            rows.append(
                _row(
                    "deepep-normal",
                    f"EP{ep} {what}, {tokens} tokens/GPU",
                    gbs,
                    pub,
                    "GB/s",
                    "DeepEP README, normal kernels",
                )
            )
    return rows


def deepgemm_rows() -> list[dict]:
    """Grouped FP8 GEMM microseconds on H800."""
    rows = []
    for groups, m, n, k, tflops in DEEPGEMM_GROUPED:
        flops = 2.0 * groups * m * n * k
        moved = groups * (n * k + m * k + 2 * m * n)  # FP8 weights and inputs, BF16 output
        model = float(gemm_time(GPUS["h800"], flops, moved, 1.0)) * 1e6
        rows.append(
            _row(
                "deepgemm",
                f"{groups}x M={m} N={n} K={k}",
                model,
                flops / (tflops * 1e12) * 1e6,
                "us",
                "DeepGEMM README (H800)",
            )
        )
    return rows


def rebalance_rows() -> list[dict]:
    """A whole rearrangement's weight copy (``move_time``) against the engines' measured stalls: DeepSeek-V3
    on 32 H200 (4 nodes), 288 slots, every slot of every GPU replaced (the most a rearrangement moves),
    all copies over RDMA (the busiest GPU receives 9 slots x 58 layers)."""
    from placement.cost.hardware import REBALANCE_STALL_S
    from placement.cost.migration import move_time

    cl = cluster_preset("h200")
    arrived = np.full(32, 9 * DSV3.num_moe_layers)
    t = move_time(arrived, DSV3.expert_bytes, cl.inter)
    rows = []
    for engine, (lo, hi) in REBALANCE_STALL_S.items():
        rows.append(
            _row(
                "rebalance",
                f"DeepSeek-V3 EP32 full rearrangement vs {engine}",
                t,
                (lo + hi) / 2,
                "s",
                f"{engine} rearrangement stall {lo:g}-{hi:g} s (costmodel.md)",
                low=lo,
                high=hi,
                within=bool(lo <= t <= hi),
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------
# The all-to-all constant sets (placement/cost/ranges.py), re-derived from the tables above
# ---------------------------------------------------------------------------------------------
def fit_rows() -> dict[str, list[tuple]]:
    """Per table, ``(label, nvl bytes, rdma bytes, nodes, EP, measured seconds, cluster)`` of each
    published figure, the busiest GPU's bytes by the model's own accounting (uniform routing).

    ``ll-legacy``: the legacy table's multi-node rows; ``ll-nvlink``: the NVLink-era figures;
    ``ll-ep8``: the legacy single-node row (NVLink only); ``normal``: the normal kernels' times
    (logical bytes over the published logical GB/s)."""
    out: dict[str, list[tuple]] = {"ll-legacy": [], "ll-nvlink": [], "ll-ep8": [], "normal": []}
    for key, table in (("ll-legacy", DEEPEP_LOW_LATENCY), ("ll-nvlink", DEEPEP_LOW_LATENCY_NVLINK)):
        cl = _ll_cluster(table)
        for ep, disp_us, comb_us in table:
            for what, payload, us in (
                ("dispatch", DISPATCH_BYTES, disp_us),
                ("combine", COMBINE_BYTES, comb_us),
            ):
                nvl, rdma = _uniform_bytes(ep, 128, "low_latency", payload)
                row = (f"EP{ep} {what}", nvl.max(), rdma.max(), max(ep // 8, 1), ep, us * 1e-6, cl)
                out["ll-ep8" if ep == 8 else key].append(row)
    cl = cluster_preset("h800")
    for ep, tokens, disp, comb in DEEPEP_NORMAL:
        nodes = ep // 8
        nodes_hit = nodes * (1 - (1 - 1 / nodes) ** 8)  # distinct nodes per token, incl. its own
        for what, payload, gbs in (("dispatch", DISPATCH_BYTES, disp), ("combine", COMBINE_BYTES, comb)):
            nvl, rdma = _uniform_bytes(ep, tokens, "normal", payload)
            secs = tokens * nodes_hit * payload / (gbs * 1e9)
            out["normal"].append((f"EP{ep} {what} {tokens} tok", nvl.max(), rdma.max(), nodes, ep, secs, cl))
    return out


def _transfer(rows, kernel: str, side: str, bandwidths: np.ndarray) -> np.ndarray:
    """``[B, R]`` seconds of each row without the latency, the ``side`` link at each bandwidth: the
    model's ``a2a_time`` at latency 0 (its time is the latency plus this transfer)."""
    fields = ("latency", "bandwidth") if kernel == "low_latency" else ("normal_latency", "normal_bandwidth")
    out = np.zeros((len(bandwidths), len(rows)))
    for j, bw in enumerate(bandwidths):
        for r, (_, nvl, rdma, nodes, ep, _, cl) in enumerate(rows):
            link = dataclasses.replace(getattr(cl, side), **{fields[0]: 0.0, fields[1]: float(bw)})
            out[j, r] = float(a2a_time(dataclasses.replace(cl, **{side: link}), nvl, rdma, nodes, ep, kernel))
    return out


def fit_errors(rows, kernel: str, side: str, latencies: np.ndarray, bandwidths: np.ndarray) -> np.ndarray:
    """``[A, B]`` largest relative error over ``rows`` of the model at each (latency, bandwidth)."""
    t0 = _transfer(rows, kernel, side, bandwidths)  # [B, R]
    meas = np.array([r[5] for r in rows])
    return np.abs((latencies[:, None, None] + t0[None]) / meas - 1.0).max(axis=2)


def _grid(nominal: float) -> tuple[np.ndarray, np.ndarray]:
    from placement.cost.ranges import BANDWIDTH_FLOOR, GRID_STEPS, LATENCY_PRIOR

    da, db = GRID_STEPS
    lat = np.round(np.arange(LATENCY_PRIOR[0], LATENCY_PRIOR[1] + da / 2, da) / da) * da
    bw = np.arange(BANDWIDTH_FLOOR, nominal + db / 2, db)
    return lat, bw


def _set(errs: dict, lat, bw, i: int, j: int) -> dict:
    return {
        "latency": float(lat[i]),
        "bandwidth": float(bw[j]),
        "errors": {k: float(e[i, j]) for k, e in errs.items()},
    }


def _ends(errs: dict, ok: np.ndarray, lat, bw, central: tuple[int, int]) -> dict:
    """The two ends of the kept region along the latency-bandwidth trade-off the tables leave open:
    ``low`` = the least kept latency with the least bandwidth kept there, ``high`` = the largest kept
    latency with the largest bandwidth kept there; ``central`` as given."""
    rows = np.nonzero(ok.any(axis=1))[0]
    if rows.size == 0:
        raise ValueError("no constant set reproduces the tables within the tolerance")
    lo, hi = int(rows[0]), int(rows[-1])
    return {
        "low": _set(errs, lat, bw, lo, int(np.nonzero(ok[lo])[0][0])),
        "central": _set(errs, lat, bw, *central),
        "high": _set(errs, lat, bw, hi, int(np.nonzero(ok[hi])[0][-1])),
        "kept": int(ok.sum()),
    }


def derive_sets(tolerance: float | None = None) -> dict:
    """The kept constant sets per link and kernel (placement/cost/ranges.py's module docstring).

    Returns ``{"rdma-low-latency", "rdma-normal", "nvlink-low-latency": {low, central, high: {latency,
    bandwidth, errors: {table: largest relative error}}, kept}}``."""
    from placement.cost.hardware import LINKS
    from placement.cost.ranges import FIT_TOLERANCE

    tol = FIT_TOLERANCE if tolerance is None else tolerance
    rows = fit_rows()
    lat, bw = _grid(LINKS["rdma"].nominal_bandwidth)
    ll = {k: fit_errors(rows[k], "low_latency", "inter", lat, bw) for k in ("ll-legacy", "ll-nvlink")}
    ok = (ll["ll-legacy"] <= tol) & (ll["ll-nvlink"] <= tol)
    nvl_best = np.where(ok, ll["ll-nvlink"], np.inf)
    c_ll = np.unravel_index(int(np.argmin(nvl_best)), nvl_best.shape)
    out = {"rdma-low-latency": _ends(ll, ok, lat, bw, c_ll)}
    nm = {"normal": fit_errors(rows["normal"], "normal", "inter", lat, bw)}
    ok_n = nm["normal"] <= tol
    c_n = (c_ll[0], int(np.argmin(np.where(ok_n[c_ll[0]], nm["normal"][c_ll[0]], np.inf))))
    out["rdma-normal"] = _ends(nm, ok_n, lat, bw, c_n)
    own = np.array([LINKS["nvlink-h800"].bandwidth])  # the EP8 row's link, at its own bandwidth
    e8 = {"ll-ep8": fit_errors(rows["ll-ep8"], "low_latency", "intra", lat, own)}
    ok8 = e8["ll-ep8"] <= tol
    out["nvlink-low-latency"] = _ends(e8, ok8, lat, own, (int(np.argmin(e8["ll-ep8"][:, 0])), 0))
    return out


def _print_fit(fit: dict) -> None:
    from placement.cost.ranges import FIT_TOLERANCE

    print(f"\nall-to-all constant sets kept within {FIT_TOLERANCE:.0%} of every published figure:")
    for name, sets in fit.items():
        for end in ("low", "central", "high"):
            s = sets[end]
            errs = ", ".join(f"{k} {v:.1%}" for k, v in s["errors"].items())
            print(
                f"  {name:<20} {end:<8} latency {s['latency'] * 1e6:6.1f} us  bandwidth "
                f"{s['bandwidth'] / 1e9:7.2f} GB/s  largest error: {errs}"
            )
        print(f"  {name:<20} ({sets['kept']} grid points kept)")


def dsv3_sized(trace) -> object:
    """DeepSeek-V3's layer sizes with the trace's experts and top-k (the trace's routing, V3's weights)."""
    return dataclasses.replace(
        DSV3,
        name="deepseek-v3-sized",
        num_logical_experts=trace.num_logical_experts,
        top_k=int(trace.top_k),
        num_groups=None,
        topk_group=None,
    )


def gain_settings(args) -> dict:
    """The published setting the gain rows transplant onto the shared trace."""
    return {
        "hardware": "h100",
        "ep_size": args.ep_size,
        "num_nodes": args.ep_size // 8,
        "slots": int(args.ep_size * args.slots_per_gpu),
        "decode_step_tokens": args.decode_tokens,
        "prefill_step_tokens": args.prefill_tokens,
        "context_len": args.context_len,
        "max_steps": args.max_steps,
    }


def _priced(trace, settings: dict) -> dict:
    """Whole-step StepTime dicts per phase and setting (none / static / balanced), each with
    ``whole_ms_sets``: the whole step on every all-to-all constant set (the same counted loads)."""
    from placement.cost.ranges import cluster_sets
    from placement.cost.step_time import price_loads, step_loads
    from placement.dispatch import BALANCED, EVEN
    from placement.model import Placement
    from placement.steps import make_steps
    from placement.topology import Topology
    from solver.greedy import greedy_placement

    G, N = settings["ep_size"], settings["num_nodes"]
    E = trace.num_logical_experts
    none = Placement.trivial(trace.num_layers, E, Topology(G, E, N))
    static = greedy_placement(trace.counts(), Topology(G, settings["slots"], N))[0]
    model, cl = dsv3_sized(trace), cluster_preset(settings["hardware"])
    out = {}
    for phase in ("decode", "prefill"):
        steps = make_steps(trace, G, phase, settings[f"{phase}_step_tokens"], max_steps=settings["max_steps"])
        runs = {"none": (none, EVEN), "static": (static, EVEN), "balanced": (static, BALANCED)}
        out[phase] = {}
        for k, (pl, d) in runs.items():
            loads = step_loads(pl, trace, steps, d, model, cl)
            kw = {
                "phase": phase,
                "dispatch": d,
                "context_len": settings["context_len"],
                "step_tokens": steps.step_tokens,
            }
            sets = {name: price_loads(loads, model, c, **kw) for name, c in cluster_sets(cl).items()}
            out[phase][k] = {
                **sets["central"].to_dict(),
                "whole_ms_sets": {n: st.whole_ms for n, st in sets.items()},
            }
    return out


def gain_rows(priced: dict) -> list[dict]:
    """Modelled whole-step gains (percent) next to the published ranges, and the split's overhead."""
    rows = []
    from placement.cost.ranges import gain_range

    for name, (phase, (base, new), lo, hi, source) in PUBLISHED_GAINS.items():
        t = priced[phase]
        gain = (t[base]["whole_ms"] / t[new]["whole_ms"] - 1.0) * 100.0
        g = gain_range(t[base]["whole_ms_sets"], t[new]["whole_ms_sets"])
        mid = (lo + hi) / 2
        rows.append(
            _row(
                "gain",
                name,
                gain,
                mid,
                "%",
                source,
                low=lo,
                high=hi,
                within=bool(lo <= gain <= hi),
                modelled_range=[g.low * 100.0, g.high * 100.0],
            )
        )
    bal = priced["decode"]["balanced"]
    share = bal["dispatch_overhead_ms"] / bal["whole_ms"] * 100.0
    lo, hi = SGLANG_LP_OVERHEAD
    rows.append(
        _row(
            "overhead",
            "decode per-step split, share of the step",
            share,
            (lo + hi) / 2,
            "%",
            "SGLang LP dispatch 1.0-1.6% of the step",
            low=lo,
            high=hi,
            within=bool(lo <= share <= hi),
        )
    )
    return rows


def _print_table(rows: list[dict], priced: dict | None, settings: dict | None) -> None:
    print(
        f"{'check':<14} {'configuration':<42} {'modelled':>10} {'published':>10} {'ratio':>7}  unit  source"
    )
    for r in rows:
        rng = f" [{r['low']:g}, {r['high']:g}]{' ok' if r['within'] else ' OUT'}" if "within" in r else ""
        if "modelled_range" in r:
            rng += f"; modelled range {r['modelled_range'][0]:+.2f}..{r['modelled_range'][1]:+.2f}"
        print(
            f"{r['check']:<14} {r['config']:<42} {r['modelled']:>10.2f} {r['published']:>10.2f} "
            f"{r['ratio']:>7.3f}  {r['unit']:<4}  {r['source']}{rng}"
        )
    if priced:
        print(f"\nwhole step, ms ({settings}):")
        for phase, runs in priced.items():
            base = runs["static"]["whole_ms"]
            for k, d in runs.items():
                print(
                    f"  {phase:<8} {k:<9} whole {d['whole_ms']:8.3f} (x{d['whole_ms'] / base:.3f} greedy static) "
                    f"moe {d['moe_ms']:7.3f} gemm {d['gemm_ms']:7.3f} a2a {d['a2a_ms']:7.3f} "
                    f"overhead {d['dispatch_overhead_ms']:6.3f} rest {d['rest_ms']:7.3f}"
                )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows, settings and step times here")
    ap.add_argument("--ep-size", type=int, default=16, help="EP ranks of the gain rows (8 per node)")
    ap.add_argument("--slots-per-gpu", type=float, default=5.0, help="slots per GPU of the static map")
    ap.add_argument("--decode-tokens", type=int, default=128, help="sequences per rank in decode")
    ap.add_argument("--prefill-tokens", type=int, default=512, help="tokens per rank per prefill chunk")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--max-steps", type=int, default=40, help="steps priced per phase (the first)")
    ap.add_argument("--no-trace", action="store_true", help="only the kernel rows (no trace needed)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = deepep_low_latency_rows() + deepep_normal_rows() + deepgemm_rows() + rebalance_rows()
    priced = settings = None
    if not args.no_trace:
        from profiling.readers import default_traces_dir, read_trace

        path = default_traces_dir() / "deepseek-v2-lite-chat-puffin" / "puffin_prompts_1-2000.npz"
        if not path.is_file():
            print(f"step_model_check: {path} not found (set MOE_TRACES_DIR); use --no-trace", file=sys.stderr)
            return 2
        settings = gain_settings(args)
        priced = _priced(read_trace(path), settings)
        rows += gain_rows(priced)
    _print_table(rows, priced, settings)
    fit = derive_sets()
    _print_fit(fit)
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        from moe_placement.base.fileio import atomic_write_json

        atomic_write_json(args.json, {"rows": rows, "settings": settings, "step_time": priced, "fit": fit})
    return 0


if __name__ == "__main__":
    sys.exit(main())
