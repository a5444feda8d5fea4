"""Validation helpers shared by the config sections: unknown keys, types, suggestions.

Every check is pure (no communication), so a bad config fails identically on every rank before
any process group is built.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

__all__ = [
    "as_bool",
    "check_bool",
    "check_choice",
    "check_positive_int",
    "closest",
    "reject_unknown_keys",
    "section_fields",
]


def closest(key: str, valid: Iterable[str]) -> str | None:
    """The valid key most similar to ``key`` (a likely typo), or None if none is close."""
    matches = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return matches[0] if matches else None


def reject_unknown_keys(
    section: str,
    given: Mapping[str, Any],
    valid: Iterable[str],
    error: type[Exception] = ValueError,
) -> None:
    """``error`` naming every key of ``given`` that is not in ``valid``, with a suggestion."""
    valid = list(valid)
    unknown = [key for key in given if key not in valid]
    if not unknown:
        return
    parts = []
    for key in unknown:
        hint = closest(str(key), valid)
        parts.append(f"{key!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    raise error(
        f"unknown {section} key{'s' if len(unknown) > 1 else ''} {', '.join(parts)}; "
        f"valid keys: {sorted(valid)}"
    )


def section_fields(cls: type) -> list[str]:
    """The field names of a config dataclass (the keys its dict form accepts)."""
    return [f.name for f in fields(cls)]


def check_bool(section: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{section}[{name!r}] must be a bool, got {value!r}")


def as_bool(section: str, name: str, value: Any) -> bool:
    """``value`` as a bool: a bool, or the int 0 / 1 NxD's example scripts pass for flags
    (``sequence_parallel=args.use_sequence_parallel``); anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{section}[{name!r}] must be a bool (or the int 0 or 1), got {value!r}")


def check_positive_int(section: str, name: str, value: Any, upper: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if ok and upper is not None:
        ok = value <= upper
    if not ok:
        bound = f" in [1, {upper}]" if upper is not None else ""
        raise ValueError(f"{section}[{name!r}] must be a positive integer{bound}, got {value!r}")


def check_choice(section: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        hint = closest(str(value), [str(c) for c in choices]) if isinstance(value, str) else None
        suggestion = f" (did you mean {hint!r}?)" if hint else ""
        raise ValueError(f"{section}[{name!r}] must be one of {choices}, got {value!r}{suggestion}")
