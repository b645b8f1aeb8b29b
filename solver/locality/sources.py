"""What the fit trace says about unseen traffic, for the locality solver (:mod:`solver.locality`).

Shapes: L layers, E logical experts, T tokens, U prompts (or other natural windows), G attention-DP
ranks (= EP ranks), m GPUs per node, N nodes.

- Sources: which rank each token comes from when fitting (:func:`fit_sources`), the nodes' token
  shares (:func:`_node_shares`, :func:`node_share_excess`) and the share excess that a random dealing of
  the prompts gives on average (:func:`expected_share_excess`, :func:`dealt_prompt_ranks`).
- Windows of the fit trace used as extra balance views (:func:`window_of_tokens`).
- The expected load drift of every expert (:func:`load_drift`, a bootstrap over prompts).
- The default number of everywhere experts per layer (:func:`default_everywhere`).
"""

from __future__ import annotations

import numpy as np

from profiling.trace import RoutingTrace

__all__ = [
    "dealt_prompt_ranks",
    "default_everywhere",
    "expected_share_excess",
    "fit_sources",
    "load_drift",
    "node_share_excess",
    "window_of_tokens",
]


def window_of_tokens(trace: RoutingTrace, num_windows: int) -> np.ndarray:
    """int64 ``[T]``: consecutive prompt groups (or token chunks without prompt boundaries), ``0..W-1``."""
    T = trace.num_tokens
    W = max(1, int(num_windows))
    if trace.seq_offsets is not None and trace.seq_offsets.size - 1 >= W:
        off = trace.seq_offsets
        n = off.size - 1
        return np.repeat((np.arange(n) * W) // n, np.diff(off)).astype(np.int64)
    return (np.arange(T) * W // max(T, 1)).astype(np.int64)


def default_everywhere(
    load: np.ndarray,
    num_slots: int,
    num_nodes: int,
    gpus_per_node: int,
    margin: float = 0.25,
    share_excess: float = 0.0,
    share_overload: float = np.inf,
) -> int:
    """Default number of everywhere experts of one layer: the most the spare slots can pay for.

    Each everywhere expert costs ``N - 1`` slots. The spare slots ``R = P - E`` must also pay for splitting
    every single-node expert heavier than a GPU's mean load ``g = sum(load) / G`` into
    ``ceil(load / g)`` replicas on its node, plus ``margin x G`` slots left for the exact packing. Returns
    the largest ``h`` (hottest first) with ``(N - 1) h + splits(h) + margin G <= R`` and
    ``share_excess x (load share of the h hottest) <= share_overload``, 0 if none.

    Args:
        load: float64 ``[E]`` fitted picks per expert.
        share_excess: ``d``: the busiest node's token share over the mean, minus 1 (everywhere replicas
            serve their own node's tokens, so that node gets ``d x`` their load share on top of its fair
            share); share_overload: the most of that allowed (see :func:`solve_locality`).
    """
    w = np.asarray(load, dtype=np.float64)
    E, N, m = w.size, int(num_nodes), int(gpus_per_node)
    G, R = N * m, int(num_slots) - w.size
    if N < 2 or w.sum() <= 0:
        return 0
    g = w.sum() / G
    order = np.argsort(-w, kind="stable")
    top = np.concatenate([[0.0], np.cumsum(w[order])]) / w.sum()  # load share of the h hottest
    best = 0
    for h in range(0, min(R // (N - 1), E) + 1):
        splits = np.maximum(np.ceil(w[order[h:]] / g - 1e-9) - 1, 0).sum()
        if (N - 1) * h + splits + margin * G <= R and max(float(share_excess), 0.0) * top[
            h
        ] <= share_overload + 1e-12:
            best = h
    return best


def load_drift(trace: RoutingTrace, seed: int = 0, draws: int = 64) -> np.ndarray:
    """Expected change of each expert's load from the fit trace to unseen traffic: float64 ``[L, E]``.

    Bootstrap over the trace's natural windows (prompts, else steps; 64-token chunks when it has fewer
    than two): the standard deviation of an expert's share of the picks over ``draws`` resamples of the
    windows, in picks of the fit trace, times ``sqrt(2)`` (the fit total and the unseen traffic are two
    independent samples).
    """
    T, L, _ = trace.topk_ids.shape
    E = trace.num_logical_experts
    bounds = trace.natural_windows()
    if len(bounds) > 1:
        unit = np.repeat(np.arange(len(bounds)), [b - a for a, b in bounds])
    else:
        unit = np.arange(T) // 64
    U = int(unit.max()) + 1 if T else 0
    out = np.zeros((L, E))
    if U < 2:
        return out
    rng = np.random.default_rng(seed)
    w = rng.multinomial(U, np.full(U, 1.0 / U), size=draws).astype(np.float64)  # [B, U]
    for l in range(L):
        ids = trace.topk_ids[:, l, :]
        v = ids >= 0
        uu = np.broadcast_to(unit[:, None], ids.shape)[v]
        cnt = np.bincount(uu * E + ids[v].astype(np.int64), minlength=U * E).reshape(U, E).astype(np.float64)
        draw = w @ cnt  # [B, E]
        share = draw / np.maximum(draw.sum(axis=1, keepdims=True), 1.0)
        out[l] = share.std(axis=0) * cnt.sum() * np.sqrt(2.0)
    return out


def _node_shares(src: np.ndarray, gpus_per_node: int, num_nodes: int) -> np.ndarray:
    """Share of the tokens each node's ranks hold: float64 ``[N]`` from source ranks ``src`` int64 ``[T]``."""
    return np.bincount(src // int(gpus_per_node), minlength=int(num_nodes)) / max(src.size, 1)


def node_share_excess(src: np.ndarray, gpus_per_node: int, num_nodes: int) -> float:
    """The busiest node's token share over the mean, minus 1, under source ranks ``src`` int64 ``[T]``."""
    return (
        float(_node_shares(src, gpus_per_node, num_nodes).max() * int(num_nodes) - 1.0) if src.size else 0.0
    )


def dealt_prompt_ranks(num_prompts: int, ep_size: int, rng: np.random.Generator) -> np.ndarray:
    """Rank of every prompt, int64 ``[U]``, when prompts in a random order are dealt round-robin."""
    rank = np.empty(int(num_prompts), dtype=np.int64)
    rank[rng.permutation(int(num_prompts))] = np.arange(int(num_prompts)) % int(ep_size)
    return rank


def expected_share_excess(
    trace: RoutingTrace,
    src: np.ndarray,
    how: str,
    gpus_per_node: int,
    num_nodes: int,
    seed: int = 0,
    draws: int = 64,
) -> float:
    """The busiest node's token share over the mean, minus 1, that unseen traffic should be expected to give.

    Prompts dealt round-robin (``how == "round-robin by prompt"``): the mean over ``draws`` random orders of
    the fit trace's prompts dealt round-robin to the ranks (the realized dealing is one draw of that).
    Otherwise the shares under ``src`` int64 ``[T]`` (the trace's own ranks; 0 for tokens dealt round-robin).
    """
    N, m = int(num_nodes), int(gpus_per_node)
    if not src.size:
        return 0.0
    if how != "round-robin by prompt" or trace.seq_offsets is None:
        return node_share_excess(src, m, N)
    lengths = np.diff(trace.seq_offsets).astype(np.float64)  # [U]
    rng = np.random.default_rng(seed)
    out = 0.0
    for _ in range(int(draws)):
        rank = dealt_prompt_ranks(lengths.size, N * m, rng)
        share = np.bincount(rank // m, weights=lengths, minlength=N) / lengths.sum()
        out += float(share.max() * N - 1.0)
    return out / int(draws)


def fit_sources(
    src: np.ndarray, how: str, source_model: str, ep_size: int, gpus_per_node: int = 1
) -> tuple[np.ndarray, str]:
    """Source ranks the solver fits with: int64 ``[T]`` and a description.

    ``"auto"``: the trace's own ranks when it has them; when they were made up by dealing prompts
    round-robin, tokens round-robin instead. Prompt lengths vary a lot (one long conversation can hold
    a rank's tokens for the whole trace), so the dealt ranks' token shares are an accident of the fit
    trace that unseen traffic does not repeat; dealing tokens gives every rank its expected, equal share.
    ``"trace"``: exactly the scoring ranks. ``"uniform"``: always tokens round-robin. The description
    gives the range of the replaced sources' per-node token shares.
    """
    if source_model not in ("auto", "trace", "uniform"):
        raise ValueError(f"source_model must be 'auto', 'trace' or 'uniform', got {source_model!r}")
    if source_model == "trace" or (source_model == "auto" and how in ("trace", "round-robin by token")):
        return src, how
    share = _node_shares(src, gpus_per_node, int(ep_size) // int(gpus_per_node))
    return (
        np.arange(src.size, dtype=np.int64) % int(ep_size),
        f"{how} (node token shares {share.min():.0%}-{share.max():.0%}); fitted with tokens round-robin "
        f"(equal shares)",
    )
