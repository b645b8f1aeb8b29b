"""A multi-domain request mix with per-token routing, drawn from real per-window expert counts.

Real traces with several domains hold counts, not per-token picks: OLMoE's routing analysis gives one
count vector per domain and layer, the Mixtral MMLU trace one per question (its subject names the
domain). Routing requests needs per-token picks, so :func:`mix_from_counts` draws them: each request
takes one window (a question, or a domain), its length from a lognormal, and each of its tokens draws
its top-k in every layer without replacement from the window's per-layer expert shares (Gumbel top-k,
a Plackett-Luce draw: the shares are matched in the first pick and approximately in the later ones).
``request_noise`` multiplies the window's shares by a lognormal factor per request and expert, for
requests of one domain that are not alike (a window that is one question already has its own counts;
use 0 there). Layers are drawn independently, so co-activation across layers is not kept.

It is synthetic per-token routing shaped by real counts; every trace it returns says so in
``metadata["synthetic"]`` and names its windows and each request's domain.

Shapes: W windows, L layers, E experts, k top-k, Q requests, T tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from profiling.trace import RoutingTrace

__all__ = ["MAX_MIX_CELLS", "MixSpec", "mix_from_counts"]

MAX_MIX_CELLS = 1 << 28  # token x layer x pick cells one mix holds (int16: 0.5 GiB), as synthetic traces


@refuse_unknown_keywords
@dataclass(frozen=True)
class MixSpec:
    """How the mix is drawn; a bad value is a ValueError naming it.

    Attributes:
        num_requests: ``Q``.
        mean_tokens: mean tokens per request (lognormal lengths, at least 2 tokens).
        length_sigma: the lognormal's sigma (spread of the lengths).
        request_noise: sigma of the per-request, per-expert lognormal factor on the window's shares.
        weights: the share of requests per domain (domain name -> weight; None: windows drawn uniformly,
            so domains in proportion to their windows).
        seed: makes the mix reproducible.
    """

    num_requests: int = 2000
    mean_tokens: int = 128
    length_sigma: float = 0.6
    request_noise: float = 0.5
    weights: Mapping[str, float] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        check_whole("num_requests", self.num_requests, 1, 1 << 24)
        check_whole("mean_tokens", self.mean_tokens, 2, 1 << 20)
        check_whole("seed", self.seed, 0, 2**32 - 1)
        for name in ("length_sigma", "request_noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not (0 <= v <= 5):
                raise ValueError(f"{name} must be a number in [0, 5], got {v!r}")


def _domains(trace: RoutingTrace, group: Mapping[str, str] | None) -> tuple[list[str], np.ndarray]:
    """Domain names and each window's domain index ``[W]`` (a window's label, or its group)."""
    W = trace.window_counts.shape[0]  # type: ignore[union-attr]
    labels = list(trace.window_labels) if trace.window_labels else [f"window{i}" for i in range(W)]
    if group is not None:
        missing = sorted({lab for lab in labels if lab not in group})
        if missing:
            raise ValueError(
                f"the domain grouping does not name {len(missing)} window label(s), e.g. {missing[:3]}"
            )
        labels = [str(group[lab]) for lab in labels]
    names = sorted(set(labels))
    return names, np.array([names.index(lab) for lab in labels], dtype=np.int64)


def _pick_windows(rng, domain: np.ndarray, names: Sequence[str], spec: MixSpec) -> np.ndarray:
    """The window of each request ``[Q]``: a domain by ``spec.weights``, then one of its windows."""
    Q = int(spec.num_requests)
    if spec.weights is None:
        return rng.integers(0, domain.size, size=Q)
    unknown = sorted(set(spec.weights) - set(names))
    if unknown:
        raise ValueError(
            f"weights name domain(s) {unknown[:3]} the trace does not have; it has {list(names)}"
        )
    w = np.array([float(spec.weights.get(n, 0.0)) for n in names])
    if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"domain weights must be >= 0 with a positive sum, got {dict(spec.weights)}")
    d = rng.choice(len(names), size=Q, p=w / w.sum())
    members = [np.flatnonzero(domain == i) for i in range(len(names))]
    return np.array([members[i][rng.integers(0, members[i].size)] for i in d], dtype=np.int64)


def mix_from_counts(
    trace: RoutingTrace,
    top_k: int,
    spec: MixSpec | None = None,
    group: Mapping[str, str] | None = None,
) -> RoutingTrace:
    """A per-token trace of requests drawn from ``trace``'s window counts (module docstring).

    Args:
        trace: a trace with ``window_counts [W, L, E]`` (domains, questions), labelled or not.
        top_k: picks per token (the model's k, which a counts-only trace does not record).
        spec: :class:`MixSpec` (default ``MixSpec()``).
        group: window label -> domain name (e.g. MMLU subjects to their categories); None: each label
            is a domain.

    Returns:
        RoutingTrace with ``topk_ids [T, L, k]`` and ``seq_offsets [Q + 1]``; ``metadata`` holds
        ``synthetic``, ``domains`` (names), ``request_domain`` and ``request_window`` (per request).
    """
    spec = spec if spec is not None else MixSpec()
    if trace.window_counts is None:
        raise ValueError("mix_from_counts needs a trace with window counts (per domain or per question)")
    wc = np.asarray(trace.window_counts, dtype=np.float64)  # [W, L, E]
    W, L, E = wc.shape
    k = check_whole(
        "top_k", top_k, 1, E - 1, fix=f"the model's experts per token (fewer than its {E} experts)"
    )
    names, domain = _domains(trace, group)
    rng = np.random.default_rng(spec.seed)
    window = _pick_windows(rng, domain, names, spec)
    mu = np.log(spec.mean_tokens) - spec.length_sigma**2 / 2
    lengths = np.maximum(np.round(rng.lognormal(mu, spec.length_sigma, size=window.size)), 2).astype(np.int64)
    if int(lengths.sum()) * L * k > MAX_MIX_CELLS:
        raise ValueError(
            f"{int(lengths.sum())} tokens x {L} layers x top-{k} = {int(lengths.sum()) * L * k} cells, over "
            f"the {MAX_MIX_CELLS} a mix may hold; ask for fewer requests or shorter ones"
        )
    ids = np.empty((int(lengths.sum()), L, k), dtype=np.int16 if E < 32767 else np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    with np.errstate(divide="ignore"):
        logp = np.log(wc / np.maximum(wc.sum(axis=2, keepdims=True), 1e-300))  # [W, L, E]
    for q in range(window.size):
        lp = logp[window[q]]
        if spec.request_noise > 0:
            lp = lp + rng.normal(0.0, spec.request_noise, size=(L, E))
        n = int(lengths[q])
        g = lp[None] - np.log(-np.log(rng.random((n, L, E))))  # [n, L, E] Gumbel keys
        ids[offsets[q] : offsets[q + 1]] = np.argpartition(-g, k - 1, axis=2)[:, :, :k]
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=trace.layer_ids,
        seq_offsets=offsets,
        name=f"{trace.name}-mix",
        metadata={
            "synthetic": True,
            "generator": "profiling.mixture.mix_from_counts",
            "source": trace.name,
            "domains": names,
            "request_domain": domain[window].tolist(),
            "request_window": window.tolist(),
            "params": {
                "num_requests": int(spec.num_requests),
                "mean_tokens": int(spec.mean_tokens),
                "length_sigma": float(spec.length_sigma),
                "request_noise": float(spec.request_noise),
                "top_k": k,
                "seed": int(spec.seed),
            },
        },
    )
