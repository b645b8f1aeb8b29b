"""An expert-parallel MoE layer over a real ``torch.distributed`` process group.

Glossary: logical expert ``e`` (a GLU FFN of the model), physical slot ``p`` (a replica on a rank),
EP rank ``g`` owns slots ``[g*S, (g+1)*S)`` (``S = slots_per_gpu``), attention-DP: every rank owns its
own tokens (here: its rows of ``x``), sends each pick to the rank of the chosen replica and gets the
expert output back.

Shapes (T = this rank's tokens, d = hidden, f = FFN width, E = logical experts, k = top-k,
S = slots per rank, G = ranks, n = picks sent by this rank, m = picks received by this rank):

- logical weights :class:`ExpertWeights`: ``w1 [E, 2f, d]`` (gate and up stacked), ``w2 [E, d, f]``;
  ``expert(x) = w2 @ (silu(w1_gate @ x) * (w1_up @ x))``.
- slot weights on a rank: ``slot_w1 [S, 2f, d]``, ``slot_w2 [S, d, f]``.
- ``forward(x [T, d], topk_ids [T, k] or None, topk_weights [T, k] or None, token_index [T])`` ->
  ``[T, d]``. With ``topk_ids=None`` the layer's router (``router_weight [E, d]``, top-k of a softmax)
  chooses; with recorded ids (trace replay) the caller passes the ids and their weights.

Replica selection is :func:`placement.metrics.route_tokens` ported to torch (:func:`route_slots`,
tested equal): pick ``j`` of the token with global index ``t`` takes replica ``(t + j) mod c`` of its
tier (own rank, own node, any: ``local``; any: ``even``). ``balanced`` splits each step's picks by the
quotas every rank computes from the all-gathered counts (:class:`runtime_hooks.step_dispatch.StepDispatch`,
one small collective per forward; ``forward`` is then one step). The dispatch models the runtime
executes are those :mod:`placement.dispatch` marks ``runtime`` (:func:`runtime_dispatch` checks a
name). Hence the picks each rank computes are exactly ``placement.metrics.routed_gpu_tokens`` of the
same ids, dispatch model and token indices (``balanced``: the model's ``step_load`` of the step's counts).

Public API (used by :mod:`runtime_hooks.validate`, the benchmark and the online rebalancer)::

    layer = EPMoELayer(placement, layer_index, weights, dispatch=EVEN.name)  # inside a launched rank
    y = layer.forward(x, topk_ids, topk_weights, token_index)            # one step (replayed ids)
    layer.last_tokens_processed                                          # picks computed this step
    layer.last_slot_tokens                                               # [S] of them per local slot
    layer.step                                                           # StepDispatch or None
    result = layer.migrate_to(new_placement, timeout=10.0)               # -> MigrationResult
    layer.slot_checksums()                                               # [S] content hashes

Dispatch and combine go through the shared :func:`runtime_hooks.exchange.exchange`.
:meth:`EPMoELayer.migrate_to` is collective (every rank calls it between the same two steps) and
either commits everywhere or changes nothing anywhere; see :mod:`runtime_hooks.migration_core`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from placement.dispatch import EVEN, DispatchModel, dispatch_names, get_dispatch
from placement.model import Placement

__all__ = [
    "EPMoELayer",
    "ExpertWeights",
    "RoutingTables",
    "build_routing_tables",
    "expert_ffn",
    "reference_moe",
    "replay_weights",
    "route_slots",
    "routes_per_step",
    "runtime_dispatch",
    "tensor_checksum",
]


@dataclass(frozen=True)
class ExpertWeights:
    """Logical expert weights: ``w1`` float ``[E, 2f, d]``, ``w2`` float ``[E, d, f]``, ``router [E, d]``."""

    w1: torch.Tensor
    w2: torch.Tensor
    router: torch.Tensor

    @classmethod
    def random(
        cls, num_experts: int, hidden: int, ffn: int, seed: int = 0, dtype=torch.float32
    ) -> ExpertWeights:
        """Seeded weights, identical in every process for the same arguments (CPU generator)."""
        if min(num_experts, hidden, ffn) < 1:
            raise ValueError(f"num_experts, hidden, ffn must be >= 1, got {num_experts}, {hidden}, {ffn}")
        g = torch.Generator().manual_seed(int(seed))
        w1 = torch.randn(num_experts, 2 * ffn, hidden, generator=g, dtype=torch.float32) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, ffn, generator=g, dtype=torch.float32) / ffn**0.5
        router = torch.randn(num_experts, hidden, generator=g, dtype=torch.float32) / hidden**0.5
        return cls(w1.to(dtype), w2.to(dtype), router.to(dtype))

    @property
    def num_experts(self) -> int:
        return int(self.w1.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[2])

    @property
    def ffn(self) -> int:
        return int(self.w2.shape[2])

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (``w1[e]`` + ``w2[e]``)."""
        return int(self.w1[0].numel() * self.w1.element_size() + self.w2[0].numel() * self.w2.element_size())


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """GLU FFN of one expert: ``x [m, d]``, ``w1 [2f, d]``, ``w2 [d, f]`` -> ``[m, d]``."""
    h = x @ w1.T  # [m, 2f]
    gate, up = h.chunk(2, dim=-1)  # [m, f] each
    return (F.silu(gate) * up) @ w2.T  # [m, d]


def reference_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights
) -> torch.Tensor:
    """Single-process MoE without replication: ``x [T, d]``, ids/weights ``[T, k]`` (-1 = none) -> ``[T, d]``."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, j = (topk_ids == e).nonzero(as_tuple=True)  # picks of expert e
        y = expert_ffn(x[tok], weights.w1[e].to(x.device), weights.w2[e].to(x.device))  # [m, d]
        out.index_add_(0, tok, y * topk_weights[tok, j, None])
    return out


def replay_weights(
    topk_ids: torch.Tensor,
    seed: int = 0,
    token_index: torch.Tensor | None = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Router weights for replayed ids: softmax over seeded random logits, gathered at the ids.

    Args:
        topk_ids: int ``[T, k]`` (-1 = none). token_index: int64 ``[T]`` global indices (seed the
            logits per token so every rank derives the same weights for the same token).
    Returns:
        float32 ``[T, k]``, 0 where the id is -1.
    """
    T = topk_ids.shape[0]
    E = int(num_experts or (int(topk_ids.max()) + 1 if topk_ids.numel() else 1))
    idx = torch.arange(T) if token_index is None else token_index.cpu()
    g = torch.Generator().manual_seed(int(seed) + 7919)
    table = torch.randn(int(idx.max()) + 1 if T else 1, E, generator=g)  # [T_global, E]
    probs = torch.softmax(table[idx], dim=-1)  # [T, E]
    w = probs.gather(1, topk_ids.cpu().long().clamp(min=0))  # [T, k]
    return torch.where(topk_ids.cpu() >= 0, w, torch.zeros_like(w)).to(topk_ids.device)


def tensor_checksum(t: torch.Tensor) -> str:
    """Content hash (blake2b of the raw bytes) of a tensor, device-independent."""
    a = t.detach().contiguous().cpu()
    return hashlib.blake2b(
        a.view(torch.uint8).numpy().tobytes() if a.numel() else b"", digest_size=16
    ).hexdigest()


# ---------------------------------------------------------------------------------------------------
# Replica selection (torch port of placement.metrics.route_tokens)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingTables:
    """Per-layer lookup tables (on the layer's device).

    ``l2p`` int64 ``[E, R]`` slots of each expert ascending (-1 pad); ``cnt`` ``[E]``; ``gpu_slot``
    ``[G, E]`` slot of e on rank g or -1; ``node_l2p`` ``[N, E, R]``; ``node_cnt`` ``[N, E]``.
    """

    l2p: torch.Tensor
    cnt: torch.Tensor
    gpu_slot: torch.Tensor
    node_l2p: torch.Tensor
    node_cnt: torch.Tensor
    slots_per_gpu: int
    gpus_per_node: int


def build_routing_tables(placement: Placement, layer: int, device=None) -> RoutingTables:
    """Tables for row ``layer`` of ``placement`` (O(P) numpy work, done once per placement)."""
    t = placement.topology
    G, N, E = t.ep_size, t.num_nodes, placement.num_logical_experts
    p2l = placement.physical_to_logical_map[layer]  # [P]
    l2p = placement.logical_to_physical_map[layer]  # [E, R]
    cnt = placement.logical_replica_count[layer]  # [E]
    gpu_slot = np.full((G, E), -1, dtype=np.int64)
    gpu_slot[t.gpu_of_slot, p2l] = np.arange(p2l.size)
    node = t.node_of_slot  # [P]
    node_cnt = np.zeros((N, E), dtype=np.int64)
    np.add.at(node_cnt, (node, p2l), 1)
    node_l2p = np.full((N, E, l2p.shape[1]), -1, dtype=np.int64)
    for n in range(N):  # slots of each expert on node n, ascending
        for e_slot in np.nonzero(node == n)[0]:
            e = p2l[e_slot]
            r = int((node_l2p[n, e] >= 0).sum())
            node_l2p[n, e, r] = e_slot

    def as_t(a):
        return torch.tensor(np.array(a, dtype=np.int64), device=device)

    return RoutingTables(
        as_t(l2p), as_t(cnt), as_t(gpu_slot), as_t(node_l2p), as_t(node_cnt), t.slots_per_gpu, t.gpus_per_node
    )


# DispatchModel.runtime_route -> what the torch runtime builds to execute it (EPMoELayer and the
# Hugging Face path alike); tests/test_dispatch.py asserts every runtime model's kind is here.
RUNTIME_ROUTES = {
    # per-rank routing tables built once per placement, a rotation over the tier's replicas per call
    "table": "runtime_hooks.ep_layer.route_slots",
    # per-step integer quotas from the all-gathered counts (a collective every call)
    "step": "runtime_hooks.step_dispatch.StepDispatch",
}


def runtime_dispatch(dispatch: str | DispatchModel) -> DispatchModel:
    """The registered dispatch model ``dispatch``, checked to be one the runtime executes.

    Raises:
        ValueError: an unknown name (listing the models), or a model only scored offline (one line
            naming it and the runtime's models).
    """
    model = get_dispatch(dispatch)
    if not model.runtime:
        runtime = ", ".join(dispatch_names(runtime=True))
        raise ValueError(
            f"dispatch model {model.name!r} is scored offline only (evaluate --dispatch {model.name}); "
            f"the runtime executes {runtime}: use one of those"
        )
    if model.runtime_route not in RUNTIME_ROUTES:
        raise ValueError(
            f"dispatch model {model.name!r} asks for runtime route {model.runtime_route!r}, which the runtime "
            f"does not build (it builds {', '.join(RUNTIME_ROUTES)})"
        )
    return model


def routes_per_step(dispatch: str | DispatchModel) -> bool:
    """Whether the runtime routes ``dispatch`` by per-step quotas (``StepDispatch``) rather than tables."""
    return runtime_dispatch(dispatch).runtime_route == "step"


def route_slots(
    tables: RoutingTables,
    topk_ids: torch.Tensor,
    token_index: torch.Tensor,
    src_rank,
    dispatch: str | DispatchModel = EVEN.name,
) -> torch.Tensor:
    """Physical slot of every pick, exactly as :func:`placement.metrics.route_tokens`.

    Args:
        topk_ids: int ``[T, k]`` logical ids, -1 = none. token_index: int64 ``[T]`` global token index.
        src_rank: int or int64 ``[T]``, the attention-DP rank of each token.
        dispatch: a runtime dispatch model (:func:`runtime_dispatch`) or its name.
    Returns:
        int64 ``[T, k]`` slot ids, -1 where the id was -1.
    """
    model = runtime_dispatch(dispatch)
    if model.runtime_route == "step":
        raise ValueError(
            f"dispatch model {model.name!r} splits each step by the counts of every rank; route it with "
            f"runtime_hooks.step_dispatch.StepDispatch (collective), not route_slots"
        )
    ids = topk_ids.long()
    T, k = ids.shape
    valid = ids >= 0
    e = ids.clamp(min=0)  # [T, k]
    rot = token_index.long().view(T, 1) + torch.arange(k, device=ids.device).view(1, k)  # [T, k]
    remote = tables.l2p[e, rot % tables.cnt[e]]  # [T, k] tier 2: any replica
    slot = remote
    if model.local_first:
        src = torch.as_tensor(src_rank, dtype=torch.int64, device=ids.device).expand(T).view(T, 1)  # [T, 1]
        node = src // tables.gpus_per_node  # [T, 1]
        own = tables.gpu_slot[src, e]  # [T, k] tier 0: replica on the token's own rank or -1
        nc = tables.node_cnt[node, e]  # [T, k] replicas on the token's node
        near = tables.node_l2p[node, e, rot % nc.clamp(min=1)]  # [T, k] tier 1
        slot = torch.where(own >= 0, own, torch.where(nc > 0, near, remote))
    return torch.where(valid, slot, torch.full_like(slot, -1))


# ---------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------
_INSTANCES = 0  # EPMoELayer objects built in this process (names migration records)


class EPMoELayer:
    """One MoE layer sharded over the ranks of ``group`` (default: the default process group).

    Args:
        placement: the placement; row ``layer`` is used (kept as a one-layer :class:`Placement`).
        layer: row index into ``placement``.
        weights: logical :class:`ExpertWeights`; only this rank's slots are copied to ``device``.
        dispatch: a dispatch model the runtime executes (:func:`runtime_dispatch`), or its name.
        group: process group for dispatch/combine; its size must equal ``placement.topology.ep_size``.
        device: compute device (default: ``cuda:<current>`` on NCCL, else CPU).
        store: key-value store for migration decisions (default: the launcher's store).
        name: key prefix for migration records; a per-process construction counter is appended, so
            every rank must build its layers in the same order (the usual SPMD model code does).

    Attribute ``simulated_seconds_per_token`` (default 0; benchmarks set it after construction): sleep
    this long per received pick after the expert compute, to model device time proportional to load
    without using the CPU cores.
    """

    def __init__(
        self,
        placement: Placement,
        layer: int,
        weights: ExpertWeights,
        *,
        dispatch: str | DispatchModel = EVEN.name,
        group=None,
        device=None,
        store=None,
        name: str | None = None,
    ):
        import torch.distributed as dist

        dispatch = runtime_dispatch(dispatch).name
        if not 0 <= layer < placement.num_layers:
            raise ValueError(f"layer {layer} is outside the placement's {placement.num_layers} rows")
        if weights.num_experts != placement.num_logical_experts:
            raise ValueError(
                f"weights hold {weights.num_experts} experts but the placement has {placement.num_logical_experts}"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.world_size != placement.topology.ep_size:
            raise ValueError(
                f"the process group has {self.world_size} ranks but the placement's ep_size is "
                f"{placement.topology.ep_size}; launch ep_size ranks"
            )
        backend = dist.get_backend(group)
        self.backend = str(backend)
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if self.backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.dispatch = dispatch
        self.store = store
        # Store keys must be unique per layer object in the world: layers are built in the same order on
        # every rank (SPMD), so a per-process construction counter names them consistently.
        global _INSTANCES
        _INSTANCES += 1
        self.name = f"{name or 'layer' + str(placement.layer_ids[layer])}#{_INSTANCES}"
        self.weights = weights
        self.simulated_seconds_per_token = 0.0  # benchmarks only (see the class docstring)
        self.router = weights.router.to(self.device)
        self.migration_epoch = 0
        self.last_tokens_processed = 0
        self.tokens_processed_total = 0
        self.last_slot_tokens = torch.zeros(0, dtype=torch.int64)
        self._set_placement(placement.select_layers([layer]))
        S = self.slots_per_gpu
        local = self.placement.physical_to_logical_map[0, self.rank * S : (self.rank + 1) * S]  # [S]
        idx = torch.tensor(np.array(local, dtype=np.int64))
        self.slot_w1 = weights.w1.index_select(0, idx).to(self.device).contiguous()  # [S, 2f, d]
        self.slot_w2 = weights.w2.index_select(0, idx).to(self.device).contiguous()  # [S, d, f]

    # ---- placement state ---------------------------------------------------------------------------
    def _set_placement(self, placement: Placement) -> None:
        """Point routing at a one-layer placement (the weights must already match it)."""
        self.placement = placement
        self.slots_per_gpu = placement.topology.slots_per_gpu
        self.tables = build_routing_tables(placement, 0, self.device)
        self.step = None  # per-step quotas, rebuilt for every placement (after a migration too)
        if routes_per_step(self.dispatch):
            from runtime_hooks.step_dispatch import StepDispatch

            self.step = StepDispatch(placement, self.device, self.group)

    @property
    def local_experts(self) -> np.ndarray:
        """int64 ``[S]``: logical expert held by each of this rank's slots."""
        S = self.slots_per_gpu
        return self.placement.physical_to_logical_map[0, self.rank * S : (self.rank + 1) * S]

    def slot_checksums(self) -> list[str]:
        """Content hash of each local slot's ``(w1, w2)`` (compare with the logical expert's)."""
        return [
            tensor_checksum(self.slot_w1[s]) + tensor_checksum(self.slot_w2[s])
            for s in range(self.slots_per_gpu)
        ]

    # ---- one step ---------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own router: ``x [T, d]`` -> (ids int64 ``[T, k]``, weights ``[T, k]``, softmax top-k)."""
        probs = torch.softmax(x @ self.router.T, dim=-1)  # [T, E]
        w, ids = probs.topk(top_k, dim=-1)
        return ids, w

    def expert_compute(self, x: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
        """Run received picks through this rank's slots: ``x [m, d]``, ``local_slot`` int64 ``[m]`` -> ``[m, d]``."""
        y = torch.empty_like(x)
        if x.shape[0] == 0:
            return y
        order = torch.argsort(local_slot, stable=True)  # picks grouped by slot
        counts = torch.bincount(local_slot, minlength=self.slots_per_gpu).tolist()
        start = 0
        for s, c in enumerate(counts):
            if c:
                rows = order[start : start + c]
                y[rows] = expert_ffn(x[rows], self.slot_w1[s], self.slot_w2[s])
                start += c
        return y

    def expert_compute_static(self, x: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
        """Same result with static shapes only (gather + batched matmul): safe under CUDA graph capture."""
        w1 = self.slot_w1.index_select(0, local_slot)  # [m, 2f, d]
        w2 = self.slot_w2.index_select(0, local_slot)  # [m, d, f]
        h = torch.bmm(w1, x.unsqueeze(2)).squeeze(2)  # [m, 2f]
        gate, up = h.chunk(2, dim=-1)
        return torch.bmm(w2, (F.silu(gate) * up).unsqueeze(2)).squeeze(2)  # [m, d]

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        top_k: int = 2,
    ) -> torch.Tensor:
        """One step: dispatch this rank's tokens, compute, combine. Collective over ``group``.

        Args:
            x: ``[T, d]`` this rank's tokens. topk_ids: int ``[T, k]`` replayed ids (-1 = none) or None
                to use the router with ``top_k``. topk_weights: ``[T, k]`` (required with ids).
            token_index: int64 ``[T]`` global token indices (replica rotation); default
                ``rank * T + arange(T)``.
        Returns:
            ``[T, d]`` on ``x``'s device.
        """
        from runtime_hooks.exchange import exchange

        dev = self.device
        x = x.to(dev)
        T = x.shape[0]
        if topk_ids is None:
            topk_ids, topk_weights = self.route(x, top_k)
        elif topk_weights is None:
            raise ValueError("replayed topk_ids need topk_weights of the same shape [T, k]")
        ids = topk_ids.to(dev).long()
        if token_index is None:
            token_index = self.rank * T + torch.arange(T, device=dev)
        if self.step is not None:
            slots = self.step.slots(ids)  # [T, k] this step's quotas (collective)
        else:
            slots = route_slots(self.tables, ids, token_index.to(dev), self.rank, self.dispatch)  # [T, k]
        return exchange(
            x, slots, topk_weights.to(dev), self.slots_per_gpu, self._compute_received, self.group
        )

    def _compute_received(self, x: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
        """Picks this rank received: ``x [m, d]``, ``local_slot`` int64 ``[m]`` -> ``[m, d]``; counts them."""
        y = self.expert_compute(x, local_slot)  # [m, d]
        m = int(x.shape[0])
        self.last_slot_tokens = torch.bincount(local_slot.cpu(), minlength=self.slots_per_gpu)  # [S]
        if self.simulated_seconds_per_token > 0 and m:
            time.sleep(self.simulated_seconds_per_token * m)
        self.last_tokens_processed = m
        self.tokens_processed_total += m
        return y

    __call__ = forward

    # ---- migration ---------------------------------------------------------------------------------
    def migrate_to(self, new_placement: Placement, layer: int = 0, timeout: float = 10.0, fault=None):
        """Move to row ``layer`` of ``new_placement`` (collective; see
        :func:`runtime_hooks.migrate.migrate_layer_placement`).

        Returns :class:`runtime_hooks.migration_core.MigrationResult`; on abort the layer keeps serving
        the old placement unchanged.
        """
        from runtime_hooks.migrate import migrate_layer_placement

        return migrate_layer_placement(self, new_placement, layer=layer, timeout=timeout, fault=fault)
