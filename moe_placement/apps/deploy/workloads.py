"""Request mixes for the deployment simulator: prompt and output lengths, and when requests arrive.

Three sources of lengths:

- **built-in mixes** (:data:`BUILTIN_WORKLOADS`), lognormal lengths whose shape is chosen to look like a
  public workload. The parameters are ours (set, not fitted to the datasets):

  - ``chat``: conversations like ShareGPT. The vLLM paper (Kwon et al., SOSP 2023, its dataset figure)
    reports ShareGPT means of 161 prompt and 338 output tokens; we use medians 100 and 250 with spreads
    that put the means near those figures.
  - ``summarization``: long documents, short summaries (the shape of LongBench's and arXiv's
    summarization sets): prompts median 4,000 tokens (most between 1,000 and 16,000), outputs median 200.
  - ``code``: code completion like HumanEval (a function signature and docstring in, a body out):
    prompts median 150, outputs median 80.
- **a JSON workload** (:func:`load_workload`): ``{"name", "source", "prompt": LENGTHS, "output":
  LENGTHS, "requests": [...]}`` where ``LENGTHS`` is ``{"median": M, "sigma": S}`` (lognormal),
  ``{"fixed": N}`` or ``{"values": [N, ...]}`` (resampled), and the optional ``requests`` list
  ``[{"arrival_s", "prompt_len", "output_len"}, ...]`` replays a request trace (its lengths in order, its
  arrival pattern scaled to each simulated rate);
- **a routing trace's prompts** (:func:`trace_workload`): the prompt lengths between its ``seq_offsets``,
  resampled; outputs from a mix (the trace records prompts only).

Arrivals: Poisson at the simulated rate (seeded exponential gaps), or a recorded pattern scaled so its
mean rate is the simulated one. The same seed gives the same requests at every rate (common random
numbers: the goodput search compares rates on the same requests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.limits import MAX_STEP_TOKENS

__all__ = [
    "BUILTIN_WORKLOADS",
    "MAX_REQUESTS",
    "Lengths",
    "Requests",
    "WorkloadSpec",
    "load_workload",
    "sample_requests",
    "trace_workload",
    "with_fixed_lengths",
]

MAX_REQUESTS = 1_000_000  # requests one simulation holds (a few arrays of this length)
MAX_LENGTH = MAX_STEP_TOKENS  # tokens of one prompt or output


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``lognormal`` (``median``, ``sigma``), ``fixed`` (``median``) or
    ``empirical`` (``values``, resampled with replacement); samples are clipped to ``[1, MAX_LENGTH]``."""

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "fixed", "empirical"):
            raise ValueError(f"length kind must be lognormal, fixed or empirical, got {self.kind!r}")
        if self.kind == "empirical":
            if not self.values or min(self.values) < 1 or max(self.values) > MAX_LENGTH:
                raise ValueError(f"empirical lengths must be a non-empty list of integers in 1..{MAX_LENGTH}")
            return
        if not (math.isfinite(self.median) and 1 <= self.median <= MAX_LENGTH):
            raise ValueError(f"a length median must be in 1..{MAX_LENGTH} tokens, got {self.median!r}")
        if not (math.isfinite(self.sigma) and 0 <= self.sigma <= 4):
            raise ValueError(f"a lognormal sigma must be in [0, 4], got {self.sigma!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """int64 ``[n]`` lengths."""
        if self.kind == "fixed":
            out = np.full(n, self.median)
        elif self.kind == "empirical":
            out = np.asarray(self.values, dtype=np.float64)[rng.integers(0, len(self.values), size=n)]
        else:
            out = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(np.round(out), 1, MAX_LENGTH).astype(np.int64)

    def typical(self) -> int:
        """The median length."""
        if self.kind == "empirical":
            return int(np.median(self.values))
        return int(round(self.median))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.typical()}"
        if self.kind == "empirical":
            return f"{len(self.values)} recorded lengths (median {self.typical()}), resampled"
        return f"lognormal median {self.typical()}, sigma {self.sigma:g}"


@dataclass(frozen=True)
class WorkloadSpec:
    """A request mix: prompt and output lengths, where they come from, and an optional recorded
    request list (``requests``: ``(arrival_s, prompt_len, output_len)`` rows, replayed in order)."""

    name: str
    prompt: Lengths
    output: Lengths
    source: str
    requests: tuple[tuple[float, int, int], ...] = ()

    def describe(self) -> str:
        what = (
            f"{len(self.requests)} recorded requests"
            if self.requests
            else (f"prompts {self.prompt.describe()}, outputs {self.output.describe()}")
        )
        return f"{self.name}: {what} ({self.source})"


_SHAPES = "our lognormal parameters, set to the shape, not fitted to the dataset"
BUILTIN_WORKLOADS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec(
        "chat",
        Lengths("lognormal", 100, 0.98),
        Lengths("lognormal", 250, 0.78),
        "shaped like ShareGPT conversations (means near the 161 prompt / 338 output tokens the vLLM paper "
        f"reports); {_SHAPES}",
    ),
    "summarization": WorkloadSpec(
        "summarization",
        Lengths("lognormal", 4000, 0.7),
        Lengths("lognormal", 200, 0.5),
        f"shaped like document summarization (LongBench, arXiv summaries: long prompts, short outputs); {_SHAPES}",
    ),
    "code": WorkloadSpec(
        "code",
        Lengths("lognormal", 150, 0.5),
        Lengths("lognormal", 80, 0.7),
        f"shaped like code completion (HumanEval: a signature and docstring in, a body out); {_SHAPES}",
    ),
}


@dataclass(frozen=True, eq=False)
class Requests:
    """Requests to simulate: int64 ``prompt [n]``, ``output [n]`` and float64 ``unit_arrival_s [n]`` (the
    arrival times at a mean rate of 1 request/s; at rate ``r`` they are divided by ``r``). ``clipped``:
    how many were shortened to fit the model's context."""

    prompt: np.ndarray
    output: np.ndarray
    unit_arrival_s: np.ndarray
    clipped: int = 0

    @property
    def n(self) -> int:
        return int(self.prompt.size)

    def head(self, n: int) -> Requests:
        """The first ``n`` requests (the same arrivals: a prefix of the sample)."""
        if n >= self.n:
            return self
        clipped = self.clipped if self.clipped == 0 else int(self.clipped * n / self.n)
        return Requests(self.prompt[:n], self.output[:n], self.unit_arrival_s[:n], clipped)


def _lengths(d: Any, where: str) -> Lengths:
    """A ``LENGTHS`` object of a JSON workload (module docstring)."""
    if not isinstance(d, dict) or len(set(d) & {"median", "fixed", "values"}) != 1:
        raise ValueError(f"{where}: give exactly one of median (+ sigma), fixed or values, got {d!r}")
    extra = set(d) - {"median", "sigma", "fixed", "values"}
    if extra:
        raise ValueError(f"{where}: unknown keys {sorted(extra)}; known: median, sigma, fixed, values")
    if "fixed" in d:
        return Lengths("fixed", _number(d["fixed"], where))
    if "values" in d:
        vals = d["values"]
        if not isinstance(vals, list) or not vals or len(vals) > MAX_REQUESTS:
            raise ValueError(f"{where}: values must be a non-empty list of at most {MAX_REQUESTS} lengths")
        return Lengths("empirical", values=tuple(int(_number(v, where)) for v in vals))
    return Lengths("lognormal", _number(d["median"], where), _number(d.get("sigma", 0.0), where, 0))


def _number(v: Any, where: str, lo: float = 1) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{where}: expected a number >= {lo:g}, got {v!r}")
    return float(v)


def _request_rows(rows: Any, where: str) -> tuple[tuple[float, int, int], ...]:
    if not isinstance(rows, list) or not rows or len(rows) > MAX_REQUESTS:
        raise ValueError(f"{where}: requests must be a non-empty list of at most {MAX_REQUESTS} rows")
    out = []
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or set(r) != {"arrival_s", "prompt_len", "output_len"}:
            raise ValueError(f"{where}: requests[{i}] must have exactly arrival_s, prompt_len, output_len")
        t = _number(r["arrival_s"], f"{where}: requests[{i}].arrival_s", 0)
        p = _number(r["prompt_len"], f"{where}: requests[{i}].prompt_len")
        o = _number(r["output_len"], f"{where}: requests[{i}].output_len")
        if max(p, o) > MAX_LENGTH:
            raise ValueError(f"{where}: requests[{i}] is longer than {MAX_LENGTH} tokens")
        out.append((t, int(p), int(o)))
    times = [r[0] for r in out]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"{where}: requests must be in arrival order (arrival_s not decreasing)")
    return tuple(out)


def load_workload(name_or_path: str | Path | WorkloadSpec) -> WorkloadSpec:
    """A built-in mix by name (``chat``, ``summarization``, ``code``), a JSON workload file (module
    docstring), or a :class:`WorkloadSpec` as it is."""
    from moe_placement.base.fileio import load_json

    if isinstance(name_or_path, WorkloadSpec):
        return name_or_path
    key = str(name_or_path)
    if key in BUILTIN_WORKLOADS:
        return BUILTIN_WORKLOADS[key]
    if not key.endswith(".json") and not Path(key).is_file():
        raise ValueError(f"unknown workload {key!r}: use {', '.join(BUILTIN_WORKLOADS)} or a .json file")
    d = load_json(key, max_bytes=256 * 1024**2)
    if not isinstance(d, dict):
        raise ValueError(f"{key}: a workload is a JSON object")
    extra = set(d) - {"name", "source", "prompt", "output", "requests"}
    if extra:
        raise ValueError(
            f"{key}: unknown keys {sorted(extra)}; known: name, source, prompt, output, requests"
        )
    rows = _request_rows(d["requests"], key) if "requests" in d else ()
    if rows:
        prompt = Lengths("empirical", values=tuple(r[1] for r in rows))
        output = Lengths("empirical", values=tuple(r[2] for r in rows))
    elif "prompt" in d and "output" in d:
        prompt, output = _lengths(d["prompt"], f"{key}: prompt"), _lengths(d["output"], f"{key}: output")
    else:
        raise ValueError(f"{key}: give prompt and output lengths, or a requests list")
    return WorkloadSpec(str(d.get("name", Path(key).stem)), prompt, output, str(d.get("source", key)), rows)


def trace_workload(trace, output: WorkloadSpec | None = None) -> WorkloadSpec:
    """Prompt lengths of a routing trace's prompts (``seq_offsets``), outputs from ``output`` (default
    the ``chat`` mix): the trace records what the model read, not what it wrote."""
    off = getattr(trace, "seq_offsets", None)
    if off is None or len(off) < 2:
        raise ValueError("the trace has no prompt boundaries (seq_offsets): give --workload or --prompt-len")
    lengths = np.diff(np.asarray(off, dtype=np.int64))
    lengths = lengths[lengths > 0]
    out = output or BUILTIN_WORKLOADS["chat"]
    return WorkloadSpec(
        f"trace {trace.name or 'prompts'}",
        Lengths("empirical", values=tuple(int(x) for x in np.minimum(lengths, MAX_LENGTH))),
        out.output,
        f"prompt lengths of the trace's {lengths.size} prompts; outputs of {out.name} ({out.output.describe()})",
    )


def with_fixed_lengths(spec: WorkloadSpec, prompt_len: int | None, output_len: int | None) -> WorkloadSpec:
    """``spec`` with its prompt and/or output length fixed (``--prompt-len``, ``--output-len``)."""
    for name, v in (("prompt_len", prompt_len), ("output_len", output_len)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= MAX_LENGTH
        ):
            raise ValueError(f"{name} must be a whole number of tokens in 1..{MAX_LENGTH}, got {v!r}")
    if prompt_len is None and output_len is None:
        return spec
    prompt = Lengths("fixed", float(prompt_len)) if prompt_len is not None else spec.prompt
    output = Lengths("fixed", float(output_len)) if output_len is not None else spec.output
    fixed = ", ".join(
        f"{k} fixed at {v}" for k, v in (("prompts", prompt_len), ("outputs", output_len)) if v is not None
    )
    return replace(spec, prompt=prompt, output=output, requests=(), source=f"{spec.source}; {fixed}")


def _check_context(spec: WorkloadSpec, context: int | None) -> None:
    """ValueError when the typical request (median prompt + median output) is longer than the context."""
    if context is None:
        return
    p, o = spec.prompt.typical(), spec.output.typical()
    if p + o > context:
        raise ValueError(
            f"workload {spec.name!r} is longer than the model's context: prompt {p} + output {o} = {p + o} "
            f"tokens > {context}; use shorter --prompt-len/--output-len or a model with a longer context"
        )


def sample_requests(spec: WorkloadSpec, n: int, seed: int = 0, context: int | None = None) -> Requests:
    """``n`` requests of ``spec`` (a recorded request list: its first ``n`` rows, in order), seeded.
    Requests longer than ``context`` are shortened (prompt first kept, output cut) and counted."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_REQUESTS:
        raise ValueError(f"requests must be a whole number in 1..{MAX_REQUESTS}, got {n!r}")
    _check_context(spec, context)
    rng = np.random.default_rng(seed)
    if spec.requests:
        rows = np.asarray(spec.requests[:n], dtype=np.float64)  # [n, 3]
        t = rows[:, 0] - rows[0, 0]
        span = t[-1] if rows.shape[0] > 1 and t[-1] > 0 else 1.0
        unit = t * (rows.shape[0] / span)  # mean rate 1 request/s
        prompt, output = rows[:, 1].astype(np.int64), rows[:, 2].astype(np.int64)
    else:
        unit = np.cumsum(rng.exponential(1.0, size=n))
        prompt, output = spec.prompt.sample(rng, n), spec.output.sample(rng, n)
    clipped = 0
    if context is not None:
        prompt_c = np.minimum(prompt, context - 1)
        output_c = np.minimum(output, context - prompt_c)
        clipped = int(((prompt_c != prompt) | (output_c != output)).sum())
        prompt, output = prompt_c, output_c
    return Requests(prompt, output, np.asarray(unit, dtype=np.float64), clipped)
