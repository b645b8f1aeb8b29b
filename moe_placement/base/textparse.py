"""Safe JSON and YAML parsing for input files (lowest layer: the standard library, PyYAML lazily).

- Duplicate keys in a mapping are refused, naming the key: ``json`` and ``yaml.safe_load`` would
  silently keep the last one, so a hand-edited file could say two things.
- YAML anchors and aliases are allowed, but the document they expand to is bounded: a few hundred
  bytes of nested aliases (a "billion laughs" file) cannot make the tool build or walk gigabytes.
- Nesting too deep for the parser (``RecursionError``) ends as a ``ValueError`` naming the file.

Every failure raises :class:`InputFileError` (a ``ValueError``) naming the file.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from moe_placement.base.errors import (
    InputFileError,  # re-exported: the family lives in moe_placement.base.errors
)

__all__ = ["InputFileError", "YAML_NODE_SLACK", "parse_json", "parse_yaml"]

# A YAML document may expand (aliases followed) to at most its length in bytes plus this many nodes:
# a document without aliases has fewer nodes than bytes, so only alias expansion can pass the limit.
YAML_NODE_SLACK = 100_000


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int | None = None):
        super().__init__(key)
        self.key = key
        self.line = line


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _duplicate_msg(where: str, kind: str, exc: _DuplicateKey) -> str:
    at = f" (line {exc.line})" if exc.line is not None else ""
    return (
        f"{where}: {kind} mapping has the key {exc.key!r} twice{at}; each key may appear once "
        f"(the parser would keep only the last value): remove or rename one"
    )


def parse_json(text: str, where: str) -> Any:
    """``json.loads`` with duplicate keys refused; every failure is an :class:`InputFileError`.

    Args:
        text: the document.
        where: the file name (or ``file: line n``) that starts every message.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as exc:
        raise InputFileError(_duplicate_msg(where, "a JSON", exc)) from None
    except json.JSONDecodeError as exc:
        raise InputFileError(
            f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise InputFileError(
            f"{where}: JSON nested too deeply for the parser; placement and trace files nest a few levels"
        ) from None
    except ValueError as exc:  # an integer longer than the interpreter converts (sys.get_int_max_str_digits)
        raise InputFileError(_long_number_msg(where, exc)) from None


def _long_number_msg(where: str, exc: ValueError) -> str:
    if "digits" not in str(exc):
        return f"{where}: a value cannot be read ({' '.join(str(exc).split())[:120]})"
    digits = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
    return f"{where}: a number in it has over {digits} digits; the file is corrupt (its ids and sizes are small integers)"


def _loader_class():
    """A ``yaml.SafeLoader`` that refuses duplicate keys and bounds alias expansion (built once)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class _BoundedSafeLoader(yaml.SafeLoader):
        max_nodes = YAML_NODE_SLACK

        def compose_document(self):
            node = super().compose_document()
            _check_expansion(node, self.max_nodes, yaml)
            return node

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        dup = key in seen
                    except TypeError:  # unhashable: the base class reports it
                        continue
                    if dup:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep)

    _LOADER = _BoundedSafeLoader
    return _LOADER


_LOADER = None


class _TooLarge(Exception):
    pass


class _Recursive(Exception):
    pass


def _check_expansion(root, limit: int, yaml) -> None:
    """Raise :class:`_TooLarge` when the node graph, aliases followed, has more than ``limit`` nodes,
    and :class:`_Recursive` when an alias refers to a node that contains it."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise _Recursive
        active.add(key)
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(size(k) + size(v) for k, v in node.value)
        active.discard(key)
        if n > limit:
            raise _TooLarge(n)
        memo[key] = n
        return n

    if root is not None:
        size(root)


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` (no ``!!python`` tags) with duplicate keys refused and alias expansion
    bounded by ``len(text) + YAML_NODE_SLACK`` nodes; every failure is an :class:`InputFileError`."""
    import yaml

    loader = _loader_class()(text)
    loader.max_nodes = len(text) + YAML_NODE_SLACK
    try:
        return loader.get_single_data()
    except _DuplicateKey as exc:
        raise InputFileError(_duplicate_msg(where, "a YAML", exc)) from None
    except _TooLarge:
        raise InputFileError(
            f"{where}: YAML anchors (&) and aliases (*) expand to over {loader.max_nodes} nodes "
            f"(limit: the file's {len(text)} bytes + {YAML_NODE_SLACK}); write the values out instead of aliasing them"
        ) from None
    except _Recursive:
        raise InputFileError(
            f"{where}: a YAML alias (*) refers to a node that contains it (a recursive document); "
            f"write the values out instead"
        ) from None
    except yaml.YAMLError as exc:
        raise InputFileError(f"{where}: invalid or unsafe YAML ({' '.join(str(exc).split())})") from None
    except RecursionError:
        raise InputFileError(f"{where}: YAML nested too deeply for the parser") from None
    except ValueError as exc:  # an integer longer than the interpreter converts
        raise InputFileError(_long_number_msg(where, exc)) from None
    finally:
        loader.dispose()
