"""Sums whose bits do not depend on the order of the terms, computed where the terms lie.

Every rank must derive the same number from the same values (SBC's mean, adaptive k's
signal), but a floating-point sum depends on its order, which differs between a GPU's and a
CPU's reduction, between GPU models and between thread counts. The terms are instead scaled by
a power of two that puts the largest one just under ``2**room`` (``room`` leaves space for
all of them in an int64), truncated to integers and added exactly: integer addition has no
order. Each term loses less than one unit, so the relative error stays below
``n * 2**-room`` of the largest term (under ``2**-17`` of it for up to a million terms). One
host read per call.
"""
from __future__ import annotations

import math

import torch


def fixed_point_sum(terms: torch.Tensor) -> float:
    """``sum(terms)`` in float64 with the same bits for any order of the same terms (NaN or
    Inf when a term is). ``terms``: float64 (exact for float32, half and bfloat16 inputs)."""
    x = terms.detach().reshape(-1)
    if x.numel() == 0:
        return 0.0
    peak = x.abs().max()
    room = 62 - x.numel().bit_length()  # n terms below 2**room each sum below 2**62
    # peak * 2**shift < 2**room; 2**shift built from its bits (exact on every device)
    shift = (room - torch.frexp(peak).exponent.to(torch.int64)).clamp_(-1022, 1023)
    scale = ((shift + 1023) << 52).view(torch.float64)
    units = torch.floor(x * scale).to(torch.int64).sum()
    n_units, e, top = torch.stack([units.to(torch.float64), shift.to(torch.float64),
                                   peak]).tolist()
    if not math.isfinite(top):
        return float(torch.sum(x).item())  # NaN, or Inf of the terms' sign
    return math.ldexp(n_units, -int(e))
