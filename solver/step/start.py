"""Starting placements for the per-step fit (:mod:`solver.step.fit`), one layer at a time.

Under a per-step split (``balanced``, ``sglang-lp``) two things set how flat each step can be made,
and the greedy window balancer sees neither:

- Which experts are replicated. Greedy hands out replicas by mean load, so an expert that is cold on
  average but spikes in some steps (a topic expert) stays a single replica, and its spikes land on one
  GPU whatever the split does. :func:`spike_weights` blends the mean load with a high quantile of the
  per-step load, so such experts get replicas too.
- Whether the replicas connect the GPUs. A replicated expert lets load move between the GPUs holding
  it; with one spare slot per GPU there are exactly as many such links as GPUs, enough for one
  connected graph with one cycle. Greedy's packing closes small cycles (two GPUs holding the same two
  experts), which cuts the graph into islands that cannot share load. :func:`connected_packing` packs
  like greedy (heaviest replica to the lightest GPU) but, among GPUs within ``slack`` of the lightest,
  prefers one that joins the expert's GPUs to another island.

:func:`start_rows` gives these candidates for one layer; the fit scores them and searches from the best
that its window guard accepts.

Shapes: E logical experts, P slots, G GPUs, S = P // G slots per GPU, N sampled steps.
"""

from __future__ import annotations

import numpy as np

from solver.greedy import replicate

__all__ = ["connected_packing", "spike_weights", "start_rows"]


def spike_weights(load: np.ndarray, step_counts: np.ndarray, blend: float, quantile: float) -> np.ndarray:
    """Replication weights ``[E]``: ``(1 - blend)`` x the mean-load share + ``blend`` x the share of the
    ``quantile`` of each expert's per-step load.

    ``load``: ``[E]`` window load; ``step_counts``: ``[N, E]`` sampled steps.
    """
    mean = load / max(float(load.sum()), 1e-12)
    high = np.quantile(step_counts, quantile, axis=0)
    high = high / max(float(high.sum()), 1e-12)
    return (1.0 - blend) * mean + blend * high


class _Islands:
    """Union-find over GPUs: which GPUs the replicas placed so far connect."""

    def __init__(self, num_gpus: int) -> None:
        self.parent = list(range(num_gpus))

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def join(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def connected_packing(
    load: np.ndarray, counts: np.ndarray, num_gpus: int, slots_per_gpu: int, slack: float
) -> np.ndarray:
    """Slot -> expert row ``[P]``: replicas (``load / counts`` each) heaviest first, each to the lightest
    GPU with room that does not hold the expert, except that among GPUs within ``slack`` x the mean GPU
    load of the lightest, one outside the expert's island (GPUs linked by the replicas placed so far) is
    preferred. ``slack=0`` is greedy's packing up to ties.

    ``load``: ``[E]`` float; ``counts``: int ``[E]`` replicas per expert, summing to ``G * S``.
    """
    G, S = int(num_gpus), int(slots_per_gpu)
    E = load.size
    experts = np.repeat(np.arange(E), counts)  # [P] one entry per replica
    piece = load[experts] / counts[experts]
    order = np.argsort(-piece, kind="stable")
    gpu_load, used = np.zeros(G), np.zeros(G, np.int64)
    holds = np.zeros((G, E), bool)
    slots: list[list[int]] = [[] for _ in range(G)]
    islands, home = _Islands(G), np.full(E, -1)
    margin = slack * float(load.sum()) / G
    for i in order:
        e = int(experts[i])
        room = np.flatnonzero((used < S) & ~holds[:, e])
        near = room[gpu_load[room] <= gpu_load[room].min() + margin]
        if home[e] >= 0:
            own = islands.find(int(home[e]))
            away = [int(g) for g in near if islands.find(int(g)) != own]
            near = np.array(away) if away else near
        g = int(near[np.argmin(gpu_load[near])])
        gpu_load[g] += piece[i]
        used[g] += 1
        holds[g, e] = True
        slots[g].append(e)
        if home[e] >= 0:
            islands.join(g, int(home[e]))
        else:
            home[e] = g
    return np.array([e for s in slots for e in s], dtype=np.int64)


def start_rows(
    load: np.ndarray,
    step_counts: np.ndarray,
    num_gpus: int,
    slots_per_gpu: int,
    blends: tuple[float, ...],
    quantile: float,
    slack: float,
) -> list[tuple[str, np.ndarray]]:
    """Candidate rows ``[P]`` for one layer, named by their blend: for each ``blend``, replica counts
    from :func:`spike_weights` (greedy's replication rule on them), packed by :func:`connected_packing`.

    ``load``: ``[E]`` fit load; ``step_counts``: ``[N, E]`` sampled fit steps.
    """
    G, S = int(num_gpus), int(slots_per_gpu)
    out = []
    for blend in blends:
        weight = spike_weights(load, step_counts, blend, quantile)
        counts = replicate(weight[None], G * S, max_replicas=G)[2][0]  # [E]
        out.append((f"blend {blend:g}", connected_packing(load, counts, G, S, slack)))
    return out
