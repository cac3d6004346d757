"""Sparsifiers: which entries of a flat, error-compensated gradient to send.

Select one with ``DistributedOptimizer(..., sparsifier=NAME)`` or pass an instance; subclass
:class:`Sparsifier` to add a method.
"""
from __future__ import annotations

from .adaptive import AdaptiveTopK
from .base import (SelectionContext, Sparsifier, k_for_density, threshold_indices, topk_indices,
                   topk_of)
from .gaussiank import GaussianK
from .randomk import RandomK
from .sbc import SparseBinary
from .threshold import HardThreshold, threshold_for_k
from .topk import TopK

SPARSIFIERS = {"topk": TopK, "gaussiank": GaussianK, "threshold": HardThreshold,
               "adaptive": AdaptiveTopK, "sbc": SparseBinary, "randomk": RandomK}

__all__ = ["Sparsifier", "SelectionContext", "TopK", "GaussianK", "HardThreshold",
           "AdaptiveTopK", "SparseBinary", "RandomK", "SPARSIFIERS", "make_sparsifier",
           "k_for_density", "topk_indices", "topk_of", "threshold_indices", "threshold_for_k"]


def make_sparsifier(spec, **options) -> Sparsifier:
    """Turn the ``sparsifier=`` keyword (a name or an instance) into a Sparsifier.

    ``options`` are the method's own keywords (``threshold=`` for ``"threshold"``,
    ``total_steps=``/``min_density=``/``max_density=``/``gamma=`` for ``"adaptive"``, ``seed=`` for
    ``"randomk"``, ``slack=``/``max_passes=`` for ``"gaussiank"``).
    """
    if isinstance(spec, Sparsifier):
        if options:
            raise TypeError(f"sparsifier options {sorted(options)} given with an instance; "
                            "configure the instance instead")
        return spec
    if isinstance(spec, str) and spec.lower() in SPARSIFIERS:
        cls = SPARSIFIERS[spec.lower()]
        try:
            return cls(**options)
        except TypeError as e:
            raise TypeError(f"sparsifier={spec!r}: {e}") from None
    raise ValueError(
        f"sparsifier={spec!r} is not known; choose one of {sorted(SPARSIFIERS)} "
        "or pass an instance of hvd_sparse.Sparsifier")
