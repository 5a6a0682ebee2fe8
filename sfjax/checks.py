"""Checks of user-given fields: a TypeError for a wrong type and a ValueError for a value out of
range, each naming the field, the value and what is allowed. Integers must be integers (not
floats, strings or bools); reals must be numbers, finite unless the field says otherwise."""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence


class InvalidType(TypeError, ValueError):
    """A field of the wrong type: a TypeError, and a ValueError too, so that callers handling
    bad input as ValueError (the CLI, the server) handle it as well."""


def shown(value: Any, render: Callable[[Any], str] = repr, limit: int = 80) -> str:
    """``value`` rendered for a message (``repr``, or e.g. ``json.dumps``), cut to ``limit``
    characters: an error about a long prompt does not send the prompt back."""
    try:
        text = render(value)
    except RecursionError:
        return "(nested too deeply to show)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bad_type(field: str, value: Any, allowed: str) -> TypeError:
    return InvalidType(f"{field} = {shown(value)} has type {type(value).__name__}: must be {allowed}")


def _out_of_range(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{field} = {shown(value)} is out of range: must be {allowed}")


def _span(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}" if hi is not None else ""


def integer(field: str, value: Any, lo: int | None = None, hi: int | None = None, *,
            allowed: str | None = None, optional: bool = False) -> int | None:
    """``value`` as an int in [lo, hi] (None passes when ``optional``)."""
    if value is None and optional:
        return None
    allowed = allowed or f"an int {_span(lo, hi)}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad_type(field, value, allowed + (" or None" if optional else ""))
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _out_of_range(field, value, allowed)
    return value


def real(field: str, value: Any, lo: float | None = None, hi: float | None = None, *,
         lo_open: bool = False, allowed: str | None = None, finite: bool = True) -> float:
    """``value`` as a float in [lo, hi] ((lo, hi] with ``lo_open``), not NaN, and finite unless
    ``finite`` is False."""
    span = (f"in ({lo}, {hi}]" if lo_open and hi is not None else f"> {lo}" if lo_open
            else "" if lo is None and hi is None else _span(lo, hi))
    allowed = allowed or f"a {'finite ' if finite else ''}number {span}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad_type(field, value, allowed)
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise _out_of_range(field, value, allowed)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise _out_of_range(field, value, allowed)
    if hi is not None and value > hi:
        raise _out_of_range(field, value, allowed)
    return value


def boolean(field: str, value: Any) -> bool:
    if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
        raise _bad_type(field, value, "True or False")
    return bool(value)


def one_of(field: str, value: Any, choices: Sequence) -> Any:
    if not any(value == c and type(value) is type(c) for c in choices):
        raise ValueError(f"{field} = {shown(value)}: must be one of {', '.join(map(repr, choices))}")
    return value


def text(field: str, value: Any, *, optional: bool = False) -> str | None:
    """A str that encodes to UTF-8 (no lone surrogates)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad_type(field, value, "a str" + (" or None" if optional else ""))
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} = {shown(value)} is not valid text: must be valid UTF-8 "
                         f"({e.reason} at position {e.start})") from None
    return value


def int_list(field: str, value: Any, lo: int | None = None, hi: int | None = None, *,
             allowed: str | None = None) -> list[int]:
    """A list (or tuple, or 1-D array) of ints in [lo, hi]."""
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):   # numpy's, jax's
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise _bad_type(field, value, "a list of ints")
    return [integer(f"{field}[{i}]", v, lo, hi, allowed=allowed) for i, v in enumerate(value)]
