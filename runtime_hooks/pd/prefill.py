"""The prefill pool's loop (one per prefill rank; the request manager runs on prefill rank 0).

Each step: free the hand-offs whose verdict came (:meth:`runtime_hooks.pd.handoff.Sender.poll`), get
this step's plan from the manager (a broadcast over the prefill group), then run this rank's request's
prompt with its KV streamed layer by layer to the planned decode rank, or join the step's experts calls
with an empty batch. The loop ends when the manager says every request has ended.

Shapes: P prefill ranks; the plan is int64 ``[3 P + 1]`` (request, attempt, decode rank per prefill rank,
``-1`` for none; then the stop flag).
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["run_prefill"]


def _broadcast_plan(manager, P: int, group) -> tuple[list, bool]:
    """The manager's plan (on prefill rank 0) on every prefill rank: ``([P] (req, attempt, dst) or None, stop)``."""
    import torch
    import torch.distributed as dist

    msg = torch.full((3 * P + 1,), -1, dtype=torch.int64)
    if manager is not None:
        plan, stop = manager.plan()
        for p, job in enumerate(plan):
            if job is not None:
                msg[3 * p : 3 * p + 3] = torch.tensor(job)
        msg[-1] = int(stop)
    dist.broadcast(msg, src=0, group=group)
    jobs = [None if int(msg[3 * p]) < 0 else tuple(int(x) for x in msg[3 * p : 3 * p + 3]) for p in range(P)]
    return jobs, bool(int(msg[-1]) == 1)


def _ended(out, verdict: dict) -> dict:
    """A finished hand-off as the report needs it (bytes, timings, verdict)."""
    m = out.meta
    committed = verdict["state"] == "committed"
    t_end = float(verdict["t"])
    return {
        "hid": m.hid,
        "request": m.request,
        "attempt": m.attempt,
        "src": m.src,
        "dst": m.dst,
        "state": verdict["state"],
        "by": verdict["by"],
        "reason": verdict["reason"],
        "fault": m.fault,
        "position": m.position,
        "layer_bytes": list(out.layer_bytes),
        "bytes": int(sum(out.layer_bytes)),
        "freed_bytes": out.freed_bytes,
        "ms": (t_end - out.t_first) * 1e3 if committed and out.t_first else None,
        "exposed_ms": max(t_end - out.t_compute_end, 0.0) * 1e3 if committed else None,
        "overlap_ms": (out.t_compute_end - out.t_first) * 1e3 if committed and out.t_first else None,
    }


def _prefill_one(ctx, sender, job: tuple[int, int, int], prompts: list, model_id: str, faults: dict) -> dict:
    """Run one request's prompt, streaming its KV to decode rank ``dst``; the first token and its time."""
    from runtime_hooks.pd.kv import prefill

    req, attempt, dst = job
    prompt = prompts[req]
    fault = faults.get(req, "") if attempt == 0 else ""
    pid = ctx.store.get("pd/decode/placement").decode()
    if fault == "metadata-mismatch":
        pid = "stale-" + pid  # planned against a decode placement the pool does not serve
    fields = {
        "hid": f"{req}.{attempt}",
        "request": req,
        "attempt": attempt,
        "position": int(prompt.numel()),
        "layout": ctx.layout.to_dict(),
        "model_id": model_id,
        "placement_id": pid,
        "deadline": time.time() + ctx.spec.handoff_timeout,
        "fault": fault,
    }
    out = sender.begin(fields, dst)
    held = []  # what leaves this rank is in the send buffers, held until the verdict
    if ctx.spec.stream_layers:
        _, first = prefill(ctx.model, [prompt], lambda l, k, v: sender.send_layer(out, l, k, v), keep=False)
        out.t_compute_end = time.time()
    else:  # every layer after the prompt ran: nothing of the transfer overlaps compute
        _, first = prefill(ctx.model, [prompt], lambda l, k, v: held.append((l, k, v)), keep=False)
        out.t_compute_end = time.time()
        for layer, keys, values in held:
            sender.send_layer(out, layer, keys, values)
        held.clear()
    sender.send_tail(out, first[0])
    return {"hid": fields["hid"], "token": first[0], "t": time.time(), "tokens_in": int(prompt.numel())}


def run_prefill(ctx) -> dict:
    """The loop of one prefill rank (see the module docstring); its records for the report."""
    from runtime_hooks.hf import slot_token_counts
    from runtime_hooks.pd.handoff import GRACE_S, Sender, model_identity
    from runtime_hooks.pd.kv import idle_step, live_kv_bytes
    from runtime_hooks.pd.manager import Manager

    spec = ctx.spec
    P = len(ctx.prefill_ranks)
    sender = Sender(ctx.store, ctx.rank, spec.handoff_timeout)
    manager = None
    if ctx.rank == 0:
        manager = Manager(
            ctx.store,
            spec.requests,
            ctx.prefill_ranks,
            ctx.decode_ranks,
            spec.on_handoff_failure,
            spec.max_attempts,
        )
    prompts, model_id = ctx.prompts(), model_identity(ctx.model, spec.seed, spec.dtype)
    faults = {f.request: f.kind for f in spec.faults}
    ended, firsts, step_ms, t0 = [], [], [], time.time()
    while True:
        ended += [_ended(o, v) for o, v in sender.poll()]
        plan, stop = _broadcast_plan(manager, P, ctx.group)
        if stop:
            break
        if all(job is None for job in plan):
            time.sleep(0.002)
            continue
        t = time.perf_counter()
        job = plan[ctx.rank]
        if job is None:
            idle_step(ctx.model)
        else:
            ended += [_ended(o, v) for o, v in sender.poll()]  # this pair's last verdict, seen by the manager
            firsts.append(_prefill_one(ctx, sender, job, prompts, model_id, faults))
        step_ms.append((time.perf_counter() - t) * 1e3)
    end = time.time() + spec.handoff_timeout + GRACE_S + 1.0
    while sender.out and time.time() < end:  # every verdict is in the store by now
        ended += [_ended(o, v) for o, v in sender.poll()]
        time.sleep(0.01)
    sender.close()
    return {
        "role": "prefill",
        "rank": ctx.rank,
        "t0": t0,
        "ended": ended,
        "firsts": firsts,
        "step_ms": step_ms,
        "picks": int(np.asarray(slot_token_counts(ctx.model)).sum()),
        "tokens": int(sum(f["tokens_in"] for f in firsts)),
        "leaked": live_kv_bytes(),
        "held": len(sender.out),
        "weights_ok": ctx.weights_ok(),
        "manager": manager.to_list() if manager is not None else None,
    }
