"""hvd_sparse: sparse gradient exchange for Horovod, as a drop-in ``DistributedOptimizer``.

``import hvd_sparse as hvd`` is a one-line switch: the optimizer, ``broadcast_optimizer_state``
(which also carries hvd_sparse's replicated state) and ``broadcast_parameters`` (Horovod's, for
tensors of any memory layout) are hvd_sparse's, and every other name a Horovod training script
uses (``init``, ``rank``, ``size``, ``Compression``, ``Average``, ``elastic``, ...) is Horovod's own,
looked up in ``horovod.torch`` on first use. ``init`` is Horovod's too, after one preparation
of the MPI environment (:mod:`hvd_sparse.core_sharing`), and so is ``join``, behind a check
that no sparse bucket needs the joined rank (:func:`join`).
"""
from . import core_sharing
from .state_broadcast import broadcast_optimizer_state, broadcast_parameters
from .checkpoint import ShardedStateWarning, merge_rank_states
from .optimizer import DistributedOptimizer, is_sparse_optimizer
from .sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold, RandomK, SelectionContext,
                          SparseBinary, Sparsifier, TopK, make_sparsifier, threshold_for_k)

__version__ = "0.1.0"
__all__ = ["init", "join", "DistributedOptimizer", "Sparsifier", "SelectionContext", "TopK", "GaussianK",
           "HardThreshold", "AdaptiveTopK", "SparseBinary", "RandomK", "make_sparsifier",
           "threshold_for_k", "is_sparse_optimizer", "broadcast_optimizer_state",
           "broadcast_parameters",
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


def join(device=-1):
    """Horovod's ``join`` (same argument, same return), refused with a clear error while an
    hvd_sparse optimizer would exchange a bucket other than by allreduce: a joined rank stands
    in for other ranks' allreduces with zeros, but not for the allgather of sparse payloads
    (Horovod's background loop then fails or hangs). Uneven data with sparse buckets: give
    every rank the same number of steps (drop or repeat the last batches). Where every bucket
    is allreduced (dense by the cost model, or no sparse bucket) it is Horovod's join."""
    from .optimizer import join_blockers

    blocked, gathers = join_blockers()
    if blocked:
        names = ", ".join(blocked[:3]) + (f" and {len(blocked) - 3} more" if len(blocked) > 3
                                          else "")
        hint = ("; at 3 or more ranks deterministic_dense=True (the default) also gathers the "
                "dense buckets: with deterministic_dense=False they are Horovod's allreduce"
                if gathers else "")
        raise RuntimeError(
            f"hvd.join() cannot serve hvd_sparse's exchange (buckets {names} go by allgather, "
            "which a joined rank cannot stand in for; Horovod would fail or hang), and it is "
            "refused even where every rank has the same number of batches (a rank cannot "
            "tell that from here without a collective that could hang): there it is not "
            "needed, so drop it or call hvd.barrier(); with uneven data give every rank the "
            "same number of steps (drop or repeat the last batches)" + hint)
    import horovod.torch as _hvd

    from .optimizer import after_join

    last = _hvd.join(device)
    after_join()  # the ranks that joined early skipped steps: their counters catch up
    return last


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
