"""Disaggregated serving on real ranks: a prefill pool and a decode pool, each on its own placement, with
the KV hand-off of :mod:`runtime_hooks.pd.handoff` between them.

One launch of ``P + D`` gloo ranks: ranks ``0..P-1`` form the prefill pool, ``P..P+D-1`` the decode pool,
each with its own process group (``new_group``) and its own placement applied to the same model
(:func:`runtime_hooks.hf.apply_placement_to_model`: attention data-parallel, routed experts sharded
over the pool as its placement says, redundant slots included). Each pool steps in lockstep (every
experts call is collective over the pool; a rank with nothing to run joins with an empty batch):

- prefill: the request manager (:class:`runtime_hooks.pd.manager.Manager`, on prefill rank 0) gives each
  prefill rank at most one request per step and its decode rank (broadcast over the prefill group);
  the rank posts the hand-off's metadata, runs the prompt and streams each layer's KV from a forward hook
  while the next layer computes, then the first generated token.
- decode: each decode rank receives on its own threads, and its loop admits every committed request
  into its running batch at the next step (continuous batching, :func:`runtime_hooks.pd.kv.decode_step`);
  a step begins with :meth:`runtime_hooks.pd.pool.Pool.sync` (the members' states through the store: a
  decode rank that died is found there, and the survivors fail over to the map on the remaining ranks).

Every request's tokens are compared with the single-process model's, the request decoded alone (greedy,
fp32): completed requests must match; failed ones have no tokens. Bytes handed off per layer are
compared with :attr:`placement.cost.modelspec.ModelSpec.kv_bytes_per_token_layer` x prompt tokens.

Public API::

    report = serve_pd(PDSpec(source, prefill_placement, decode_placement, requests=8))
    report.tokens_match, report.requests, report.pools, report.leaked_kv_bytes, report.to_dict()

Shapes: N requests, L decoder layers, request ``i``'s prompt ``T_i = prompt_len + i % 3`` tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import EVEN
from placement.model import Placement
from runtime_hooks.pd.handoff import HandoffFault
from runtime_hooks.pd.manager import ON_FAILURE
from runtime_hooks.pd.report import PDReport, build_report

__all__ = ["PDReport", "PDSpec", "serve_pd"]

log = logging.getLogger(__name__)


@refuse_unknown_keywords
@dataclass(frozen=True)
class PDSpec:
    """One disaggregated run.

    Attributes:
        source: checkpoint folder, ``config.json`` path or config object (random weights from ``seed``).
        prefill_placement / decode_placement: each pool's placement (its ``ep_size`` is the pool's ranks).
        requests: ``N`` seeded prompts; request ``i`` has ``prompt_len + i % 3`` tokens.
        new_tokens: tokens generated per request (the first by the prefill, the rest by the decode pool).
        on_handoff_failure: ``fail`` or ``retry`` (from the prompt; see :mod:`runtime_hooks.pd.manager`).
        handoff_timeout: seconds from a hand-off's request to its last layer.
        liveness_timeout: seconds a decode rank waits for its peers at a step before it takes them as lost.
        max_attempts: attempts per request under ``retry``.
        faults: hand-off faults, each on the first attempt of one request.
        stream_layers: send each layer's KV as soon as it is computed (False: all after the prompt ran,
            the comparison that shows what streaming hides).
    """

    source: Any
    prefill_placement: Placement
    decode_placement: Placement
    requests: int = 8
    prompt_len: int = 8
    new_tokens: int = 8
    on_handoff_failure: str = "fail"
    handoff_timeout: float = 5.0
    liveness_timeout: float = 3.0
    max_attempts: int = 3
    faults: tuple[HandoffFault, ...] = ()
    seed: int = 0
    dtype: str = "float32"
    dispatch: str = EVEN.name
    stream_layers: bool = True

    def __post_init__(self) -> None:
        for name in ("requests", "prompt_len", "new_tokens", "max_attempts"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("handoff_timeout", "liveness_timeout"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.on_handoff_failure not in ON_FAILURE:
            raise ValueError(
                f"on_handoff_failure must be one of {', '.join(ON_FAILURE)}, got {self.on_handoff_failure!r}"
            )
        object.__setattr__(self, "faults", tuple(self.faults))
        seen = [f.request for f in self.faults]
        if len(set(seen)) != len(seen) or any(r >= self.requests for r in seen):
            raise ValueError(
                f"hand-off faults go on distinct requests below {self.requests}, got requests {seen}; "
                f"raise --requests or inject fewer faults"
            )

    @property
    def ranks(self) -> tuple[int, int]:
        """(prefill ranks, decode ranks)."""
        return self.prefill_placement.topology.ep_size, self.decode_placement.topology.ep_size

    def prompt_lens(self) -> list[int]:
        return [self.prompt_len + i % 3 for i in range(self.requests)]


def serve_pd(spec: PDSpec, backend: str = "gloo", timeout: float = 300.0) -> PDReport:
    """Launch the two pools and serve ``spec``'s requests (see the module docstring).

    Raises:
        ValueError: a placement that does not fit the model (naming the numbers), or bad spec values.
    """
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf import match_layers
    from runtime_hooks.hf_validate import describe_model
    from runtime_hooks.launcher import launch

    if backend != "gloo":
        raise ValueError(
            f"backend {backend!r}: this runtime keeps KV caches and transfers on the CPU over gloo; use gloo"
        )
    runtime_dispatch(spec.dispatch)
    info = describe_model(spec.source)
    for pool, p in (("prefill", spec.prefill_placement), ("decode", spec.decode_placement)):
        try:
            match_layers(p, list(info.layer_ids), info.num_experts)
        except ValueError as exc:
            raise ValueError(f"the {pool} placement: {exc}") from None
    P, D = spec.ranks
    lost_ok = any(f.kind == "decode-dies" for f in spec.faults)
    t0 = time.perf_counter()
    results = launch(_pd_worker, P + D, args=(spec,), backend=backend, timeout=timeout, lost_ok=lost_ok)
    return build_report(spec, results, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------
# Per-rank bodies
# ---------------------------------------------------------------------------------------------------
def _pd_worker(rank: int, world: int, spec: PDSpec) -> dict:
    """Both pools' groups, the model with this pool's placement, then the pool's loop."""
    import torch
    import torch.distributed as dist

    from runtime_hooks.hf import apply_placement_to_model
    from runtime_hooks.hf_serve_migrate import row_checksums, served_rows
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.launcher import current_store
    from runtime_hooks.pd.handoff import placement_identity
    from runtime_hooks.pd.kv import kv_layout, prefill

    P, _ = spec.ranks
    groups = [dist.new_group(list(range(P))), dist.new_group(list(range(P, world)))]
    prefill_side = rank < P
    model = load_model(spec.source, spec.seed, spec.dtype)
    probe, _ = prefill(model, [torch.zeros(1, dtype=torch.int64)])  # before sharding: no collective
    layout = kv_layout(model, probe[0])
    probe[0].free()
    expected = row_checksums(model)  # [L, E, 2] every expert, before sharding
    placement = spec.prefill_placement if prefill_side else spec.decode_placement
    apply_placement_to_model(model, placement, group=groups[not prefill_side], dispatch=spec.dispatch)
    store = current_store()
    if not prefill_side:
        store.set("pd/decode/placement", placement_identity(served_rows(model)))
    dist.barrier()
    ctx = _Context(spec, rank, world, model, layout, store, groups[not prefill_side], expected)
    if prefill_side:
        from runtime_hooks.pd.prefill import run_prefill

        return run_prefill(ctx)
    from runtime_hooks.pd.decode import run_decode

    return run_decode(ctx)


@dataclass
class _Context:
    """What a rank's loop needs."""

    spec: PDSpec
    rank: int
    world: int
    model: Any
    layout: Any
    store: Any
    group: Any
    expected: Any

    def weights_ok(self) -> bool:
        """This rank's slots hold exactly (by checksum) the experts of the rows it serves now."""
        import numpy as np

        from runtime_hooks.hf_serve_migrate import row_checksums, served_rows

        rows = served_rows(self.model)
        S = rows.topology.slots_per_gpu
        me = self.model_rank()
        mine = rows.physical_to_logical_map[:, me * S : (me + 1) * S]  # [L, S]
        return bool(
            np.array_equal(row_checksums(self.model), np.take_along_axis(self.expected, mine[:, :, None], 1))
        )

    def model_rank(self) -> int:
        from runtime_hooks.hf import moe_experts

        return int(next(iter(moe_experts(self.model).values()))._moe_placement.rank)

    @property
    def prefill_ranks(self) -> list[int]:
        return list(range(self.spec.ranks[0]))

    @property
    def decode_ranks(self) -> list[int]:
        return list(range(self.spec.ranks[0], self.world))

    def prompts(self):
        from runtime_hooks.pd.kv import make_prompts

        vocab = int(self.model.config.get_text_config().vocab_size)
        return make_prompts(self.spec.seed, self.spec.prompt_lens(), vocab)
