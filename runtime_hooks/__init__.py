"""Torch expert-parallel runtime, migration and the online rebalancing hook.

Importing this package must stay cheap: no ortools or networkx at import time (serving path).
"""
