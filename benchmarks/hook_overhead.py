"""Routing-hook overhead on a small real MoE model (CPU), and trace-statistics throughput.

Part 1 builds a random-weight Qwen3-MoE (transformers) model and times its forward pass without a
recorder, with a counts-mode recorder and with a tokens-mode recorder. The three variants are run
interleaved (off, counts, tokens, off, ...) so machine noise hits all of them alike; the table gives
medians and the ratio to the unhooked forward. It also times ``RoutingRecorder.record`` alone, which
gives the overhead the hooks add per forward independently of forward-time noise.

Part 2 times the statistics of :mod:`profiling.stats` on the 192k-token DeepSeek-V2-Lite trace
(skipped when the shared traces are absent).

    PYTHONPATH=. .venv/bin/python benchmarks/hook_overhead.py [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def _table(rows, cols):
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in cols]
    line = "  ".join(h.ljust(w) for (_, h), w in zip(cols, widths))
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(r[k].ljust(w) for (k, _), w in zip(cols, widths)))
    return "\n".join(out)


def bench_hooks(args) -> None:
    import torch
    import transformers

    from profiling.hooks import RecordOptions, RoutingRecorder, attach

    torch.set_num_threads(args.threads)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    x = torch.randint(0, 1024, (args.batch, args.seq_len))
    tokens = args.batch * args.seq_len

    def fwd():
        with torch.inference_mode():
            model(input_ids=x, use_cache=False)

    for _ in range(3):
        fwd()  # warm-up
    times: dict[str, list[float]] = {"off": [], "counts": [], "tokens": []}
    for _ in range(args.repeats):
        for mode in ("off", "counts", "tokens"):
            rec = None if mode == "off" else attach(model, RecordOptions(mode=mode, capacity_tokens=1 << 16))
            t0 = time.perf_counter()
            fwd()
            times[mode].append(time.perf_counter() - t0)
            if rec is not None:
                rec.detach()
    base = statistics.median(times["off"])
    # the recorder's own cost per forward, measured without the model around it
    ids = torch.randint(0, args.experts, (tokens, args.top_k))
    rec_cost = {}
    for mode in ("counts", "tokens"):
        rec = RoutingRecorder(
            list(range(args.layers)),
            args.experts,
            args.top_k,
            RecordOptions(mode=mode, capacity_tokens=1 << 16),
        )
        n = 200
        t0 = time.perf_counter()
        for i in range(n):
            rec.record(i % args.layers, ids)
        rec_cost[mode] = (time.perf_counter() - t0) / n * args.layers
    rows = []
    for mode in ("off", "counts", "tokens"):
        med = statistics.median(times[mode])
        q = np.percentile(times[mode], [25, 75])
        rows.append(
            {
                "mode": mode,
                "median_ms": f"{med * 1e3:.2f}",
                "iqr_ms": f"{q[0] * 1e3:.2f}-{q[1] * 1e3:.2f}",
                "ratio": f"{med / base:.4f}",
                "overhead": "-" if mode == "off" else f"{(med / base - 1) * 100:+.2f}%",
                "record_only": "-"
                if mode == "off"
                else f"{rec_cost[mode] * 1e3:.3f} ms ({rec_cost[mode] / base * 100:.2f}%)",
            }
        )
    print(
        f"== hook overhead: Qwen3-MoE random weights, hidden {args.hidden}, {args.layers} MoE layers, "
        f"{args.experts} experts top-{args.top_k}, batch {args.batch} x {args.seq_len} tokens, "
        f"{args.threads} thread(s), {args.repeats} interleaved repeats"
    )
    print(
        _table(
            rows,
            [
                ("mode", "mode"),
                ("median_ms", "forward median ms"),
                ("iqr_ms", "IQR ms"),
                ("ratio", "/ no hook"),
                ("overhead", "overhead"),
                ("record_only", "record() per forward"),
            ],
        )
    )


def bench_stats(args) -> None:
    from profiling import stats
    from profiling.readers import default_traces_dir, read_trace
    from profiling.skew import skew_table

    path = default_traces_dir() / "deepseek-v2-lite-chat-puffin" / "puffin_prompts_1-2000.npz"
    if not path.is_file():
        print(f"\n== trace statistics: skipped, {path} not found (set MOE_TRACES_DIR)")
        return
    t0 = time.perf_counter()
    tr = read_trace(path)
    t_read = time.perf_counter() - t0
    T, L, k = tr.topk_ids.shape
    rows = []

    def timed(name, fn, units):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        rows.append({"step": name, "s": f"{dt:.3f}", "rate": f"{units / dt / 1e6:.2f} M token-layers/s"})

    rows.append(
        {"step": "read_trace", "s": f"{t_read:.3f}", "rate": f"{T * L / t_read / 1e6:.2f} M token-layers/s"}
    )
    timed("counts [L, E]", lambda: tr.slice_tokens(0, T).counts(), T * L)
    timed("skew_table", lambda: skew_table(tr), T * L)
    wl = {}
    timed("window_loads (8 windows)", lambda: wl.setdefault("w", stats.window_loads(tr, 8)), T * L)
    timed(
        "window_drift + persistence",
        lambda: (stats.window_drift(wl["w"]), stats.hot_expert_persistence(wl["w"])),
        T * L,
    )
    timed("natural windows (1999 prompts) drift", lambda: stats.window_drift(tr.window_load()), T * L)
    co = {}
    timed("coactivation [26, 64, 64]", lambda: co.setdefault("c", stats.coactivation(tr)), T * L)
    timed(
        "lift + NPMI",
        lambda: (stats.coactivation_lift(co["c"], T), stats.pmi(co["c"], T, normalized=True)),
        T * L,
    )
    timed("layer NMI (25 consecutive pairs)", lambda: stats.layer_mutual_information(tr), T * (L - 1))
    print(f"\n== trace statistics on {path.name}: {T} tokens x {L} layers x top-{k}")
    print(_table(rows, [("step", "step"), ("s", "seconds"), ("rate", "throughput")]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--skip-stats", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    bench_hooks(args)
    if not args.skip_stats:
        bench_stats(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
