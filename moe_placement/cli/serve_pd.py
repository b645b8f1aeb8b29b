"""The two other runtimes of ``moe-placement serve-demo``: ``--disaggregated`` (a prefill pool and a
decode pool, each on its own placement, with a KV hand-off that fails safely) and ``--kill-rank R
--at-step S`` (a co-located pool that loses a rank mid-serving). Flags, checks, specs and the text
reports; ``moe_placement.cli.serve_demo`` registers the flags and dispatches.
"""

from __future__ import annotations

import argparse

from moe_placement.cli.common import CliError, echo, open_placement, positive_int

__all__ = [
    "add_arguments",
    "check_modes",
    "kill_ok",
    "kill_spec",
    "pd_ok",
    "pd_spec",
    "print_kill",
    "print_pd",
]

_PD_FLAGS = (
    "prefill_ranks",
    "decode_ranks",
    "prefill_placement",
    "decode_placement",
    "on_handoff_failure",
    "handoff_timeout",
    "inject_fault",
    "requests",
)
_KILL_FLAGS = ("kill_rank", "at_step", "on_rank_loss")
_SHARED_ONLY = (
    "ranks",
    "placement",
    "redundant",
    "layers",
    "prompts_per_rank",
    "rebalance_every",
    "max_moves",
    "gain_gate",
    "no_wait",
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--disaggregated`` and ``--kill-rank`` flags."""
    from runtime_hooks.pd.handoff import FAULTS
    from runtime_hooks.pd.manager import ON_FAILURE
    from runtime_hooks.pd.rank_loss import ON_RANK_LOSS

    g = p.add_argument_group("disaggregated serving (--disaggregated)")
    g.add_argument(
        "--disaggregated", action="store_true", help="a prefill pool and a decode pool, KV handed off"
    )
    g.add_argument("--prefill-ranks", type=positive_int, metavar="P", help="prefill ranks (default 2)")
    g.add_argument("--decode-ranks", type=positive_int, metavar="D", help="decode ranks (default 2)")
    g.add_argument("--prefill-placement", metavar="FILE", help="the prefill pool's placement (ep_size P)")
    g.add_argument("--decode-placement", metavar="FILE", help="the decode pool's placement (ep_size D)")
    g.add_argument(
        "--on-handoff-failure",
        choices=ON_FAILURE,
        help="fail the request, or retry it from its prompt (default fail)",
    )
    g.add_argument("--handoff-timeout", type=float, metavar="S", help="seconds per hand-off (default 5)")
    g.add_argument(
        "--inject-fault",
        choices=FAULTS,
        action="append",
        help="a fault on one request's first hand-off (repeat: one request each, requests 1, 2, ...)",
    )
    g.add_argument(
        "--requests",
        type=positive_int,
        metavar="N",
        help="requests (default 8); request i has --prompt-len + i %% 3 tokens",
    )
    k = p.add_argument_group("a rank lost mid-serving (--kill-rank)")
    k.add_argument("--kill-rank", type=int, metavar="R", help="rank that exits abruptly at --at-step")
    k.add_argument("--at-step", type=int, metavar="S", help="step at which it exits (1: the prefill)")
    k.add_argument(
        "--on-rank-loss",
        choices=ON_RANK_LOSS,
        help="its requests fail, or restart from their prompts on the survivors (default fail)",
    )
    p.add_argument(
        "--liveness-timeout",
        type=float,
        metavar="S",
        help="seconds a rank waits for a peer at a step before it takes it as lost (default 3)",
    )


def check_modes(args: argparse.Namespace) -> str:
    """``"pd"``, ``"kill"`` or ``"live"``; CliError for flags of another mode, or missing partners."""
    from moe_placement.cli.validate import check_numbers

    pd_given = [_flag(d) for d in _PD_FLAGS if getattr(args, d) is not None]
    kill_given = [_flag(d) for d in _KILL_FLAGS if getattr(args, d) is not None]
    check_numbers(args, positive=("handoff_timeout", "liveness_timeout"), non_negative=("kill_rank",))
    if args.disaggregated or pd_given:
        if not args.disaggregated:
            raise CliError(f"{pd_given[0]} belongs to disaggregated serving: add --disaggregated")
        other = kill_given + [_flag(d) for d in _SHARED_ONLY if getattr(args, d) not in (None, False)]
        if other:
            raise CliError(
                f"{other[0]} does not apply with --disaggregated (the pools take --prefill-ranks/--decode-ranks "
                f"and --prefill-placement/--decode-placement; --inject-fault decode-dies loses a rank): drop it"
            )
        return "pd"
    if kill_given:
        if args.kill_rank is None or args.at_step is None:
            raise CliError("--kill-rank R and --at-step S go together: give both")
        live = [
            _flag(d)
            for d in ("rebalance_every", "max_moves", "gain_gate", "no_wait", "layers")
            if getattr(args, d)
        ]
        if live:
            raise CliError(
                f"{live[0]} does not apply with --kill-rank (it serves without live rebalancing): drop it"
            )
        return "kill"
    if args.liveness_timeout is not None:
        raise CliError("--liveness-timeout applies with --disaggregated or --kill-rank: drop it or add one")
    return "live"


def _pool_placement(path: str | None, ranks: int, info, which: str):
    """A pool's placement: the file (its ep_size must be the pool's ranks), else contiguous blocks with
    one redundant slot per rank (none on one rank)."""
    from runtime_hooks.hf_serve import contiguous_placement

    if path is None:
        redundant = ranks if ranks > 1 else 0
        try:
            return contiguous_placement(len(info.layer_ids), info.num_experts, ranks, redundant)
        except ValueError as exc:
            raise CliError(f"--{which}-ranks {ranks}: {exc}; or pass --{which}-placement FILE") from None
    placement = open_placement(path)
    if placement.topology.ep_size != ranks:
        raise CliError(
            f"--{which}-ranks {ranks} differs from --{which}-placement's ep_size {placement.topology.ep_size}; "
            f"pass --{which}-ranks {placement.topology.ep_size}"
        )
    return placement


def pd_spec(args: argparse.Namespace, info, max_tokens: int):
    """The :class:`runtime_hooks.pd.serve.PDSpec` the flags describe (CliError on bad input)."""
    from runtime_hooks.pd.failover_map import failover_map
    from runtime_hooks.pd.handoff import HandoffFault
    from runtime_hooks.pd.serve import PDSpec

    P, D, N = args.prefill_ranks or 2, args.decode_ranks or 2, args.requests or 8
    faults = tuple(HandoffFault(kind, i + 1) for i, kind in enumerate(args.inject_fault or ()))
    if len(faults) >= N:
        raise CliError(
            f"{len(faults)} --inject-fault need --requests {len(faults) + 1} or more (one request each, from request 1)"
        )
    if N * (args.prompt_len + 2 + args.new_tokens) > max_tokens:
        raise CliError(
            f"--requests {N} x (--prompt-len {args.prompt_len} + 2 + --new-tokens {args.new_tokens}) tokens is "
            f"over the accepted {max_tokens:,} (MAX_SERVE_TOKENS); lower one of them"
        )
    dies = any(f.kind == "decode-dies" for f in faults)
    if dies and D < 2:
        raise CliError("--inject-fault decode-dies needs --decode-ranks 2 or more (a survivor must carry on)")
    prefill = _pool_placement(args.prefill_placement, P, info, "prefill")
    decode = _pool_placement(args.decode_placement, D, info, "decode")
    if dies:
        for r in range(D):
            try:
                failover_map(decode, [r])
            except ValueError as exc:
                raise CliError(
                    f"--inject-fault decode-dies: the decode placement cannot lose decode rank {r}: {exc}"
                ) from None
    return PDSpec(
        args.model,
        prefill,
        decode,
        requests=N,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        on_handoff_failure=args.on_handoff_failure or "fail",
        handoff_timeout=args.handoff_timeout or 5.0,
        liveness_timeout=args.liveness_timeout or 3.0,
        faults=faults,
        seed=args.seed,
        dtype=args.dtype,
        dispatch=args.dispatch,
    )


def kill_spec(args: argparse.Namespace, live_spec):
    """The :class:`runtime_hooks.pd.rank_loss.RankLossSpec` from the co-located run's spec and the flags."""
    from runtime_hooks.pd.rank_loss import RankLossSpec

    try:
        return RankLossSpec(
            args.model,
            live_spec.placement,
            kill_rank=args.kill_rank,
            at_step=args.at_step,
            on_rank_loss=args.on_rank_loss or "fail",
            new_tokens=args.new_tokens,
            prompts_per_rank=args.prompts_per_rank,
            prompt_len=args.prompt_len,
            seed=args.seed,
            dtype=args.dtype,
            dispatch=args.dispatch,
            liveness_timeout=args.liveness_timeout or 3.0,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_pd(rep) -> bool:
    """The disaggregated run as text; True when it passed."""
    echo(
        f"{'req':>3}  {'status':9}  {'tokens':6}  {'prompt':6}  {'hand-off B':>10}  {'formula B':>9}  {'ms':>6}  {'exposed':>7}  {'TTFT ms':>7}  {'TPOT ms':>7}  attempts"
    )
    for r in rep.requests:
        h = r["handoff"]
        tok = {True: "match", False: "DIFFER", None: "-"}[r["tokens_match"]]
        tries = ", ".join(
            f"{a['prefill_rank']}->{a['decode_rank']} {a['state']}"
            + (f" ({a['fault']})" if a["fault"] else "")
            for a in r["attempts"]
        )
        echo(
            f"{r['id']:>3}  {r['status']:9}  {tok:6}  {r['prompt_tokens']:>6}  {h['bytes']:>10}  {h.get('expected_bytes') or '-':>9}  {_ms(h['ms']):>6}  {_ms(h['exposed_ms']):>7}  {_ms(r['ttft_ms']):>7}  {_ms(r['tpot_ms']):>7}  {tries}"
        )
        if r["reason"]:
            echo(f"     {r['status']}: {r['reason']}")
    for name, p in rep.pools.items():
        extra = (
            f"; lost ranks {p['lost_ranks']}, {p['reloads']} expert(s) reloaded"
            if p.get("lost_ranks")
            else ""
        )
        echo(
            f"pool {name}: {p['ranks']} ranks x {p['slots_per_gpu']} slots ({p['redundant_slots']} redundant), {p['steps']} steps, median {_ms(p['step_ms_median'])} ms; picks per rank {p['load_per_rank']}, tokens per rank {p['tokens_run']}{extra}"
        )
    echo(
        f"KV bytes per token and layer: {rep.measured_kv_bytes_per_token_layer} measured, {rep.kv_bytes_per_token_layer} by the formula (x {rep.num_layers} layers x prompt tokens)"
    )
    echo(
        f"KV left in memory at the end: prefill {rep.leaked_kv_bytes['prefill']} B, decode {rep.leaked_kv_bytes['decode']} B"
    )
    ok = pd_ok(rep)
    done = sum(r["status"] != "failed" for r in rep.requests)
    echo(
        f"{'PASS' if ok else 'FAIL'}: {done} of {len(rep.requests)} requests completed, their tokens {'equal' if rep.tokens_match else 'DIFFER from'} the single-process model's"
    )
    return ok


def pd_ok(rep) -> bool:
    weights = all(p["weights_match"] for p in rep.pools.values())
    return rep.tokens_match and weights and not any(rep.leaked_kv_bytes.values())


def print_kill(rep) -> bool:
    """The run with a killed rank as text; True when it passed."""
    for r in rep.requests:
        tok = {True: "match", False: "DIFFER", None: "-"}[r["tokens_match"]]
        echo(f"request {r['id']} (rank {r['rank']}): {r['status']}, served by {r['served_by']}, tokens {tok}")
    f = rep.failover
    echo(
        f"rank {rep.killed_rank} killed at step {rep.at_step}: survivors {f['survivors']} switched to the failover map in {_ms(f['ms'])} ms, {rep.reloads} expert(s) reloaded from the checkpoint (slots loaded per rank {f['loaded_slots_per_rank']})"
    )
    ok = kill_ok(rep)
    echo(
        f"{'PASS' if ok else 'FAIL'}: every finished request's tokens {'equal' if rep.tokens_match else 'DIFFER from'} the single-process model's; slot weights {'match' if rep.weights_match else 'DO NOT match'} the failover map; on rank loss: {rep.on_rank_loss}"
    )
    return ok


def kill_ok(rep) -> bool:
    return rep.tokens_match and rep.weights_match and not rep.leaked_kv_bytes
