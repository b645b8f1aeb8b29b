"""The engine EPLB cases as data (no pytest: the engines' side venv and the benchmarks read them too).

The inputs of vLLM 0.33's ``tests/distributed/test_eplb_algo.py`` (not in its wheel) and DeepSeek
EPLB's README example, written from their facts; and seeded calls of assorted shapes.
"""

from __future__ import annotations

import numpy as np

# name: (weight [L, E], slots P, groups, nodes N, GPUs G); the facts of vLLM's test_eplb_algo.py
README = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
CASES = {
    "basic_rebalance": (README, 16, 4, 2, 8),  # DeepSeek EPLB's README example
    "single_gpu": ([[10, 20, 30, 40]], 4, 1, 1, 1),
    "equal_weights": ([[50] * 8], 8, 2, 2, 4),
    "extreme_imbalance": ([[1000, 1, 1, 1, 1, 1, 1, 1]], 12, 2, 2, 4),
    "multiple_layers": ([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6], 8, 2, 2, 4),
    "groups_not_dividing_nodes": ([[10, 20, 30, 40]], 8, 3, 2, 4),
    "slots_not_dividing_gpus": ([[10, 20, 30, 40]], 7, 2, 2, 4),  # the engine raises AssertionError
    "small_scale_hierarchical": ([[100, 50, 200, 75, 150, 25, 300, 80]], 12, 4, 2, 4),
    "global_fallback": ([[10, 20, 30, 40, 50, 60]], 8, 3, 2, 4),
    "device_cpu": ([[10, 20, 30, 40]], 6, 2, 1, 2),
    "additional_1": ([[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]], 24, 8, 4, 8),
    "additional_2": ([[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]], 10, 3, 1, 2),
}


def random_cases(seed: int = 36) -> dict:
    """Seeded engine calls of assorted shapes (skewed loads, global and hierarchical)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, (E, G, S, N, groups) in enumerate(
        [
            (8, 2, 5, 1, 1),
            (8, 4, 3, 2, 2),
            (12, 4, 4, 2, 4),
            (16, 8, 3, 2, 4),
            (16, 4, 6, 1, 2),
            (32, 8, 5, 4, 8),
        ]
    ):
        w = np.round(rng.pareto(1.2, (3, E)) * 100 + 1).astype(int)
        out[f"random_{i}"] = (w.tolist(), G * S, groups, N, G)
    return out
