"""Options objects given whole or as keywords: one check for every function that takes an options
dataclass (``options=``) or its fields as keywords (``**fields``)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["options_or_fields"]

T = TypeVar("T")


def options_or_fields(
    cls: type[T], options: T | None, fields: dict[str, Any], caller: str, merge: bool = False
) -> T:
    """``options`` (a ``cls`` instance, or None for ``cls()``) with the keyword ``fields``.

    ``merge``: the fields are set over ``options`` (``dataclasses.replace``); otherwise giving both is
    refused. Raises ValueError naming a stray keyword (with the fields ``cls`` has), an ``options`` of
    another type, or both forms at once.
    """
    if options is not None and not isinstance(options, cls):
        raise ValueError(f"{caller}: options must be a {cls.__name__}, got {type(options).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(
            f"{caller} got unknown keyword(s) {', '.join(unknown)}; its keywords are the fields of "
            f"{cls.__name__}: {', '.join(known)}"
        )
    if options is None:
        return cls(**fields)
    if fields and not merge:
        raise ValueError(
            f"give {caller} options={cls.__name__}(...) or its fields as keywords, not both "
            f"(got options and {', '.join(sorted(fields))}); use dataclasses.replace(options, ...)"
        )
    return dataclasses.replace(options, **fields) if fields else options  # type: ignore[type-var]
