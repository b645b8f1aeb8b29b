"""What ``moe-placement calibrate`` measures and how its timings become a hardware preset (numpy only).

The runtime that times things lives in :mod:`runtime_hooks.calibrate`; this module owns the two ends
that belong to the cost model:

- the message plans (:func:`a2a_points`): the bytes every rank sends every other rank in one dispatch
  or combine of the model, for decode and prefill token counts, over the intra-node or the inter-node
  pairs, with uniform receivers or one receiver ``skew`` times the mean. The per-GPU bytes come from
  :func:`placement.cost.traffic.traffic_bytes` (the step-time model's own traffic) under uniform
  routing, so the sizes measured are the sizes priced;
- the fits: :func:`fit_link` (``t = latency + busiest bytes / bytes_per_s``, least squares over the
  medians of the repeats, with R^2 and how time follows the busiest receiver), :func:`fit_gemm`
  (``t = max(F / C, M / B) + t0``, the grouped-GEMM model of :func:`placement.cost.primitives.gemm_time`)
  and :func:`spread` (min / median / p90 of repeated runs).

Shapes: G ranks, n points, R repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import kernel_of_phase
from placement.cost.traffic import traffic_bytes
from placement.steps import PHASES

__all__ = [
    "A2APoint",
    "GEMM_NOISE",
    "GemmFit",
    "LinkFit",
    "LINKS_MEASURED",
    "OPS",
    "a2a_points",
    "fit_gemm",
    "fit_link",
    "gemm_shapes",
    "gemm_work",
    "link_pairs",
    "routed_points",
    "routed_traffic",
    "skewed_topk",
    "sweep",
    "spread",
]

LINKS_MEASURED = ("intra", "inter")  # the pairs of ranks an all-to-all point exercises
OPS = ("dispatch", "combine")

# The sweep: tokens per rank of one step (decode: sequences in flight per rank; prefill: a chunk), the
# busiest receiver's share against the mean, the repeats of each point, back-to-back calls per sample
# and the tokens per expert of the grouped GEMM. --quick: fewer of each.
_SWEEPS = {
    "full": {
        "decode": (16, 32, 64, 128, 256),
        "prefill": (1024, 2048, 4096, 8192),
        "skews": (1.0, 1.5, 2.0, 2.5),
        "repeats": 10,
        "inner": {"decode": 10, "prefill": 2},
        "gemm": {"decode": (1, 2, 4, 8, 16, 32, 64), "prefill": (128, 256, 512, 1024, 2048)},
        "gemm_cpu": {"decode": (1, 2, 4, 8, 16, 32, 64), "prefill": (128, 256)},
    },
    "quick": {
        "decode": (32, 128),
        "prefill": (1024, 4096),
        "skews": (1.0, 2.5),
        "repeats": 3,
        "inner": {"decode": 3, "prefill": 1},
        "gemm": {"decode": (1, 8, 32), "prefill": (256, 1024)},
        "gemm_cpu": {"decode": (1, 2, 4, 8, 16, 32, 64), "prefill": (128,)},
    },
}


def sweep(quick: bool) -> dict:
    """The sweep's settings (a copy): ``decode``/``prefill`` token counts per rank, ``skews``,
    ``repeats``, ``inner`` calls per sample by phase, ``gemm`` tokens per expert by phase (``gemm_cpu``:
    on a CPU core, the small counts that fit its budget, :data:`runtime_hooks.calibrate_kernels.CPU_GEMM_FLOPS`)."""
    s = _SWEEPS["quick" if quick else "full"]
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in s.items()}


@dataclass(frozen=True)
class A2APoint:
    """One all-to-all to time: the bytes rank ``i`` sends rank ``j``.

    Attributes:
        link: ``intra`` (pairs inside a node) or ``inter`` (pairs across nodes).
        phase: ``decode`` (low-latency kernels' traffic) or ``prefill`` (normal, node-deduplicated).
        op: ``dispatch`` or ``combine`` (its payload per token).
        step_tokens: tokens each rank holds in the step.
        skew: the busiest receiver's bytes over the mean receiver's (1.0: uniform).
        splits: int64 ``[G, G]`` bytes from rank ``i`` (row) to rank ``j`` (column); diagonal 0.
    """

    link: str
    phase: str
    op: str
    step_tokens: int
    skew: float
    splits: np.ndarray

    @property
    def send(self) -> np.ndarray:
        """Bytes each rank sends, int64 ``[G]``."""
        return self.splits.sum(axis=1)

    @property
    def recv(self) -> np.ndarray:
        """Bytes each rank receives, int64 ``[G]``."""
        return self.splits.sum(axis=0)

    @property
    def busiest(self) -> float:
        """The busiest GPU's bytes, sent or received (what the cost model prices)."""
        return float(max(self.send.max(), self.recv.max()))

    @property
    def mean_recv(self) -> float:
        return float(self.recv.mean())

    def key(self) -> str:
        return f"{self.link}/{self.phase}/{self.op}/{self.step_tokens}/{self.skew:g}"


def link_pairs(ranks: int, gpus_per_node: int, link: str, kernel: str) -> np.ndarray:
    """bool ``[G, G]``: the pairs one link carries. Intra: other ranks of the node. Inter: every rank of
    another node (low-latency kernels), or only the same-index rank of each other node (normal kernels:
    a token crosses once per remote node, landing on that GPU)."""
    idx = np.arange(ranks)
    node = idx // gpus_per_node
    same = node[:, None] == node[None, :]
    if link == "intra":
        return same & (idx[:, None] != idx[None, :])
    across = ~same
    if kernel == "normal":
        across &= (idx % gpus_per_node)[:, None] == (idx % gpus_per_node)[None, :]
    return across


def _receiver_factors(G: int, skew: float, hot: int = 0) -> np.ndarray:
    """float ``[G]``: receiver ``hot`` gets ``skew`` times the mean, the others share the rest evenly."""
    factor = np.full(G, (G - skew) / (G - 1))
    factor[hot] = skew
    return factor


def _skewed(splits: np.ndarray, skew: float, hot: int = 0) -> np.ndarray:
    """Scale every column of ``splits`` ``[G, G]`` by :func:`_receiver_factors` (the total is unchanged)."""
    return splits * _receiver_factors(splits.shape[0], skew, hot)[None, :]


def _uniform_bytes(model: ModelSpec, ranks: int, gpus_per_node: int, tokens: int, kernel: str, op: str):
    """Each rank's dispatch (or combine) bytes over (NVLink, RDMA), float ``[G, 2]``, under uniform
    routing of ``tokens`` per rank: :func:`traffic_bytes` of the step-time model."""
    picks = np.full((1, ranks, ranks), tokens * model.top_k / ranks)  # [1, G, G]
    held = np.full((1, ranks), float(tokens))
    payload = model.dispatch_bytes_per_token if op == "dispatch" else model.combine_bytes_per_token
    send, _ = traffic_bytes(picks, held, gpus_per_node, model.top_k, kernel, payload)
    return send[0]


def self_send_bytes(model: ModelSpec, tokens: int) -> int:
    """Dispatch bytes one rank sends itself when all its ``tokens`` pick experts it holds (a one-rank
    all-to-all, the device check's shape): ``tokens x top_k`` copies of one token's payload."""
    return int(tokens * model.top_k * model.dispatch_bytes_per_token)


def a2a_points(
    model: ModelSpec, ranks: int, gpus_per_node: int, quick: bool, max_rank_bytes: float
) -> tuple[list[A2APoint], list[str]]:
    """Every all-to-all of the sweep, and a note per point left out.

    Links: ``intra`` when a node holds two ranks or more, ``inter`` when there are two nodes or more
    (``ranks`` must be a multiple of ``gpus_per_node``). A skew above ``ranks`` cannot be made (every
    other receiver would get less than nothing): it becomes ``ranks`` (all to one). A point where one rank would
    send or receive more than ``max_rank_bytes`` (the buffers are allocated once, at the largest point).
    """
    if ranks < 2 or gpus_per_node < 1 or ranks % gpus_per_node:
        raise ValueError(
            f"ranks {ranks} must be >= 2 and a multiple of gpus_per_node {gpus_per_node}: nodes hold equal ranks"
        )
    s = sweep(quick)
    links = [k for k, ok in (("intra", gpus_per_node > 1), ("inter", ranks > gpus_per_node)) if ok]
    skews = sorted({min(float(x), float(ranks)) for x in s["skews"]})
    points, notes = [], []
    for link in links:
        for phase in PHASES:
            kernel = kernel_of_phase(phase)
            pairs = link_pairs(ranks, gpus_per_node, link, kernel)
            col = 0 if link == "intra" else 1
            for op in OPS:
                for b in s[phase]:
                    per_rank = _uniform_bytes(model, ranks, gpus_per_node, b, kernel, op)[:, col]  # [G]
                    base = pairs * (per_rank / np.maximum(pairs.sum(axis=1), 1))[:, None]  # [G, G]
                    for sk in skews:
                        m = np.rint(_skewed(base, sk)).astype(np.int64)
                        worst = max(m.sum(axis=1).max(), m.sum(axis=0).max())
                        if worst > max_rank_bytes:
                            notes.append(
                                f"{link} {phase} {op} at {b} tokens/rank, skew {sk:g}: {worst / 1e6:.0f} MB "
                                f"per rank, over the {max_rank_bytes / 1e6:.0f} MB buffer limit: left out"
                            )
                            continue
                        points.append(A2APoint(link, phase, op, b, float(sk), m))
    return points, notes


# ---------------------------------------------------------------------------------------------
# Routed points: DeepEP's kernels take each token's experts, not byte counts
# ---------------------------------------------------------------------------------------------
def routed_points(ranks: int, gpus_per_node: int, quick: bool) -> list[dict]:
    """The DeepEP sweep: ``{"link", "phase", "step_tokens", "skew"}`` for every link, phase, token
    count and skew of :func:`sweep` (each rank draws its tokens' experts with :func:`skewed_topk`)."""
    s = sweep(quick)
    links = [k for k, ok in (("intra", gpus_per_node > 1), ("inter", ranks > gpus_per_node)) if ok]
    return [
        {"link": link, "phase": phase, "step_tokens": b, "skew": float(sk)}
        for link in links
        for phase in PHASES
        for b in s[phase]
        for sk in sorted({min(float(x), float(ranks)) for x in s["skews"]})
    ]


def skewed_topk(
    rng: np.random.Generator, rank: int, ranks: int, gpus_per_node: int, point: dict, top_k: int, experts: int
) -> np.ndarray:
    """One rank's routing for a routed point: int64 ``[T, k]`` distinct experts per token (-1: none),
    drawn among the experts of every rank the point's link reaches from ``rank`` (:func:`link_pairs` of
    the low-latency kernels: the normal kernels de-duplicate per node themselves),
    each rank's experts weighted by its receiver factor (rank 0 ``skew`` times the mean); Gumbel top-k.
    ``experts`` must be a multiple of ``ranks`` (rank ``r`` holds ``[r E/G, (r+1) E/G)``)."""
    per = experts // ranks
    reach = np.flatnonzero(link_pairs(ranks, gpus_per_node, point["link"], "low_latency")[rank])  # [d]
    ids = (reach[:, None] * per + np.arange(per)[None, :]).ravel()  # [d * per]
    weight = np.repeat(_receiver_factors(ranks, point["skew"])[reach], per)
    T, k = int(point["step_tokens"]), min(top_k, ids.size)
    with np.errstate(divide="ignore"):
        score = np.log(weight)[None, :] - np.log(-np.log(rng.random((T, ids.size))))  # [T, d * per]
    pick = np.argpartition(-score, k - 1, axis=1)[:, :k] if k else np.zeros((T, 0), dtype=np.int64)
    out = np.full((T, top_k), -1, dtype=np.int64)
    out[:, :k] = ids[pick]
    return out


def routed_traffic(
    pair_picks: np.ndarray, tokens: int, gpus_per_node: int, top_k: int, phase: str, payload: float, link: str
) -> tuple[float, float]:
    """``(busiest GPU's bytes, mean receiver's bytes)`` over ``link`` of a routed point, from the picks
    ``[G, G]`` (source rank, serving rank) every rank made: :func:`traffic_bytes` of the cost model."""
    G = pair_picks.shape[0]
    held = np.full((1, G), float(tokens))
    send, recv = traffic_bytes(
        pair_picks[None].astype(float), held, gpus_per_node, top_k, kernel_of_phase(phase), payload
    )
    col = 0 if link == "intra" else 1
    return float(max(send[0, :, col].max(), recv[0, :, col].max())), float(recv[0, :, col].mean())


# ---------------------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------------------
def spread(seconds: np.ndarray) -> dict:
    """Repeats of one point, float ``[R]`` -> ``{min, median, p90, rel_spread}`` (seconds;
    ``rel_spread = (p90 - min) / median``)."""
    t = np.asarray(seconds, dtype=np.float64)
    lo, med, p90 = float(t.min()), float(np.median(t)), float(np.quantile(t, 0.9))
    return {"min": lo, "median": med, "p90": p90, "rel_spread": (p90 - lo) / med if med > 0 else 0.0}


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """``y = a + b x`` by least squares: ``(a, b, R^2)`` (R^2 0 when ``y`` is constant)."""
    A = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - a - b * x) ** 2).sum()) / ss if ss > 0 else 0.0
    return float(a), float(b), r2


@dataclass(frozen=True)
class LinkFit:
    """``t = latency + busiest / bytes_per_s`` over one link and phase's points.

    Attributes:
        latency_s, bytes_per_s: the fit on the medians of the repeats (uniform and skewed runs).
        r2: its R^2 (``skew_r2`` in the summary: how well the busiest GPU's bytes explain the time).
        mean_r2: R^2 of the same fit against the mean receiver's bytes instead (for contrast).
        skew_slope: the slope of time against the busiest receiver's bytes at a fixed message size
            (skewed runs against the uniform one), times ``bytes_per_s``: 1.0 = a skewed run costs what
            its busiest receiver's bytes predict (the cost model's rule), 0 = only the total matters;
            None without skewed runs.
        band: ``(low, high)`` bytes/s: the fit on the p90 and on the minimum times.
        points: points fitted; note: what was clipped or bounded, '' when nothing.
    """

    latency_s: float
    bytes_per_s: float
    r2: float
    mean_r2: float
    skew_slope: float | None
    band: tuple[float, float]
    points: int
    note: str = ""

    def to_dict(self) -> dict:
        return {
            "latency_us": self.latency_s * 1e6,
            "bytes_per_s": self.bytes_per_s,
            "skew_slope": self.skew_slope,
            "skew_r2": self.r2,
            "mean_r2": self.mean_r2,
            "band_bytes_per_s": list(self.band),
            "points": self.points,
            "note": self.note,
        }


def _line(x: np.ndarray, t: np.ndarray) -> tuple[float, float, float, str]:
    """``(latency, bytes/s, R^2, note)`` of ``t = latency + x / B``; a negative intercept refits through
    the origin; a slope <= 0 (time did not grow with bytes) gives the lower bound ``max x / its time``."""
    a, b, r2 = _ols(x, t)
    if b <= 0 or len(np.unique(x)) < 2:
        i = int(np.argmax(x))
        return 0.0, float(x[i] / t[i]), r2, "time did not grow with bytes: bytes_per_s is a lower bound"
    if a < 0:
        b = float((x * t).sum() / (x * x).sum())
        return 0.0, 1.0 / b, r2, "negative intercept: refitted with latency 0"
    return a, 1.0 / b, r2, ""


def _within_slope(x: np.ndarray, t: np.ndarray, group: np.ndarray) -> float | None:
    """Least-squares slope of ``t`` on ``x`` inside groups (each group's mean removed): None when no
    group has two distinct ``x``."""
    dx, dt = np.zeros_like(x), np.zeros_like(t)
    for g in np.unique(group):
        m = group == g
        dx[m], dt[m] = x[m] - x[m].mean(), t[m] - t[m].mean()
    den = float((dx * dx).sum())
    return float((dx * dt).sum()) / den if den > 0 else None


def fit_link(busiest: np.ndarray, mean: np.ndarray, seconds: np.ndarray, group: np.ndarray) -> LinkFit:
    """Fit one link and phase.

    Args:
        busiest, mean: float ``[n]`` the busiest GPU's and the mean receiver's bytes of each point.
        seconds: float ``[n, R]`` the repeats of each point.
        group: int ``[n]`` points with equal message sizes (the same op and tokens per rank) share a
            group: they differ only in skew.
    """
    x, xm = np.asarray(busiest, float), np.asarray(mean, float)
    t_all = np.asarray(seconds, float)
    if x.size < 2:
        raise ValueError(f"a link fit needs two points or more, got {x.size}")
    t = np.median(t_all, axis=1)
    lat, bw, r2, note = _line(x, t)
    lo = _line(x, np.quantile(t_all, 0.9, axis=1))[1]
    hi = _line(x, t_all.min(axis=1))[1]
    within = _within_slope(x, t, np.asarray(group))
    return LinkFit(
        latency_s=lat,
        bytes_per_s=bw,
        r2=r2,
        mean_r2=_ols(xm, t)[2],
        skew_slope=None if within is None else within * bw,
        band=(min(lo, hi, bw), max(lo, hi, bw)),
        points=int(x.size),
        note=note,
    )


# ---------------------------------------------------------------------------------------------
# Grouped expert GEMM
# ---------------------------------------------------------------------------------------------
GEMM_NOISE = 0.01  # relative timing noise below which two GEMM fits are equally good


def gemm_shapes(quick: bool, cpu: bool = False) -> dict[str, tuple[int, ...]]:
    """Tokens per expert timed for each phase (``cpu``: the counts a CPU core times)."""
    return dict(sweep(quick)["gemm_cpu" if cpu else "gemm"])


def gemm_work(
    hidden: int, inter: int, experts: int, tokens: np.ndarray, weight_bytes: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(FLOPs, bytes)`` float ``[n]`` of one grouped GLU expert GEMM of ``experts`` experts, each with
    ``tokens[i]`` tokens: ``F = 6 d f n E``; ``M = E 3 d f b_w + n E (d b_w + 2 d + 4 f)`` (weights read
    once, the input at ``b_w``, a BF16 output, the ``4 f`` intermediate)."""
    n = np.asarray(tokens, dtype=np.float64)
    d, f, E = float(hidden), float(inter), float(experts)
    flops = 6.0 * d * f * n * E
    moved = E * 3.0 * d * f * weight_bytes + n * E * (d * weight_bytes + 2 * d + 4 * f)
    return flops, moved


@dataclass(frozen=True)
class GemmFit:
    """``t = max(F / flops_per_s, M / bytes_per_s) + overhead_s`` (:func:`placement.cost.primitives.gemm_time`).

    ``flops_per_s`` / ``bytes_per_s`` None: no point was in that regime, the figure is not identified
    (a preset keeps its base's). ``rms_log_error``: root mean square of ``log(model / measured)``.
    """

    flops_per_s: float | None
    bytes_per_s: float | None
    overhead_s: float
    rms_log_error: float

    def predict(self, flops: np.ndarray, moved: np.ndarray) -> np.ndarray:
        c = np.asarray(flops, float) / self.flops_per_s if self.flops_per_s else 0.0
        m = np.asarray(moved, float) / self.bytes_per_s if self.bytes_per_s else 0.0
        return np.maximum(c, m) + self.overhead_s


def _gemm_split(F: np.ndarray, M: np.ndarray, t: np.ndarray, k: int, with_t0: bool = True) -> GemmFit | None:
    """The fit with points ``[:k]`` memory-bound and ``[k:]`` compute-bound (sorted by ``F / M``): a
    relative least squares of ``t0 + M / B`` and ``t0 + F / C``; a negative ``t0`` refits without it;
    None when a figure still comes out negative."""
    mem = np.arange(t.size) < k
    cols = {"t0": np.ones_like(t), "mem": np.where(mem, M, 0.0), "comp": np.where(mem, 0.0, F)}
    if not with_t0:
        del cols["t0"]
    names = [n for n, c in cols.items() if c.any()]
    A = np.stack([cols[n] for n in names], axis=1) / t[:, None]
    sol, *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    p = dict(zip(names, sol))
    if p.get("t0", 0.0) < 0:
        return _gemm_split(F, M, t, k, with_t0=False) if with_t0 else None
    if p.get("mem", 1.0) <= 0 or p.get("comp", 1.0) <= 0:
        return None
    fit = GemmFit(
        1.0 / p["comp"] if "comp" in p else None,
        1.0 / p["mem"] if "mem" in p else None,
        float(p.get("t0", 0.0)),
        0.0,
    )
    err = np.log(np.maximum(fit.predict(F, M), 1e-30) / t)
    return GemmFit(fit.flops_per_s, fit.bytes_per_s, fit.overhead_s, float(np.sqrt(np.mean(err**2))))


def fit_gemm(flops: np.ndarray, moved: np.ndarray, seconds: np.ndarray) -> GemmFit:
    """Fit ``t = max(F / C, M / B) + t0`` to measured times, float ``[n]`` each (n >= 3).

    Pure numpy: for every split of the points (sorted by arithmetic intensity ``F / M``) into a
    memory-bound head and a compute-bound tail, a least squares on relative error; the split whose full
    ``max`` model has the best Akaike score wins (log-time error, errors under :data:`GEMM_NOISE`
    counted as that noise, 2 per figure fitted): a figure the points cannot pin down is left None
    rather than fitted to noise; between equal scores, more points memory-bound (the low-intensity end
    of a GEMM sweep is weight-read bound).
    """
    F, M, t = (np.asarray(a, dtype=np.float64) for a in (flops, moved, seconds))
    if t.size < 3 or not (np.all(t > 0) and np.all(np.isfinite(t))):
        raise ValueError(f"a GEMM fit needs three or more positive finite times, got {t.size}")
    order = np.argsort(F / M, kind="stable")
    F, M, t = F[order], M[order], t[order]
    fits = [(k, f) for k in range(t.size + 1) if (f := _gemm_split(F, M, t, k)) is not None]
    if not fits:
        raise ValueError("no GEMM fit with non-negative figures: the times do not follow max(F/C, M/B) + t0")

    def score(f: GemmFit) -> float:  # AIC with errors below the timing noise counted as that noise
        figures = sum(x is not None for x in (f.flops_per_s, f.bytes_per_s)) + (f.overhead_s > 0)
        return t.size * np.log(max(f.rms_log_error, GEMM_NOISE) ** 2) + 2 * figures

    return min(fits, key=lambda kf: (score(kf[1]), -kf[0]))[1]  # a tie: the low-intensity points memory-bound
