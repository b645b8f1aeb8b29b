"""Trace-replay simulator for online rebalancing (numpy only; the solvers are imported lazily).

A real trace becomes a stream of serving steps, each a count matrix ``[L, E]`` (token-expert
assignments per logical expert). The stream is cut into windows of ``window_steps`` steps. After
each window every strategy may re-place using what it has seen; the placement is then scored on the
NEXT window's traffic (held out: fitted on the past, scored on what comes).

Rebalancing strategies compared in one run, all starting from the same initial placement (greedy fitted on the
first window):

- ``migration``: the :class:`runtime_hooks.rebalancer.Rebalancer` fed step by step (interval trigger
  at every window end, its sliding window, its cost-model gate, its migration-aware solver);
- ``greedy``: the greedy balancer from scratch on the same sliding window, every window;
- ``greedy+align``: the same, relabelled by :func:`solver.migration.align_to_previous` (same loads,
  fewer moves: the fair from-scratch baseline);
- ``static``: never rebalance.

Streams:

- :func:`token_stream` (DeepSeek-V2-Lite chat trace in prompt order): a step is ``step_tokens``
  consecutive tokens on each of the ``G`` attention-DP ranks (as ``step_par`` in docs/metrics.md).
- :func:`domain_stream` (OLMoE per-domain counts, domains switched mid-stream): COUNTS ONLY, so each
  step is SAMPLED: per layer a seeded multinomial of ``world_step_tokens * top_k`` assignments from the
  domain's load vector (assignments drawn independently; the real no-repeat-within-a-token rule is
  not modelled).
- :func:`question_stream` (Mixtral MMLU): one step per question, subjects in their recorded sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from placement.dispatch import EVEN, DispatchModel, get_dispatch

__all__ = [
    "STRATEGIES",
    "break_even",
    "ReplayResult",
    "ReplayStream",
    "domain_stream",
    "question_stream",
    "replay",
    "token_stream",
]

STRATEGIES = ("migration", "greedy", "greedy+align", "static")  # how each window is re-placed


@dataclass(frozen=True)
class ReplayStream:
    """Steps to replay.

    Attributes:
        name: what was replayed.
        steps: float64 ``[N, L, E]`` assignments per step.
        labels: ``N`` labels (domain or subject per step; empty when none).
        layer_ids: the model's layer index per row.
        note: how the steps were made (sampled or recorded).
        rank_steps: float64 ``[N, L, G, E]`` the same assignments by source rank, or None (streams
            that do not know where tokens come from can only be scored with ``even``, or with a
            model scored per step from the step counts alone).
    """

    name: str
    steps: np.ndarray
    labels: tuple[str, ...] = ()
    layer_ids: tuple[int, ...] = ()
    note: str = ""
    rank_steps: np.ndarray | None = None


def token_stream(trace, ep_size: int, step_tokens: int = 32, name: str | None = None) -> ReplayStream:
    """Per-token trace -> steps of ``step_tokens * ep_size`` consecutive tokens (trace order)."""
    from profiling.trace import token_counts

    if not trace.has_tokens:
        raise ValueError(
            "token_stream needs a per-token trace (topk_ids); use domain_stream or question_stream"
        )
    per = int(step_tokens) * int(ep_size)
    n = trace.num_tokens // per
    if n < 2:
        raise ValueError(
            f"the trace has {trace.num_tokens} tokens: fewer than 2 steps of {per}; lower step_tokens"
        )
    ids = trace.topk_ids[: n * per]
    steps = np.stack(
        [token_counts(ids[i * per : (i + 1) * per], trace.num_logical_experts) for i in range(n)]
    )  # [N, L, E]
    return ReplayStream(
        name or trace.name,
        steps.astype(np.float64),
        (),
        trace.layer_ids,
        f"{n} steps of {step_tokens} tokens x {ep_size} ranks, prompt order",
        _rank_steps(ids, n, int(step_tokens), int(ep_size), trace.num_logical_experts),
    )


def _rank_steps(ids: np.ndarray, n: int, step_tokens: int, ep_size: int, E: int) -> np.ndarray:
    """Assignments per (step, layer, source rank, expert) ``[n, L, G, E]``: token ``t`` of a step sits
    on rank ``t // step_tokens`` (``ids [n * step_tokens * G, L, k]``)."""
    L, k = ids.shape[1], ids.shape[2]
    grid = ids.reshape(n, ep_size, step_tokens, L, k).transpose(0, 3, 1, 2, 4).reshape(n, L, ep_size, -1)
    valid = grid >= 0
    cell = (np.arange(n * L * ep_size).reshape(n, L, ep_size, 1) * E + np.where(valid, grid, 0))[valid]
    return np.bincount(cell, minlength=n * L * ep_size * E).reshape(n, L, ep_size, E).astype(np.float64)


def domain_stream(
    trace,
    domains: Sequence[str],
    steps_per_domain: int,
    world_step_tokens: int,
    top_k: int,
    seed: int = 0,
    name: str | None = None,
) -> ReplayStream:
    """Counts-only per-domain trace -> SAMPLED steps, domain after domain (seeded multinomial).

    ``world_step_tokens``: tokens in one step over all ranks (a counts-only trace has no ranks: ``G``
    ranks of ``step_tokens`` each is ``G * step_tokens``)."""
    if trace.window_counts is None or not trace.window_labels:
        raise ValueError("domain_stream needs a counts-only trace with one labelled window per domain")
    labels = list(trace.window_labels)
    rng = np.random.default_rng(seed)
    out, lab = [], []
    for d in domains:
        if d not in labels:
            raise ValueError(f"domain {d!r} not in the trace; available: {labels}")
        w = np.asarray(trace.window_counts[labels.index(d)], dtype=np.float64)  # [L, E]
        p = w / w.sum(axis=1, keepdims=True)
        for _ in range(int(steps_per_domain)):
            out.append(
                np.stack(
                    [rng.multinomial(int(world_step_tokens) * int(top_k), p[l]) for l in range(p.shape[0])]
                )
            )
            lab.append(d)
    return ReplayStream(
        name or f"{trace.name}:{'->'.join(domains)}",
        np.stack(out).astype(np.float64),
        tuple(lab),
        trace.layer_ids,
        f"SAMPLED: {steps_per_domain} steps per domain, {world_step_tokens} tokens x top-{top_k} "
        f"assignments per step, seeded multinomial (seed={seed}) from each domain's counts",
    )


def question_stream(trace, name: str | None = None, max_steps: int | None = None) -> ReplayStream:
    """Counts-only per-question trace -> one step per question, in recorded order."""
    if trace.window_counts is None:
        raise ValueError("question_stream needs a counts-only trace with one row per question")
    wc = np.asarray(trace.window_counts, dtype=np.float64)
    labels = trace.window_labels
    if max_steps is not None:
        wc, labels = wc[:max_steps], labels[:max_steps]
    return ReplayStream(
        name or trace.name, wc, tuple(labels), trace.layer_ids, f"{wc.shape[0]} questions, one step each"
    )


@dataclass(frozen=True)
class ReplayResult:
    """Per-window rows and per-strategy summaries.

    ``rows``: one dict per (window, strategy) with ``window``, ``strategy``, ``par``, ``step_par`` (held out:
    scored on that window's traffic with the placement chosen before it), ``moved_slots``, ``moved_bytes``,
    ``migration_time_s`` (for the re-placement made before the window), ``label``, and the rebalance
    rule's held-out figures (:mod:`runtime_hooks.rebalance_rule`): ``arrived_experts``,
    ``saved_s_per_step`` (peak-GPU compute seconds saved per step against the map before) and
    ``rebalance_cost_s`` (the busiest GPU's arrivals' copy time x the config's ``stall``).
    ``summary``: per strategy ``mean_par``, ``mean_step_par``, ``moved_slots``, ``moved_bytes``,
    ``migration_time_s``, ``moved_fraction`` (of all slots per re-placement, mean), ``arrived_experts``
    and ``break_even_steps``: the rebalance interval in steps at which its re-placements pay (mean cost
    over mean held-out saving per step; ``"never"`` when they saved nothing; None when nothing moved);
    ``params["window_steps"]`` is the interval the replay rebalanced at.
    """

    name: str
    rows: tuple[dict, ...]
    summary: dict
    params: dict = field(default_factory=dict)


def _par_rows(gpu_load: np.ndarray) -> np.ndarray:
    """PAR per leading index, mean over layers: ``gpu_load [..., L, G]`` -> ``[...]``."""
    mean = gpu_load.mean(axis=-1)
    peak = gpu_load.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        par = np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 1.0)
    return par.mean(axis=-1)


def _window_load(steps: np.ndarray, k: int, window_steps: int) -> np.ndarray:
    """Load of window ``k``: ``steps [N, L, E]`` -> ``[L, E]`` summed over its ``window_steps`` steps."""
    return steps[k * window_steps : (k + 1) * window_steps].sum(axis=0)


def _check_windows(N: int, window_steps: int, strategies: Sequence[str]) -> int:
    """The number of windows ``W`` (at least 3); ValueError on too few steps or unknown strategies."""
    W = N // window_steps
    if W < 3:
        raise ValueError(
            f"{N} steps give {W} windows of {window_steps}; need at least 3 (lower window_steps)"
        )
    bad = [p for p in strategies if p not in STRATEGIES]
    if bad:
        raise ValueError(f"unknown strategies {bad}; choose from {STRATEGIES}")
    return W


@dataclass(frozen=True)
class _Run:
    """What every window of one replay shares.

    Attributes:
        stream: the replayed stream. steps: float64 ``[N, L, E]`` (its steps). window_steps: steps per window.
        cfg: the rebalancer config (interval trigger). topology: the slots. layer_ids: ``L`` layer ids.
        strategies: the strategies compared. expert_bytes: bytes of one expert in one layer.
        model: the dispatch model windows are scored with. reb: the rebalancer (None without ``migration``).
    """

    stream: ReplayStream
    steps: np.ndarray
    window_steps: int
    cfg: object
    topology: object
    layer_ids: tuple[int, ...]
    strategies: tuple[str, ...]
    expert_bytes: float
    model: DispatchModel
    reb: object = None


def _greedy(load: np.ndarray, topology, layer_ids, keep):
    """Greedy from scratch on ``load`` ``[L, E]`` through the one pipeline (:func:`solver.api.solve`).
    A window that routed nothing has no balance to place for: the placement ``keep`` stays (the
    engines' trivial map when there is none yet)."""
    from placement.model import Placement
    from solver.api import solve

    if not np.any(load > 0):
        if keep is not None:
            return keep
        return Placement.trivial(load.shape[0], load.shape[1], topology, layer_ids)
    return solve("greedy", topology=topology, load=load, layer_ids=layer_ids).placement


def _replace_all(run: _Run, k: int, current: dict) -> dict:
    """Each strategy's placement for window ``k``, fitted on what was seen up to the end of window ``k-1``.

    The fit load is the rebalancer's sliding window (or the last ``cfg.window_size`` steps of
    ``run.steps`` summed, ``[L, E]``). Returns strategy -> placement.
    """
    from solver.migration import align_to_previous

    ws, strategies, reb = run.window_steps, run.strategies, run.reb
    lo = max(0, k * ws - run.cfg.window_size)
    fit = reb.window_load() if reb is not None else run.steps[lo : k * ws].sum(axis=0)  # [L, E]
    new = {}
    if "greedy" in strategies or "greedy+align" in strategies:
        g = _greedy(fit, run.topology, run.layer_ids, current.get("greedy", current.get("greedy+align")))
        if "greedy" in strategies:
            new["greedy"] = g
        if "greedy+align" in strategies:
            new["greedy+align"] = align_to_previous(g, current["greedy+align"])
    if "static" in strategies:
        new["static"] = current["static"]
    if reb is not None:
        reb.wait()  # the simulator waits; a server would poll() and keep serving
        new["migration"] = reb.placement
    return new


def _score_window(run: _Run, k: int, new: dict, current: dict) -> list[dict]:
    """One row per strategy: window ``k``'s held-out PAR and step PAR under its new placement, and the
    cost of moving there from ``current`` (which then becomes the new placement, in place)."""
    from placement.metrics import moved_slots
    from runtime_hooks.rebalancer import migration_time

    stream, ws, cfg, dispatch = run.stream, run.window_steps, run.cfg, run.model
    window = slice(k * ws, (k + 1) * ws)
    held = run.steps[window]  # [w, L, E] held-out traffic
    held_ranks = None if stream.rank_steps is None else stream.rank_steps[window]  # [w, L, G, E]
    label = stream.labels[k * ws] if stream.labels else ""
    rows = []
    for p in run.strategies:
        pl = new[p]
        gl_steps = _window_gpu_load(pl, dispatch, held, held_ranks)  # [w, L, G]
        par = float(_par_rows(gl_steps.sum(axis=0)[None])[0])
        spar = float(_par_rows(gl_steps).mean())
        moved = moved_slots(current[p], pl)
        pays = _held_out_payback(current[p], pl, gl_steps, dispatch, held, held_ranks, run.expert_bytes, cfg)
        t_move = migration_time(
            current[p].physical_to_logical_map,
            pl.physical_to_logical_map,
            run.topology.ep_size,
            run.expert_bytes,
            cfg.bandwidth,
            cfg.latency,
        )
        rows.append(
            {
                "window": k,
                "strategy": p,
                "label": label,
                "par": par,
                "step_par": spar,
                "moved_slots": moved,
                "moved_bytes": moved * run.expert_bytes,
                "migration_time_s": t_move,
                **pays,
            }
        )
        current[p] = pl
    return rows


def _held_out_payback(old, new, gl_new, dispatch, held, held_ranks, expert_bytes: float, cfg) -> dict:
    """What re-placing ``old`` by ``new`` saved and cost on the held-out window (the rule's model,
    :mod:`runtime_hooks.rebalance_rule`): ``arrived_experts``, ``saved_s_per_step`` (peak-GPU compute
    seconds per step, from both maps' peaks on the window, ``gl_new [w, L, G]``) and
    ``rebalance_cost_s`` (the busiest GPU's arrived experts' copy time x ``cfg.stall``)."""
    from placement.churn import arrived_per_gpu
    from runtime_hooks.rebalance_rule import RuleParams, peak_saving, transfer_seconds

    params = RuleParams(
        seconds_per_assignment=cfg.seconds_per_assignment,
        expert_bytes=expert_bytes,
        bandwidth=cfg.bandwidth,
        latency=cfg.latency,
        stall=cfg.stall,
    )
    arrived = arrived_per_gpu(old, new)  # [L, G]
    if not arrived.any():
        return {"arrived_experts": 0, "saved_s_per_step": 0.0, "rebalance_cost_s": 0.0}
    gl_old = _window_gpu_load(old, dispatch, held, held_ranks)  # [w, L, G]
    saved = peak_saving(gl_old.sum(axis=0).max(axis=1), gl_new.sum(axis=0).max(axis=1))  # per window
    return {
        "arrived_experts": int(arrived.sum()),
        "saved_s_per_step": saved * params.seconds_per_assignment / held.shape[0],
        "rebalance_cost_s": transfer_seconds(arrived, params),
    }


def break_even(rows: list[dict]) -> float | str | None:
    """The rebalance interval, in steps, at which a strategy's re-placements pay (held out): the mean
    cost of a re-placement that moved something over the mean saving per step it realized on the
    window after it; ``"never"`` when they saved nothing on average; None when nothing ever moved."""
    from runtime_hooks.rebalance_rule import break_even_steps

    moved = [r for r in rows if r.get("arrived_experts", 0) > 0]
    if not moved:
        return None
    cost = float(np.mean([r["rebalance_cost_s"] for r in moved]))
    steps = break_even_steps(cost, float(np.mean([r["saved_s_per_step"] for r in moved])))
    return "never" if steps == float("inf") else steps


def _needs_rank_steps(model: DispatchModel) -> bool:
    """Whether scoring under ``model`` needs each step's counts by source rank (``rank_steps``): all
    but ``even`` and the models scored per step from the step counts alone."""
    return not model.counts_only and (model.step_load is None or model.needs_source_ranks)


def _window_gpu_load(pl, model: DispatchModel, held: np.ndarray, held_ranks: np.ndarray | None) -> np.ndarray:
    """Per-step GPU loads ``[w, L, G]`` of a window: ``held [w, L, E]``, ``held_ranks [w, L, G, E]`` or None.

    ``even`` splits the counts; the other models read where each token came from (a model scored per
    step that ignores the source rank reads the step counts as from one rank)."""
    from placement.metrics import expected_gpu_load, rank_gpu_load

    if model.counts_only:
        return expected_gpu_load(pl, held)
    if held_ranks is None:
        held_ranks = held[:, :, None, :]  # [w, L, 1, E]: only reached when not _needs_rank_steps(model)
    return rank_gpu_load(pl, held_ranks, model)


def _summarize(rows: list[dict], strategies: Sequence[str], P: int, L: int) -> dict:
    """Per strategy: mean PAR and step PAR, total moves, bytes and time, mean moved fraction of ``P * L`` slots."""
    summary = {}
    for p in strategies:
        r = [x for x in rows if x["strategy"] == p]
        summary[p] = {
            "mean_par": float(np.mean([x["par"] for x in r])),
            "mean_step_par": float(np.mean([x["step_par"] for x in r])),
            "moved_slots": int(sum(x["moved_slots"] for x in r)),
            "moved_bytes": float(sum(x["moved_bytes"] for x in r)),
            "migration_time_s": float(sum(x["migration_time_s"] for x in r)),
            "moved_fraction": float(np.mean([x["moved_slots"] for x in r]) / (P * L)),
            "arrived_experts": int(sum(x.get("arrived_experts", 0) for x in r)),
            "break_even_steps": break_even(r),
        }
    return summary


def _params(
    stream: ReplayStream,
    cfg,
    window_steps: int,
    W: int,
    G: int,
    P: int,
    expert_bytes: float,
    dispatch: DispatchModel,
) -> dict:
    """What the replay ran with (``ReplayResult.params``)."""
    return {
        "window_steps": window_steps,
        "windows_scored": W - 1,
        "ep_size": G,
        "num_physical_experts": P,
        "expert_bytes": expert_bytes,
        "note": stream.note,
        "link": cfg.link,
        "rebalancer_window_size": cfg.window_size,
        "max_moves": cfg.max_moves,
        "dispatch": dispatch.name,
    }


def replay(
    stream: ReplayStream,
    topology,
    config=None,
    *,
    window_steps: int = 50,
    expert_bytes: float = 44_040_192.0,
    strategies: Sequence[str] = STRATEGIES,
    dispatch: str | DispatchModel = EVEN,
) -> ReplayResult:
    """Replay a stream through the rebalancer and the baselines; score each window held out.

    Args:
        stream: :class:`ReplayStream` with ``steps [N, L, E]``.
        topology: :class:`placement.topology.Topology`.
        config: :class:`runtime_hooks.rebalancer.RebalancerConfig`; its ``trigger`` is forced to
            ``interval`` and ``step_interval``/``window_size`` default to ``window_steps``.
        window_steps: steps per scored window (and per re-placement).
        expert_bytes: bytes of one expert in one layer (moved bytes, migration time).
        strategies: the rebalancing strategies compared (:data:`STRATEGIES`).
        dispatch: the dispatch model each window is scored with (a name or model of
            ``placement.dispatch``); all but ``even`` and the models scored per step from the step
            counts alone need the stream's ``rank_steps`` (token streams have them).

    Returns:
        :class:`ReplayResult`.

    Steps: initial greedy placement on window 0 -> per later window: re-place every strategy, score it
    on the window -> feed the window to the rebalancer -> summarise.
    """
    from runtime_hooks.rebalancer import Rebalancer, RebalancerConfig

    steps = np.asarray(stream.steps, dtype=np.float64)  # [N, L, E]
    N, L, E = steps.shape
    W = _check_windows(N, window_steps, strategies)
    model = get_dispatch(dispatch)
    if _needs_rank_steps(model) and stream.rank_steps is None:
        raise ValueError(
            f"scoring with {model.name!r} needs source ranks; the stream {stream.name!r} has none "
            f"(use a token stream, or dispatch {EVEN.name!r})"
        )
    cfg = config or RebalancerConfig(window_size=window_steps, step_interval=window_steps)
    cfg = replace(cfg, trigger="interval", step_interval=window_steps)
    G = topology.ep_size
    layer_ids = stream.layer_ids or tuple(range(L))
    init = _greedy(_window_load(steps, 0, window_steps), topology, layer_ids, None)
    current = {p: init for p in strategies}
    reb = Rebalancer(init, cfg, expert_bytes=expert_bytes) if "migration" in strategies else None
    run = _Run(
        stream, steps, window_steps, cfg, topology, layer_ids, tuple(strategies), expert_bytes, model, reb
    )
    rows = []
    for k in range(W):
        if k > 0:
            rows += _score_window(run, k, _replace_all(run, k, current), current)
        if reb is not None:
            for s in range(k * window_steps, (k + 1) * window_steps):
                reb.observe(steps[s])
    if reb is not None:
        reb.close()
    P = topology.num_physical_experts
    summary = _summarize(rows, strategies, P, L)
    return ReplayResult(
        stream.name, tuple(rows), summary, _params(stream, cfg, window_steps, W, G, P, expert_bytes, model)
    )
