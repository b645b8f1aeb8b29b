"""Live serving of a Hugging Face MoE model on a placement, rebalanced online without stopping.

Every rank of ``G`` launched ranks loads the same model, applies the placement
(:func:`runtime_hooks.hf.apply_placement_to_model`: routed experts sharded, attention data-parallel)
and greedily decodes its own ``B`` prompts (rank ``r`` owns prompts ``[r*B, (r+1)*B)``) with the model's
KV cache.
After every step:

1. the routing recorder (:func:`profiling.hooks.attach`, counts mode) gives this rank's selections of
   the step, ``[L, E]``; an ``all_reduce`` sums them over ranks;
2. rank 0 feeds them to the online :class:`runtime_hooks.rebalancer.Rebalancer` (``interval`` trigger
   every ``rebalance_every`` steps; the migration-aware re-solve runs on its worker thread) and polls it;
3. rank 0 broadcasts whether a new placement is to be applied (and its ``[L, P]`` map); if so every rank
   calls :func:`runtime_hooks.hf_serve_migrate.migrate_model` before the next step: the changed slots'
   expert tensors move between ranks and every rank commits, or none does and the old placement keeps
   serving (rank 0 then tells the rebalancer so).

Under ``balanced`` every experts call is one step split by the quotas of the all-gathered counts
(:mod:`runtime_hooks.step_dispatch`); each rank then checks that its slots computed exactly what the
numpy quotas (:func:`placement.step_balance.balanced_quotas`) give for the recorded counts of every
step, on the row served at that step (``ServeReport.quotas_match``), and reports the counts
all-gather's median time and bytes per layer call.

Placement changes never change what a token computes (every replica holds the same weights), so the
generated tokens equal those of the single-process model without any placement (fp32, greedy), which
each rank decodes first as the reference.

Shapes: G ranks, B prompts per rank, T0 prompt length, n new tokens, L MoE layers, E logical experts,
P slots per layer, W windows between placement changes.

Public API::

    report = serve_hf(ServeSpec(source, placement, rebalance_every=4, new_tokens=12))
    report.tokens_match, report.events, report.tokens_per_second
    serve_many([spec, ...])   # several models in one launch (same ep_size)
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import EVEN, get_dispatch
from placement.model import Placement
from runtime_hooks.migration_core import FaultSpec

__all__ = [
    "RebalanceRecord",
    "ServeReport",
    "ServeSpec",
    "contiguous_placement",
    "greedy_decode",
    "serve_hf",
    "serve_many",
]

log = logging.getLogger(__name__)


@refuse_unknown_keywords
@dataclass(frozen=True)
class ServeSpec:
    """One serving run.

    Attributes:
        source: checkpoint folder, ``config.json`` path or config object (random weights from ``seed``).
        placement: rows for the model's MoE layers (see :func:`runtime_hooks.hf.match_layers`).
        rows: explicit placement row per MoE layer, in model order (``--layers``; None: matched as
            :func:`runtime_hooks.hf.match_layers` says).
        rebalance_every: steps between re-solves (0: never rebalance).
        new_tokens: greedy steps (the first is the prefill of the prompts).
        prompts_per_rank / prompt_len: ``B`` seeded prompts of ``T0`` tokens per rank.
        dispatch: replica selection, a dispatch model the runtime executes
            (:func:`runtime_hooks.ep_layer.runtime_dispatch`).
        wait_for_solve: block on a submitted re-solve at the step it was submitted (deterministic steps);
            False polls it without blocking and applies it at whichever step it is ready.
        always_apply: apply every re-solve that moves slots, skipping the rebalancer's gain gate (whose
            default constants describe DeepSeek-V3 on Hopper, not a tiny CPU model).
        max_moves: moved slots allowed per re-solve (None: no budget).
        migration_timeout: seconds for one migration's transfer and decision.
        faults: test-only fault injection applied to the first ``fault_attempts`` migrations that move slots.
        reference: also decode with the single-process model first and compare the tokens.
    """

    source: Any
    placement: Placement
    rebalance_every: int = 4
    new_tokens: int = 8
    prompts_per_rank: int = 2
    prompt_len: int = 6
    dispatch: str = EVEN.name
    seed: int = 0
    dtype: str = "float32"
    wait_for_solve: bool = True
    always_apply: bool = True
    max_moves: int | None = None
    migration_timeout: float = 10.0
    faults: tuple[FaultSpec, ...] = ()
    fault_attempts: int = 1
    reference: bool = True
    rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("rebalance_every", "fault_attempts"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("new_tokens", "prompts_per_rank", "prompt_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.migration_timeout > 0:
            raise ValueError(f"migration_timeout must be > 0 seconds, got {self.migration_timeout}")


@dataclass(frozen=True)
class RebalanceRecord:
    """One placement change the rebalancer asked for, as every rank saw it.

    ``load_before`` / ``load_after``: int ``[G]`` picks each rank's experts computed in the steps since
    the previous change (``steps_before``) and from this change to the next one or the end
    (``steps_after``). ``predicted_before`` / ``predicted_after``: float ``[G]`` the rebalancer's window
    load spread over the old / new placement (``even`` split, :func:`placement.metrics.expected_gpu_load`).
    """

    step: int
    committed: bool
    reason: str
    moved_slots: int
    network_bytes: int
    wall_s: float
    steps_before: int
    steps_after: int
    load_before: tuple[int, ...]
    load_after: tuple[int, ...]
    predicted_before: tuple[float, ...]
    predicted_after: tuple[float, ...]


@dataclass(frozen=True)
class ServeReport:
    """Result of :func:`serve_hf`.

    ``tokens`` / ``reference``: int64 ``[G, B, n]`` generated tokens (reference: single process, or None);
    ``initial_map`` / ``final_map``: int64 ``[L, P]`` rows served at the start and the end;
    ``load_per_rank``: int64 ``[G]`` picks computed per rank over the run; ``solves``: the rebalancer's
    events (rank 0), applied or not; ``weights_match``: at the end every rank's slots hold exactly (by
    checksum) the experts of ``final_map``, as loaded.
    """

    model_class: str
    ranks: int
    steps: int
    layer_ids: tuple[int, ...]
    tokens: np.ndarray
    reference: np.ndarray | None
    events: tuple[RebalanceRecord, ...]
    initial_map: np.ndarray
    final_map: np.ndarray
    load_per_rank: np.ndarray
    expert_bytes_per_rank: tuple[dict, ...]
    serve_seconds: float
    weights_match: bool = False
    solves: tuple[dict, ...] = field(default=())
    quotas_match: bool | None = None
    balanced_collective_us_per_layer: tuple[float, ...] | None = None
    balanced_collective_bytes_per_layer: int | None = None

    @property
    def tokens_match(self) -> bool:
        """Generated tokens equal the single-process reference (False without one)."""
        return self.reference is not None and bool(np.array_equal(self.tokens, self.reference))

    @property
    def committed_moves(self) -> int:
        """Changes that committed and moved at least one slot."""
        return sum(1 for e in self.events if e.committed and e.moved_slots > 0)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of all ranks per second of the slowest rank's serving loop."""
        return float(self.tokens.size) / max(self.serve_seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("tokens", "reference", "initial_map", "final_map", "load_per_rank"):
            v = getattr(self, k)
            d[k] = None if v is None else v.tolist()
        d["tokens_match"] = self.tokens_match
        d["committed_moves"] = self.committed_moves
        d["tokens_per_second"] = self.tokens_per_second
        return d


def contiguous_placement(num_layers: int, num_experts: int, ranks: int, redundant: int = 0) -> Placement:
    """Experts in contiguous blocks, one block per rank (as transformers' own EP shards them), plus
    ``redundant / ranks`` replicas per rank of the first experts of the next rank's block: ``[L, E + R]``.

    Raises:
        ValueError: ``E`` or ``R`` does not divide over the ranks, or more replicas per rank than a block.
    """
    E, G, R = int(num_experts), int(ranks), int(redundant)
    if G < 1 or E % G or R % G or R < 0 or R // G > E // G:
        raise ValueError(
            f"{E} experts and {R} redundant slots do not split evenly over {G} ranks (each must divide, "
            f"with at most {E // max(G, 1)} replicas per rank); use --redundant 0 or a multiple of {G}"
        )
    block, extra = E // G, R // G
    row = []
    for g in range(G):
        nxt = (g + 1) % G
        row += list(range(g * block, (g + 1) * block)) + list(range(nxt * block, nxt * block + extra))
    return Placement.from_map(np.tile(np.array(row, dtype=np.int64), (int(num_layers), 1)), E, ep_size=G)


# ---------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------
def greedy_decode(model, prompts, new_tokens: int, after_step=None):
    """Greedy decoding with the model's KV cache: prompts int64 ``[B, T0]`` -> int64 ``[B, n]``.

    ``after_step(step)`` (1-based) runs between two forward calls (rebalancing goes there); not after the last.
    """
    import torch

    cache, ids, out = None, prompts, []
    with torch.no_grad():
        for step in range(int(new_tokens)):
            res = model(input_ids=ids, cache=cache, use_cache=True)
            cache = res.cache
            nxt = res.logits[:, -1].argmax(-1)  # [B]
            out.append(nxt)
            ids = nxt[:, None]  # [B, 1]
            if after_step is not None and step + 1 < int(new_tokens):
                after_step(step + 1)
    return torch.stack(out, dim=1)  # [B, n]


def _prompts(spec: ServeSpec, ranks: int, vocab: int):
    """int64 ``[G*B, T0]`` seeded prompts, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(int(spec.seed) + 29)
    return torch.randint(0, vocab, (ranks * spec.prompts_per_rank, spec.prompt_len), generator=g)


# ---------------------------------------------------------------------------------------------------
# The live rebalancing controller (one per rank)
# ---------------------------------------------------------------------------------------------------
class _LiveRebalance:
    """Counts routing, runs the rebalancer on rank 0, applies its placements on every rank."""

    def __init__(self, model, rows: Placement, layer_ids: tuple[int, ...], spec: ServeSpec, rank: int):
        from profiling.hooks import RecordOptions, attach

        self.model, self.spec, self.rank = model, spec, rank
        self.recorder = attach(model, RecordOptions(mode="counts"))
        missing = [lid for lid in layer_ids if lid not in self.recorder.layer_ids]
        if missing:
            raise ValueError(
                f"the routing recorder found MoE layers {list(self.recorder.layer_ids)} but the placement "
                f"serves {list(layer_ids)}; layers {missing} are not recorded"
            )
        self.order = [self.recorder.layer_ids.index(lid) for lid in layer_ids]  # recorder row per layer
        self.prev = np.zeros((len(layer_ids), rows.num_logical_experts), dtype=np.int64)  # [L, E]
        self.rebalancer = self._rebalancer(rows) if rank == 0 and spec.rebalance_every else None
        self.changes: list[dict] = []  # per placement change: step, result, predictions
        self.boundaries: list[tuple[int, int]] = []  # (step, this rank's cumulative picks) per change
        self.attempts_with_moves = 0
        self._predicted = None  # rank 0: ([G] old, [G] new) window load of the last proposal

    def _rebalancer(self, rows: Placement):
        from runtime_hooks.hf import moe_experts
        from runtime_hooks.hf_serve_migrate import slot_tensors
        from runtime_hooks.migration_core import slot_bytes
        from runtime_hooks.rebalancer import Rebalancer, RebalancerConfig

        module = next(iter(moe_experts(self.model).values()))
        n = self.spec.rebalance_every
        cfg = RebalancerConfig(
            window_size=n,
            step_interval=n,
            trigger="interval",
            always_apply=self.spec.always_apply,
            max_moves=self.spec.max_moves,
            time_limit=2.0,
        )
        return Rebalancer(rows, cfg, expert_bytes=float(slot_bytes(slot_tensors(module))))

    def close(self) -> None:
        self.recorder.detach()
        if self.rebalancer is not None:
            self.rebalancer.close()

    def _step_counts(self):
        """This step's selections summed over ranks, int64 ``[L, E]`` (collective)."""
        import torch
        import torch.distributed as dist

        now = self.recorder.counts()[self.order]  # [L, E] cumulative on this rank
        delta, self.prev = now - self.prev, now
        t = torch.from_numpy(np.ascontiguousarray(delta))
        dist.all_reduce(t)
        return t.numpy()

    def _proposal(self, counts: np.ndarray, rows: Placement):
        """Rank 0: observe, poll (or wait); every rank: the broadcast new map ``[L, P]`` or None."""
        import torch
        import torch.distributed as dist

        msg = torch.zeros(1 + rows.physical_to_logical_map.size, dtype=torch.int64)
        self._predicted = None
        if self.rebalancer is not None:
            reb = self.rebalancer
            reb.observe(counts)
            new = reb.poll()
            if new is None and self.spec.wait_for_solve and reb.pending:
                new = reb.wait()
            if new is not None:
                window = reb.window_load()  # [L, E]
                self._predicted = (_rank_load(rows, window), _rank_load(new, window))
                msg[0] = 1
                msg[1:] = torch.from_numpy(new.physical_to_logical_map.reshape(-1).astype(np.int64))
        dist.broadcast(msg, src=0)
        if not int(msg[0]):
            return None
        return msg[1:].numpy().reshape(rows.physical_to_logical_map.shape)

    def after_step(self, step: int) -> None:
        """Between two forward calls: count, maybe re-place, maybe migrate (collective on every rank)."""
        from runtime_hooks.hf import slot_token_counts
        from runtime_hooks.hf_serve_migrate import migrate_model, served_rows

        if not self.spec.rebalance_every:
            return
        rows = served_rows(self.model)
        new_map = self._proposal(self._step_counts(), rows)
        if new_map is None:
            return
        new = Placement(new_map, rows.num_logical_experts, rows.topology, rows.layer_ids)
        moves = int((new_map != rows.physical_to_logical_map).sum())
        faults = ()
        if moves and self.attempts_with_moves < self.spec.fault_attempts:
            faults = self.spec.faults
        self.attempts_with_moves += bool(moves)
        self.boundaries.append((step, int(slot_token_counts(self.model).sum())))
        result = migrate_model(self.model, new, timeout=self.spec.migration_timeout, faults=faults)
        if not result.committed and self.rebalancer is not None:
            self.rebalancer.set_placement(rows)  # the old placement keeps serving
        self.changes.append({"step": step, "result": asdict(result), "predicted": self._predicted})


def _rank_load(rows: Placement, window: np.ndarray) -> tuple[float, ...]:
    """float ``[G]``: a window load ``[L, E]`` spread over ``rows`` (even split), summed over layers."""
    from placement.metrics import expected_gpu_load

    return tuple(float(x) for x in expected_gpu_load(rows, window).sum(axis=0))


# ---------------------------------------------------------------------------------------------------
# Per-rank body
# ---------------------------------------------------------------------------------------------------
def _serve_worker(rank: int, ranks: int, specs: list[ServeSpec]) -> list[dict]:
    """Per-rank body: each spec in turn."""
    return [_serve_job(rank, ranks, spec) for spec in specs]


def _serve_job(rank: int, ranks: int, spec: ServeSpec) -> dict:
    """Reference decode (one process), apply the placement, decode live with rebalancing."""
    import torch.distributed as dist

    from runtime_hooks.hf import apply_placement_to_model, slot_token_counts
    from runtime_hooks.hf_serve_migrate import row_checksums, served_rows
    from runtime_hooks.hf_validate import describe_model, load_model

    info = describe_model(spec.source)
    model = load_model(spec.source, spec.seed, spec.dtype)
    B = spec.prompts_per_rank
    prompts = _prompts(spec, ranks, info.vocab_size)[rank * B : (rank + 1) * B]  # [B, T0]
    reference = greedy_decode(model, prompts, spec.new_tokens).numpy() if spec.reference else None
    expected = row_checksums(model)  # [L, E, 2] of every logical expert, before sharding
    step = get_dispatch(spec.dispatch).needs_step_counts  # record each step's counts to check the quotas
    applied = apply_placement_to_model(
        model, spec.placement, dispatch=spec.dispatch, rows=spec.rows, record=step
    )
    rows = served_rows(model)
    live = _LiveRebalance(model, rows, applied.layer_ids, spec, rank)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        tokens = greedy_decode(model, prompts, spec.new_tokens, live.after_step).numpy()  # [B, n]
        wall = time.perf_counter() - t0
    finally:
        live.close()
    final = served_rows(model).physical_to_logical_map  # [L, P]
    S = final.shape[1] // ranks
    mine = final[:, rank * S : (rank + 1) * S]  # [L, S] experts this rank must hold
    weights_ok = bool(np.array_equal(row_checksums(model), np.take_along_axis(expected, mine[:, :, None], 1)))
    history = [asdict(e) for e in live.rebalancer.history] if live.rebalancer is not None else []
    return {
        "model_class": applied.model_class,
        "layer_ids": applied.layer_ids,
        "tokens": tokens,
        "reference": reference,
        "changes": live.changes,
        "boundaries": live.boundaries,
        "picks": int(slot_token_counts(model).sum()),
        "initial_map": rows.physical_to_logical_map.copy(),
        "final_map": final.copy(),
        "weights_ok": weights_ok,
        "bytes": {"before": applied.expert_bytes_before, "after": applied.expert_bytes_after},
        "wall": wall,
        "history": history,
        **_step_checks(model, rank, ranks),
    }


def _step_checks(model, rank: int, ranks: int) -> dict:
    """``balanced``: this rank's picks per slot against the numpy quotas of the recorded steps, and the
    counts all-gather's cost; empty for the other models."""
    from runtime_hooks.hf import balanced_collective, slot_token_counts, step_quota_tokens

    quota = step_quota_tokens(model)  # [L, P] or None
    if quota is None:
        return {}
    S = quota.shape[1] // ranks
    us, nbytes = balanced_collective(model)
    return {
        "quotas_ok": bool(np.array_equal(quota[:, rank * S : (rank + 1) * S], slot_token_counts(model))),
        "collective": (us, nbytes),
    }


# ---------------------------------------------------------------------------------------------------
# Launching and the report
# ---------------------------------------------------------------------------------------------------
def serve_hf(spec: ServeSpec, backend: str = "gloo", timeout: float = 300.0) -> ServeReport:
    """Launch ``placement.topology.ep_size`` ranks and serve ``spec`` live (see the module docstring)."""
    return serve_many([spec], backend=backend, timeout=timeout)[0]


def serve_many(specs: list[ServeSpec], backend: str = "gloo", timeout: float = 300.0) -> list[ServeReport]:
    """Serve several specs in one launch (one transformers import per rank; one ``ep_size`` for all).

    Every placement is checked against its model first: ValueError naming the numbers.
    """
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf import match_layers
    from runtime_hooks.hf_validate import describe_model
    from runtime_hooks.launcher import launch

    if not specs:
        return []
    sizes = {s.placement.topology.ep_size for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"one launch needs one ep_size, the placements have {sorted(sizes)}")
    for s in specs:
        runtime_dispatch(s.dispatch)
        info = describe_model(s.source)
        match_layers(s.placement, list(info.layer_ids), info.num_experts, s.rows)
    results = launch(_serve_worker, sizes.pop(), args=(list(specs),), backend=backend, timeout=timeout)
    return [_report(spec, [res[j] for res in results]) for j, spec in enumerate(specs)]


def _windows(results: list[dict], steps: int) -> tuple[list[list[int]], list[int]]:
    """Per-rank picks ``[W][G]`` and steps ``[W]`` of the windows between placement changes."""
    G = len(results)
    marks = [b[0] for b in results[0]["boundaries"]] + [steps]  # [W] end step of each window
    cum = [[b[1] for b in r["boundaries"]] + [r["picks"]] for r in results]  # [G][W] cumulative picks
    loads, lens, prev_step = [], [], 0
    prev = [0] * G
    for w, end in enumerate(marks):
        loads.append([cum[g][w] - prev[g] for g in range(G)])
        lens.append(end - prev_step)
        prev, prev_step = [cum[g][w] for g in range(G)], end
    return loads, lens


def _report(spec: ServeSpec, results: list[dict]) -> ServeReport:
    """Assemble the per-rank results of one spec; the ranks must agree on every placement change."""
    first = results[0]
    for r, res in enumerate(results[1:], start=1):
        same = [c["result"]["committed"] for c in res["changes"]] == [
            c["result"]["committed"] for c in first["changes"]
        ]
        if not same or not np.array_equal(res["final_map"], first["final_map"]):
            raise RuntimeError(
                f"rank {r} disagrees with rank 0 on the placement changes; the migration is not atomic"
            )
    loads, lens = _windows(results, spec.new_tokens)
    events = []
    for i, change in enumerate(first["changes"]):
        res = change["result"]
        pred = change["predicted"] or ((), ())
        events.append(
            RebalanceRecord(
                step=int(change["step"]),
                committed=bool(res["committed"]),
                reason=str(res["reason"]),
                moved_slots=int(res["moved_slots"]),
                network_bytes=int(res["network_bytes"]),
                wall_s=max(float(c["changes"][i]["result"]["wall_time_s"]) for c in results),
                steps_before=lens[i],
                steps_after=lens[i + 1],
                load_before=tuple(loads[i]),
                load_after=tuple(loads[i + 1]),
                predicted_before=tuple(pred[0]),
                predicted_after=tuple(pred[1]),
            )
        )
    ref = first["reference"]
    step = {}
    if "quotas_ok" in first:
        step = {
            "quotas_match": all(r["quotas_ok"] for r in results),
            "balanced_collective_us_per_layer": tuple(
                float(u) for u in np.array([r["collective"][0] for r in results]).max(axis=0)
            ),
            "balanced_collective_bytes_per_layer": int(first["collective"][1]),
        }
    return ServeReport(
        model_class=first["model_class"],
        ranks=len(results),
        steps=spec.new_tokens,
        layer_ids=tuple(first["layer_ids"]),
        tokens=np.stack([r["tokens"] for r in results]),
        reference=None if ref is None else np.stack([r["reference"] for r in results]),
        events=tuple(events),
        initial_map=first["initial_map"],
        final_map=first["final_map"],
        load_per_rank=np.array([r["picks"] for r in results], dtype=np.int64),
        expert_bytes_per_rank=tuple(r["bytes"] for r in results),
        serve_seconds=max(float(r["wall"]) for r in results),
        weights_match=all(r["weights_ok"] for r in results),
        solves=tuple(first["history"]),
        **step,
    )
