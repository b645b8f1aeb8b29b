"""Which nodes tokens reach, for the replicated locality method (:mod:`solver.locality.replicated`).

Shapes: E logical experts, N nodes, T tokens, k top-k. Every expert lives on one node (``node_of[e]``)
or on all nodes (``every[e]``); a token reaches a remote node when one of its single-node picks lives
there. :class:`NodeReach` keeps per-token counts so the node partition, the everywhere trades and the
GPU repair can price moves exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FitViews", "NodeReach", "remote_nodes_fit", "token_sample"]


@dataclass(frozen=True)
class FitViews:
    """One layer's fit data, as the node packing and the GPU repair read it (V = W + 1 views when the fit
    trace has W > 1 windows: the fit total, then every window; else V = 1).

    Attributes:
        load: float64 ``[V, E]`` picks per view; src: float64 ``[V, N, E]`` the same by source node.
        ids: int64 ``[T, k]`` fit picks (-1 none); src_node: int64 ``[T]`` source node of each token.
    """

    load: np.ndarray
    src: np.ndarray
    ids: np.ndarray
    src_node: np.ndarray


def token_sample(rng: np.random.Generator, num_tokens: int, sample: int) -> np.ndarray:
    """Sorted int64 ``[min(T, sample)]`` token rows: a random sample without replacement when there are
    more than ``sample`` tokens (one draw from ``rng``), else all of them (no draw)."""
    T = num_tokens
    return np.sort(rng.choice(T, size=sample, replace=False)) if T > sample else np.arange(T)


def remote_nodes_fit(
    node_of: np.ndarray, every: np.ndarray, ids: np.ndarray, src_node: np.ndarray, num_nodes: int
) -> np.ndarray:
    """Remote nodes of each token ``[T]`` (float64): distinct nodes other than its own among its picks.

    Args:
        node_of: int64 ``[E]`` node of each single-node expert; every: bool ``[E]``; ids: int64 ``[T, k]``
            picks (-1 none); src_node: int64 ``[T]`` node of each token's source rank.
    """
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    node = np.where(valid & ~every[e], node_of[e], -1)
    hit = np.zeros((ids.shape[0], num_nodes + 1), dtype=bool)
    hit[np.arange(ids.shape[0])[:, None], node + 1] = True
    hit[np.arange(ids.shape[0]), src_node + 1] = False
    return hit[:, 1:].sum(axis=1).astype(np.float64)


class NodeReach:
    """Which nodes a set of tokens reaches through its single-node picks, and the exact change in remote
    nodes when single-node experts move or trade nodes (shared by the partition search, the GPU repair
    and the everywhere trades).

    ``X`` float32 ``[T, E]``: token picks expert (all experts); ``cnt`` float32 ``[T, N]``: picks of
    single-node experts on each node; ``notsrc`` float32 ``[T, N]``: node is not the token's own;
    ``pt, pe, pf``: every pair of single-node picks of one token (token, expert, expert).
    """

    def __init__(
        self, ids: np.ndarray, src_node: np.ndarray, every: np.ndarray, node_of: np.ndarray, num_nodes: int
    ):
        T, k = ids.shape
        self.E, self.N = every.size, int(num_nodes)
        valid = ids >= 0
        self.X = np.zeros((T, self.E), dtype=np.float32)
        self.X[np.repeat(np.arange(T), k)[valid.ravel()], ids[valid]] = 1.0
        single_pick = valid & ~every[np.where(valid, ids, 0)]  # [T, k]
        iu, ju = np.triu_indices(k, 1)
        both = single_pick[:, iu] & single_pick[:, ju]
        self.pt = np.broadcast_to(np.arange(T)[:, None], both.shape)[both]
        self.pe, self.pf = ids[:, iu][both], ids[:, ju][both]
        self.notsrc = (np.arange(self.N)[None, :] != src_node[:, None]).astype(np.float32)
        self.recount(node_of)

    def recount(self, node_of: np.ndarray) -> None:
        """Rebuild ``cnt`` from ``node_of`` int64 ``[E]`` (-1: everywhere)."""
        on = np.zeros((self.E, self.N), dtype=np.float32)
        single = np.flatnonzero(node_of >= 0)
        on[single, node_of[single]] = 1.0
        self.cnt = self.X @ on

    def relocate(self, e: int, a: int, b: int) -> None:
        """Single-node expert ``e`` moves from node ``a`` to ``b``."""
        self.cnt[:, a] -= self.X[:, e]
        self.cnt[:, b] += self.X[:, e]

    def reach(self) -> tuple[np.ndarray, np.ndarray]:
        """``(z0, z1)`` float32 ``[T, N]``: remote node not reached / reached by exactly one pick."""
        return (
            ((self.cnt == 0) * self.notsrc).astype(np.float32),
            ((self.cnt == 1) * self.notsrc).astype(np.float32),
        )

    def deltas(self, node_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Remote-node changes (token counts) under the current ``cnt``.

        Returns ``(move [E, N], kp [E, E], z1 [T, N])``: ``move[e, b]`` for moving ``e`` alone to node
        ``b``; trading ``e`` and ``f`` (on different nodes) changes by
        ``move[e, node(f)] + move[f, node(e)] + kp[e, f]`` (for tokens picking both, the two single moves'
        terms cancel: ``kp`` adds back z1 at both nodes). Rows of everywhere experts are meaningless.
        """
        z0, z1 = self.reach()
        a_all = np.maximum(node_of, 0)
        move = self.X.T @ z0 - (self.X.T @ z1)[np.arange(self.E), a_all][:, None]
        w = z1[self.pt, a_all[self.pe]] + z1[self.pt, a_all[self.pf]]
        kp = np.bincount(self.pe * self.E + self.pf, weights=w, minlength=self.E * self.E).reshape(
            self.E, self.E
        )
        return move, kp + kp.T, z1

    def remote(self) -> float:
        """Remote nodes summed over the tokens."""
        return float(((self.cnt > 0) * self.notsrc).sum())
