"""Node-level grouping for the communication-aware (locality) solver: one layer at a time.

Shapes: E logical experts, N nodes, T tokens, k top-k, m GPUs per node.

The decision is a membership matrix ``member [E, N]`` (bool: expert ``e`` has a replica on node ``n``)
and a replica-count matrix ``reps [E, N]`` (int: how many of ``e``'s replicas node ``n`` holds, each
on a different GPU). Expert ``e`` has ``c_e`` replicas in all (from the greedy replication) and lives
on ``k_e = min(c_e, N)`` nodes: one replica per node, and where ``c_e > N`` the extra replicas
(fixed before the search) sit on nodes that already hold it.

Load model under the ``local`` dispatch model (the one the placement is scored with):
a token from node ``s`` that picks ``e`` stays on ``s`` when ``s`` holds ``e`` and otherwise spreads
evenly over all ``c_e`` replicas, so node ``n`` receives from expert ``e``

    member[e, n] * src_count[n, e] + reps[e, n] / c_e * sum_{s: not member[e, s]} src_count[s, e]

(``src_count [N, E]``: picks of ``e`` by tokens that originate on node ``s``). This is exactly the node
total of :func:`placement.metrics.trace_gpu_load` under ``local``.

Fitted objective: the expected number of remote nodes a token must reach (node-deduplicated dispatch)
when each remote pick lands on node ``n`` with probability ``reps[e, n] / c_e``; exact for experts on
one node, and the mean of the runtime's round-robin choice otherwise.

Three stages, each never worse than the one before on its own objective:

1. ``agglomerate``: experts in order of Louvain community (networkx) and then load join the node
   with the largest co-activation to them, under slot and load caps; a swap pass repairs balance.
2. ``refine_cpsat``: CP-SAT over ``member`` maximising co-located co-activation weight with exact slot
   counts and the node-load cap, hinted with stage 1.
3. ``swap_search``: membership swaps between nodes, scored on the token-level fitted objective.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from placement.dispatch import LOCAL, get_dispatch
from solver.locality.reach import token_sample
from solver.search import run_solve

log = logging.getLogger(__name__)

__all__ = [
    "LayerProblem",
    "node_loads",
    "expected_remote_nodes",
    "agglomerate",
    "refine_cpsat",
    "swap_search",
    "pair_objective",
]

SWAP_SAMPLE = 12000  # tokens in the sample that scores a membership swap (:func:`swap_search`)


@dataclass(frozen=True)
class LayerProblem:
    """One layer's node-grouping problem (all arrays read-only by convention).

    Attributes:
        ids: int64 ``[T, k]`` fitted picks (-1 = none).
        src_node: int64 ``[T]`` node of each token's attention-DP rank.
        coact: float64 ``[E, E]`` co-activation counts, zero diagonal.
        src_count: float64 ``[N, E]`` picks of each expert by tokens from each node.
        count: int64 ``[E]`` replicas per expert (``c_e``).
        num_nodes: ``N``; slots_per_node: ``P / N``; gpus_per_node: ``m``.
        dispatch: ``"local"`` or ``"even"`` (how tokens choose among replicas).
    """

    ids: np.ndarray
    src_node: np.ndarray
    coact: np.ndarray
    src_count: np.ndarray
    count: np.ndarray
    num_nodes: int
    slots_per_node: int
    gpus_per_node: int
    dispatch: str = LOCAL.name

    @property
    def num_experts(self) -> int:
        return int(self.count.size)

    @property
    def load(self) -> np.ndarray:
        """float64 ``[E]`` picks per expert."""
        return self.src_count.sum(axis=0)

    @property
    def homes(self) -> np.ndarray:
        """int64 ``[E]``: nodes each expert lives on, ``k_e = min(c_e, N)``."""
        return np.minimum(self.count, self.num_nodes)

    @property
    def mean_node_load(self) -> float:
        return float(self.src_count.sum() / self.num_nodes)


def node_loads(prob: LayerProblem, reps: np.ndarray) -> np.ndarray:
    """float64 ``[N]`` node loads of a replica layout ``reps [E, N]`` under ``prob.dispatch`` (see module doc)."""
    member = reps > 0
    c = prob.count.astype(np.float64)
    if get_dispatch(prob.dispatch).counts_only:
        return (reps / c[:, None] * prob.load[:, None]).sum(axis=0)
    remote = (prob.src_count.T * ~member).sum(axis=1)  # [E] picks from nodes without the expert
    return (member * prob.src_count.T + reps / c[:, None] * remote[:, None]).sum(axis=0)


def _pick_probs(prob: LayerProblem, reps: np.ndarray) -> np.ndarray:
    """float64 ``[E, N]``: where a pick that leaves its own node lands."""
    return reps / prob.count[:, None].astype(np.float64)


def expected_remote_nodes(
    prob: LayerProblem, reps: np.ndarray, tokens: np.ndarray | None = None
) -> np.ndarray:
    """Expected distinct remote nodes per token ``[T']`` (``tokens``: row indices, default all)."""
    ids = prob.ids if tokens is None else prob.ids[tokens]  # [T', k]
    src = prob.src_node if tokens is None else prob.src_node[tokens]  # [T']
    valid = ids >= 0
    e = np.where(valid, ids, 0)
    q = _pick_probs(prob, reps)[e]  # [T', k, N]
    q = np.where(valid[:, :, None], q, 0.0)
    if get_dispatch(prob.dispatch).local_first:
        home = (reps[e, src[:, None]] > 0) & valid  # [T', k] picks served on the own node
        q = np.where(home[:, :, None], 0.0, q)
    miss = np.prod(1.0 - q, axis=1)  # [T', N] probability that no pick lands on node n
    need = 1.0 - miss
    need[np.arange(src.size), src] = 0.0  # the own node is not remote
    return need.sum(axis=1)


def pair_weights(prob: LayerProblem) -> np.ndarray:
    """float64 ``[E, E]`` co-location reward per shared node: ``coact / (k_i k_j)``, 0 for experts on all nodes."""
    k = prob.homes.astype(np.float64)
    w = prob.coact / np.outer(k, k)
    everywhere = prob.homes >= prob.num_nodes
    w[everywhere, :] = 0.0
    w[:, everywhere] = 0.0
    np.fill_diagonal(w, 0.0)
    return w


def source_weights(prob: LayerProblem) -> np.ndarray:
    """float64 ``[E, N]`` reward for holding ``e`` on ``n``: picks of ``e`` from node ``n`` over ``k_e``
    (0 for experts on all nodes, and under ``even``): tokens then find ``e`` on their own node."""
    s = prob.src_count.T / prob.homes[:, None]
    s[prob.homes >= prob.num_nodes] = 0.0
    if get_dispatch(prob.dispatch).counts_only:
        s[:] = 0.0
    return s


def pair_objective(prob: LayerProblem, member: np.ndarray) -> float:
    """``sum_n [sum_{i<j} W_ij member_in member_jn + sum_i s_in member_in]`` (the CP-SAT objective)."""
    W = pair_weights(prob)
    m = member.astype(np.float64)
    return float(np.einsum("in,ij,jn->", m, W, m) / 2.0 + (m * source_weights(prob)).sum())


def _extras(prob: LayerProblem) -> np.ndarray:
    """int64 ``[E, N]`` replicas beyond one per node, for experts with ``c_e > N``, spread round-robin.

    Raises ValueError if an expert needs more replicas on a node than the node has GPUs.
    """
    E, N, m = prob.num_experts, prob.num_nodes, prob.gpus_per_node
    extra = np.zeros((E, N), dtype=np.int64)
    nxt = 0
    for e in np.argsort(-prob.load, kind="stable"):
        for _ in range(int(prob.count[e]) - N if prob.count[e] > N else 0):
            for _try in range(N):
                n = nxt % N
                nxt += 1
                if extra[e, n] + 1 < m:
                    extra[e, n] += 1
                    break
            else:
                raise ValueError(
                    f"expert {e} needs {prob.count[e]} replicas but {N} nodes x {m} GPUs allow at most {N * m}"
                )
    return extra


def _slot_caps(prob: LayerProblem, extra: np.ndarray) -> np.ndarray:
    """int64 ``[N]`` single-membership slots left per node after the extras."""
    caps = prob.slots_per_node - extra.sum(axis=0)
    if caps.min() < 0:
        raise ValueError("extra replicas overflow a node; use fewer redundant experts")
    return caps


def _fix_extras(prob: LayerProblem) -> tuple[np.ndarray, np.ndarray]:
    """Extras and membership caps, rebalanced so the caps sum to the memberships needed."""
    extra = _extras(prob)
    caps = _slot_caps(prob, extra)
    need = int(prob.homes.sum())
    if caps.sum() != need:  # cannot happen when slots add up; guards the invariant
        raise ValueError(f"{need} memberships do not match {caps.sum()} free slots")
    # Even out the membership caps: move extras of all-node experts from nodes with few free slots.
    for _ in range(extra.sum() + 1):
        lo, hi = int(caps.argmin()), int(caps.argmax())
        if caps[hi] - caps[lo] <= 1:
            break
        cand = np.flatnonzero((extra[:, hi] == 0) | True)
        moved = False
        for e in cand:
            if extra[e, lo] > 0 and extra[e, hi] + 1 < prob.gpus_per_node:
                extra[e, lo] -= 1
                extra[e, hi] += 1
                moved = True
                break
        if not moved:
            break
        caps = _slot_caps(prob, extra)
    return extra, caps


def _membership_load(prob: LayerProblem) -> np.ndarray:
    """float64 ``[E, N]``: load a node takes on by holding expert ``e`` (linear model for the search).

    Exact for experts on one node (``w_e``) and on all nodes (``src_count[n, e]``); ``w_e / k_e`` in
    between (uniform-source approximation).
    """
    w = prob.load
    k = prob.homes
    a = np.repeat((w / k)[:, None], prob.num_nodes, axis=1)
    everywhere = k >= prob.num_nodes
    a[everywhere] = prob.src_count.T[everywhere]
    if get_dispatch(prob.dispatch).counts_only:
        a = np.repeat((w / k)[:, None], prob.num_nodes, axis=1)
    return a


def size_classes(prob: LayerProblem, num_classes: int, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Size classes of the movable experts and per-node class caps (so every node gets a similar mix).

    Movable experts (``k_e < N``) are ranked by per-replica load ``w_e / c_e`` and cut into
    ``num_classes`` groups of equal count (``-1`` for experts on all nodes). A node may hold at most
    ``ceil(members_j * caps_n / sum(caps))`` memberships of class ``j``: nodes with the same total load
    but a different mix of heavy and light replicas pack onto GPUs very differently.

    Returns:
        ``(cls int64 [E], class_cap int64 [C, N])``.
    """
    E, N = prob.num_experts, prob.num_nodes
    k = prob.homes
    cls = np.full(E, -1, dtype=np.int64)
    mov = np.flatnonzero(k < N)
    C = max(1, int(num_classes))
    if mov.size:
        per = prob.load[mov] / prob.count[mov]
        order = mov[np.argsort(-per, kind="stable")]
        # memberships, not experts, fill the classes
        units = np.repeat(order, k[order])
        bounds = np.linspace(0, units.size, C + 1).round().astype(int)
        for j in range(C):
            for e in units[bounds[j] : bounds[j + 1]]:
                if cls[e] < 0:
                    cls[e] = j
    members = np.array([int(k[cls == j].sum()) for j in range(C)])
    frac = caps / max(int(caps.sum()), 1)
    class_cap = np.ceil(members[:, None] * frac[None, :] - 1e-9).astype(np.int64) + 1
    return cls, class_cap


def reps_from_member(prob: LayerProblem, member: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """int64 ``[E, N]`` replica counts: one per membership plus the fixed extras."""
    return member.astype(np.int64) + extra


def agglomerate(
    prob: LayerProblem, load_cap: float, seed: int = 0, num_classes: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1: greedy agglomeration on the co-activation graph, then balance-repair swaps.

    Returns:
        ``(member bool [E, N], extra int64 [E, N])``.
    """
    import networkx as nx

    E, N = prob.num_experts, prob.num_nodes
    extra, caps = _fix_extras(prob)
    k = prob.homes
    a = _membership_load(prob)  # [E, N]
    W = pair_weights(prob)
    member = np.zeros((E, N), dtype=bool)
    member[k >= N] = True
    used = member.sum(axis=0).astype(np.int64)
    load = (member * a).sum(axis=0)
    cls, class_cap = size_classes(prob, num_classes, caps)
    class_used = np.zeros_like(class_cap)
    src_aff = source_weights(prob)  # [E, N]
    # Order: Louvain communities of the co-activation graph (heaviest community first), load inside.
    g = nx.Graph()
    g.add_nodes_from(range(E))
    iu, ju = np.nonzero(np.triu(W, 1))
    g.add_weighted_edges_from((int(i), int(j), float(W[i, j])) for i, j in zip(iu, ju))
    comms = (
        nx.community.louvain_communities(g, weight="weight", seed=seed)
        if g.number_of_edges()
        else [set(range(E))]
    )
    comms = sorted(comms, key=lambda c: (-sum(prob.load[list(c)]), min(c)))
    rank = {e: r for r, c in enumerate(comms) for e in c}
    # Experts on several nodes first (they need distinct nodes), then by community and load.
    order = sorted((e for e in range(E) if k[e] < N), key=lambda e: (-k[e], rank[e], -prob.load[e], e))
    for e in order:
        for _ in range(int(k[e])):
            room = (used < caps) & ~member[e]
            if not room.any():
                _free_slot(e, member, used, load, a, caps, k)
                room = (used < caps) & ~member[e]
                if not room.any():
                    raise ValueError(f"cannot give expert {e} {k[e]} distinct nodes within the slot limits")
            mix = room & (class_used[cls[e]] < class_cap[cls[e]])
            room2 = mix if mix.any() else room
            fits = room2 & (load + a[e] <= load_cap)
            pool = fits if fits.any() else room2
            # [N] co-activation with the node's experts, plus picks of e made on the node (local hits)
            aff = (W[e] @ member).astype(np.float64) + src_aff[e]
            # Largest affinity; ties (e.g. empty nodes) -> least loaded.
            score = np.where(pool, aff - 1e-9 * load, -np.inf)
            n = int(score.argmax())
            member[e, n] = True
            used[n] += 1
            load[n] += a[e, n]
            class_used[cls[e], n] += 1
    member = _repair_balance(prob, member, a, load_cap, cls)
    return member, extra


def _free_slot(
    e: int,
    member: np.ndarray,
    used: np.ndarray,
    load: np.ndarray,
    a: np.ndarray,
    caps: np.ndarray,
    k: np.ndarray,
) -> None:
    """Free a slot for expert ``e``: move a membership of another expert ``f`` off a full node ``b``
    (without ``e``) to a node with room that lacks ``f`` (the first such move; none if there is none).

    Updates in place ``member`` bool ``[E, N]``, ``used`` int64 ``[N]`` and ``load`` float64 ``[N]``
    (``a`` float64 ``[E, N]``: load of a membership; ``caps`` int64 ``[N]``; ``k`` int64 ``[E]`` homes).
    """
    E, N = member.shape
    has_room = np.flatnonzero(used < caps)
    for b in np.flatnonzero(~member[e]):
        for f in np.flatnonzero(member[:, b] & (k < N) & (np.arange(E) != e)):
            dst = [a_ for a_ in has_room if not member[f, a_]]
            if dst:
                member[f, b], member[f, dst[0]] = False, True
                used[b] -= 1
                used[dst[0]] += 1
                load[b] -= a[f, b]
                load[dst[0]] += a[f, dst[0]]
                return


def _repair_balance(
    prob: LayerProblem, member: np.ndarray, a: np.ndarray, load_cap: float, cls: np.ndarray
) -> np.ndarray:
    """Swap memberships between the heaviest node and others until loads fit ``load_cap`` (best effort)."""
    member = member.copy()
    W = pair_weights(prob)
    movable = prob.homes < prob.num_nodes
    for same_class in (True, False):  # keep the size mix if possible, else any swap
        member = _repair_pass(
            prob, member, a, load_cap, cls if same_class else np.zeros_like(cls), W, movable
        )
    return member


def _repair_pass(prob, member, a, load_cap, cls, W, movable):
    for _ in range(4 * prob.num_experts):
        load = (member * a).sum(axis=0)
        hi = int(load.argmax())
        if load[hi] <= load_cap:
            break
        best = None
        for lo in np.argsort(load):
            if lo == hi:
                continue
            for e in np.flatnonzero(member[:, hi] & ~member[:, lo] & movable):
                for f in np.flatnonzero(member[:, lo] & ~member[:, hi] & movable & (cls == cls[e])):
                    d = a[e, hi] - a[f, lo]
                    new_hi, new_lo = load[hi] - a[e, hi] + a[f, hi], load[lo] - a[f, lo] + a[e, lo]
                    peak = max(new_hi, new_lo)
                    if d <= 0 or peak >= load[hi]:
                        continue
                    aff = (
                        (W[e] @ member[:, lo] - W[e, f])
                        + (W[f] @ member[:, hi] - W[f, e])
                        - (W[e] @ member[:, hi] + W[f] @ member[:, lo])
                    )
                    key = (max(peak, load_cap), -aff)
                    if best is None or key < best[0]:
                        best = (key, e, f, lo)
        if best is None:
            break
        _, e, f, lo = best
        member[e, hi], member[e, lo] = False, True
        member[f, lo], member[f, hi] = False, True
    return member


def refine_cpsat(
    prob: LayerProblem,
    member0: np.ndarray,
    extra: np.ndarray,
    load_cap: float,
    time_limit: float,
    seed: int = 0,
    max_edges: int = 800,
    num_classes: int = 1,
) -> tuple[np.ndarray, str]:
    """Stage 2: CP-SAT over memberships, maximising co-located pair weight (hinted with ``member0``).

    Constraints: each expert on exactly ``k_e`` nodes; exact membership slots per node; node load
    (linear model) within ``load_cap``. Only the ``max_edges`` heaviest pairs enter the objective.

    Returns:
        ``(member bool [E, N], status)``; ``member0`` itself when CP-SAT finds nothing at least as good.
    """
    from ortools.sat.python import cp_model

    model, x = _membership_model(prob, member0, load_cap, max_edges, num_classes)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(max(time_limit, 0.05))
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = 1  # one worker: the same seed gives the same memberships
    st = run_solve(solver, model)
    name = solver.status_name(st).lower()
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return member0, name
    member = np.zeros((prob.num_experts, prob.num_nodes), dtype=bool)
    for (e, n), v in x.items():
        member[e, n] = bool(solver.value(v))
    if pair_objective(prob, member) + 1e-9 < pair_objective(prob, member0):
        return member0, name
    return member, name


def _membership_model(
    prob: LayerProblem, member0: np.ndarray, load_cap: float, max_edges: int, num_classes: int
) -> tuple:
    """:func:`refine_cpsat`'s model: ``(model, x)`` with ``x[e, n]`` (bool var, or the constant 1 for experts
    on all nodes): expert ``e`` is on node ``n``. Hinted with ``member0`` bool ``[E, N]``."""
    from ortools.sat.python import cp_model

    E, N = prob.num_experts, prob.num_nodes
    movable = prob.homes < N
    model = cp_model.CpModel()
    x = {}
    for e in range(E):
        for n in range(N):
            if movable[e]:
                x[e, n] = model.new_bool_var(f"x_{e}_{n}")
            else:
                x[e, n] = model.new_constant(1)
    _add_membership_limits(model, x, prob, member0, load_cap, num_classes)
    _add_colocation_objective(model, x, prob, max_edges)
    for e in np.flatnonzero(movable):
        for n in range(N):
            model.add_hint(x[e, n], bool(member0[e, n]))
    return model, x


def _add_membership_limits(
    model, x: dict, prob: LayerProblem, member0: np.ndarray, load_cap: float, num_classes: int
) -> None:
    """Each expert on exactly ``k_e`` nodes; ``member0``'s slots per node; the size-class mix; the node
    load cap (linear model, in integers: ``1e6`` is the cap; a start above it sets each node's limit)."""
    E, N = prob.num_experts, prob.num_nodes
    k = prob.homes
    a = _membership_load(prob)
    caps = member0.sum(axis=0)
    lscale = 1e6 / max(load_cap, 1e-9)
    a_int = np.round(a * lscale).astype(np.int64)
    cap_int = int(np.floor(load_cap * lscale))
    # each expert on exactly k_e nodes
    for e in np.flatnonzero(k < N):
        model.add(sum(x[e, n] for n in range(N)) == int(k[e]))
    # exact membership slots per node
    for n in range(N):
        model.add(sum(x[e, n] for e in range(E)) == int(caps[n]))
    # size-class mix per node (as in the heuristic start, which satisfies it or sets the limit)
    cls, class_cap = size_classes(prob, num_classes, caps)
    for j in range(class_cap.shape[0]):
        in_j = np.flatnonzero(cls == j)
        for n in range(N):
            lim = max(int(class_cap[j, n]), int(member0[in_j, n].sum()))
            model.add(sum(x[e, n] for e in in_j) <= lim)
    # node load cap (linear model)
    base_ok = (member0 * a).sum(axis=0).max() <= load_cap + 1e-9
    for n in range(N):
        limit = cap_int if base_ok else max(cap_int, int(np.ceil((member0[:, n] * a[:, n]).sum() * lscale)))
        model.add(sum(int(a_int[e, n]) * x[e, n] for e in range(E)) <= limit)


def _add_colocation_objective(model, x: dict, prob: LayerProblem, max_edges: int) -> None:
    """Maximise the co-located weight of the ``max_edges`` heaviest pairs (an indicator per pair and node)
    plus the source weights, in integers (``1e4`` is the heaviest pair)."""
    N = prob.num_nodes
    W = pair_weights(prob)
    iu, ju = np.nonzero(np.triu(W, 1))
    wts = W[iu, ju]
    keep = np.argsort(-wts, kind="stable")[:max_edges]
    iu, ju, wts = iu[keep], ju[keep], wts[keep]
    wscale = 1e4 / max(float(wts.max()) if wts.size else 1.0, 1e-12)
    w_int = np.round(wts * wscale).astype(np.int64)
    terms = []
    for i, j, wi in zip(iu, ju, w_int):
        if wi <= 0:
            continue
        for n in range(N):
            y = model.new_bool_var("")
            model.add_implication(y, x[i, n])
            model.add_implication(y, x[j, n])
            terms.append(int(wi) * y)
    sw = source_weights(prob)
    for e in np.flatnonzero(prob.homes < N):
        for n in range(N):
            v = int(round(sw[e, n] * wscale))
            if v > 0:
                terms.append(v * x[e, n])
    model.maximize(sum(terms))


def swap_search(
    prob: LayerProblem,
    member: np.ndarray,
    extra: np.ndarray,
    load_cap: float,
    time_limit: float,
    seed: int = 0,
    balance_weight: float = 0.0,
    num_classes: int = 1,
) -> np.ndarray:
    """Stage 3: first-improvement membership swaps scored on the token-level fitted objective.

    A swap moves ``e`` from node ``a`` to ``b`` and ``f`` from ``b`` to ``a`` (slot counts kept); it is
    taken when the expected remote nodes on a token sample drop and the node loads stay within
    ``load_cap`` (exact local-dispatch loads). A start above the cap is first brought under it (large
    penalty on the excess). ``balance_weight`` adds ``w * (max node load / mean - 1)``.
    """
    rng = np.random.default_rng(seed)
    T = prob.ids.shape[0]
    E, N = prob.num_experts, prob.num_nodes
    toks = token_sample(rng, T, SWAP_SAMPLE)
    ids = prob.ids[toks]
    # tokens (sample positions) that pick each expert
    by_expert = [np.flatnonzero((ids == e).any(axis=1)) for e in range(E)]
    reps = reps_from_member(prob, member, extra)
    mean = prob.mean_node_load
    cur_tok = expected_remote_nodes(prob, reps, toks)  # [T']
    cur_load = node_loads(prob, reps)
    movable = np.flatnonzero(prob.homes < N)
    cls, _ = size_classes(prob, num_classes, np.full(N, 1))
    scale = 1.0 / max(toks.size, 1)

    def pen(loads):
        over = 100.0 * max(0.0, loads.max() - load_cap) / mean  # restore the cap first (exact loads)
        return over + (balance_weight * (loads.max() / mean - 1.0) if balance_weight else 0.0)

    deadline = time.perf_counter() + time_limit
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for e in rng.permutation(movable):
            if time.perf_counter() >= deadline:
                break
            for a_n in np.flatnonzero(reps[e] > 0):
                best = None
                for b_n in np.flatnonzero(reps[e] == 0):
                    for f in movable[
                        (reps[movable, b_n] > 0) & (reps[movable, a_n] == 0) & (cls[movable] == cls[e])
                    ]:
                        new = reps.copy()
                        new[e, a_n] -= 1
                        new[e, b_n] += 1
                        new[f, b_n] -= 1
                        new[f, a_n] += 1
                        loads = node_loads(prob, new)
                        if loads.max() > max(load_cap, cur_load.max()) + 1e-9:
                            continue
                        touched = np.union1d(by_expert[e], by_expert[f])
                        if touched.size == 0:
                            continue
                        after = expected_remote_nodes(prob, new, toks[touched])
                        delta = (after.sum() - cur_tok[touched].sum()) * scale + pen(loads) - pen(cur_load)
                        if delta < -1e-9 and (best is None or delta < best[0]):
                            best = (delta, new, touched, after, loads)
                if best is not None:
                    _, reps, touched, after, cur_load = best
                    cur_tok[touched] = after
                    improved = True
                    break
    return (reps - extra) > 0
