"""Options objects given whole or as keywords, and the one check that names an unknown keyword.

:func:`check_keywords` owns that check and its wording; everything that takes keywords uses it: the
:func:`refuse_unknown_keywords` decorator (an options dataclass, or a keyword API such as
``solver.api.solve``) and :func:`options_or_fields` (a function that takes an options dataclass
(``options=``) or its fields as keywords (``**fields``)). One message for all of them::

    FitOptions: unknown keyword 'stepz' (did you mean 'steps'?); its keywords are enabled, steps, ...
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

__all__ = ["check_keywords", "options_or_fields", "refuse_unknown_keywords"]

T = TypeVar("T")


def check_keywords(
    caller: str,
    given: Iterable[Any],
    accepted: Sequence[str],
    positional: int = 0,
    max_positional: int | None = None,
    fix: str = "",
) -> None:
    """A one-line ValueError when a name in ``given`` is not in ``accepted``, or when ``positional``
    arguments are more than ``max_positional`` (default: ``len(accepted)``); else nothing.

    The message starts with ``caller``, names each unknown keyword with the closest accepted one
    (``difflib``), lists ``accepted`` and ends with ``fix`` when given.
    """
    accepted = [str(a) for a in accepted]
    unknown = sorted(set(given) - set(accepted), key=str)
    limit = len(accepted) if max_positional is None else max_positional
    if not unknown and positional <= limit:
        return
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        what = f"unknown keyword{plural} {', '.join(_with_hint(u, accepted) for u in unknown)}"
    else:
        what = f"takes at most {limit} positional argument{'s' if limit != 1 else ''}, got {positional}"
    tail = f"; {fix}" if fix else ""
    raise ValueError(f"{caller}: {what}; its keywords are {', '.join(accepted)}{tail}")


def _with_hint(word: Any, accepted: Sequence[str]) -> str:
    """``'word'``, with ``(did you mean 'x'?)`` when an accepted name is close to it."""
    close = difflib.get_close_matches(str(word), accepted, n=1)
    return f"{word!r} (did you mean {close[0]!r}?)" if close else repr(word)


def refuse_unknown_keywords(obj=None, *, fix: str = ""):
    """Decorator: an unknown keyword (or too many positional arguments) given to a function, or to an
    options dataclass's constructor, raises :func:`check_keywords`' ValueError instead of Python's
    TypeError, which names neither the accepted keywords nor a close match.

    On a class it goes above ``@dataclass``; ``dataclasses.replace(obj, nosuch=1)`` meets the same
    check. The signature seen by ``help`` and ``inspect`` is unchanged. ``fix`` ends the message
    (``@refuse_unknown_keywords(fix="...")``). On a class, every field annotated ``bool`` must then
    hold True or False (one ValueError naming the field otherwise).
    """
    if obj is None:
        return functools.partial(refuse_unknown_keywords, fix=fix)
    if isinstance(obj, type):
        if not dataclasses.is_dataclass(obj):
            raise TypeError(f"refuse_unknown_keywords goes above @dataclass on {obj.__name__}")
        obj.__init__ = _bools_checked(_checked(obj.__init__, obj.__name__, fix, skip=1), obj)
        return obj
    return _checked(obj, obj.__name__, fix, skip=0)


def _bools_checked(init, cls: type):
    """``init`` followed by a check that every field annotated ``bool`` holds True or False (a numpy
    bool is taken as one): a string such as ``"no"``, a 0/1, None or a list would otherwise be
    truthy or falsy by accident, and the options object would say something the caller did not."""
    names = [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)]

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for name in names:
            value = getattr(self, name)
            if isinstance(value, np.bool_):  # numpy's bool: the same two values
                object.__setattr__(self, name, bool(value))
            elif not isinstance(value, bool):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                raise ValueError(
                    f"{cls.__name__}.{name} must be True or False, got {shown} ({type(value).__name__})"
                )

    return wrapper


def _checked(fn, caller: str, fix: str, skip: int):
    """``fn`` wrapped so that its keywords and positional count are checked first; ``skip``: leading
    parameters (``self``) not counted."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        raise TypeError(f"{caller} takes **kwargs: refuse_unknown_keywords cannot check its keywords")
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in params if p.kind in by_name]
    in_order = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    most = None if inspect.Parameter.VAR_POSITIONAL in kinds else sum(p.kind in in_order for p in params)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = len(args) - skip
        check_keywords(caller, kwargs, names, n, most if most is not None else n, fix)
        return fn(*args, **kwargs)

    return wrapper


def options_or_fields(
    cls: type[T], options: T | None, fields: dict[str, Any], caller: str, merge: bool = False
) -> T:
    """``options`` (a ``cls`` instance, or None for ``cls()``) with the keyword ``fields``.

    ``merge``: the fields are set over ``options`` (``dataclasses.replace``); otherwise giving both is
    refused. Raises ValueError naming a stray keyword (:func:`check_keywords`, with the fields ``cls``
    has), an ``options`` of another type, or both forms at once.
    """
    if options is not None and not isinstance(options, cls):
        raise ValueError(f"{caller}: options must be a {cls.__name__}, got {type(options).__name__}")
    known = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    check_keywords(caller, fields, known, fix=f"they are the fields of {cls.__name__}")
    if options is None:
        return cls(**fields)
    if fields and not merge:
        raise ValueError(
            f"give {caller} options={cls.__name__}(...) or its fields as keywords, not both "
            f"(got options and {', '.join(sorted(fields))}); use dataclasses.replace(options, ...)"
        )
    return dataclasses.replace(options, **fields) if fields else options  # type: ignore[type-var]
