"""Replicated expert parallelism for Hugging Face MoE models, driven by a :class:`Placement`.

transformers 5.x routes the experts of most MoE classes (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
GLM4-MoE, GPT-OSS, ...) through a forward chosen by name: classes decorated with
``@use_experts_implementation`` call ``ExpertsInterface`` entry ``config._experts_implementation`` as
``fn(experts_module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
:func:`apply_placement_to_model` registers :data:`IMPLEMENTATION` there and switches the model to it, so
no per-class code is needed. Llama4 and DBRX (not decorated) are rejected with a ValueError naming the
class.

Glossary (as in :mod:`runtime_hooks.ep_layer`): logical expert ``e``; physical slot ``p``; rank ``g`` of
the process group owns slots ``[g*S, (g+1)*S)``. Attention and dense layers stay data-parallel: every
rank runs the whole model on its own requests; only the routed experts are sharded.

Shapes (T = this rank's tokens in one experts call, H = hidden, I = expert FFN width, K = top-k,
E = logical experts, S = slots per rank, G = ranks, n = picks sent, m = picks received):

- fused weights of the model: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` (``is_transposed``
  classes such as GPT-OSS: ``[E, H, 2I]`` and ``[E, I, H]``; optional biases ``[E, 2I]``, ``[E, H]``;
  ``up_proj`` instead of ``gate_up_proj`` without a gate).
- after :func:`apply_placement_to_model` every such tensor is ``[S, ...]``: slot ``s`` of rank ``g``
  holds a copy of logical expert ``physical_to_logical_map[row, g*S + s]``; the full tensors are freed.

Routing: pick ``j`` of the token with global index ``t`` goes to the replica that
:func:`placement.metrics.route_tokens` picks for the dispatch model (one the registry marks
``runtime``: :func:`runtime_hooks.ep_layer.runtime_dispatch`), through
:func:`runtime_hooks.ep_layer.route_slots` (its torch port). Global indices number the tokens of one
experts call rank by rank (rank 0's tokens first), continuing across calls, so a trace of the recorded
ids in that order replays the same choices. Under ``balanced`` one experts call of a layer is one step:
the ranks all-gather their counts per expert and split each expert's picks by the step's quotas
(:class:`runtime_hooks.step_dispatch.StepDispatch`, built once per placement row and rebuilt after a
migration; it replaces the gather of token counts the rotation needs). Picks travel through the shared
:func:`runtime_hooks.exchange.exchange` (``all_to_all_single``, uneven splits) and come back weighted,
summed over ``K`` like transformers' own forwards (``[T, K, H].sum(1)``).

Public API::

    applied = apply_placement_to_model(model, placement, group=None)  # collective setup, even dispatch
    applied.expert_bytes_before, applied.expert_bytes_after                    # this rank's bytes
    logits = model(input_ids).logits                                           # every rank, lockstep
    slot_token_counts(model)  # int64 [L, S] picks this rank's slots computed
    recorded_ids(model)       # per layer, the top-k ids of each call, when record=True
    step_quota_tokens(model)  # balanced, record=True: int64 [L, P] the numpy quotas of the recorded steps
    balanced_collective(model, repeats)  # balanced: ([L] median us per counts all-gather, bytes per call)

Inference only (no autograd through the exchange). Every rank must call the model the same number of
times (the exchange is collective); a rank with no tokens passes an empty batch.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from placement.dispatch import EVEN, get_dispatch
from placement.model import Placement

__all__ = [
    "IMPLEMENTATION",
    "AppliedPlacement",
    "apply_placement_to_model",
    "balanced_collective",
    "expert_bytes",
    "moe_experts",
    "match_layers",
    "recorded_ids",
    "served_placement",
    "slot_token_counts",
    "step_quota_tokens",
]

log = logging.getLogger(__name__)

IMPLEMENTATION = "moe_placement"
"""Name registered with ``transformers.integrations.moe.ExpertsInterface``."""

# Per-expert tensors of a decorated experts module (leading dim E), in the interface's names.
_EXPERT_TENSORS = (
    "gate_up_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "up_proj_bias",
    "down_proj_bias",
)


@dataclass(frozen=True)
class AppliedPlacement:
    """What :func:`apply_placement_to_model` did on this rank.

    Attributes:
        model_class: the model's class name. rank / ranks: this rank and the group size.
        layer_ids: model layer index of each MoE layer, ``L`` of them, in model order.
        rows: placement row serving each of those layers (``[L]``).
        expert_bytes_before / expert_bytes_after: bytes of routed-expert tensors on this rank.
        dispatch: the replica-selection model.
    """

    model_class: str
    rank: int
    ranks: int
    layer_ids: tuple[int, ...]
    rows: tuple[int, ...]
    expert_bytes_before: int
    expert_bytes_after: int
    dispatch: str


@dataclass
class _SlotState:
    """Per experts module: the one-layer placement, its routing tables and this rank's counters."""

    placement: Placement  # one row
    tables: object  # ep_layer.RoutingTables
    group: object
    rank: int
    ranks: int
    dispatch: str
    slot_tokens: torch.Tensor  # int64 [S] picks computed per local slot
    tokens_seen: int = 0  # global tokens of earlier calls (rotation offset)
    record: bool = False
    ids: list = field(default_factory=list)  # int64 [T, K] per call, when recording
    step: object = None  # step_dispatch.StepDispatch of ``placement`` (balanced), built at the first call
    timer: object = None  # step_dispatch.CollectiveTimer kept across migrations (balanced)
    steps: list = field(default_factory=list)  # (row, counts [E] tensor) per call, balanced and recording


# ---------------------------------------------------------------------------------------------------
# Finding the experts
# ---------------------------------------------------------------------------------------------------
def _is_interface_experts(module: torch.nn.Module) -> bool:
    """True for modules of a class decorated with ``@use_experts_implementation``."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "_is_expert_parallel")
        and hasattr(module, "down_proj")
    )


def moe_experts(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Model layer index -> experts module, for every experts module that uses the experts interface.

    The index is the ``layers.<i>`` number of the module's name; modules without one (or with repeated
    numbers, as in multi-stack models) are numbered in model order instead.

    Raises:
        ValueError: the model has no such module (dense model, or Llama4/DBRX-style experts).
    """
    found = [(name, m) for name, m in model.named_modules() if _is_interface_experts(m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no experts module using transformers' experts interface "
            f"(@use_experts_implementation with fused gate_up_proj/down_proj); moe-placement cannot place "
            f"its experts. Classes such as Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS are supported"
        )
    ids = []
    for name, _ in found:
        hit = re.search(r"layers\.(\d+)\.", name)
        ids.append(int(hit.group(1)) if hit else -1)
    if min(ids) < 0 or len(set(ids)) != len(ids):
        ids = list(range(len(found)))
    return dict(zip(ids, (m for _, m in found)))


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed-expert tensors (:data:`_EXPERT_TENSORS`) held by the model."""
    total = 0
    for module in moe_experts(model).values():
        for name in _EXPERT_TENSORS:
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def match_layers(
    placement: Placement, layer_ids: list[int], num_experts: int, rows: list[int] | None = None
) -> list[int]:
    """Placement row serving each model MoE layer (``[L]``), or ValueError naming the numbers.

    Args:
        placement: ``N`` rows; layer_ids: the model's ``L`` MoE layer ids in model order.
        rows: explicit placement rows (0-based), one per MoE layer in model order (``--layers``);
            a row may serve several layers.

    Without ``rows`` the placement must have exactly ``L`` rows: matched by real layer id when its
    ids are the model's MoE layers, or in order when it has the default ids ``0..L-1`` (for models
    whose first MoE layer is not layer 0, e.g. DeepSeek with dense first layers).
    """
    if placement.num_logical_experts != num_experts:
        raise ValueError(
            f"the placement has {placement.num_logical_experts} logical experts per layer but the model "
            f"has {num_experts}; solve the placement for {num_experts} experts"
        )
    L, N = len(layer_ids), placement.num_layers
    if rows is not None:
        return _explicit_rows(list(rows), L, N)
    if N != L:
        raise ValueError(
            f"the model has {L} MoE layers (ids {layer_ids}) but the placement has {N} rows (layer ids "
            f"{list(placement.layer_ids)}); pass --layers with {L} placement rows (0..{N - 1}), one per "
            f"MoE layer in order, or solve a placement for these {L} layers"
        )
    by_id = {lid: r for r, lid in enumerate(placement.layer_ids)}
    if all(lid in by_id for lid in layer_ids):
        return [by_id[lid] for lid in layer_ids]
    if placement.layer_ids == tuple(range(L)):
        log.info("placement rows 0..%d matched in order to MoE layers %s", L - 1, layer_ids)
        return list(range(L))
    missing = [lid for lid in layer_ids if lid not in by_id]
    raise ValueError(
        f"the model has {L} MoE layers (ids {layer_ids}) but the placement has {N} rows for layer ids "
        f"{list(placement.layer_ids)}; layers {missing} have no row: pass --layers to map rows to layers"
    )


def _explicit_rows(rows: list[int], num_moe_layers: int, num_rows: int) -> list[int]:
    """``--layers``: one placement row per MoE layer, each in ``0..num_rows-1``."""
    if len(rows) != num_moe_layers:
        raise ValueError(
            f"--layers names {len(rows)} placement rows but the model has {num_moe_layers} MoE layers; "
            f"give one row (0..{num_rows - 1}) per MoE layer, in model order"
        )
    bad = [r for r in rows if not 0 <= int(r) < num_rows]
    if bad:
        raise ValueError(f"--layers {bad} outside the placement's rows 0..{num_rows - 1}")
    return [int(r) for r in rows]


def served_placement(placement: Placement, rows: list[int], layer_ids: list[int]) -> Placement:
    """The rows serving the model, ``[L, P]``, labelled with the model's MoE ``layer_ids``."""
    return Placement(
        placement.physical_to_logical_map[list(rows)],
        placement.num_logical_experts,
        placement.topology,
        tuple(int(i) for i in layer_ids),
        placement.provenance,
        placement.allow_colocated_replicas,
    )


# ---------------------------------------------------------------------------------------------------
# Applying a placement
# ---------------------------------------------------------------------------------------------------
def apply_placement_to_model(
    model: torch.nn.Module,
    placement: Placement,
    group=None,
    dispatch: str = EVEN.name,
    record: bool = False,
    rows: list[int] | None = None,
) -> AppliedPlacement:
    """Shard ``model``'s routed experts over ``group`` as ``placement`` says; switch it to our forward.

    Call on every rank of ``group`` with the same model weights and placement (``ep_size`` must equal
    the group size). Each rank keeps copies of its own slots' experts, sliced from the model's tensors,
    and frees the full tensors.

    Args:
        model: a transformers model whose experts use the experts interface.
        placement: rows for the model's MoE layers (see :func:`match_layers`).
        group: process group (default: the default group).
        dispatch: a dispatch model the runtime executes (as :func:`placement.metrics.route_tokens`;
            :func:`runtime_hooks.ep_layer.runtime_dispatch`).
        record: keep each call's top-k ids (for :func:`recorded_ids`).
        rows: explicit placement row per MoE layer (see :func:`match_layers`).

    Raises:
        ValueError: unsupported class, layers or experts that do not fit, wrong group size or dispatch.
    """
    import torch.distributed as dist

    from runtime_hooks.ep_layer import runtime_dispatch

    dispatch = runtime_dispatch(dispatch).name
    experts = moe_experts(model)
    _check_switchable(model)
    if any(hasattr(m, "_moe_placement") for m in experts.values()):
        raise ValueError(
            f"a placement is already applied to this {type(model).__name__}; reload the model to apply another"
        )
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    if ranks != placement.topology.ep_size:
        raise ValueError(
            f"the process group has {ranks} ranks but the placement's ep_size is "
            f"{placement.topology.ep_size}; launch {placement.topology.ep_size} ranks"
        )
    num_experts = {int(getattr(m, "num_experts", 0)) for m in experts.values()}
    rows = match_layers(placement, list(experts), max(num_experts), rows)
    served = served_placement(placement, rows, list(experts))  # [L, P] labelled with the model's ids
    before = expert_bytes(model)
    for l, module in enumerate(experts.values()):
        _shard_module(module, served.select_layers([l]), group, rank, ranks, dispatch, record)
    _switch(model)
    after = expert_bytes(model)
    log.info("rank %d keeps %d of %d expert bytes", rank, after, before)
    return AppliedPlacement(
        type(model).__name__, rank, ranks, tuple(experts), tuple(rows), before, after, dispatch
    )


def _check_switchable(model: torch.nn.Module) -> None:
    """ValueError naming the class when transformers cannot switch its experts implementation."""
    can = getattr(type(model), "_can_set_experts_implementation", None)
    if can is None or not can():
        raise ValueError(
            f"{type(model).__name__} cannot switch its experts implementation "
            f"(set_experts_implementation); moe-placement needs @use_experts_implementation experts"
        )


def _shard_module(module, row: Placement, group, rank: int, ranks: int, dispatch: str, record: bool) -> None:
    """Replace the module's ``[E, ...]`` expert tensors by this rank's ``[S, ...]`` slot copies."""
    from runtime_hooks.ep_layer import build_routing_tables

    S = row.topology.slots_per_gpu
    local = np.array(row.physical_to_logical_map[0, rank * S : (rank + 1) * S], dtype=np.int64)  # [S]
    for name in _EXPERT_TENSORS:
        full = getattr(module, name, None)
        if not isinstance(full, torch.Tensor):
            continue
        idx = torch.as_tensor(local, device=full.device)
        slots = full.detach().index_select(0, idx).clone()  # [S, ...] own storage: the [E, ...] is freed
        setattr(module, name, torch.nn.Parameter(slots, requires_grad=False))
    device = module.down_proj.device
    module._moe_placement = _SlotState(
        placement=row,
        tables=build_routing_tables(row, 0, device),
        group=group,
        rank=rank,
        ranks=ranks,
        dispatch=dispatch,
        slot_tokens=torch.zeros(S, dtype=torch.int64),
        record=record,
    )


def _switch(model: torch.nn.Module) -> None:
    """Register :func:`placed_experts_forward` under :data:`IMPLEMENTATION` and select it."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, placed_experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)


# ---------------------------------------------------------------------------------------------------
# The experts forward
# ---------------------------------------------------------------------------------------------------
def placed_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts forward over the placement: ``[T, H]``, ids ``[T, K]``, weights ``[T, K]`` -> ``[T, H]``.

    Collective over the placement's group: dispatch picks to their replicas, compute, combine.
    """
    from runtime_hooks.exchange import exchange

    state: _SlotState | None = getattr(self, "_moe_placement", None)
    if state is None:
        raise RuntimeError(
            f"{type(self).__name__} runs experts implementation {IMPLEMENTATION!r} without a placement; "
            f"call runtime_hooks.hf.apply_placement_to_model(model, placement, group) on every rank first"
        )
    slots = _route(state, top_k_index)  # [T, K] physical slot of every pick
    with torch.no_grad():
        y = exchange(
            hidden_states,
            slots,
            top_k_weights,
            state.placement.topology.slots_per_gpu,
            lambda x, s: _compute_slots(self, state, x, s),
            state.group,
        )  # [T, H] weighted sum over K of every pick's expert output
    return y.to(hidden_states.dtype)


def _route(state: _SlotState, top_k_index: torch.Tensor) -> torch.Tensor:
    """Physical slot of every pick, int64 ``[T, K]``; advances the global token counter."""
    import torch.distributed as dist

    from runtime_hooks.ep_layer import route_slots, routes_per_step

    if routes_per_step(state.dispatch):
        return _route_step(state, top_k_index)
    T = top_k_index.shape[0]
    sizes = torch.zeros(state.ranks, dtype=torch.int64)
    mine = torch.tensor([T], dtype=torch.int64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(sizes, mine, group=state.group)  # [G] tokens of each rank this call
    first = state.tokens_seen + int(sizes[: state.rank].sum())
    state.tokens_seen += int(sizes.sum())
    device = top_k_index.device
    token_index = torch.arange(first, first + T, dtype=torch.int64, device=device)  # [T]
    if state.record:
        state.ids.append(top_k_index.detach().to("cpu", torch.int64).numpy().copy())
    return route_slots(state.tables, top_k_index, token_index, state.rank, state.dispatch)


def _step_dispatch(state: _SlotState, device):
    """The state's :class:`~runtime_hooks.step_dispatch.StepDispatch`, (re)built when its row changed."""
    from runtime_hooks.step_dispatch import CollectiveTimer, StepDispatch

    if state.step is None or state.step.placement is not state.placement:  # first call, or migrated
        state.timer = state.timer or CollectiveTimer(device)
        state.step = StepDispatch(state.placement, device, state.group, timer=state.timer)
    return state.step


def _route_step(state: _SlotState, top_k_index: torch.Tensor) -> torch.Tensor:
    """``balanced``: slots ``[T, K]`` by this call's quotas (one counts all-gather, no host sync)."""
    step = _step_dispatch(state, top_k_index.device)
    slots = step.slots(top_k_index)  # [T, K]
    if state.record:
        state.ids.append(top_k_index.detach().to("cpu", torch.int64).numpy().copy())
        state.steps.append((state.placement, step.last_counts.sum(0)))  # [E] stays on the device
    return slots


def _compute_slots(module, state: _SlotState, x: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
    """Received picks through this rank's slots: ``x [m, H]``, ``local_slot`` int64 ``[m]`` -> ``[m, H]``."""
    y = x.new_empty(x.shape)
    if x.shape[0] == 0:
        return y
    counts = torch.bincount(local_slot, minlength=state.slot_tokens.numel())  # [S]
    state.slot_tokens += counts.cpu()
    order = torch.argsort(local_slot, stable=True)  # picks grouped by slot
    start = 0
    for s, c in enumerate(counts.tolist()):
        if c:
            rows = order[start : start + c]
            y[rows] = _expert(module, s, x[rows])
            start += c
    return y


def _linear(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [n, in]`` through one expert matrix in the module's layout (``[out, in]`` or transposed)."""
    y = x @ weight if module.is_transposed else F.linear(x, weight)
    return y + bias if bias is not None else y


def _expert(module, s: int, x: torch.Tensor) -> torch.Tensor:
    """Local slot ``s`` of ``module`` on ``x [n, H]`` -> ``[n, H]`` (gate, bias and post-norm as the class)."""
    has_bias = bool(getattr(module, "has_bias", False))
    if module.has_gate:
        h = _linear(module, x, module.gate_up_proj[s], module.gate_up_proj_bias[s] if has_bias else None)
        h = module._apply_gate(h)  # [n, I]
    else:
        h = module.act_fn(_linear(module, x, module.up_proj[s], module.up_proj_bias[s] if has_bias else None))
    y = _linear(module, h, module.down_proj[s], module.down_proj_bias[s] if has_bias else None)  # [n, H]
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y


# ---------------------------------------------------------------------------------------------------
# Read-outs
# ---------------------------------------------------------------------------------------------------
def slot_token_counts(model: torch.nn.Module) -> np.ndarray:
    """int64 ``[L, S]``: picks each local slot computed since :func:`apply_placement_to_model`, MoE layers
    in order."""
    return np.stack([_state(m).slot_tokens.numpy().copy() for m in moe_experts(model).values()])


def recorded_ids(model: torch.nn.Module) -> list[list[np.ndarray]]:
    """Per MoE layer, the int64 ``[T, K]`` top-k ids of each call on this rank (``record=True``)."""
    return [list(_state(m).ids) for m in moe_experts(model).values()]


def step_quota_tokens(model: torch.nn.Module) -> np.ndarray | None:
    """int64 ``[L, P]``: picks per slot the numpy quotas give for every recorded step (the oracle of
    :func:`placement.step_balance.balanced_quotas` on the all-gathered counts, on the row served at
    that step); None unless ``balanced`` with ``record=True``."""
    from runtime_hooks.ep_layer import routes_per_step
    from runtime_hooks.step_dispatch import quota_slot_tokens

    states = [_state(m) for m in moe_experts(model).values()]
    if not states or not routes_per_step(states[0].dispatch) or not states[0].record:
        return None
    out = np.zeros((len(states), states[0].placement.num_physical_experts), dtype=np.int64)
    for l, state in enumerate(states):
        for row, counts in state.steps:
            out[l] += quota_slot_tokens(row, counts.cpu().numpy()[None], get_dispatch(state.dispatch))[0]
    return out


def balanced_collective(model: torch.nn.Module, repeats: int = 0) -> tuple[tuple[float, ...], int] | None:
    """``([L] median microseconds per counts all-gather, bytes it gathers per call)`` of each MoE layer
    under ``balanced`` (None otherwise). ``repeats`` more gathers per layer are timed first (collective:
    every rank passes the same number)."""
    from runtime_hooks.ep_layer import routes_per_step

    states = [_state(m) for m in moe_experts(model).values()]
    if not states or not routes_per_step(states[0].dispatch):
        return None
    us, nbytes = [], 0
    for module, state in zip(moe_experts(model).values(), states):
        step = _step_dispatch(state, module.down_proj.device)
        empty = torch.empty((0, 1), dtype=torch.int64, device=step.device)
        for _ in range(int(repeats)):
            step.gather_counts(empty)
        us.append(step.timer.median_us())
        nbytes = step.bytes_per_call
    return tuple(us), nbytes


def _state(module) -> _SlotState:
    state = getattr(module, "_moe_placement", None)
    if state is None:
        raise ValueError("no placement applied to this model; call apply_placement_to_model first")
    return state
