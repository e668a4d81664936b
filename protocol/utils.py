"""Small arithmetic helpers that every tokenmill package may use (protocol imports nothing of
the project, so anything may import it)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def cdiv(a: T, b: int) -> T:
    """Ceiling division: how many blocks of size b hold a items (ints or numpy arrays)."""
    return -(a // -b)  # type: ignore[operator]
