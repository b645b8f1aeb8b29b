"""Applications built on the solvers and the runtime: ``advise`` (what to launch), the layout
``planner`` (attention-DP / expert-EP sizes) and the trace ``replay`` simulator (online rebalancing
played over a recorded trace). They sit above ``solver`` and ``runtime_hooks`` and below ``cli``;
nothing below imports them.
"""
