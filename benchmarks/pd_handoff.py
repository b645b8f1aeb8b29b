"""Disaggregated serving on gloo ranks: KV hand-off bytes against the formula, hand-off time and the part
of it compute did not hide, with layer-wise streaming and without it, and each injected fault's outcome.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/pd_handoff.py [--layers 8] [--hidden 256] [--prompt-len 512]
        [--requests 6] [--new-tokens 3] [--json OUT]

Three launches of 2 prefill + 2 decode ranks, a random Mixtral (``--layers`` layers, hidden ``--hidden``,
8 KV heads, 8 experts top-2, fp32), the prefill pool on contiguous blocks plus one replica per rank, the
decode pool with every expert on each rank (so it serves on after losing one):

- ``streamed``: each layer's KV is sent from a forward hook as soon as the layer has computed;
- ``after compute``: the same requests, every layer sent once the prompt has run (the baseline);
- ``faults, retry``: requests 1-4 each with one fault on their first hand-off (metadata mismatch,
  corrupted chunk, a transfer slower than the timeout, a decode rank that dies mid-transfer), retried
  from their prompts.

Per run: bytes per request against ``ModelSpec.kv_bytes_per_token_layer x layers x prompt tokens``,
the median hand-off time (first layer sent to commit) and exposed time (commit minus the end of the
prompt's compute), exposed/total, and the prefill pool's median step time (the prompt's compute with
the sender's per-layer packing and checksum, plus, after compute, the sends: what the prefill rank
really spends); per faulted request its first attempt's verdict and the request's end. Wall-clock times on one host, CPU gloo over loopback: a GPU fabric moves the bytes 2-3 orders of
magnitude faster, while compute shrinks too; the ratio is what streaming changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAULTS = ("metadata-mismatch", "corrupt-chunk", "slow-transfer", "decode-dies")


def _config(layers: int, hidden: int):
    import transformers as tf

    return tf.MixtralConfig(
        vocab_size=128,
        hidden_size=hidden,
        num_attention_heads=8,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )


def _run(args, name: str, **kw) -> dict:
    from placement.model import Placement
    from runtime_hooks.hf_serve import contiguous_placement
    from runtime_hooks.pd.handoff import HandoffFault
    from runtime_hooks.pd.serve import PDSpec, serve_pd

    L = args.layers
    decode = Placement.from_map(np.tile(np.r_[np.arange(8), np.roll(np.arange(8), 4)], (L, 1)), 8, ep_size=2)
    faults = tuple(HandoffFault(k, i + 1) for i, k in enumerate(kw.pop("faults", ())))
    spec = PDSpec(
        _config(L, args.hidden),
        contiguous_placement(L, 8, 2, 2),
        decode,
        requests=args.requests,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        handoff_timeout=3.0,
        liveness_timeout=3.0,
        faults=faults,
        **kw,
    )
    rep = serve_pd(spec, timeout=600).to_dict()
    rep["name"] = name
    return rep


def _row(rep: dict) -> dict:
    done = [r["handoff"] for r in rep["requests"] if r["handoff"]["state"] == "committed"]
    ms = statistics.median(h["ms"] for h in done)
    exposed = statistics.median(h["exposed_ms"] for h in done)
    return {
        "run": rep["name"],
        "requests": f"{sum(r['status'] != 'failed' for r in rep['requests'])}/{len(rep['requests'])}",
        "tokens": "match" if rep["tokens_match"] else "DIFFER",
        "bytes = formula": all(h["bytes"] == h["expected_bytes"] for h in done),
        "MB/request": statistics.median(h["bytes"] for h in done) / 1e6,
        "hand-off ms": ms,
        "exposed ms": exposed,
        "exposed/total": exposed / ms,
        "prefill step ms": rep["pools"]["prefill"]["step_ms_median"],
        "leaked B": sum(rep["leaked_kv_bytes"].values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=3)
    ap.add_argument("--json", help="write every report to this file")
    args = ap.parse_args()
    reps = [
        _run(args, "streamed"),
        _run(args, "after compute", stream_layers=False),
        _run(args, "faults, retry", on_handoff_failure="retry", faults=FAULTS),
    ]
    rows = [_row(r) for r in reps]
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()))
    base = rows[1]["exposed ms"]
    print(f"streamed exposed time / after-compute exposed time: {rows[0]['exposed ms'] / base:.2f}")
    print("faults (first attempt -> the request's end):")
    for r in reps[2]["requests"][1 : 1 + len(FAULTS)]:
        first = r["attempts"][0]
        print(
            f"  request {r['id']} {first['fault']}: {first['state']} ({first['reason'][:70]}) -> {r['status']}"
        )
    dec = reps[2]["pools"]["decode"]
    print(f"  decode ranks lost {dec['lost_ranks']}, survivors {dec['survivors']}, reloads {dec['reloads']}")
    if args.json:
        Path(args.json).write_text(json.dumps(reps, indent=1))


if __name__ == "__main__":
    main()
