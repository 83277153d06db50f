"""Argument checks shared by the constructors: each raises a ``ValueError`` naming the argument, the rule and
the value received, e.g. ``max_batch_size must be an int >= 1 (got 0)``."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_device", "check_devices", "check_int", "check_number", "check_seconds", "is_int"]


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


def check_device(name: str, value: Any) -> torch.device | None:
    """``value`` as a device values can be served on (``None`` stays ``None``); ``"cuda"`` names the current one."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name} must be a torch.device or a device string (got {value!r})") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={value!r}: this torch build or machine has no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={value!r}: there are {torch.cuda.device_count()} CUDA devices")
        if device.index is None:  # "cuda" is the current device: named by index, as its tensors' devices are
            device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "meta":
        raise ValueError(f"{name}={value!r}: the meta device holds no values to serve")
    return device


def check_devices(value: Any) -> list[torch.device | None]:
    """``device`` as one entry per replica: a device, ``None``, or a non-empty sequence of devices."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError("device must name at least one device (got an empty sequence)")
        if any(d is None for d in value):  # a typo (a YAML null) rather than a replica's device
            raise ValueError(f"device: a sequence names a device for each replica; None is none (got {value!r})")
        return [check_device(f"device[{i}]", d) for i, d in enumerate(value)]
    return [check_device("device", value)]
