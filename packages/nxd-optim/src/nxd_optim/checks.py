"""Validation of NxD's config dicts: unknown keys (with the closest valid one), types, choices.

Shared by every config dataclass: nxd-optim's :class:`~nxd_optim.OptimizerConfig` and
:class:`~nxd_optim.MixedPrecisionConfig`, and nxd-trainer's sections. Every check is pure (no
communication), so a bad config fails identically on every rank before any process group is
built, and every message names the key, the value and what was expected.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

__all__ = [
    "as_bool",
    "check_bool",
    "check_choice",
    "check_positive_int",
    "check_positive_number",
    "closest",
    "parse_section",
    "reject_unknown_keys",
    "section_fields",
]

S = TypeVar("S")


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


def parse_section(cls: type[S], section: str, value: Any) -> S:
    """NxD's dict for the dataclass ``cls`` as an instance: ``None`` -> the defaults, a dict
    -> its keys checked (an unknown one is an error naming the closest valid key), an
    instance -> itself; anything else is a TypeError naming the type."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{section} must be a dict (or a {cls.__name__}), got {type(value).__name__}"
        )
    reject_unknown_keys(section, value, section_fields(cls))
    return cls(**dict(value))


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


def check_positive_number(section: str, name: str, value: Any, meaning: str = "") -> None:
    """``value`` a positive int or float (``math.inf`` allowed; NaN, bools and 0 are not);
    ``meaning`` is appended to the message (what the value does, what inf means)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and value > 0):  # NaN fails the comparison
        raise ValueError(f"{section}[{name!r}] must be a positive number{meaning}, got {value!r}")


def check_choice(section: str, name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        hint = closest(str(value), [str(c) for c in choices]) if isinstance(value, str) else None
        suggestion = f" (did you mean {hint!r}?)" if hint else ""
        raise ValueError(f"{section}[{name!r}] must be one of {choices}, got {value!r}{suggestion}")
