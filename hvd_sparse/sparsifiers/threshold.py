"""Hard threshold (Sahu et al., NeurIPS'21, arXiv 2108.00951): send every |acc| >= lambda.

Sahu et al. show that, for a communication budget over the whole run, the sparsifier minimising
the *total error* (the sum over steps of the compression error ||acc_t - sent_t||^2) is a constant
hard threshold, not a constant k: it sends much when the accumulated gradient is large and
little (possibly nothing) when it is small. k therefore varies per step and per rank, including
zero; the wire and the aggregation handle empty payloads.

Choosing lambda from a target k: :func:`threshold_for_k`. Two rules are offered:
``"chebyshev"`` gives ``||x||_2 / sqrt(k)``, which by Chebyshev's inequality keeps at most k
entries of ``x`` (a safe, budget-respecting start); ``"sample"`` gives the k-th largest magnitude
of a sample gradient, which keeps exactly k on that sample. Either is computed once, from an
early error-compensated gradient, then held constant as the method requires.
"""
from __future__ import annotations

import torch

from .. import validate
from ..kernels import select as fused_select
from .base import Sparsifier, threshold_indices


def threshold_for_k(sample: torch.Tensor, k: int, rule: str = "sample") -> float:
    """A lambda that keeps about ``k`` entries of gradients like ``sample``."""
    x = sample.detach().reshape(-1).double()
    k = max(1, min(int(k), x.numel()))
    if rule == "chebyshev":
        return float(x.norm() / k ** 0.5)
    if rule == "sample":
        return float(torch.topk(x.abs(), k).values[-1])
    raise ValueError(f"rule must be 'sample' or 'chebyshev', got {rule!r}")


class HardThreshold(Sparsifier):
    """Select exactly the entries with ``|acc| >= threshold``; ``density`` is not used."""

    name = "threshold"
    elementwise = True

    def __init__(self, threshold: float):
        # finite: an infinite threshold selects nothing, ever (the bucket's mass piles up in
        # its residual unseen), which no one asks for on purpose
        self.threshold = validate.real("threshold", threshold, lo=0)
        # last step's count per (bucket, direction): room for the scan to collect candidates in
        # its one pass (a GPU scan told nothing counts first and collects in a second); speed
        # only, never the result, so it is not checkpointed
        self._last_count = {}

    def _floored(self) -> float:
        """The threshold, at least the smallest positive float32 (as every other method's):
        at 0, ``|acc| >= 0`` took every zero too, an (index, value) pair each, twice the dense
        bytes for nothing that moves a weight."""
        return max(self.threshold, float(fused_select.tiny()))

    def select(self, acc, density, ctx):
        return threshold_indices(acc, self._floored())

    def fused(self, ops, grad, residual, density, ctx):
        key = (ctx.bucket, ctx.direction)
        last = self._last_count.get(key)
        sel = fused_select.threshold(ops, grad, residual, self._floored(), watch=ctx.watch,
                                     expect=None if last is None else 2 * last + 1024)
        self._last_count[key] = sel.idx.numel()
        return sel

    def target_count(self, numel, density, ctx):
        return None

    def __repr__(self):
        return f"HardThreshold(threshold={self.threshold})"
