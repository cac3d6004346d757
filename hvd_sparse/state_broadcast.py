"""``broadcast_optimizer_state`` for Horovod jobs that also carries hvd_sparse's replicated state.

Horovod's own function (which ``hvd_sparse`` optimizers support as they are) copies the base
optimizer's state and hyper-parameters from the root. hvd_sparse's replicated state (downlink
residuals, counters, adaptive state) is brought into line at the next exchange anyway when the
job has just started, loaded a state dict, or changed size (:mod:`hvd_sparse.engine.agreement`).
This version also covers a broadcast in the middle of a run, with the chosen root.
"""
from __future__ import annotations

import warnings

from .checkpoint import ShardedStateWarning


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, **kwargs):
    """Horovod's ``broadcast_optimizer_state``; for an hvd_sparse optimizer, also take the
    root's replicated state before the next exchange. Call it on every rank."""
    import horovod.torch as hvd

    with warnings.catch_warnings():  # the state dict it reads is not a checkpoint
        warnings.simplefilter("ignore", ShardedStateWarning)
        hvd.broadcast_optimizer_state(optimizer, root_rank, model=model, **kwargs)
    engine = getattr(optimizer, "_hs_engine", None)
    if engine is not None:
        engine.request_agreement(root_rank)
