"""Argument checks shared by the constructors: each raises a ``ValueError`` naming the argument, the rule and
the value received, e.g. ``max_batch_size must be an int >= 1 (got 0)``."""

from __future__ import annotations

import math
import threading
from typing import Any

__all__ = ["check_int", "check_number", "check_seconds", "is_int"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (``True`` is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int, why: str = "") -> int:
    """``value``, an int >= ``minimum``; ``why`` follows the rule in the message."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why} (got {value!r})")
    return value


def check_number(name: str, value: Any, positive: bool = False, unit: str = "") -> float:
    """``value``, a finite number >= 0 (> 0 if ``positive``); ``unit`` (" of seconds") follows "number"."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise ValueError(f"{name} must be a finite number{unit} {'> 0' if positive else '>= 0'} (got {value!r})")
    return float(value)


def check_seconds(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as the seconds a thread may wait: >= 0 (> 0 if ``positive``), up to ``threading.TIMEOUT_MAX``."""
    seconds = check_number(name, value, positive, " of seconds")
    if seconds > threading.TIMEOUT_MAX:  # a wait that long raises OverflowError, in a serve loop or a close
        raise ValueError(
            f"{name} must be at most threading.TIMEOUT_MAX = {threading.TIMEOUT_MAX:g} seconds, the longest a "
            f"thread can wait (got {value!r})"
        )
    return seconds
