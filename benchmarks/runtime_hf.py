"""Tokens per second and per-rank expert load of a real HF MoE model: our live-rebalanced placement vs
contiguous expert parallelism, on the same gloo ranks and prompts, as ratios in one run.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/runtime_hf.py [--model DIR_OR_CONFIG] [--ranks 4]
        [--new-tokens 24] [--prompts-per-rank 4] [--rebalance-every 4] [--redundant 4] [--json OUT]

Runs (one launch, same prompts):

- ``contiguous``: experts in contiguous blocks, one per rank (transformers' own EP layout), plus the
  same number of redundant slots as ours (replicas of the next block), served through our path with no
  rebalancing;
- ``ours``: the same start, rebalanced live every ``--rebalance-every`` steps
  (:mod:`runtime_hooks.hf_serve`).

transformers' own EP (``DistributedConfig(ep_size=G, tp_size=G)``) is tried first on the same ranks; when
it does not load on gloo CPU the reason is printed and the comparison is against ``contiguous`` through
our path only. Load is picks computed per rank over the run; ``peak/mean`` is the straggler factor.

On a CPU machine with fewer cores than ranks the ranks' expert compute runs in series, so tokens per
second measures total work plus the exchange, not the straggler; the load ratio is what a placement
changes on GPUs. Default model: a tiny random Mixtral (hidden 64, 2 layers, 8 experts, top-2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime_hooks.hf_serve import ServeSpec, contiguous_placement, serve_many  # noqa: E402
from runtime_hooks.hf_validate import describe_model  # noqa: E402
from runtime_hooks.launcher import launch  # noqa: E402


def _default_config(folder: Path) -> Path:
    """A tiny random Mixtral ``config.json`` in ``folder``."""
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=2,
        initializer_range=0.2,
    )
    path = folder / "config.json"
    path.write_text(cfg.to_json_string())
    return path


def _hf_ep_rank(rank: int, ranks: int, ckpt: str) -> str:
    """Load the checkpoint with transformers' own EP on this rank: ``ok`` or the error, one line."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
    try:
        dc = DistributedConfig(ep_size=ranks, tp_size=ranks)
        model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=dc, dtype=torch.float32)
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 4), dtype=torch.int64))
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported, then we compare through our own path
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def try_transformers_ep(model: str, ranks: int, seed: int, folder: Path) -> str:
    """``ok`` when transformers' ``DistributedConfig(ep_size=G)`` loads and runs on gloo, else why not."""
    from runtime_hooks.hf_validate import load_model

    ckpt = folder / "ckpt"
    load_model(model, seed).save_pretrained(ckpt)
    results = launch(_hf_ep_rank, ranks, args=(str(ckpt),), timeout=300)
    bad = sorted({r for r in results if r != "ok"})
    return "ok" if not bad else bad[0]


def _row(name: str, rep) -> dict:
    load = rep.load_per_rank.astype(float)
    return {
        "run": name,
        "tokens_per_s": rep.tokens_per_second,
        "load_per_rank": rep.load_per_rank.tolist(),
        "peak_over_mean": float(load.max() / max(load.mean(), 1e-9)),
        "committed_rebalances": rep.committed_moves,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder or config.json (default: a tiny random Mixtral)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompts-per-rank", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--rebalance-every", type=int, default=4)
    ap.add_argument("--redundant", type=int, help="redundant slots per layer (default: --ranks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers-ep", action="store_true")
    ap.add_argument("--json", help="write the result object here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(_default_config(Path(tmp)))
        hf_ep = (
            "skipped"
            if args.skip_transformers_ep
            else try_transformers_ep(model, args.ranks, args.seed, Path(tmp))
        )
        info = describe_model(model)
        redundant = args.ranks if args.redundant is None else args.redundant
        start = contiguous_placement(len(info.layer_ids), info.num_experts, args.ranks, redundant)
        common = dict(
            new_tokens=args.new_tokens,
            prompts_per_rank=args.prompts_per_rank,
            prompt_len=args.prompt_len,
            seed=args.seed,
            reference=False,
        )
        contiguous, ours = serve_many(
            [
                ServeSpec(model, start, rebalance_every=0, **common),
                ServeSpec(model, start, rebalance_every=args.rebalance_every, **common),
            ],
            timeout=600,
        )
    rows = [_row("contiguous", contiguous), _row("ours", ours)]
    out = {
        "model_class": info.model_class,
        "ranks": args.ranks,
        "transformers_ep": hf_ep,
        "baseline": "transformers EP" if hf_ep == "ok" else "contiguous placement through our path",
        "runs": rows,
        "same_tokens": bool(np.array_equal(contiguous.tokens, ours.tokens)),
        "tokens_per_s_ratio": rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"],
        "peak_load_ratio": max(rows[1]["load_per_rank"]) / max(max(rows[0]["load_per_rank"]), 1),
        "peak_over_mean_ratio": rows[1]["peak_over_mean"] / rows[0]["peak_over_mean"],
    }
    print(f"{info.model_class} on {args.ranks} gloo ranks; transformers' own EP: {hf_ep}")
    for r in rows:
        print(
            f"{r['run']:>10}: {r['tokens_per_s']:8.1f} tokens/s  load per rank {r['load_per_rank']}  "
            f"peak/mean {r['peak_over_mean']:.3f}  rebalances {r['committed_rebalances']}"
        )
    print(
        f"ours / contiguous: tokens/s x{out['tokens_per_s_ratio']:.3f}, peak rank load x{out['peak_load_ratio']:.3f}, "
        f"peak/mean x{out['peak_over_mean_ratio']:.3f}; same tokens: {out['same_tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
