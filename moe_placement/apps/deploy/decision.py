"""The decision: rank the simulated deployments, say why the winner wins and the runner-up loses, how
the prefill/decode split traded off, and whether that agrees with the rule of thumb.

Ranking: goodput per GPU (descending); when nothing meets the targets, the deployment that came
closest first (its lowest simulated rate's worse target ratio, ``p(100 X) latency / target`` of TTFT or
TPOT, smallest first). Ties keep the search order.

The rule of thumb (the serving literature's: split prefill and decode only when it pays; it rarely does
for short outputs, short prompts, small models, a weak interconnect or a single machine): each
condition is tested on the plan's inputs (:func:`rule_of_thumb`); the simulator decides, and the reason
says when it disagrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_placement.apps.deploy.options import COLOCATED, DISAGGREGATED, REPLICAS
from placement.cost.handoff import WEAK_LINK_BITS_PER_S, bytes_per_s_from_bits_per_s

__all__ = [
    "SHORT_OUTPUT_TOKENS",
    "SHORT_PROMPT_TOKENS",
    "WEAK_LINK_BYTES_PER_S",
    "RuleOfThumb",
    "closeness",
    "explain",
    "rank",
    "rule_of_thumb",
]

SHORT_OUTPUT_TOKENS = 128  # median output below this: "short outputs"
SHORT_PROMPT_TOKENS = 512  # median prompt below this: "short prompts"
WEAK_LINK_BYTES_PER_S = bytes_per_s_from_bits_per_s(WEAK_LINK_BITS_PER_S)  # slower: "a weak interconnect"


@dataclass(frozen=True)
class RuleOfThumb:
    """Which of the rule's conditions against a prefill/decode split hold (``reasons``, empty: none)."""

    reasons: tuple[str, ...]

    @property
    def split_rarely_pays(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict:
        return {"split_rarely_pays": self.split_rarely_pays, "conditions": list(self.reasons)}


def rule_of_thumb(
    prompt: int, output: int, model_fits_one_gpu: bool, link_name: str, link_bytes_per_s: float, nodes: int
) -> RuleOfThumb:
    """The conditions of the rule of thumb that hold for the median request and this cluster."""
    out = []
    if output < SHORT_OUTPUT_TOKENS:
        out.append(f"short outputs (median {output} < {SHORT_OUTPUT_TOKENS} tokens)")
    if prompt < SHORT_PROMPT_TOKENS:
        out.append(f"short prompts (median {prompt} < {SHORT_PROMPT_TOKENS} tokens)")
    if model_fits_one_gpu:
        out.append("a small model (its weights fit on one GPU)")
    if link_bytes_per_s < WEAK_LINK_BYTES_PER_S:
        out.append(
            f"a weak interconnect ({link_name}: {link_bytes_per_s / 1e9:.1f} GB/s < "
            f"{WEAK_LINK_BYTES_PER_S / 1e9:.0f} GB/s = {WEAK_LINK_BITS_PER_S / 1e9:.0f} Gbit/s)"
        )
    if nodes == 1:
        out.append("a single machine")
    return RuleOfThumb(tuple(out))


def closeness(result, targets: tuple[float, float, float]) -> float:
    """How far a deployment is from the targets at its lowest simulated rate: the worse of
    ``p(100 X) TTFT / TTFT target`` and ``p(100 X) TPOT / TPOT target`` (1 or less: met)."""
    ttft, tpot, share = targets
    res = result.goodput.zero
    q = 100.0 * share
    with np.errstate(invalid="ignore"):
        a = np.nan_to_num(res.ttft, nan=math.inf, posinf=math.inf)
        b = np.nan_to_num(res.tpot, nan=math.inf, posinf=math.inf)
        worse = max(
            float(np.percentile(a, q, method="higher")) / ttft,
            float(np.percentile(b, q, method="higher")) / tpot,
        )
    return worse


def rank(results: list, targets: tuple[float, float, float]) -> list:
    """``results`` best first (module docstring)."""
    keyed = [(-r.goodput_per_gpu, closeness(r, targets), i, r) for i, r in enumerate(results)]
    return [r for *_, r in sorted(keyed, key=lambda k: k[:3])]


def _why_loses(result, targets) -> str:
    """Which target breaks first above a deployment's goodput (the first rate simulated that missed)."""
    ttft, tpot, share = targets
    g = result.goodput
    above = [p for p in g.curve if p.rate > g.goodput_rps and p.attainment < share]
    if not above:
        return ""
    p = above[0]
    return (
        f"above it, at {p.rate:.3g} req/s, {p.ttft_ok:.1%} of its requests meet TTFT <= {ttft * 1e3:g} ms and "
        f"{p.tpot_ok:.1%} TPOT <= {tpot * 1e3:g} ms"
    )


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%" if b > 0 else "(the other meets nothing)"


def _winner_sentence(ranked: list, targets) -> str:
    ttft, tpot, share = targets
    best = ranked[0]
    q = best.percentiles()
    s = (
        f"{best.label} wins with {best.goodput_per_gpu:.4g} req/s per GPU ({best.goodput.goodput_rps:.4g} req/s on "
        f"{best.gpus} GPUs) meeting TTFT <= {ttft * 1e3:g} ms and TPOT <= {tpot * 1e3:g} ms for {share:.0%} of "
        f"requests (at that rate p99 TTFT {_ms(q[0]['p99'])}, p99 TPOT {_ms(q[1]['p99'])})"
    )
    if len(ranked) > 1:
        second = ranked[1]
        why = _why_loses(second, targets)
        s += (
            f"; the runner-up {second.label} gives {second.goodput_per_gpu:.4g} "
            f"({_pct(second.goodput_per_gpu, best.goodput_per_gpu)})" + (f": {why}" if why else "")
        )
    return s + "."


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def _split_sentence(ranked: list, prompt: int) -> tuple[str, float | None]:
    """The trade-off of the best split against the best co-located deployment, and the relative
    goodput gain of the split (None when one of the two was not simulated)."""
    split = next((r for r in ranked if r.kind == DISAGGREGATED), None)
    colo = next((r for r in ranked if r.kind in (COLOCATED, REPLICAS)), None)
    if split is None or colo is None:
        return "", None
    b = split.breakdown
    h = split.sim.handoff
    gain = split.goodput_per_gpu / colo.goodput_per_gpu - 1 if colo.goodput_per_gpu > 0 else math.inf
    way = "pays" if split.goodput_per_gpu > colo.goodput_per_gpu else "does not pay"
    by = "" if math.isinf(gain) else f" ({gain * 100:+.0f}% goodput per GPU)"
    qs, qc = split.percentiles(), colo.percentiles()
    s = (
        f"The prefill/decode split {way}{by}: best split {split.label} {split.goodput_per_gpu:.4g} vs best "
        f"co-located {colo.label} {colo.goodput_per_gpu:.4g} req/s per GPU. Its hand-off of the median prompt "
        f"({prompt} tokens, {b.handoff_bytes / 1e6:.1f} MB) goes over {h.link} at {h.link_bytes_per_s / 1e9:.1f} GB/s: "
        f"{b.handoff_bytes / (h.link_bytes_per_s * h.links) * 1e3:.2f} ms of transfer, {b.handoff_s * 1e3:.2f} ms "
        f"of it after the prefill ({h.streaming} streaming, {h.fixed_s * 1e3:g} ms fixed), "
        f"{b.handoff_s / max(b.prefill_s + b.handoff_s, 1e-12):.1%} of the zero-load TTFT; p99 TPOT "
        f"{_ms(qs[1]['p99'])} split vs {_ms(qc[1]['p99'])} co-located."
    )
    return s, (None if math.isinf(gain) else gain)


def explain(ranked: list, targets, prompt: int, rule: RuleOfThumb, met: bool) -> str:
    """The reason: winner and runner-up with numbers, the split's trade-off, the rule of thumb."""
    parts = []
    if met:
        parts.append(_winner_sentence(ranked, targets))
    else:
        ttft, tpot, share = targets
        c = ranked[0]
        parts.append(
            f"No deployment meets TTFT <= {ttft * 1e3:g} ms and TPOT <= {tpot * 1e3:g} ms for {share:.0%} of "
            f"requests even at a near-zero rate; closest: {c.label} (its worse target ratio is "
            f"{closeness(c, targets):.2f}x the target at {c.goodput.zero.rate:.3g} req/s)."
        )
    split, gain = _split_sentence(ranked, prompt)
    if split:
        parts.append(split)
    parts.append(_rule_sentence(ranked, rule, gain))
    return " ".join(parts)


def _rule_sentence(ranked: list, rule: RuleOfThumb, gain: float | None) -> str:
    won = bool(ranked) and ranked[0].kind == DISAGGREGATED
    if not rule.split_rarely_pays:
        return (
            "Rule of thumb: none of its conditions against the split holds (short outputs, short prompts, a small "
            f"model, a weak interconnect, a single machine); the simulator {'picks' if won else 'does not pick'} the split."
        )
    cond = "; ".join(rule.reasons)
    if gain is None:
        return f"Rule of thumb: the split rarely pays here ({cond}); the split was not simulated against co-located."
    if gain <= 0 and won:  # a tie on goodput, broken by latency (rank's second key)
        return (
            f"Rule of thumb: the split rarely pays here ({cond}); the simulator agrees on goodput ({gain * 100:+.0f}% "
            "for the split), which ranks first only on latency at equal goodput."
        )
    if gain > 0:
        return (
            f"Rule of thumb: the split rarely pays here ({cond}); the simulator DISAGREES: the split gains "
            f"{gain * 100:+.0f}% goodput per GPU on this workload."
        )
    return f"Rule of thumb: the split rarely pays here ({cond}); the simulator agrees ({gain * 100:+.0f}% for the split)."
