"""Tokens per second and per-rank expert load of a real HF MoE model: our live-rebalanced placement vs
contiguous expert parallelism, on the same gloo ranks and prompts, as ratios in one run.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/runtime_hf.py [--model DIR_OR_CONFIG] [--ranks 4]
        [--new-tokens 24] [--prompts-per-rank 4] [--rebalance-every 4] [--redundant 4] [--json OUT]

Needs ``accelerate`` for transformers' own EP: ``pip install -e '.[torch,hf,bench]'``.

Rows (same checkpoint, same ``G x B`` prompts, same greedy decode):

- ``contiguous``: experts in contiguous blocks, one per rank, plus the same number of redundant slots
  as ours (replicas of the next block), served through OUR path (attention data-parallel, each rank
  decodes its own ``B`` prompts) with no rebalancing;
- ``ours``: the same start, rebalanced live every ``--rebalance-every`` steps
  (:mod:`runtime_hooks.hf_serve`);
- ``transformers EP``: transformers' own ``DistributedConfig(ep_size=G, tp_size=G)`` (5.24 rejects EP
  without TP or FSDP). Its ``grouped_gemm`` rule shards ``gate_up_proj`` / ``down_proj`` with
  ``Shard(0)``, so rank ``r`` holds experts ``[r*E/G, (r+1)*E/G)``, one copy each; attention is
  tensor-parallel, so every rank must be fed the same input ids: each rank decodes all ``G x B``
  prompts as one batch. With the EP group equal to the TP group, ``ep_implementation="auto"`` runs
  ``AllReduceEP`` at inference: each rank runs its own experts on the whole batch (routes to other
  ranks masked) and an all-reduce sums the outputs. Its per-rank load is counted from the router's
  top-k (:func:`profiling.hooks.attach`): expert ``e`` is computed on rank ``e // (E/G)``. When it
  does not load or run on gloo CPU the reason is printed in one line and the other rows stay.

Load is picks (token, expert) computed per rank over the run; ``peak/mean`` is the straggler factor.
Tokens per second: generated tokens of all ranks per second of the slowest rank's decode loop.

On a CPU machine with fewer cores than ranks the ranks' compute runs in series, so tokens per second
measures total work plus the exchange, not the straggler; the load ratio is what a placement changes on
GPUs. Default model: a tiny random Mixtral (hidden 64, 2 layers, 8 experts, top-2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime_hooks.hf_serve import ServeSpec, contiguous_placement, serve_many  # noqa: E402
from runtime_hooks.hf_serve import _prompts as serve_prompts  # noqa: E402 - the prompts ours decodes
from runtime_hooks.hf_validate import _has_weights, describe_model, load_model  # noqa: E402
from runtime_hooks.launcher import WorkerError, WorkerTimeout, launch  # noqa: E402

HF_EP = "transformers EP"
INSTALL_HINT = "pip install -e '.[torch,hf,bench]'"


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


def _checkpoint(model: str, seed: int, folder: Path) -> str:
    """A checkpoint folder every run loads: ``model`` itself when it holds weights, else the seeded
    random model saved under ``folder`` (transformers' EP loads only through ``from_pretrained``)."""
    if _has_weights(model):
        return str(model)
    ckpt = folder / "ckpt"
    load_model(model, seed).save_pretrained(ckpt)
    return str(ckpt)


def _hf_ep_rank(rank: int, ranks: int, ckpt: str, prompts, new_tokens: int, num_experts: int) -> dict:
    """One rank of transformers' own EP: load, greedy-decode all prompts ``[G*B, T0]``, time, count."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from profiling.hooks import RecordOptions, attach, find_moe_layers
    from runtime_hooks.hf_serve import greedy_decode

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
    dc = DistributedConfig(ep_size=ranks, tp_size=ranks)
    model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=dc, dtype=torch.float32).eval()
    experts = find_moe_layers(model)[0].block.experts
    param = experts.gate_up_proj
    recorder = attach(model, RecordOptions(mode="counts"), num_logical_experts=num_experts)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        tokens = greedy_decode(model, prompts, new_tokens)  # [G*B, n]
        wall = time.perf_counter() - t0
        counts = recorder.counts()  # [L, E]: the whole batch, identical on every rank
    finally:
        recorder.detach()
    return {
        "tokens": tokens.numpy(),
        "wall": wall,
        "counts": counts,
        "local_experts": int(experts.num_experts),
        "sharding": str(getattr(param, "placements", "not a DTensor")),
        "dispatch": dc.ep_implementation,
    }


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return " ".join((lines[-1] if lines else "unknown error").split())[:300]


def run_transformers_ep(ckpt: str, ranks: int, prompts, new_tokens: int, num_experts: int):
    """``(result, reason)``: the timed transformers EP run on ``ranks`` gloo ranks, or None and why not."""
    if importlib.util.find_spec("accelerate") is None:
        return None, f"accelerate is not installed: {INSTALL_HINT}"
    args = (ckpt, prompts, new_tokens, num_experts)
    try:
        results = launch(_hf_ep_rank, ranks, args=args, timeout=600)
    except WorkerError as exc:
        return None, f"rank {exc.rank}: {_one_line(exc.remote_traceback)}"
    except WorkerTimeout as exc:
        return None, _one_line(str(exc))
    first = results[0]
    if any(not np.array_equal(r["counts"], first["counts"]) for r in results):
        return None, "ranks disagree on the routing of the shared batch"
    if any(not np.array_equal(r["tokens"], first["tokens"]) for r in results):
        return None, "ranks generated different tokens from the shared batch"
    block = num_experts // ranks
    load = first["counts"].sum(axis=0).reshape(ranks, block).sum(axis=1)  # [G] expert e on rank e // block
    # "auto" runs AllReduceEP at inference when the EP group is the TP group (ep_size == tp_size)
    mode = "auto -> AllReduceEP" if first["dispatch"] == "auto" else first["dispatch"]
    how = f"experts {first['sharding']}, {first['local_experts']} per rank in blocks; {mode}"
    return {
        "tokens": first["tokens"],
        "wall": max(float(r["wall"]) for r in results),
        "load": load.astype(np.int64),
        "how": how,
    }, "ok"


def _row(name: str, tokens_per_s: float, load: np.ndarray, rebalances: int | None) -> dict:
    load = np.asarray(load, dtype=np.int64)
    return {
        "run": name,
        "tokens_per_s": float(tokens_per_s),
        "load_per_rank": load.tolist(),
        "peak_over_mean": float(load.max() / max(load.mean(), 1e-9)),
        "committed_rebalances": rebalances,
    }


def _ratios(ours: dict, base: dict, same_tokens: bool) -> dict:
    return {
        "tokens_per_s": ours["tokens_per_s"] / max(base["tokens_per_s"], 1e-9),
        "peak_load": max(ours["load_per_rank"]) / max(max(base["load_per_rank"]), 1),
        "peak_over_mean": ours["peak_over_mean"] / max(base["peak_over_mean"], 1e-9),
        "same_tokens": bool(same_tokens),
    }


def _serve_ours(args, ckpt: str, info):
    """``(contiguous, ours, spec)``: the two runs through our path, in one launch."""
    redundant = args.ranks if args.redundant is None else args.redundant
    start = contiguous_placement(len(info.layer_ids), info.num_experts, args.ranks, redundant)
    common = dict(
        new_tokens=args.new_tokens,
        prompts_per_rank=args.prompts_per_rank,
        prompt_len=args.prompt_len,
        seed=args.seed,
        reference=False,
    )
    specs = [
        ServeSpec(ckpt, start, rebalance_every=0, **common),
        ServeSpec(ckpt, start, rebalance_every=args.rebalance_every, **common),
    ]
    contiguous, ours = serve_many(specs, timeout=600)
    return contiguous, ours, specs[0]


def _report(args, info, contiguous, ours, hf, hf_status: str) -> dict:
    """The result object: rows, and ours over each baseline."""
    rows = [
        _row(
            "contiguous", contiguous.tokens_per_second, contiguous.load_per_rank, contiguous.committed_moves
        ),
        _row("ours", ours.tokens_per_second, ours.load_per_rank, ours.committed_moves),
    ]
    ratios = {"contiguous": _ratios(rows[1], rows[0], np.array_equal(contiguous.tokens, ours.tokens))}
    if hf is not None:
        rows.append(_row(HF_EP, hf["tokens"].size / max(hf["wall"], 1e-9), hf["load"], None))
        same = np.array_equal(hf["tokens"].reshape(ours.tokens.shape), ours.tokens)
        ratios[HF_EP] = _ratios(rows[1], rows[2], same)
    return {
        "model_class": info.model_class,
        "ranks": args.ranks,
        "prompts": args.ranks * args.prompts_per_rank,
        "new_tokens": args.new_tokens,
        "transformers_ep": hf_status,
        "transformers_ep_layout": None if hf is None else hf["how"],
        "baselines": {
            "contiguous": "contiguous blocks + redundant replicas, through our path, not rebalanced",
            HF_EP: "transformers' DistributedConfig(ep_size=G, tp_size=G) on the same ranks",
        },
        "runs": rows,
        "ratios_ours_over": ratios,
    }


def _print(out: dict) -> None:
    print(
        f"{out['model_class']} on {out['ranks']} gloo ranks, {out['prompts']} prompts x {out['new_tokens']} "
        f"new tokens; transformers' own EP: {out['transformers_ep']}"
    )
    if out["transformers_ep_layout"]:
        print(f"  {HF_EP}: {out['transformers_ep_layout']}")
    for r in out["runs"]:
        reb = "" if r["committed_rebalances"] is None else f"  rebalances {r['committed_rebalances']}"
        print(
            f"{r['run']:>16}: {r['tokens_per_s']:8.1f} tokens/s  load per rank {r['load_per_rank']}  "
            f"peak/mean {r['peak_over_mean']:.3f}{reb}"
        )
    for base, q in out["ratios_ours_over"].items():
        print(
            f"ours / {base}: tokens/s x{q['tokens_per_s']:.3f}, peak rank load x{q['peak_load']:.3f}, "
            f"peak/mean x{q['peak_over_mean']:.3f}; same tokens: {q['same_tokens']}"
        )


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
        ckpt = _checkpoint(args.model or str(_default_config(Path(tmp))), args.seed, Path(tmp))
        info = describe_model(ckpt)
        contiguous, ours, spec = _serve_ours(args, ckpt, info)
        hf, hf_status = None, "skipped (--skip-transformers-ep)"
        if not args.skip_transformers_ep:
            prompts = serve_prompts(spec, args.ranks, info.vocab_size)  # [G*B, T0], rank-major as ours
            hf, hf_status = run_transformers_ep(ckpt, args.ranks, prompts, args.new_tokens, info.num_experts)
    out = _report(args, info, contiguous, ours, hf, hf_status)
    _print(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
