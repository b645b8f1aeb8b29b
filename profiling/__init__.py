"""Routing traces, readers/writers, statistics; torch recording hooks live in submodules only."""

from profiling.trace import RoutingTrace, token_counts

__all__ = ["RoutingTrace", "token_counts"]
