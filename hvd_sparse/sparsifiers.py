"""Which entries of a flat, error-compensated gradient to send.

A sparsifier is a pure function of one flat tensor: no communication and no state that differs
between ranks unless the algorithm itself needs it. It returns the selected positions as int64,
sorted ascending, so payloads are canonical (and delta/Golomb coding can use them later).
"""
from __future__ import annotations

import math

import torch

__all__ = ["Sparsifier", "TopK", "k_for_density", "topk_indices", "make_sparsifier", "SPARSIFIERS"]


def k_for_density(numel: int, density: float) -> int:
    """Entries kept for a given density: ceil(density * n), at least one, at most n.

    Depends only on (numel, density), so every rank derives the same k for the same bucket.
    """
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel)))


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact Top-K by magnitude with ties broken by lowest index; indices sorted ascending.

    ``torch.topk`` alone does not define which of several equal magnitudes it keeps, which would
    let replicas choose differently. Here the k-th largest magnitude ``t`` is found first, then
    every entry above ``t`` is kept together with the lowest-index entries equal to ``t``: the
    result is a function of the values only.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device, dtype=torch.int64)
    if k <= 0:
        return torch.empty(0, device=x.device, dtype=torch.int64)
    mag = x.abs()
    t = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > t).squeeze(1)
    missing = k - above.numel()
    if missing > 0:
        ties = torch.nonzero(mag == t).squeeze(1)[:missing]
        above = torch.cat([above, ties])
    return torch.sort(above).values


class Sparsifier:
    """Base class: subclass and implement :meth:`select` to plug in a new method."""

    name = "base"

    def select(self, acc: torch.Tensor, density: float) -> torch.Tensor:
        """Return int64 positions (ascending, unique) of the entries of ``acc`` to send."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Algorithm state that must survive a checkpoint (none for stateless methods)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TopK(Sparsifier):
    """Exact Top-K by magnitude at the requested density (Aji & Heafield; Lin et al. DGC)."""

    name = "topk"

    def select(self, acc: torch.Tensor, density: float) -> torch.Tensor:
        return topk_indices(acc, k_for_density(acc.numel(), density))


SPARSIFIERS = {"topk": TopK}


def make_sparsifier(spec) -> Sparsifier:
    """Turn the ``sparsifier=`` keyword (a name or an instance) into a Sparsifier."""
    if isinstance(spec, Sparsifier):
        return spec
    if isinstance(spec, str) and spec.lower() in SPARSIFIERS:
        return SPARSIFIERS[spec.lower()]()
    raise ValueError(
        f"sparsifier={spec!r} is not known; choose one of {sorted(SPARSIFIERS)} "
        "or pass an instance of hvd_sparse.Sparsifier")
