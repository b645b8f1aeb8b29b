"""Serving across pools and rank losses on real ranks: disaggregated prefill/decode with a KV hand-off
that fails safely (:mod:`runtime_hooks.pd.serve`), and a co-located pool that survives a killed rank
(:mod:`runtime_hooks.pd.rank_loss`).

- :mod:`runtime_hooks.pd.kv`: per-request KV caches, prefill with per-layer hooks, continuous batching.
- :mod:`runtime_hooks.pd.handoff`: the hand-off protocol (states, deadline, checksums, metadata, one verdict).
- :mod:`runtime_hooks.pd.manager`: the request manager (placement of attempts, fail or retry).
- :mod:`runtime_hooks.pd.pool`: lockstep pools, liveness through the store, failover of a sharded model.
- :mod:`runtime_hooks.pd.failover_map`: the map on the survivors (one function, replaceable).
"""
