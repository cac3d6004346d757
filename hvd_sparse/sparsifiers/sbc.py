"""Sparse Binary Compression (Sattler et al., arXiv 1805.08768).

Per bucket: take the k largest positive and the k largest negative entries (a side with fewer
than k entries of its sign takes all of them; zeros are never sent), keep the side whose
mean magnitude is larger, and send only its positions plus that one mean (with its sign). The
positions go Golomb-Rice coded (``hvd_sparse.golomb``), which brings a position down to about
11.4 bits at 0.1% density; the values cost 32 bits per bucket in total. What the binarisation
changes (entry minus the mean) stays in the error-feedback residual.
"""
from __future__ import annotations

import torch

from ..kernels import select as fused_select
from .base import Sparsifier, k_for_density, topk_of


class SparseBinary(Sparsifier):
    name = "sbc"
    constant_value = True

    def select(self, acc, density, ctx):
        return self.compress(acc, density, ctx)[0]

    def compress(self, acc, density, ctx):
        k = k_for_density(acc.numel(), density)
        pos, neg = _side(acc, k), _side(-acc, k)
        mean_pos = fused_select.binary_mean(acc[pos])
        mean_neg = -fused_select.binary_mean(acc[neg])
        if mean_pos >= mean_neg:
            idx, mean = pos, mean_pos
        else:
            idx, mean = neg, -mean_neg
        return idx, torch.full((idx.numel(),), mean, dtype=acc.dtype, device=acc.device)

    def fused(self, ops, grad, residual, density, ctx):
        return fused_select.sbc(ops, grad, residual, k_for_density(residual.numel(), density),
                                watch=ctx.watch)


def _side(score, k):
    """The k largest positive entries of ``score`` (ties by lowest index), or every positive
    one when there are at most k: filling up with zeros would send the mean where nothing
    was."""
    above = score > 0
    if int(above.sum()) <= k:
        return torch.nonzero(above).squeeze(1)
    return topk_of(score.clamp(min=0), k)
