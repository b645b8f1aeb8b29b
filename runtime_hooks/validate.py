"""End-to-end validation of a placement on real ranks, replaying recorded routing.

For each placement row (one MoE layer) the check runs :class:`~runtime_hooks.ep_layer.EPMoELayer` on
``G = ep_size`` ranks over one process group and compares:

- outputs against :func:`~runtime_hooks.ep_layer.reference_moe` (single process, no replication),
  max absolute error within fp32 tolerance (``atol``);
- every slot's weight checksum against its logical expert's;
- the picks each rank and each slot computed against ``placement.metrics.routed_gpu_tokens(placement,
  route_tokens(...))`` for the same ids, source ranks, dispatch model and token indices, EXACTLY; under
  ``balanced`` (one forward per layer is one step) against the model's numpy ``step_load`` of the
  slice's counts (:func:`runtime_hooks.step_dispatch.quota_slot_tokens`), and the per-layer cost of its
  counts all-gather is reported (``collective_us_per_layer``, ``collective_bytes_per_layer``).

Token layout: the replayed slice has ``G * step_tokens`` tokens; token ``t`` (0-based in the slice)
lives on rank ``t // step_tokens`` and its global index (the replica rotation) is ``offset + t``.
Router weights for replayed ids: softmax over seeded per-token random logits gathered at the ids.

Public API::

    spec = ValidationSpec.from_trace(placement, trace, step_tokens=8)   # even dispatch
    report = validate_placement(spec, backend="gloo", timeout=120)   # -> ValidationReport
    report.ok, report.predicted [L, G], report.measured [L, G], report.max_abs_error
    report.predicted_slots [L, P], report.measured_slots [L, P]
    validate_rank(rank, world_size, spec)   # the per-rank body, reusable inside another launched world
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import EVEN, get_dispatch
from placement.metrics import route_tokens
from placement.model import Placement
from profiling.trace import RoutingTrace

TIMING_REPEATS = 8  # extra counts all-gathers per row after the forward, timed with it (balanced)

__all__ = [
    "ValidationReport",
    "ValidationSpec",
    "predicted_slot_tokens",
    "predicted_tokens",
    "validate_placement",
    "validate_rank",
]


@refuse_unknown_keywords
@dataclass(frozen=True)
class ValidationSpec:
    """Everything a rank needs (pickled to every rank).

    Attributes:
        placement: rows to validate, ``L`` rows.
        topk_ids: int64 ``[G * step_tokens, L, k]`` replayed ids (-1 = none).
        dispatch: a dispatch model the runtime executes (its name). hidden / ffn: expert sizes. seed: weights and router logits.
        token_offset: global index of the slice's first token. atol: output tolerance.
    """

    placement: Placement
    topk_ids: np.ndarray
    step_tokens: int
    dispatch: str = EVEN.name
    hidden: int = 16
    ffn: int = 8
    seed: int = 0
    token_offset: int = 0
    atol: float = 1e-4

    def __post_init__(self):
        G = self.placement.topology.ep_size
        ids = np.asarray(self.topk_ids)
        if ids.ndim != 3 or ids.shape[0] != G * self.step_tokens or ids.shape[1] != self.placement.num_layers:
            raise ValueError(
                f"topk_ids must be [{G} ranks x {self.step_tokens} tokens, {self.placement.num_layers} layers, k], "
                f"got {ids.shape}"
            )
        from runtime_hooks.ep_layer import runtime_dispatch

        object.__setattr__(self, "dispatch", runtime_dispatch(self.dispatch).name)
        if ids.size and ids.max() >= self.placement.num_logical_experts:
            raise ValueError(
                f"the ids reach expert {int(ids.max())} but the placement has {self.placement.num_logical_experts} experts"
            )

    @classmethod
    def from_trace(
        cls, placement: Placement, trace: RoutingTrace, step_tokens: int = 8, offset: int = 0, **kw
    ) -> ValidationSpec:
        """Slice ``G * step_tokens`` tokens from ``offset`` of a per-token trace with matching layers."""
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
        n = placement.topology.ep_size * int(step_tokens)
        if step_tokens < 1 or offset < 0 or offset + n > trace.num_tokens:
            raise ValueError(
                f"need {n} tokens from offset {offset} but the trace has {trace.num_tokens}; lower --tokens-per-rank"
            )
        ids = np.asarray(trace.topk_ids[offset : offset + n], dtype=np.int64)
        return cls(placement, ids, int(step_tokens), token_offset=int(offset), **kw)

    @property
    def src(self) -> np.ndarray:
        """int64 ``[G * step_tokens]`` source rank of each token."""
        return np.arange(self.topk_ids.shape[0], dtype=np.int64) // self.step_tokens

    @property
    def token_index(self) -> np.ndarray:
        return self.token_offset + np.arange(self.topk_ids.shape[0], dtype=np.int64)


def predicted_tokens(spec: ValidationSpec) -> np.ndarray:
    """int64 ``[L, G]``: picks per rank and layer that placement.metrics predicts for the spec."""
    L, P = spec.placement.num_layers, spec.placement.num_physical_experts
    G = spec.placement.topology.ep_size
    return predicted_slot_tokens(spec).reshape(L, G, P // G).sum(axis=2)


def predicted_slot_tokens(spec: ValidationSpec) -> np.ndarray:
    """int64 ``[L, P]``: picks per slot and layer predicted for the spec.

    ``even``/``local``: :func:`placement.metrics.route_tokens`, counted per slot; a model that needs
    step counts (``balanced``): its numpy ``step_load`` of the slice's counts (the slice is one step).
    """
    pl = spec.placement
    if not get_dispatch(spec.dispatch).needs_step_counts:
        slots = route_tokens(pl, spec.topk_ids, spec.src, spec.dispatch, token_index=spec.token_index)
        return _slot_counts(slots, pl.num_physical_experts)
    from runtime_hooks.step_dispatch import quota_slot_tokens

    E = pl.num_logical_experts
    out = []
    for l in range(pl.num_layers):
        ids = spec.topk_ids[:, l, :]
        counts = np.bincount(ids[ids >= 0], minlength=E)[None]  # [1, E] the step's valid picks
        out.append(quota_slot_tokens(pl.select_layers([l]), counts, spec.dispatch)[0])
    return np.stack(out)


def _slot_counts(slots: np.ndarray, num_slots: int) -> np.ndarray:
    """``slots`` int ``[T, L, k]`` (-1 = none) -> picks per slot int64 ``[L, P]``."""
    return np.stack([np.bincount(s[s >= 0], minlength=num_slots) for s in np.moveaxis(slots, 1, 0)])


@dataclass(frozen=True)
class ValidationReport:
    """Result of :func:`validate_placement`.

    ``predicted``/``measured``: int64 ``[L, G]`` picks per rank; ``predicted_slots``/``measured_slots``:
    int64 ``[L, P]`` per slot (None when not collected). ``balanced_collective_us_per_layer``: ``[L]``
    median microseconds of the counts all-gather of each row (its forward's call and
    :data:`TIMING_REPEATS` more; slowest rank), and
    ``balanced_collective_bytes_per_layer`` the bytes it gathers per rank (``4 G E``); None unless the
    dispatch gathers step counts.
    """

    predicted: np.ndarray
    measured: np.ndarray
    max_abs_error: float
    max_abs_error_per_layer: tuple[float, ...]
    checksum_mismatches: tuple[str, ...]
    atol: float
    dispatch: str
    layer_ids: tuple[int, ...] = field(default_factory=tuple)
    predicted_slots: np.ndarray | None = None
    measured_slots: np.ndarray | None = None
    balanced_collective_us_per_layer: tuple[float, ...] | None = None
    balanced_collective_bytes_per_layer: int | None = None

    @property
    def tokens_match(self) -> bool:
        slots = self.predicted_slots is None or np.array_equal(self.predicted_slots, self.measured_slots)
        return bool(np.array_equal(self.predicted, self.measured)) and bool(slots)

    @property
    def ok(self) -> bool:
        return self.tokens_match and self.max_abs_error <= self.atol and not self.checksum_mismatches


def validate_rank(rank: int, world_size: int, spec: ValidationSpec, store=None) -> dict:
    """Per-rank body: run every row once, return ``{"measured": [L], "slots": [L][S], "max_err": [L],
    "bad_checksums": [...], "collective_us": [L] | None, "collective_bytes": int | None}``."""
    import torch
    import torch.distributed as dist

    from runtime_hooks.ep_layer import (
        EPMoELayer,
        ExpertWeights,
        reference_moe,
        replay_weights,
        tensor_checksum,
    )

    P = spec.placement
    E = P.num_logical_experts
    T = spec.step_tokens
    lo, hi = rank * T, (rank + 1) * T
    tok_index = torch.as_tensor(spec.token_index[lo:hi])
    measured, errs, bad, slots, us, nbytes = [], [], [], [], [], None
    for l in range(P.num_layers):
        weights = ExpertWeights.random(E, spec.hidden, spec.ffn, seed=spec.seed * 1000 + P.layer_ids[l])
        layer = EPMoELayer(P, l, weights, dispatch=spec.dispatch, store=store)
        g = torch.Generator().manual_seed(spec.seed * 7 + l)
        x_all = torch.randn(spec.topk_ids.shape[0], spec.hidden, generator=g)  # same on every rank
        x = x_all[lo:hi].to(layer.device)
        ids = torch.as_tensor(spec.topk_ids[lo:hi, l, :])  # [T, k]
        wts = replay_weights(ids, seed=spec.seed + l, token_index=tok_index, num_experts=E)
        dist.barrier()  # the ranks enter the step together: the collectives' times exclude set-up skew
        y = layer.forward(x, ids, wts, tok_index)
        ref = reference_moe(x.cpu(), ids, wts, weights)
        errs.append(float((y.cpu() - ref).abs().max()) if y.numel() else 0.0)
        measured.append(layer.last_tokens_processed)
        slots.append(layer.last_slot_tokens.tolist())
        if layer.step is not None:
            for _ in range(TIMING_REPEATS):  # the same gather again, so one slow call does not decide
                layer.step.gather_counts(ids)
            us.append(layer.step.timer.median_us())
            nbytes = layer.step.bytes_per_call
        got = layer.slot_checksums()
        for s, e in enumerate(layer.local_experts.tolist()):
            want = tensor_checksum(weights.w1[e]) + tensor_checksum(weights.w2[e])
            if got[s] != want:
                bad.append(f"layer row {l} rank {rank} slot {rank * layer.slots_per_gpu + s} (expert {e})")
    return {
        "measured": measured,
        "slots": slots,
        "max_err": errs,
        "bad_checksums": bad,
        "collective_us": us if nbytes is not None else None,
        "collective_bytes": nbytes,
    }


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
    measured_slots = np.concatenate([np.array(r["slots"], dtype=np.int64) for r in results], axis=1)  # [L, P]
    us = None
    if results[0]["collective_us"] is not None:
        us = tuple(float(u) for u in np.array([r["collective_us"] for r in results]).max(axis=0))  # [L]
    return ValidationReport(
        predicted=predicted_tokens(spec),
        measured=measured,
        max_abs_error=float(errs.max()) if errs.size else 0.0,
        max_abs_error_per_layer=tuple(float(e) for e in errs),
        checksum_mismatches=bad,
        atol=spec.atol,
        dispatch=spec.dispatch,
        layer_ids=spec.placement.layer_ids,
        predicted_slots=predicted_slot_tokens(spec),
        measured_slots=measured_slots,
        balanced_collective_us_per_layer=us,
        balanced_collective_bytes_per_layer=results[0]["collective_bytes"],
    )
