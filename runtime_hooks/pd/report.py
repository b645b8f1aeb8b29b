"""The report of a disaggregated run: per request, per pool, what stayed in memory, against the formula.

Per request: its status (``completed``, ``retried`` = completed on a later attempt, ``failed``), its tokens
(from the one attempt that completed: the report counts the completions of every attempt, so a spliced
output would show) against the single-process model's, TTFT (from the run's start, when every request
arrives, to the first token of the attempt that completed) and TPOT, and its hand-off: bytes in all and
per layer (with the formula's figure beside them), the time from the first layer sent to the commit
(``ms``), the part of it after the prompt's compute ended (``exposed_ms``), the state, who decided it and
why.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PDReport", "build_report", "kv_formula"]


@dataclass(frozen=True)
class PDReport:
    """Result of :func:`runtime_hooks.pd.serve.serve_pd` (see :meth:`to_dict` for the JSON)."""

    tokens_match: bool
    requests: tuple[dict, ...]
    pools: dict
    leaked_kv_bytes: dict
    kv_bytes_per_token_layer: float
    measured_kv_bytes_per_token_layer: int
    num_layers: int
    model_class: str
    serve_seconds: float
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_match": self.tokens_match,
            "requests": list(self.requests),
            "pools": self.pools,
            "leaked_kv_bytes": self.leaked_kv_bytes,
            "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer,
            "measured_kv_bytes_per_token_layer": self.measured_kv_bytes_per_token_layer,
            "num_layers": self.num_layers,
            "model_class": self.model_class,
            "serve_seconds": self.serve_seconds,
            "notes": list(self.notes),
        }


def kv_formula(config, dtype: str) -> float | None:
    """:attr:`placement.cost.modelspec.ModelSpec.kv_bytes_per_token_layer` of the model's HF config with
    ``kv_cache_bytes`` the runtime dtype's size (None when the config does not map to a ModelSpec)."""
    import torch

    from placement.cost.modelspec import model_from_hf_config

    try:
        spec = model_from_hf_config(config.get_text_config().to_dict())
    except ValueError:
        return None
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return float(dataclasses.replace(spec, kv_cache_bytes=float(itemsize)).kv_bytes_per_token_layer)


def _handoff(h: dict | None, per_token_layer: float | None, layers: int) -> dict:
    """One attempt's hand-off as the JSON shows it (``None`` fields when it never ran)."""
    if h is None:
        return {
            "bytes": 0,
            "bytes_per_layer": [],
            "ms": None,
            "exposed_ms": None,
            "state": "requested",
            "reason": "",
        }
    expected = None if per_token_layer is None else int(per_token_layer * layers * h["position"])
    return {
        "bytes": h["bytes"],
        "bytes_per_layer": h["layer_bytes"],
        "expected_bytes": expected,
        "ms": h["ms"],
        "exposed_ms": h["exposed_ms"],
        "overlap_ms": h["overlap_ms"],
        "state": h["state"],
        "decided_by": h["by"],
        "reason": h["reason"],
        "freed_bytes": h["freed_bytes"],
    }


def _request(m: dict, ctx: dict) -> dict:
    """One request's entry (``m``: the manager's record of it)."""
    rid, attempts = m["id"], m["attempts"]
    final = attempts[-1]["hid"] if attempts else None
    # attempts that finished: the decode ranks' records (a rank lost after finishing one returns none)
    # and the output the manager received
    completions = {c["hid"]: c for c in ctx["done"].get(rid, [])}
    if m["output"] is not None:
        completions.setdefault(m["output"]["hid"], m["output"])
    status = m["status"]
    if status == "completed":
        status = "retried" if len(attempts) > 1 else "completed"
    comp = completions.get(final) if status != "failed" else None
    tokens = comp["tokens"] if comp is not None else None
    first = ctx["firsts"].get(final)
    n = ctx["new_tokens"]
    ttft = (first["t"] - ctx["t0"]) * 1e3 if comp and first else None
    tpot = (comp["t_done"] - first["t"]) * 1e3 / (n - 1) if comp and first and n > 1 else None
    ended = ctx["ended"]
    return {
        "id": rid,
        "status": status,
        "tokens_match": None if tokens is None else tokens == ctx["reference"][rid],
        "tokens": tokens,
        "reference": ctx["reference"][rid],
        "prompt_tokens": ctx["lens"][rid],
        "reason": m["reason"],
        "completions": len(completions),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "handoff": _handoff(ended.get(final), ctx["kv"], ctx["layers"]),
        "attempts": [
            {
                "hid": a["hid"],
                "prefill_rank": a["src"],
                "decode_rank": a["dst"],
                "state": a["state"],
                "reason": a["reason"],
                "fault": (ended.get(a["hid"]) or {}).get("fault", ""),
                "bytes": (ended.get(a["hid"]) or {}).get("bytes", 0),
                "prefill_freed_bytes": (ended.get(a["hid"]) or {}).get("freed_bytes", 0),
            }
            for a in attempts
        ],
    }


def _pool(placement, results: list, role: str) -> dict:
    """Per-pool figures: layout, step times, loads (picks computed, tokens run) per rank."""
    alive = [r for r in results if r is not None]
    steps = [ms for r in alive for ms in r["step_ms"]]
    t = placement.topology
    out = {
        "ranks": t.ep_size,
        "slots_per_gpu": t.slots_per_gpu,
        "redundant_slots": placement.num_redundant_experts,
        "steps": max((len(r["step_ms"]) for r in alive), default=0),
        "step_ms_median": statistics.median(steps) if steps else None,
        "step_ms_max": max(steps) if steps else None,
        "load_per_rank": [None if r is None else r["picks"] for r in results],
        "tokens_run": [None if r is None else r["tokens"] for r in results],
        "weights_match": all(r["weights_ok"] for r in alive),
    }
    if role == "decode":
        fo = [f for r in alive for f in r["failovers"]]
        out["lost_ranks"] = sorted({x for f in fo for x in f["lost"]})
        out["reloads"] = fo[0]["reloads"] if fo else 0
        out["failover_ms"] = max((f["seconds"] * 1e3 for f in fo), default=None)
        out["max_batch"] = max((max(r["batch"], default=0) for r in alive), default=0)
        out["survivors"] = alive[0]["members"] if alive else []
        out["aborted_handoffs"] = sorted(
            ({"hid": h, "reason": why, "freed_bytes": b} for r in alive for h, why, b in r["aborted"]),
            key=lambda a: a["hid"],
        )
    return out


def build_report(spec, results: list, wall: float):
    """:class:`runtime_hooks.pd.serve.PDReport` from the ranks' results (None for a lost rank)."""
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.pd.kv import make_prompts, reference_tokens

    P, _ = spec.ranks
    pre, dec = results[:P], results[P:]
    model = load_model(spec.source, spec.seed, spec.dtype)
    config = model.config
    lens = spec.prompt_lens()
    prompts = make_prompts(spec.seed, lens, int(config.get_text_config().vocab_size))
    layers = int(config.get_text_config().num_hidden_layers)
    done: dict = {}
    for r in dec:
        for d in r["done"] if r is not None else ():
            done.setdefault(d["request"], []).append(d)
    ctx = {
        "done": done,
        "ended": {e["hid"]: e for r in pre for e in r["ended"]},
        "firsts": {f["hid"]: f for r in pre for f in r["firsts"]},
        "reference": reference_tokens(model, prompts, spec.new_tokens),
        "lens": lens,
        "t0": pre[0]["t0"],
        "new_tokens": spec.new_tokens,
        "kv": kv_formula(config, spec.dtype),
        "layers": layers,
    }
    requests = tuple(_request(m, ctx) for m in pre[0]["manager"])
    notes = []
    if ctx["kv"] is None:
        notes.append("the model's config maps to no ModelSpec: no formula to compare the bytes with")
    finished = [r for r in requests if r["status"] != "failed"]
    measured = {b // h["position"] for r in pre for h in r["ended"] for b in h["layer_bytes"]}
    if ctx["kv"] is not None and measured and measured != {ctx["kv"]}:
        notes.append(
            f"transformers' cache holds {sorted(measured)} B per token and layer where the formula counts "
            f"{ctx['kv']:g} (an MLA model caches full keys and values, the formula its latent)"
        )
    return PDReport(
        tokens_match=bool(finished) and all(r["tokens_match"] for r in finished),
        requests=requests,
        pools={
            "prefill": _pool(spec.prefill_placement, pre, "prefill"),
            "decode": _pool(spec.decode_placement, dec, "decode"),
        },
        leaked_kv_bytes={
            "prefill": int(sum(r["leaked"] for r in pre)),
            "decode": int(sum(r["leaked"] for r in dec if r is not None)),
        },
        kv_bytes_per_token_layer=ctx["kv"],
        measured_kv_bytes_per_token_layer=min(measured) if len(measured) == 1 else -1,
        notes=tuple(notes),
        num_layers=layers,
        model_class=type(model).__name__,
        serve_seconds=wall,
    )
