"""GaussianK (Shi et al., arXiv 1911.08772): a Top-K threshold read off a normal fit.

Sorting or a selection network over the whole gradient is what makes exact Top-K slow on GPUs.
GaussianK instead assumes the error-compensated gradient is roughly normal, N(mu, sigma^2),
and takes the threshold whose two-sided tail holds the target fraction ``rho``:
``t = |mu| + sigma * Phi^-1(1 - rho / 2)``. Here mu and sigma come from a fixed sample of the
vector (blocks of 64 entries, up to 65,536 entries; the whole vector when it is short), so
the fit costs no pass over the data. Real gradients have heavier tails than a normal, so the
count at ``t`` is checked and ``t`` corrected, a bounded number of times, until the count lies in
``[k / slack, k * slack]``. Each check is one read-only scan and one host read (the count).

Correction rule. Error feedback piles residual entries up just under the last step's
threshold, a wall of values that no normal fit follows, so the first correction takes the
threshold that k/n of the same fixed sample reach (its empirical quantile: no extra pass); a
later one interpolates ``log(count)`` linearly in ``t`` between the scans that bracket k (tail
counts fall about exponentially). Without a usable sample quantile, ``t`` is rescaled by
``z(k/n) / z(c/n)`` (the normal model's own correction, exact on normal data). On the engine
benchmark's residual this takes GaussianK from three scans and an exact fallback per direction
to two scans. If the passes run out with the count still outside the band, an exact Top-K over
the candidates (too many) or over the whole vector (too few) makes the result land inside it:
the band is a guarantee.
"""
from __future__ import annotations

import math

from ..kernels import reference
from ..kernels import select as fused_select
from .. import validate
from .base import Sparsifier, k_for_density


class GaussianK(Sparsifier):
    name = "gaussiank"

    def __init__(self, slack: float = 2.0, max_passes: int = 3):
        self.slack = validate.real("slack", slack, 1.0)
        self.max_passes = validate.whole("max_passes", max_passes, 1)
        self.last_passes = 0
        self.last_fallback = False

    def bounds(self, k: int):
        """The accepted count band for a target k."""
        return max(1, math.ceil(k / self.slack)), max(1, int(k * self.slack))

    def _run(self, ops, grad, residual, density, watch=None):
        k = k_for_density(residual.numel(), density)
        lo, hi = self.bounds(k)
        sel = fused_select.gaussiank(ops, grad, residual, k, lo, hi, self.max_passes,
                                     watch=watch)
        self.last_passes, self.last_fallback = sel.passes, sel.fallback
        return sel

    def select(self, acc, density, ctx):
        return self._run(reference, None, acc, density).idx

    def fused(self, ops, grad, residual, density, ctx):
        return self._run(ops, grad, residual, density, ctx.watch)

    def __repr__(self):
        return f"GaussianK(slack={self.slack}, max_passes={self.max_passes})"
