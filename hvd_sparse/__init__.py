"""hvd_sparse: sparse gradient exchange for Horovod, as a drop-in ``DistributedOptimizer``.

``import hvd_sparse as hvd`` is a one-line switch: the optimizer (and
``broadcast_optimizer_state``, which also carries hvd_sparse's replicated state) is hvd_sparse's,
and every other name a Horovod training script uses (``init``, ``rank``, ``size``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``Compression``, ``Average``, ``elastic``, ...) is Horovod's own,
looked up in ``horovod.torch`` on first use. ``init`` is Horovod's too, after one preparation
of the MPI environment (:mod:`hvd_sparse.core_sharing`).
"""
from . import core_sharing
from .state_broadcast import broadcast_optimizer_state
from .checkpoint import ShardedStateWarning, merge_rank_states
from .optimizer import DistributedOptimizer, is_sparse_optimizer
from .sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold, RandomK, SelectionContext,
                          SparseBinary, Sparsifier, TopK, make_sparsifier, threshold_for_k)

__version__ = "0.1.0"
__all__ = ["init", "DistributedOptimizer", "Sparsifier", "SelectionContext", "TopK", "GaussianK",
           "HardThreshold", "AdaptiveTopK", "SparseBinary", "RandomK", "make_sparsifier",
           "threshold_for_k", "is_sparse_optimizer", "broadcast_optimizer_state",
           "merge_rank_states", "ShardedStateWarning"]


def init(*args, **kwargs):
    """Horovod's ``init`` (same arguments). Before it starts MPI: where this node's ranks share
    its cores, Open MPI is asked to yield while idle, so Horovod's background loop does not
    spin on a core the training thread needs (:mod:`hvd_sparse.core_sharing`)."""
    try:
        import horovod.torch as _hvd
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(f"hvd_sparse.init is Horovod's and Horovod is not installed ({exc}); "
                          "without Horovod use hvd_sparse.mpi") from exc
    core_sharing.prepare(waiting_threads=2)
    return _hvd.init(*args, **kwargs)


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
