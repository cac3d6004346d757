"""The plain torch fused step every fast kernel is tested against.

``residual`` is updated in place: it becomes ``grad + residual`` and then holds zeros where
entries were selected (their values are returned). Top-K ties break by lowest index.
"""
from __future__ import annotations

import torch

from ..sparsifiers.base import topk_indices


def fused_topk(grad: torch.Tensor, residual: torch.Tensor, k: int):
    residual.add_(grad)
    idx = topk_indices(residual, k)
    vals = residual[idx].clone()
    residual[idx] = 0
    return idx, vals


def fused_threshold(grad: torch.Tensor, residual: torch.Tensor, threshold: float):
    residual.add_(grad)
    idx = torch.nonzero(residual.abs() >= threshold).squeeze(1)
    vals = residual[idx].clone()
    residual[idx] = 0
    return idx, vals
