"""`arg`: a settings field with its help text (the CLI's --help reads it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def check_at_least(args: Any, names: tuple[str, ...], low: float) -> None:
    """ValueError naming the first of the flags below low."""
    for name in names:
        if getattr(args, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(args, name)}")


def check_fraction(args: Any, names: tuple[str, ...]) -> None:
    """ValueError naming the first of the flags outside [0, 1]."""
    for name in names:
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {getattr(args, name)}")
