"""GaussianK (Shi et al., arXiv 1911.08772): a Top-K threshold read off a normal fit.

Sorting or a selection network over the whole gradient is what makes exact Top-K slow on GPUs.
GaussianK instead assumes the error-compensated gradient is roughly normal, N(mu, sigma^2),
and takes the threshold whose two-sided tail holds the target fraction ``rho``:
``t = |mu| + sigma * Phi^-1(1 - rho / 2)``. Real gradients have heavier tails than a normal, so the
count at ``t`` is checked and ``t`` corrected, a bounded number of times, until the count lies in
``[k / slack, k * slack]``. Each pass costs one reduction and one host read (the count).

Correction rule: at the current threshold the observed tail fraction is ``c / n``; the normal
model maps a fraction to a quantile, so ``t`` is rescaled by ``z(k/n) / z(c/n)``, which moves it
toward the target from either side and converges in one step on normal data. If the passes run
out with the count still outside the band, an exact Top-K over the candidates (too many) or over
the whole vector (too few) makes the result land inside it: the band is a guarantee.
"""
from __future__ import annotations

import torch

from .base import Sparsifier, k_for_density, topk_of


def _tail_quantile(frac: float) -> float:
    """z with P(|N(0,1)| >= z) = frac."""
    frac = min(max(frac, 1e-12), 1.0)
    return float(torch.special.ndtri(torch.tensor(1.0 - frac / 2.0, dtype=torch.float64)))


class GaussianK(Sparsifier):
    name = "gaussiank"

    def __init__(self, slack: float = 2.0, max_passes: int = 3):
        if slack < 1.0:
            raise ValueError(f"slack must be >= 1, got {slack}")
        if max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {max_passes}")
        self.slack = float(slack)
        self.max_passes = int(max_passes)
        self.last_passes = 0
        self.last_fallback = False

    def bounds(self, k: int):
        """The accepted count band for a target k."""
        return max(1, int(k / self.slack)), max(1, int(k * self.slack))

    def select(self, acc, density, ctx):
        n = acc.numel()
        k = k_for_density(n, density)
        if k >= n:
            return torch.arange(n, device=acc.device)
        lo, hi = self.bounds(k)
        mag = acc.abs()
        std, mean = torch.std_mean(acc.float())
        z_target = _tail_quantile(k / n)
        t = mean.abs() + std * z_target
        count = 0
        self.last_fallback = False
        for p in range(1, self.max_passes + 1):
            self.last_passes = p
            count = int((mag >= t).sum())  # the one host read of this pass
            if lo <= count <= hi:
                return torch.nonzero(mag >= t).squeeze(1)
            if count == 0:
                t = t * 0.5
                continue
            z_seen = _tail_quantile(count / n)
            if z_seen <= 0 or float(t) == 0.0:  # (nearly) every entry at or above t, e.g. an
                break                           # all-zero or constant vector: exact Top-K below
            t = t * (z_target / z_seen)
        self.last_fallback = True
        if count > hi:  # too many: keep the k largest of the candidates
            cand = torch.nonzero(mag >= t).squeeze(1)
            return torch.sort(cand[topk_of(mag[cand], k)]).values
        return topk_of(mag, k)  # too few even after correction: exact Top-K

    def __repr__(self):
        return f"GaussianK(slack={self.slack}, max_passes={self.max_passes})"
