"""Decisions that survive their uncertainty: does the recommended option stay the same when the evidence
or the deployment moves?

Three checks, each re-running the one choice rule (:func:`moe_placement.apps.advise.choice.choose`):

- the halves swapped: every option placed on the held-out half and priced on the fit half, exactly as
  ``advise(..., fit_half=<the other>)`` does (so a swapped run changes the option only when this check
  said so);
- a bootstrap over prompts: :data:`BOOTSTRAP` resamples, with replacement, of the blocks of consecutive
  held-out steps each phase is priced in (a block holds its own prompts' tokens), every option's gain
  recomputed from its resampled blocks (the same blocks for every option), each range keeping its width;
  the option must stay chosen in :data:`AGREE` of them;
- a sweep over the knobs of the deployment the user did not pin (:data:`...options.KNOBS`): the decode
  batch halved and doubled, the context a quarter and four times, the prefill chunk halved and doubled,
  two-batch overlap flipped; each re-prices the baseline, the chosen option and the
  :data:`CONTENDERS` best other runnable options by net gain (the rest keep out of it), with memory
  re-checked at the new batch x context.

The decision is stable when no check changes the option and every priced phase has a band (more than
one held-out step); ``would_flip`` names each check that changes it and to what.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import moe_placement.apps.advise.phases as phases
import moe_placement.apps.advise.pricing as pricing
from moe_placement.apps.advise.advice import NO_BALANCING, Row
from moe_placement.apps.advise.balance import NO_EPLB
from moe_placement.apps.advise.choice import choose, net_gain, net_of, phase_gains
from moe_placement.apps.advise.options import KNOB_FLAGS, KNOBS, AdviseOptions, knob_value, with_knob
from moe_placement.apps.advise.recommend import availability

__all__ = ["AGREE", "BOOTSTRAP", "CONTENDERS", "Check", "Stability", "check"]

BOOTSTRAP = 200  # resamples of the held-out blocks
AGREE = 0.9  # share of resamples that must keep the option
CONTENDERS = 3  # other options re-priced in the sweep, the best by net gain
NOTHING_FITS = "nothing fits"
# knob -> the values tried around the one advised (x factor; overlap flips)
_FACTORS = {"decode_step_tokens": (0.5, 2.0), "context_len": (0.25, 4.0), "prefill_step_tokens": (0.5, 2.0)}
_AFFECTS = {"decode_step_tokens": ("decode",), "prefill_step_tokens": ("prefill",)}  # others: every phase


@dataclass(frozen=True)
class Check:
    """One perturbation: what was changed, to which value, and the option chosen then."""

    what: str
    value: Any
    option: str
    note: str = ""

    def to_dict(self) -> dict:
        return {"what": self.what, "value": self.value, "option": self.option, "note": self.note}


@dataclass(frozen=True)
class Stability:
    """The checks run, the ones that change the option, and what stops the decision being judged."""

    chosen: str
    checks: tuple[Check, ...]
    unknown: tuple[str, ...] = ()

    @property
    def flips(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.option not in (self.chosen, NOTHING_FITS))

    @property
    def stable(self) -> bool:
        return not self.flips and not self.unknown

    def to_dict(self, min_gain: float) -> dict:
        """The recommendation's keys: ``decision_stable``, ``would_flip``, ``min_gain``, ``stability``."""
        return {
            "decision_stable": self.stable,
            "would_flip": [c.to_dict() for c in self.flips],
            "min_gain": min_gain,
            "stability": {
                "checks": [c.to_dict() for c in self.checks],
                "unknown": list(self.unknown),
                "bootstrap_resamples": BOOTSTRAP,
                "agree": AGREE,
                "contenders": CONTENDERS,
            },
        }

    def line(self) -> str:
        """``Decision stable: yes (...)`` or ``no (...)``, naming what would flip it."""
        tried = ", ".join(_said(c) for c in self.checks) or "nothing"
        if self.stable:
            return f"Decision stable: yes (the same option with {tried})."
        why = [f"{_said(c)} picks {c.option}" for c in self.flips] + list(self.unknown)
        if not self.flips and self.checks:
            why.append(f"the checks keep the option: {tried}")
        return f"Decision stable: no ({'; '.join(why)})."


def _said(c: Check) -> str:
    if c.what == "fit_half":
        return f"placements fitted on the {c.value} half"
    if c.what == "bootstrap":
        return f"a bootstrap over held-out prompts ({c.note})"
    return f"{KNOB_FLAGS[c.what]} {c.value}"


def _key(row: Row, base: Row) -> str:
    return NO_BALANCING if row is base else row.key


# ---------------------------------------------------------------------------------------------
# the halves swapped
# ---------------------------------------------------------------------------------------------
def swapped(inp, options: AdviseOptions, progress: pricing.Progress) -> Check:
    """Every option placed on the held-out half and priced on the fit half, and chosen as advise does."""
    other = "second" if options.fit_half == "first" else "first"
    opts = replace(options, fit_half=other)

    def staged(items, total, desc):
        return progress(items, total, f"stability, fitted on the {other} half: {desc}")

    rows, placements, steps = pricing.rows(
        inp.held, inp.fit, inp.model, inp.cluster, opts, staged, scored=False
    )
    base = next(r for r in rows if r.kind == NO_EPLB)
    rows = pricing.with_ranges(rows, base, placements, steps, inp.fit, inp.model, inp.cluster, opts)
    base = next(r for r in rows if r.kind == NO_EPLB)
    available = {r.key: availability(opts.engine, inp.model.name, r) for r in rows}
    return Check("fit_half", other, _key(choose(rows, base, available, opts.min_gain).row, base))


# ---------------------------------------------------------------------------------------------
# bootstrap over held-out prompts
# ---------------------------------------------------------------------------------------------
def _block_means(row: Row, ph: str, idx: np.ndarray) -> float:
    p = row.phase(ph)
    x, w = np.asarray(p.block_whole_ms), np.asarray(p.block_steps, dtype=float)
    return float((x[idx] * w[idx]).sum() / w[idx].sum())


def bootstrap(
    rows: list[Row], base: Row, available: Mapping, options: AdviseOptions, chosen: str
) -> Check | None:
    """The option chosen most often over :data:`BOOTSTRAP` resamples of each phase's blocks, with the
    share that keep ``chosen``; None when no priced phase has two blocks."""
    phases_ = [ph for ph in base.priced if len(base.phase(ph).block_whole_ms) >= 2]
    if not phases_:
        return None
    rng = np.random.default_rng(options.seed)
    central = {r.key: phase_gains(r, base) for r in rows if r is not base}
    picks: dict[str, int] = {}
    for _ in range(BOOTSTRAP):
        idx = {
            ph: rng.integers(0, len(base.phase(ph).block_whole_ms), len(base.phase(ph).block_whole_ms))
            for ph in phases_
        }
        table = {}
        for r in rows:
            if r is base:
                continue
            per = dict(central[r.key])
            for ph in phases_:
                g, band, lo, hi = per[ph]
                gb = _block_means(base, ph, idx[ph]) / _block_means(r, ph, idx[ph]) - 1.0
                per[ph] = (gb, band, lo - g + gb, hi - g + gb)
            table[r.key] = net_of(per)
        key = _key(choose(rows, base, available, options.min_gain, gains=table).row, base)
        picks[key] = picks.get(key, 0) + 1
    share = picks.get(chosen, 0) / BOOTSTRAP
    option = chosen if share >= AGREE else max((k for k in picks if k != chosen), key=lambda k: picks[k])
    return Check(
        "bootstrap", round(share, 3), option, f"{share * 100:.0f}% of {BOOTSTRAP} resamples keep {chosen}"
    )


# ---------------------------------------------------------------------------------------------
# sweep over the knobs not pinned
# ---------------------------------------------------------------------------------------------
def _values(knob: str, options: AdviseOptions, held_tokens: int) -> list:
    now = knob_value(options, knob)
    if knob == "overlap":
        return ["off" if now == "on" else "on"]
    out = []
    for f in _FACTORS[knob]:
        v = max(1, int(now * f))
        if knob == "decode_step_tokens" and v * options.ep_size > held_tokens:
            continue  # a decode step larger than the held-out half
        if knob == "prefill_step_tokens":
            v = min(v, max(1, held_tokens // options.ep_size))
        if v != now and v not in out:
            out.append(v)
    return out


def contenders(rows: list[Row], base: Row, available: Mapping, chosen: Row) -> list[Row]:
    """The chosen row and the :data:`CONTENDERS` best other runnable rows by central net gain."""
    ranked = sorted(
        (r for r in rows if r is not base and r is not chosen and available[r.key][0]),
        key=lambda r: -net_gain(r, base)["net"],
    )
    return ([chosen] if chosen is not base else []) + ranked[:CONTENDERS]


def _repriced(inp, rows: list[Row], placements: Mapping, opts: AdviseOptions, knob: str) -> list[Row]:
    """``rows`` priced again under ``opts`` on the phases ``knob`` changes, memory re-checked."""
    phases_ = [ph for ph in _AFFECTS.get(knob, opts.priced_phases) if ph in opts.priced_phases]
    steps = {ph: st for ph, st in pricing.held_steps(inp.held, opts).items() if ph in phases_}
    out = []
    for r in rows:
        p = pricing.price(
            placements[r.placement_key], inp.held, steps, r.dispatch, inp.model, inp.cluster, opts
        )
        mem = pricing.memory(inp.model, inp.cluster, opts, r.redundant_per_gpu)
        out.append(
            replace(r, decode=p.get("decode", r.decode), prefill=p.get("prefill", r.prefill), memory=mem)
        )
    return out


def _at_context(inp, row: Row, opts: AdviseOptions, old: int) -> Row:
    """``row`` at ``opts.context_len`` (:func:`...phases.with_context`), memory re-checked."""
    new = opts.context_len
    moved = {ph: phases.with_context(row.phase(ph), inp.model, inp.cluster, old, new) for ph in row.priced}
    mem = pricing.memory(inp.model, inp.cluster, opts, row.redundant_per_gpu)
    return replace(row, decode=moved.get("decode"), prefill=moved.get("prefill"), memory=mem)


def _shifted(old: Row, new: Row, base_old: Row, base_new: Row) -> dict:
    """``new``'s net figures, each phase's range keeping its width around the old central gain."""
    before, after = phase_gains(old, base_old), phase_gains(new, base_new)
    per = {}
    for ph, (g, band, _, _) in after.items():
        g0, _, lo0, hi0 = before[ph]
        per[ph] = (g, band, g + lo0 - g0, g + hi0 - g0)
    return net_of(per)


def sweep(inp, dec, options: AdviseOptions, progress: pricing.Progress) -> list[Check]:
    """One :class:`Check` per value tried of each knob not pinned."""
    pinned = set(options.pinned or ())
    tries = [(k, v) for k in KNOBS if k not in pinned for v in _values(k, options, inp.held.num_tokens)]
    keep = [dec.base, *contenders(dec.rows, dec.base, dec.available, dec.choice.row)]

    def one(knob: str, value) -> Check:
        opts = with_knob(options, knob, value)
        if knob == "context_len" and options.overlap != "on":  # only attention changes: every row, exactly
            old = [r for r in dec.rows if r is not dec.base]
            rows = [_at_context(inp, r, opts, options.context_len) for r in [dec.base, *old]]
            base = rows[0]
            if not base.memory.fits:
                return Check(
                    knob, value, NOTHING_FITS, "the KV cache of the decode batch x context does not fit"
                )
            table = {n.key: _shifted(o, n, dec.base, base) for o, n in zip(old, rows[1:])}
            return Check(
                knob, value, _key(choose(rows, base, dec.available, opts.min_gain, gains=table).row, base)
            )
        rows = _repriced(inp, keep, dec.placements, opts, knob)
        base = rows[0]
        if not base.memory.fits:
            return Check(knob, value, NOTHING_FITS, "the KV cache of the decode batch x context does not fit")
        table = {n.key: _shifted(o, n, dec.base, base) for o, n in zip(keep[1:], rows[1:])}
        return Check(
            knob, value, _key(choose(rows, base, dec.available, opts.min_gain, gains=table).row, base)
        )

    steps: list[tuple[str, Callable[[], Check]]] = [
        (f"{k}={v}", lambda k=k, v=v: one(k, v)) for k, v in tries
    ]
    return pricing.run_stage(steps, progress, "stability: sweep") if steps else []


def check(inp, dec, options: AdviseOptions, progress: pricing.Progress) -> Stability:
    """Every check of the module docstring, for the choice ``dec`` made on ``inp``."""
    chosen = _key(dec.choice.row, dec.base)
    unknown = tuple(
        f"the {ph} figures rest on one held-out step: their band cannot be estimated"
        for ph in dec.base.priced
        if len(dec.base.phase(ph).block_whole_ms) < 2
    )
    if not options.stability:
        return Stability(chosen, (), ("not checked (stability=False)",))
    checks = [swapped(inp, options, progress)]
    boot = bootstrap(dec.rows, dec.base, dec.available, options, chosen)
    checks += [boot] if boot is not None else []
    checks += sweep(inp, dec, options, progress)
    return Stability(chosen, tuple(checks), unknown)
