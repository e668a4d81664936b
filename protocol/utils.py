"""Small helpers that every tokenmill package may use (protocol imports nothing of the
project, so anything may import it): ceiling division, and a value's repr cut short for
error messages."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling division: how many blocks of size b hold a items (ints or numpy arrays)."""
    return -(a // -b)  # type: ignore[operator]


def short_repr(value: object, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (error messages quote what a client sent)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
