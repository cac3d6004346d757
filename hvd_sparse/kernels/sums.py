"""Sums whose bits do not depend on the order of the terms, computed where the terms lie.

Every rank must derive the same number from the same values (SBC's mean, adaptive k's
signal), but a floating-point sum depends on its order, which differs between a GPU's and a
CPU's reduction, between GPU models and between thread counts. The terms are instead scaled by
a power of two that puts the largest one just under ``2**room`` (``room`` leaves space for
all of them in an int64), truncated to integers and added exactly: integer addition has no
order. Each term loses less than one unit, so the relative error stays below
``n * 2**-room`` of the largest term (under ``2**-17`` of it for up to a million terms).

Two forms with the same result bit for bit (every step is exact but the truncation, which
is the same in both): torch operations where the terms lie (one host read), and on the CPU a
compiled two-pass loop when numba is there (no temporaries: a few hundred thousand terms cost
a fraction of a millisecond instead of page faults on each temporary).
"""
from __future__ import annotations

import math

import numpy as np
import torch


def fixed_point_sum(terms: torch.Tensor, square: bool = False) -> float:
    """``sum(terms)`` (``sum(terms ** 2)`` with ``square``) in float64, with the same bits for
    any order of the same terms; NaN or Inf when a term is. Float32, half, bfloat16 and float64
    terms are widened to float64 first (their squares are then exact, but for float64's)."""
    return fixed_point_sums([terms], square)[0]


def fixed_point_sums(terms_list, square: bool = False) -> list:
    """:func:`fixed_point_sum` of each tensor in ``terms_list``, the same bits, with one host
    read for all of those that lie on a device (SBC's two side means cost one read)."""
    out, pending = [], []
    for terms in terms_list:
        x = terms.detach().reshape(-1)
        if x.numel() == 0:
            out.append(0.0)
        elif x.device.type == "cpu" and _fixed_point is not None and \
                x.dtype in (torch.float32, torch.float64):
            units, shift, finite = _fixed_point(x.contiguous().numpy(), square)
            out.append(math.ldexp(float(units), -shift) if finite else _plain_sum(x, square))
        else:
            x = x.to(torch.float64)
            if square:
                x = torch.square(x)
            out.append(None)
            pending.append((len(out) - 1, x, _parts(x)))
    if pending:
        read = torch.stack([p for _, _, p in pending]).tolist()  # the one host read
        for (i, x, _), (n_units, e, top) in zip(pending, read):
            out[i] = math.ldexp(n_units, -int(e)) if math.isfinite(top) \
                else float(torch.sum(x).item())  # NaN, or Inf of the terms' sign
    return out


def _parts(x: torch.Tensor) -> torch.Tensor:
    """(integer units, shift, largest magnitude) of float64 terms ``x``, as float64 where they
    lie, not yet read."""
    peak = x.abs().max()
    room = 62 - x.numel().bit_length()  # n terms below 2**room each sum below 2**62
    # peak * 2**shift < 2**room; 2**shift built from its bits (exact on every device)
    shift = (room - torch.frexp(peak).exponent.to(torch.int64)).clamp_(-1022, 1023)
    scale = ((shift + 1023) << 52).view(torch.float64)
    units = torch.floor(x * scale).to(torch.int64).sum()
    return torch.stack([units.to(torch.float64), shift.to(torch.float64), peak])


def _plain_sum(x: torch.Tensor, square: bool) -> float:
    """The float64 sum of terms of which one is NaN or Inf: NaN, or Inf."""
    x = x.to(torch.float64)
    return float(torch.sum(x * x if square else x).item())


try:  # the CPU form: compiled when numba is there
    from numba import njit

    @njit(cache=True)
    def _fixed_point(x, square):
        """(integer units, shift, all finite) of :func:`fixed_point_sum` in two passes."""
        peak = 0.0
        for i in range(x.size):
            v = np.float64(x[i])
            a = v * v if square else abs(v)
            if not (a <= 1.7976931348623157e308):  # NaN or Inf
                return 0, 0, False
            if a > peak:
                peak = a
        room = 62 - _bit_length(x.size)
        shift = room - math.frexp(peak)[1]
        shift = min(max(shift, -1022), 1023)
        scale = math.ldexp(1.0, shift)
        units = 0
        for i in range(x.size):
            v = np.float64(x[i])
            units += np.int64(math.floor((v * v if square else v) * scale))
        return units, shift, True

    @njit(cache=True, inline="always")
    def _bit_length(n):
        b = 0
        while n:
            n >>= 1
            b += 1
        return b
except ImportError:  # pragma: no cover - depends on the installation
    _fixed_point = None
