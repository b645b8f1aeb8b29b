"""Co-located serving that survives a killed rank: ``serve-demo --kill-rank R --at-step S``.

``G`` ranks serve a Hugging Face MoE model on one placement (attention data-parallel, routed experts
sharded), rank ``r`` owning requests ``[r B, (r+1) B)``, with per-request KV caches and continuous
batching (:mod:`runtime_hooks.pd.kv`). Every step starts with :meth:`runtime_hooks.pd.pool.Pool.sync`;
a step is a prefill (when any rank has prompts to run) or a greedy decode step. Rank ``R`` exits abruptly
(``os._exit``) when step ``S`` is due; the others find it missing at that step's sync, agree on the loss,
switch to the failover map on the survivors (:func:`runtime_hooks.pd.failover_map.failover_map`),
reloading from the checkpoint (the seeded model for a config) only the experts with no surviving copy,
and go on. The killed rank's unfinished requests fail (``on_rank_loss="fail"``) or restart from their
prompts on the survivors (``"restart"``: spread in request order, each run whole on one survivor);
nothing the killed rank produced is kept. The others' requests are never interrupted.

Public API::

    report = serve_rank_loss(RankLossSpec(source, placement, kill_rank=1, at_step=3, on_rank_loss="restart"))
    report.tokens_match, report.requests, report.reloads, report.to_dict()

Shapes: G ranks, B requests per rank, L MoE layers, P slots per layer.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import EVEN
from placement.model import Placement

__all__ = ["ON_RANK_LOSS", "RankLossReport", "RankLossSpec", "serve_rank_loss"]

ON_RANK_LOSS = ("fail", "restart")


@refuse_unknown_keywords
@dataclass(frozen=True)
class RankLossSpec:
    """One run with a killed rank (see the module docstring); ``at_step`` 1 is the prefill."""

    source: Any
    placement: Placement
    kill_rank: int
    at_step: int
    on_rank_loss: str = "fail"
    new_tokens: int = 8
    prompts_per_rank: int = 2
    prompt_len: int = 6
    seed: int = 0
    dtype: str = "float32"
    dispatch: str = EVEN.name
    liveness_timeout: float = 3.0

    def __post_init__(self) -> None:
        G = self.placement.topology.ep_size
        if G < 2:
            raise ValueError(f"killing a rank needs at least 2 ranks; the placement has {G}")
        if not 0 <= int(self.kill_rank) < G:
            raise ValueError(f"--kill-rank {self.kill_rank} is not one of the ranks 0..{G - 1}")
        if not 1 <= int(self.at_step) <= int(self.new_tokens):
            raise ValueError(
                f"--at-step {self.at_step} is outside the run's steps 1..{self.new_tokens} (1 is the prefill); "
                f"use a step in that range or raise --new-tokens"
            )
        if self.on_rank_loss not in ON_RANK_LOSS:
            raise ValueError(
                f"on_rank_loss must be one of {', '.join(ON_RANK_LOSS)}, got {self.on_rank_loss!r}"
            )
        for name in ("prompts_per_rank", "prompt_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not float(self.liveness_timeout) > 0:
            raise ValueError(f"liveness_timeout must be > 0 seconds, got {self.liveness_timeout}")


@dataclass(frozen=True)
class RankLossReport:
    """Result of :func:`serve_rank_loss`; ``requests[i]``: ``{id, rank, served_by, status, tokens_match,
    tokens, reference, reason}`` (status ``completed``, ``restarted`` (completed after a restart) or
    ``failed``)."""

    tokens_match: bool
    requests: tuple[dict, ...]
    killed_rank: int
    at_step: int
    on_rank_loss: str
    reloads: int
    failover: dict
    weights_match: bool
    leaked_kv_bytes: int
    serve_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"requests": list(self.requests)}


def serve_rank_loss(spec: RankLossSpec, backend: str = "gloo", timeout: float = 300.0) -> RankLossReport:
    """Launch ``ep_size`` ranks, kill one at its step, serve on (see the module docstring).

    Raises:
        ValueError: a placement that does not fit the model, or that no failover map can serve without
            the killed rank (too few redundant slots), before any rank starts.
    """
    from runtime_hooks.ep_layer import runtime_dispatch
    from runtime_hooks.hf import match_layers
    from runtime_hooks.hf_validate import describe_model
    from runtime_hooks.launcher import launch
    from runtime_hooks.pd.failover_map import failover_map

    if backend != "gloo":
        raise ValueError(
            f"backend {backend!r}: this runtime keeps KV caches and transfers on the CPU over gloo; use gloo"
        )
    runtime_dispatch(spec.dispatch)
    info = describe_model(spec.source)
    match_layers(spec.placement, list(info.layer_ids), info.num_experts)
    try:
        failover_map(spec.placement, [spec.kill_rank])
    except ValueError as exc:
        raise ValueError(f"rank {spec.kill_rank} cannot be lost on this placement: {exc}") from None
    t0 = time.perf_counter()
    G = spec.placement.topology.ep_size
    results = launch(_worker, G, args=(spec,), backend=backend, timeout=timeout, lost_ok=True)
    return _report(spec, results, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------
# Per rank
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Rank:
    """One rank's serving state."""

    spec: RankLossSpec
    model: Any
    pool: Any
    prompts: list
    pending: list
    active: dict
    done: dict
    step_ms: list
    failovers: list
    restarted: set


def _worker(rank: int, world: int, spec: RankLossSpec) -> dict:
    """Apply the placement on a replaceable group, then serve (see the module docstring)."""
    import torch.distributed as dist

    from runtime_hooks.hf import apply_placement_to_model
    from runtime_hooks.hf_serve_migrate import row_checksums
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.launcher import current_store
    from runtime_hooks.pd.kv import live_kv_bytes, make_prompts
    from runtime_hooks.pd.pool import Pool

    group = dist.new_group(list(range(world)))
    model = load_model(spec.source, spec.seed, spec.dtype)
    expected = row_checksums(model)  # [L, E, 2]
    apply_placement_to_model(model, spec.placement, group=group, dispatch=spec.dispatch)
    B = spec.prompts_per_rank
    vocab = int(model.config.get_text_config().vocab_size)
    prompts = make_prompts(spec.seed, [spec.prompt_len] * (world * B), vocab)
    pool = Pool("serve/pool", list(range(world)), group, rank, current_store(), spec.liveness_timeout)
    me = _Rank(spec, model, pool, prompts, list(range(rank * B, (rank + 1) * B)), {}, {}, [], [], set())
    dist.barrier()
    _serve(me)
    return {
        "rank": rank,
        "done": me.done,
        "restarted": sorted(me.restarted),
        "failovers": me.failovers,
        "step_ms": me.step_ms,
        "weights_ok": _weights_ok(model, expected),
        "leaked": live_kv_bytes(),
        "members": pool.members,
    }


def _serve(me: _Rank) -> None:
    """Steps until no rank has work; rank ``kill_rank`` exits when step ``at_step`` is due."""
    from runtime_hooks.launcher import LOST_RANK_EXIT_CODE
    from runtime_hooks.pd.pool import RankLost

    spec, pool, steps = me.spec, me.pool, 0
    while True:
        if pool.me == spec.kill_rank and steps + 1 == spec.at_step:
            os._exit(LOST_RANK_EXIT_CODE)  # abruptly: no goodbye, nothing flushed
        try:
            states = pool.sync({"prefill": len(me.pending), "active": len(me.active)})
        except RankLost as exc:
            _on_loss(me, exc.missing)
            continue
        if not any(s["prefill"] or s["active"] for s in states):
            return
        steps += 1
        t = time.perf_counter()
        _step(me, any(s["prefill"] for s in states))
        me.step_ms.append((time.perf_counter() - t) * 1e3)
        _finish(me)


def _step(me: _Rank, prefill_step: bool) -> None:
    """A prefill of every pending prompt (left-padded batch), or one greedy step of the running requests;
    an empty batch through the experts when this rank has none of that kind."""
    from runtime_hooks.pd.kv import decode_step, idle_step, prefill

    if prefill_step and me.pending:
        kvs, first = prefill(me.model, [me.prompts[r] for r in me.pending])
        for rid, kv, tok in zip(me.pending, kvs, first):
            me.active[rid] = {"kv": kv, "tokens": [tok]}
        me.pending = []
    elif not prefill_step and me.active:
        reqs = list(me.active.values())
        nxt = decode_step(me.model, [r["kv"] for r in reqs], [r["tokens"][-1] for r in reqs])
        for r, t in zip(reqs, nxt):
            r["tokens"].append(t)
    else:
        idle_step(me.model)


def _finish(me: _Rank) -> None:
    """Requests with all their tokens: published in the store (they outlive this rank), KV freed."""
    for rid in [r for r, a in me.active.items() if len(a["tokens"]) >= me.spec.new_tokens]:
        a = me.active.pop(rid)
        a["kv"].free()
        me.done[rid] = a["tokens"]
        me.pool.store.set(f"serve/r/{rid}/done", json.dumps(a["tokens"]))


def _on_loss(me: _Rank, missing: list[int]) -> None:
    """Agree on the loss, fail over, then fail or restart the lost ranks' unfinished requests."""
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.pd.failover_map import failover_map
    from runtime_hooks.pd.pool import fail_over

    spec, pool = me.spec, me.pool
    old = list(pool.members)
    lost = pool.shrink(missing)
    rec = fail_over(
        me.model, pool, old, lost, lambda: load_model(spec.source, spec.seed, spec.dtype), failover_map
    )
    B = spec.prompts_per_rank
    orphans = []
    for rid in (rid for r in lost for rid in range(r * B, (r + 1) * B)):
        key = f"serve/r/{rid}/done"
        if pool.store.check([key]):
            me.done.setdefault(rid, json.loads(pool.store.get(key)))  # finished before the loss
        else:
            orphans.append(rid)
    if spec.on_rank_loss == "restart":
        mine = [rid for i, rid in enumerate(orphans) if pool.members[i % len(pool.members)] == pool.me]
        me.pending += mine
        me.restarted |= set(mine)
    out = asdict(rec)
    out.update(lost=list(rec.lost), before=rec.before.tolist(), after=rec.after.tolist(), orphans=orphans)
    me.failovers.append(out)


def _weights_ok(model, expected: np.ndarray) -> bool:
    """This rank's slots hold exactly (by checksum) the experts of the rows it serves now."""
    from runtime_hooks.hf import moe_experts
    from runtime_hooks.hf_serve_migrate import row_checksums, served_rows

    rows = served_rows(model)
    S = rows.topology.slots_per_gpu
    me = int(next(iter(moe_experts(model).values()))._moe_placement.rank)
    mine = rows.physical_to_logical_map[:, me * S : (me + 1) * S]  # [L, S]
    return bool(np.array_equal(row_checksums(model), np.take_along_axis(expected, mine[:, :, None], 1)))


# ---------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------
def _report(spec: RankLossSpec, results: list, wall: float) -> RankLossReport:
    """Per request: who served it, how it ended, its tokens against the single-process model's."""
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.pd.kv import make_prompts, reference_tokens

    G, B = len(results), spec.prompts_per_rank
    alive = [r for r in results if r is not None]
    model = load_model(spec.source, spec.seed, spec.dtype)
    vocab = int(model.config.get_text_config().vocab_size)
    ref = reference_tokens(
        model, make_prompts(spec.seed, [spec.prompt_len] * (G * B), vocab), spec.new_tokens
    )
    served = {rid: (r["rank"], toks) for r in alive for rid, toks in r["done"].items()}
    restarted = {rid for r in alive for rid in r["restarted"]}
    requests = []
    for rid in range(G * B):
        by, toks = served.get(rid, (None, None))
        status = "failed" if toks is None else "restarted" if rid in restarted else "completed"
        requests.append(
            {
                "id": rid,
                "rank": rid // B,
                "served_by": by,
                "status": status,
                "tokens_match": None if toks is None else toks == ref[rid],
                "tokens": toks,
                "reference": ref[rid],
                "reason": f"rank {rid // B} was killed" if rid // B == spec.kill_rank else "",
            }
        )
    fo = [f for r in alive for f in r["failovers"]]
    finished = [q for q in requests if q["status"] != "failed"]
    failover = {
        "lost": fo[0]["lost"] if fo else [],
        "survivors": alive[0]["members"] if alive else [],
        "reloads": fo[0]["reloads"] if fo else 0,
        "loaded_slots_per_rank": {r["rank"]: sum(f["loaded_here"] for f in r["failovers"]) for r in alive},
        "ms": max((f["seconds"] * 1e3 for f in fo), default=None),
        "map_before": fo[0]["before"] if fo else None,
        "map_after": fo[0]["after"] if fo else None,
    }
    return RankLossReport(
        tokens_match=bool(finished) and all(q["tokens_match"] for q in finished),
        requests=tuple(requests),
        killed_rank=spec.kill_rank,
        at_step=spec.at_step,
        on_rank_loss=spec.on_rank_loss,
        reloads=failover["reloads"],
        failover=failover,
        weights_match=all(r["weights_ok"] for r in alive),
        leaked_kv_bytes=int(sum(r["leaked"] for r in alive)),
        serve_seconds=wall,
    )
