"""Small tensor helpers the engine's parts share: a parameter's flat slice written in any
memory layout, numpy views for the numba kernels, and a finiteness check in one read."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

def write_flat(p: torch.Tensor, lo: int, hi: int, values: torch.Tensor) -> None:
    """``p.reshape(-1)[lo:hi] = values`` for a parameter in any memory layout: positions are
    the tensor's logical (row-major) order on every rank, which a ``channels_last`` or
    transposed parameter's storage is not, so such a parameter is written whole."""
    if p.is_contiguous():
        p.view(-1)[lo:hi].copy_(values)
        return
    if lo == 0 and hi == p.numel():
        p.copy_(values.view(p.shape))
        return
    whole = p.detach().reshape(-1).clone()
    whole[lo:hi] = values
    p.copy_(whole.view(p.shape))


def numpy_view(p) -> "Optional[np.ndarray]":
    """A flat numpy view of a contiguous CPU tensor of a dtype numpy has (it shares the
    tensor's memory), else None."""
    if p.device.type != "cpu" or p.dtype not in NUMPY_FLOATS or not p.is_contiguous():
        return None
    return p.detach().numpy().reshape(-1)


NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def all_finite(t: torch.Tensor) -> bool:
    """One vectorised read, no temporary: a sum is finite exactly when every entry is, short of
    the sum itself overflowing (entries summing past 3e38, which is taken as non-finite too).
    ``torch.isfinite(t).all()`` costs ~30x more on the CPU (a bool tensor, then a reduction).
    Half-precision tensors sum in float32: a float16 sum overflows past 65504, and 70,000
    gradient entries of 1.0 read as non-finite (AdamW's local step skipped every step)."""
    wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
    return bool(torch.isfinite(t.sum(dtype=wide)))
