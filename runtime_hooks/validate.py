"""End-to-end validation of a placement on real ranks, replaying recorded routing.

For each placement row (one MoE layer) the check runs :class:`~runtime_hooks.ep_layer.EPMoELayer` on
``G = ep_size`` ranks over one process group and compares:

- outputs against :func:`~runtime_hooks.ep_layer.reference_moe` (single process, no replication),
  max absolute error within fp32 tolerance (``atol``);
- every slot's weight checksum against its logical expert's;
- the picks each rank computed against ``placement.metrics.routed_gpu_tokens(placement,
  route_tokens(...))`` for the same ids, source ranks, policy and token indices, EXACTLY.

Token layout: the replayed slice has ``G * tokens_per_rank`` tokens; token ``t`` (0-based in the slice)
lives on rank ``t // tokens_per_rank`` and its global index (the replica rotation) is ``offset + t``.
Router weights for replayed ids: softmax over seeded per-token random logits gathered at the ids.

Public API::

    spec = ValidationSpec.from_trace(placement, trace, tokens_per_rank=8)   # even dispatch
    report = validate_placement(spec, backend="gloo", timeout=120)   # -> ValidationReport
    report.ok, report.predicted [L, G], report.measured [L, G], report.max_abs_error
    validate_rank(rank, world_size, spec)   # the per-rank body, reusable inside another launched world
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from placement.dispatch import EVEN
from placement.metrics import route_tokens, routed_gpu_tokens
from placement.model import Placement
from profiling.trace import RoutingTrace

__all__ = ["ValidationReport", "ValidationSpec", "predicted_tokens", "validate_placement", "validate_rank"]


@dataclass(frozen=True)
class ValidationSpec:
    """Everything a rank needs (pickled to every rank).

    Attributes:
        placement: rows to validate, ``L`` rows.
        topk_ids: int64 ``[G * tokens_per_rank, L, k]`` replayed ids (-1 = none).
        policy: a dispatch model the runtime executes (its name). hidden / ffn: expert sizes. seed: weights and router logits.
        token_offset: global index of the slice's first token. atol: output tolerance.
    """

    placement: Placement
    topk_ids: np.ndarray
    tokens_per_rank: int
    policy: str = EVEN.name
    hidden: int = 16
    ffn: int = 8
    seed: int = 0
    token_offset: int = 0
    atol: float = 1e-4

    def __post_init__(self):
        G = self.placement.topology.ep_size
        ids = np.asarray(self.topk_ids)
        if (
            ids.ndim != 3
            or ids.shape[0] != G * self.tokens_per_rank
            or ids.shape[1] != self.placement.num_layers
        ):
            raise ValueError(
                f"topk_ids must be [{G} ranks x {self.tokens_per_rank} tokens, {self.placement.num_layers} layers, k], "
                f"got {ids.shape}"
            )
        from runtime_hooks.ep_layer import runtime_dispatch

        object.__setattr__(self, "policy", runtime_dispatch(self.policy).name)
        if ids.size and ids.max() >= self.placement.num_logical_experts:
            raise ValueError(
                f"the ids reach expert {int(ids.max())} but the placement has {self.placement.num_logical_experts} experts"
            )

    @classmethod
    def from_trace(
        cls, placement: Placement, trace: RoutingTrace, tokens_per_rank: int = 8, offset: int = 0, **kw
    ) -> ValidationSpec:
        """Slice ``G * tokens_per_rank`` tokens from ``offset`` of a per-token trace with matching layers."""
        if not trace.has_tokens:
            raise ValueError(
                "validation replays per-token routing; this trace has counts only (use a topk_ids trace)"
            )
        if trace.num_logical_experts != placement.num_logical_experts:
            raise ValueError(
                f"the trace has {trace.num_logical_experts} experts, the placement {placement.num_logical_experts}"
            )
        if trace.num_layers != placement.num_layers:
            raise ValueError(
                f"the trace has {trace.num_layers} layers, the placement {placement.num_layers}; select matching layers"
            )
        n = placement.topology.ep_size * int(tokens_per_rank)
        if tokens_per_rank < 1 or offset < 0 or offset + n > trace.num_tokens:
            raise ValueError(
                f"need {n} tokens from offset {offset} but the trace has {trace.num_tokens}; lower --tokens-per-rank"
            )
        ids = np.asarray(trace.topk_ids[offset : offset + n], dtype=np.int64)
        return cls(placement, ids, int(tokens_per_rank), token_offset=int(offset), **kw)

    @property
    def src(self) -> np.ndarray:
        """int64 ``[G * tokens_per_rank]`` source rank of each token."""
        return np.arange(self.topk_ids.shape[0], dtype=np.int64) // self.tokens_per_rank

    @property
    def token_index(self) -> np.ndarray:
        return self.token_offset + np.arange(self.topk_ids.shape[0], dtype=np.int64)


def predicted_tokens(spec: ValidationSpec) -> np.ndarray:
    """int64 ``[L, G]``: picks per rank and layer that placement.metrics predicts for the spec."""
    slots = route_tokens(spec.placement, spec.topk_ids, spec.src, spec.policy, token_index=spec.token_index)
    return routed_gpu_tokens(spec.placement, slots)


@dataclass(frozen=True)
class ValidationReport:
    """Result of :func:`validate_placement`. ``predicted``/``measured`` int64 ``[L, G]``."""

    predicted: np.ndarray
    measured: np.ndarray
    max_abs_error: float
    max_abs_error_per_layer: tuple[float, ...]
    checksum_mismatches: tuple[str, ...]
    atol: float
    policy: str
    layer_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def tokens_match(self) -> bool:
        return bool(np.array_equal(self.predicted, self.measured))

    @property
    def ok(self) -> bool:
        return self.tokens_match and self.max_abs_error <= self.atol and not self.checksum_mismatches


def validate_rank(rank: int, world_size: int, spec: ValidationSpec, store=None) -> dict:
    """Per-rank body: run every row once, return ``{"measured": [L], "max_err": [L], "bad_checksums": [...]}``."""
    import torch

    from runtime_hooks.ep_layer import (
        EPMoELayer,
        ExpertWeights,
        reference_moe,
        replay_weights,
        tensor_checksum,
    )

    P = spec.placement
    E = P.num_logical_experts
    T = spec.tokens_per_rank
    lo, hi = rank * T, (rank + 1) * T
    tok_index = torch.as_tensor(spec.token_index[lo:hi])
    measured, errs, bad = [], [], []
    for l in range(P.num_layers):
        weights = ExpertWeights.random(E, spec.hidden, spec.ffn, seed=spec.seed * 1000 + P.layer_ids[l])
        layer = EPMoELayer(P, l, weights, policy=spec.policy, store=store)
        g = torch.Generator().manual_seed(spec.seed * 7 + l)
        x_all = torch.randn(spec.topk_ids.shape[0], spec.hidden, generator=g)  # same on every rank
        x = x_all[lo:hi].to(layer.device)
        ids = torch.as_tensor(spec.topk_ids[lo:hi, l, :])  # [T, k]
        wts = replay_weights(ids, seed=spec.seed + l, token_index=tok_index, num_experts=E)
        y = layer.forward(x, ids, wts, tok_index)
        ref = reference_moe(x.cpu(), ids, wts, weights)
        errs.append(float((y.cpu() - ref).abs().max()) if y.numel() else 0.0)
        measured.append(layer.last_tokens_processed)
        got = layer.slot_checksums()
        for s, e in enumerate(layer.local_experts.tolist()):
            want = tensor_checksum(weights.w1[e]) + tensor_checksum(weights.w2[e])
            if got[s] != want:
                bad.append(f"layer row {l} rank {rank} slot {rank * layer.slots_per_gpu + s} (expert {e})")
    return {"measured": measured, "max_err": errs, "bad_checksums": bad}


def _validate_worker(rank: int, world_size: int, spec: ValidationSpec) -> dict:
    return validate_rank(rank, world_size, spec)


def validate_placement(
    spec: ValidationSpec, backend: str = "gloo", timeout: float = 120.0
) -> ValidationReport:
    """Launch ``ep_size`` ranks, validate every row of ``spec.placement``, return the report."""
    from runtime_hooks.launcher import launch

    G = spec.placement.topology.ep_size
    results = launch(_validate_worker, G, args=(spec,), backend=backend, timeout=timeout)
    return collect_report(spec, results)


def collect_report(spec: ValidationSpec, results: list[dict]) -> ValidationReport:
    """Assemble per-rank results of :func:`validate_rank` into a :class:`ValidationReport`."""
    measured = np.array([r["measured"] for r in results], dtype=np.int64).T  # [L, G]
    errs = np.array([r["max_err"] for r in results], dtype=np.float64).max(axis=0)  # [L]
    bad = tuple(b for r in results for b in r["bad_checksums"])
    return ValidationReport(
        predicted=predicted_tokens(spec),
        measured=measured,
        max_abs_error=float(errs.max()) if errs.size else 0.0,
        max_abs_error_per_layer=tuple(float(e) for e in errs),
        checksum_mismatches=bad,
        atol=spec.atol,
        policy=spec.policy,
        layer_ids=spec.placement.layer_ids,
    )
