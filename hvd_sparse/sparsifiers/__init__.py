"""Sparsifiers: which entries of a flat, error-compensated gradient to send.

Select one with ``DistributedOptimizer(..., sparsifier=NAME)`` or pass an instance; subclass
:class:`Sparsifier` to add a method.
"""
from __future__ import annotations

import inspect

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
#: other spellings of the names (compared without case, "_", "-" or spaces), as the papers and
#: other libraries write them
ALIASES = {"hardthreshold": "threshold", "adaptivetopk": "adaptive", "adaptivek": "adaptive",
           "sparsebinary": "sbc", "sparsebinarycompression": "sbc", "random": "randomk"}

__all__ = ["Sparsifier", "SelectionContext", "TopK", "GaussianK", "HardThreshold",
           "AdaptiveTopK", "SparseBinary", "RandomK", "SPARSIFIERS", "make_sparsifier", "canonical",
           "k_for_density", "topk_indices", "topk_of", "threshold_indices", "threshold_for_k"]


def canonical(name):
    """The registered name a spelling stands for (``"top_k"`` -> ``"topk"``,
    ``"Hard-Threshold"`` -> ``"threshold"``), or None."""
    if not isinstance(name, str):
        return None
    key = "".join(ch for ch in name.lower() if ch not in "_- ")
    key = ALIASES.get(key, key)
    return key if key in SPARSIFIERS else None


#: what each method's keyword options are for, for errors that name the right method
_OPTION_OWNERS = {"threshold": "threshold", "min_density": "adaptive", "max_density": "adaptive",
                  "gamma": "adaptive", "seed": "randomk", "slack": "gaussiank",
                  "max_passes": "gaussiank"}


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
    name = canonical(spec)
    if name is not None:
        cls = SPARSIFIERS[name]
        taken = inspect.signature(cls).parameters
        anything = any(v.kind is v.VAR_KEYWORD for v in taken.values())
        foreign = [] if anything else sorted(k for k in options if k not in taken)
        if foreign:
            owners = sorted({f"{k}= is for sparsifier={_OPTION_OWNERS[k]!r}"
                             for k in foreign if k in _OPTION_OWNERS})
            raise TypeError(f"sparsifier={spec!r} takes no option "
                            f"{', '.join(k + '=' for k in foreign)}"
                            + (f" ({'; '.join(owners)})" if owners else ""))
        missing = [k for k, v in taken.items() if v.default is v.empty
                   and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY) and k not in options]
        if missing:
            raise TypeError(f"sparsifier={spec!r} needs {', '.join(k + '=' for k in missing)}"
                            + (" (the magnitude from which entries are sent; "
                               "hvd_sparse.threshold_for_k(grad, k) gives one that sends about "
                               "k entries of vectors like grad; where weight updates are "
                               "exchanged (Adam's family by default), "
                               "give it a weight change)"
                               if missing == ["threshold"] else ""))
        return cls(**options)
    raise ValueError(
        f"sparsifier={spec!r} is not known; choose one of {sorted(SPARSIFIERS)} "
        "or pass an instance of hvd_sparse.Sparsifier")
