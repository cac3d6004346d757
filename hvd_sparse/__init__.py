"""hvd_sparse: sparse gradient exchange for Horovod, as a drop-in ``DistributedOptimizer``.

``import hvd_sparse as hvd`` is a one-line switch: the optimizer (and
``broadcast_optimizer_state``, which also carries hvd_sparse's replicated state) is hvd_sparse's,
and every other name a Horovod training script uses (``init``, ``rank``, ``size``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``Compression``, ``Average``, ``elastic``, ...) is Horovod's own,
looked up in ``horovod.torch`` on first use.
"""
from .broadcast import broadcast_optimizer_state
from .checkpoint import ShardedStateWarning, merge_rank_states
from .optimizer import DistributedOptimizer, is_sparse_optimizer
from .sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold, RandomK, SelectionContext,
                          SparseBinary, Sparsifier, TopK, make_sparsifier, threshold_for_k)

__version__ = "0.1.0"
__all__ = ["DistributedOptimizer", "Sparsifier", "SelectionContext", "TopK", "GaussianK",
           "HardThreshold", "AdaptiveTopK", "SparseBinary", "RandomK", "make_sparsifier",
           "threshold_for_k", "is_sparse_optimizer", "broadcast_optimizer_state",
           "merge_rank_states", "ShardedStateWarning"]


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        import horovod.torch as _hvd
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise AttributeError(
            f"hvd_sparse.{name} is Horovod's and Horovod is not installed ({exc})") from exc
    try:
        return getattr(_hvd, name)
    except AttributeError:
        raise AttributeError(f"module 'hvd_sparse' has no attribute {name!r}") from None


def __dir__():
    names = set(globals())
    try:
        import horovod.torch as _hvd
        names.update(n for n in dir(_hvd) if not n.startswith("_"))
    except ImportError:  # pragma: no cover
        pass
    return sorted(names)
