"""One layer's slots as a mutable state for local searches that move single replicas.

Shapes: E logical experts, G GPUs, S slots per GPU, P = G x S slots, C candidate moves.

:class:`LayerSlots` keeps a layer's map ``row [P]`` (``-1``: a free slot) with what the moves read:
copies per expert ``cnt [E]``, GPU membership ``hold [E, G]`` and GPU loads ``load [G]`` (each
expert's load split evenly over its copies, the ``even`` dispatch model). Two moves, each scored for
many candidates at once: put an expert in a slot (the slot's expert, if any, leaves that GPU:
replica counts change), and swap the experts of two slots on different GPUs (counts unchanged). The
failure-domain spreading (:mod:`solver.failure`) and the failover maps (:mod:`solver.failover`) use
it; both break ties by position, so a search is deterministic.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LayerSlots", "best_index"]


def best_index(peaks: np.ndarray, tie: np.ndarray) -> int:
    """Index of the lowest of ``peaks [C]`` (within 1e-9 relative), ties broken by the lowest ``tie
    [C]``, then by position."""
    low = peaks.min()
    near = np.flatnonzero(peaks <= low + 1e-9 * max(abs(low), 1.0))
    return int(near[np.argmin(tie[near])]) if near.size > 1 else int(near[0])


class LayerSlots:
    """One layer's map and its derived counts, membership and GPU loads (see the module docstring).

    Args:
        row: int64 ``[P]`` map, owned and changed in place (``-1``: free; at most one copy of an
            expert per GPU).
        w: float64 ``[E]`` tokens per expert.
        G, S: GPUs and slots per GPU (``P = G x S``).
    """

    def __init__(self, row: np.ndarray, w: np.ndarray, G: int, S: int) -> None:
        self.row, self.w, self.G, self.S = row, w, G, S
        gpu = np.arange(row.size) // S
        self.hold = np.zeros((w.size, G), dtype=bool)  # [E, G]
        full = row >= 0
        self.hold[row[full], gpu[full]] = True
        self.cnt = self.hold.sum(axis=1).astype(np.int64)  # [E]
        self.refresh()

    def refresh(self) -> None:
        """Recompute the GPU loads ``[G]`` from the map."""
        e = np.maximum(self.row, 0)
        share = np.where(self.row >= 0, self.w[e] / np.maximum(self.cnt[e], 1), 0.0)  # [P]
        self.load = share.reshape(self.G, self.S).sum(axis=1)

    @property
    def share(self) -> np.ndarray:
        """float64 ``[P]``: each slot's load (its expert's load over its copies; 0 when free)."""
        e = np.maximum(self.row, 0)
        return np.where(self.row >= 0, self.w[e] / np.maximum(self.cnt[e], 1), 0.0)

    def put(self, slot: int, expert: int) -> None:
        """Slot ``slot`` holds ``expert`` from now on (its old expert, if any, leaves that GPU)."""
        g = slot // self.S
        old = int(self.row[slot])
        if old >= 0:
            self.hold[old, g] = False
            self.cnt[old] -= 1
        self.row[slot] = expert
        self.hold[expert, g] = True
        self.cnt[expert] += 1
        self.refresh()

    def swap(self, a: int, b: int) -> None:
        """Exchange the experts of slots ``a`` and ``b`` (on different GPUs; counts unchanged)."""
        ea, eb = int(self.row[a]), int(self.row[b])
        ga, gb = a // self.S, b // self.S
        self.hold[ea, ga] = self.hold[eb, gb] = False
        self.hold[ea, gb] = self.hold[eb, ga] = True
        self.row[a], self.row[b] = eb, ea
        self.refresh()

    def surplus_slots(self) -> np.ndarray:
        """Slots that may be overwritten with every expert kept: free, or an expert with another copy."""
        r = self.row
        return np.flatnonzero((r < 0) | (self.cnt[np.maximum(r, 0)] >= 2))

    def peaks_if_put(self, slots: np.ndarray, experts: np.ndarray, changed_only: bool = False) -> np.ndarray:
        """``[C]`` peak GPU load after putting ``experts[c]`` in ``slots[c]``, each alone.

        Each expert must be absent from its slot's GPU, each slot free or holding an expert with
        another copy. ``changed_only``: the peak over the GPUs whose load the move changes (the slot's
        GPU, and those holding either expert), so that a move lowering one of several equal peaks
        still shows its gain."""
        w, cnt = self.w, self.cnt
        g = slots // self.S
        d = self.row[slots]  # [C] the expert dropped, -1 for a free slot
        full = d >= 0
        dd = np.maximum(d, 0)
        c_d = np.maximum(cnt[dd], 2)
        inc = np.where(full, w[dd] / (c_d - 1) - w[dd] / c_d, 0.0)  # [C] each other copy of d gains
        c_f = cnt[experts]
        dec = np.where(c_f > 0, w[experts] / np.maximum(c_f, 1) - w[experts] / (c_f + 1), 0.0)  # [C]
        holds_d = np.where(full[:, None], self.hold[dd], False)  # [C, G]
        new = self.load[None, :] + holds_d * inc[:, None] - self.hold[experts] * dec[:, None]  # [C, G]
        rows = np.arange(slots.size)
        dropped = np.where(full, w[dd] / np.maximum(cnt[dd], 1), 0.0)
        new[rows, g] += -dropped - inc + w[experts] / (c_f + 1)
        if not changed_only:
            return new.max(axis=1)
        changed = self.hold[experts] | holds_d
        changed[rows, g] = True
        return np.where(changed, new, -np.inf).max(axis=1)

    def swaps_from(self, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every swap of a slot of GPU ``top`` with a slot of another GPU that keeps one copy of an
        expert per GPU: ``(slots on top [C], other slots [C], the higher of the two GPUs' new loads [C])``."""
        S, row = self.S, self.row
        share = self.share
        mine = np.arange(top * S, (top + 1) * S)
        other = np.flatnonzero(np.arange(row.size) // S != top)
        x, y = np.repeat(mine, other.size), np.tile(other, S)
        h = y // S
        ex, ey = np.maximum(row[x], 0), np.maximum(row[y], 0)
        ok = ((row[x] < 0) | ~self.hold[ex, h]) & ((row[y] < 0) | ~self.hold[ey, top]) & (row[x] != row[y])
        x, y, h = x[ok], y[ok], h[ok]
        delta = share[x] - share[y]  # top loses it, h gains it
        return x, y, np.maximum(self.load[top] - delta, self.load[h] + delta)
