"""Deterministic sum of the ranks' sparse contributions.

Within one payload indices are unique, so adding payloads one after another in rank order gives
the same bits on every rank and every backend; a single fused scatter-add over all ranks would
not (atomics on GPUs). The order is the rank order, never the order in which data arrived.
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision gradients are summed and kept in float32; others in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def aggregate(payloads: Union[Sequence, Mapping[int, object]], numel: int, dtype: torch.dtype,
              device) -> torch.Tensor:
    """Dense sum of ``payloads`` (a rank-ordered list, or a mapping rank -> payload)."""
    if isinstance(payloads, Mapping):
        payloads = [payloads[r] for r in sorted(payloads)]
    dense = torch.zeros(numel, dtype=dtype, device=device)
    for p in payloads:
        if p.indices.numel():
            dense.index_add_(0, p.indices.to(device), p.values.to(device=device, dtype=dtype))
    return dense
