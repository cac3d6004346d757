"""Exact Top-K (Aji & Heafield 2017; Lin et al., DGC 2018): the k largest magnitudes."""
from ..kernels import select as fused_select
from . import layer_floor
from .base import Sparsifier, k_for_density, topk_indices


class TopK(Sparsifier):
    """Exact Top-K by magnitude at the requested density, ties by lowest index; in a bucket of
    several tensors with ``layer_floor`` set, each tensor keeps a share of its own Top-K first
    (:mod:`~hvd_sparse.sparsifiers.layer_floor`)."""

    name = "topk"
    supports_layer_floor = True

    def select(self, acc, density, ctx):
        if ctx.floored:
            return layer_floor.select(acc.abs(), density, ctx.segments, ctx.layer_floor)
        return topk_indices(acc, k_for_density(acc.numel(), density))

    def fused(self, ops, grad, residual, density, ctx):
        if ctx.floored:
            return fused_select.topk_floored(ops, grad, residual, density, ctx.segments,
                                             ctx.layer_floor)
        return fused_select.topk(ops, grad, residual, k_for_density(residual.numel(), density),
                                 watch=ctx.watch)

    def target_count(self, numel, density, ctx):
        if ctx.floored:
            return layer_floor.budget(numel, ctx.segments, density, ctx.layer_floor)
        return k_for_density(numel, density)
