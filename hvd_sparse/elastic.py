"""Horovod's ``horovod.torch.elastic`` under hvd_sparse's name, so that an elastic script runs
with ``horovod.torch`` replaced by ``hvd_sparse`` in its imports too
(``from hvd_sparse.elastic import TorchState, run, ElasticSampler``), not only as
``hvd.elastic`` after ``import hvd_sparse as hvd``. Everything here is Horovod's own:
``TorchState`` keeps and restores an hvd_sparse optimizer's state through its
``state_dict``, residuals included (docs/robustness.md).
"""
try:
    import horovod.torch.elastic as _horovod_elastic
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"hvd_sparse.elastic is Horovod's and Horovod is not installed ({exc})"
                      ) from exc

from horovod.torch.elastic import (  # noqa: F401 - Horovod's names, re-exported
    ElasticSampler, TorchState, init, run, run_fn, sampler, shutdown, state)

__all__ = ["ElasticSampler", "TorchState", "init", "run", "run_fn", "sampler", "shutdown",
           "state"]


def __getattr__(name):
    if name.startswith("__"):  # not Horovod's __path__: this is a module, not its package
        raise AttributeError(name)
    return getattr(_horovod_elastic, name)
