"""Exact Top-K (Aji & Heafield 2017; Lin et al., DGC 2018): the k largest magnitudes."""
from ..kernels import select as fused_select
from .base import Sparsifier, k_for_density, topk_indices


class TopK(Sparsifier):
    """Exact Top-K by magnitude at the requested density, ties by lowest index."""

    name = "topk"

    def select(self, acc, density, ctx):
        return topk_indices(acc, k_for_density(acc.numel(), density))

    def fused(self, ops, grad, residual, density, ctx):
        return fused_select.topk(ops, grad, residual, k_for_density(residual.numel(), density),
                                 watch=ctx.watch)
