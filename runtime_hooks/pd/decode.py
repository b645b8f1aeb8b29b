"""The decode pool's loop (one per decode rank): continuous batching of the requests handed to it.

Each step: admit the hand-offs the receiver committed since the last step, agree with the other decode
ranks on the step (:meth:`runtime_hooks.pd.pool.Pool.sync`: who has requests, who saw the stop), then
one greedy step over this rank's running requests (or an empty batch through the experts calls when it
has none while a peer has some). A request that has its tokens is delivered (``pd/r/<hid>/done`` holds
them, so they outlive this rank) and its
KV freed. A peer lost at the sync: the survivors fail over (:func:`runtime_hooks.pd.pool.fail_over` with
:func:`runtime_hooks.pd.failover_map.failover_map`) and publish the lost ranks (``pd/decode/lost``) and
their new placement's identity (``pd/decode/placement``); the requests they run are untouched.
"""

from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import asdict

import numpy as np

__all__ = ["run_decode"]


def _expectation(ctx, served: list[str]):
    """``meta -> why it does not fit this rank`` ("" when it does); ``served``: the placement identities
    this pool has served (a hand-off planned against an earlier one of the same run is accepted)."""
    from runtime_hooks.pd.handoff import model_identity

    model_id = model_identity(ctx.model, ctx.spec.seed, ctx.spec.dtype)
    layout = ctx.layout.to_dict()
    limit = int(getattr(ctx.model.config.get_text_config(), "max_position_embeddings", 0) or 1 << 30)

    def expect(meta) -> str:
        if meta.dst != ctx.rank:
            return f"addressed to rank {meta.dst}, this is rank {ctx.rank}"
        if meta.model_id != model_id:
            return f"model {meta.model_id} is not this rank's model {model_id}"
        if meta.layout != layout:
            return f"KV layout {meta.layout} is not this rank's {layout}"
        if meta.placement_id not in served:
            return f"planned for decode placement {meta.placement_id}; this pool serves {served[-1]}"
        if not 1 <= meta.position <= limit - ctx.spec.new_tokens:
            return f"position {meta.position} outside 1..{limit - ctx.spec.new_tokens}"
        return ""

    return expect


def _admit(receiver, active: dict) -> None:
    """Committed hand-offs join the running batch."""
    while True:
        try:
            a = receiver.ready.get_nowait()
        except queue.Empty:
            return
        active[a.meta.hid] = {"meta": a.meta, "kv": a.kv, "tokens": [a.first_token], "t_commit": a.t_commit}


def _finish(ctx, active: dict, done: list) -> None:
    """Requests with all their tokens: reported, their KV freed."""
    for hid in [h for h, r in active.items() if len(r["tokens"]) >= ctx.spec.new_tokens]:
        r = active.pop(hid)
        freed = r["kv"].free()
        out = {"hid": hid, "tokens": r["tokens"], "t_commit": r["t_commit"], "t_done": time.time()}
        done.append(
            {**out, "request": r["meta"].request, "attempt": r["meta"].attempt, "kv_bytes_freed": freed}
        )
        ctx.store.set(f"pd/r/{hid}/done", json.dumps(out))  # the output, delivered: it outlives this rank


def _step(ctx, active: dict) -> None:
    """One greedy step of this rank's running requests (an empty batch through the experts when none)."""
    from runtime_hooks.pd.kv import decode_step, idle_step

    if not active:
        idle_step(ctx.model)
        return
    reqs = list(active.values())
    nxt = decode_step(ctx.model, [r["kv"] for r in reqs], [r["tokens"][-1] for r in reqs])
    for r, t in zip(reqs, nxt):
        r["tokens"].append(t)


def _fail_over(ctx, pool, missing: list[int], served: list[str]) -> dict:
    """Continue without the lost decode ranks: the failover map, reloads, the new identity published."""
    from runtime_hooks.hf_serve_migrate import served_rows
    from runtime_hooks.hf_validate import load_model
    from runtime_hooks.pd.failover_map import failover_map
    from runtime_hooks.pd.handoff import placement_identity
    from runtime_hooks.pd.pool import fail_over

    old = list(pool.members)
    lost = pool.shrink(missing)
    spec = ctx.spec
    rec = fail_over(
        ctx.model, pool, old, lost, lambda: load_model(spec.source, spec.seed, spec.dtype), failover_map
    )
    served.append(placement_identity(served_rows(ctx.model)))
    ctx.store.set("pd/decode/placement", served[-1])
    ctx.store.set("pd/decode/lost", json.dumps(pool.lost))
    out = asdict(rec)
    out.update(lost=list(rec.lost), before=rec.before.tolist(), after=rec.after.tolist())
    return out


def run_decode(ctx) -> dict:
    """The loop of one decode rank (see the module docstring); its records for the report."""
    from runtime_hooks.hf import slot_token_counts
    from runtime_hooks.launcher import LOST_RANK_EXIT_CODE
    from runtime_hooks.pd.handoff import Receiver
    from runtime_hooks.pd.kv import live_kv_bytes
    from runtime_hooks.pd.pool import Pool, RankLost

    spec = ctx.spec
    pool = Pool("pd/decode", ctx.decode_ranks, ctx.group, ctx.rank, ctx.store, spec.liveness_timeout)
    served = [ctx.store.get("pd/decode/placement").decode()]
    receiver = Receiver(
        ctx.store, ctx.rank, ctx.prefill_ranks, _expectation(ctx, served), spec.handoff_timeout
    )
    active: dict = {}
    done, step_ms, failovers, batch = [], [], [], []
    try:
        while True:
            if receiver.die.is_set():
                os._exit(LOST_RANK_EXIT_CODE)  # the decode-dies fault: this rank is gone
            _admit(receiver, active)
            _finish(ctx, active, done)
            try:
                states = pool.sync({"n": len(active), "stop": ctx.store.check(["pd/stop"])})
            except RankLost as exc:
                failovers.append(_fail_over(ctx, pool, exc.missing, served))
                continue
            if not any(s["n"] for s in states):
                if all(s["stop"] for s in states):
                    break
                time.sleep(0.002)
                continue
            t = time.perf_counter()
            _step(ctx, active)
            step_ms.append((time.perf_counter() - t) * 1e3)
            batch.append(len(active))
            _finish(ctx, active, done)
    finally:
        receiver.close()
    return {
        "role": "decode",
        "rank": ctx.rank,
        "done": done,
        "step_ms": step_ms,
        "batch": batch,
        "picks": int(np.asarray(slot_token_counts(ctx.model)).sum()),
        "tokens": int(sum(batch)),
        "leaked": live_kv_bytes(),
        "held": len(active),
        "aborted": [list(a) for a in receiver.aborted],
        "failovers": failovers,
        "members": pool.members,
        "weights_ok": ctx.weights_ok(),
    }
