"""Checks of user-given option values, shared by the optimizer's keywords and the methods'.

Each returns the value as a plain Python type or raises an error that names the option: the
wrong value is refused when the optimizer is built, never inside a step (NaN and infinities
included, which pass a plain ``x <= 0`` test). NumPy scalars and one-element tensors count as
the numbers they hold, as config files and schedules often hand them over.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
import torch


def plain_number(value):
    """A Python number from a NumPy scalar or a one-element torch tensor, else ``value``
    itself; booleans (Python's and NumPy's) stay booleans."""
    if type(value) in (bool, int, float):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad \
            and value.dtype != torch.bool:
        return value.item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def real(name, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """A finite real number within the bounds given (open or closed ends), as a float."""
    value = plain_number(value)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        where = ("" if lo is None and hi is None else " in " + ("(" if lo_open else "[")
                 + ("-inf" if lo is None else f"{lo:g}") + ", "
                 + ("inf" if hi is None else f"{hi:g}") + (")" if hi_open or hi is None
                                                           else "]"))
        raise ValueError(f"{name} must be a finite number{where}, got {value!r}")
    return float(value)


def whole(name, value, minimum=0) -> int:
    """An int (a NumPy integer, or a float with no fraction such as ``3.0``; not a bool) of
    at least ``minimum``."""
    value = plain_number(value)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def flag(name, value) -> bool:
    """True or False (1 and 0, NumPy's booleans and one-element bool tensors, as Horovod takes
    them; None as False)."""
    if value is None:
        return False
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        return bool(value)
    value = plain_number(value)
    if value not in (True, False) or not isinstance(value, (bool, int)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)
