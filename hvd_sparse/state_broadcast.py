"""Horovod's two start-of-training broadcasts, for hvd_sparse jobs.

``broadcast_parameters`` is Horovod's, except that tensors Horovod's in-place broadcast refuses
(non-contiguous ones: a ``channels_last`` model's convolution weights, a transposed view; and
bfloat16 ones, sent as their int16 bits) go through a contiguous copy and come back in their own
layout, and any iterable of tensors or (name, tensor) pairs is taken (Horovod's takes a dict or
a list). ``broadcast_optimizer_state`` of such parameters or state (on any rank) sends the root's
state dict as one object instead, as the Horovod-free front ends do.

``broadcast_optimizer_state`` also carries hvd_sparse's replicated state.

Horovod's own function (which ``hvd_sparse`` optimizers support as they are) copies the base
optimizer's state and hyper-parameters from the root. hvd_sparse's replicated state (downlink
residuals, counters, adaptive state) is brought into line at the next exchange anyway when the
job has just started, loaded a state dict, or changed size (:mod:`hvd_sparse.engine.agreement`).
This version also covers a broadcast in the middle of a run, with the chosen root.
"""
from __future__ import annotations

import warnings

import torch

from . import compat
from .checkpoint import ShardedStateWarning


#: dtypes Horovod's broadcast refuses, sent as integers of the same width (their bits)
_AS_BITS = {torch.bfloat16: torch.int16}


def _refused(p) -> bool:
    return isinstance(p, torch.Tensor) and (not p.is_contiguous() or p.dtype in _AS_BITS)


def broadcast_parameters(params, root_rank, **kwargs):
    """Horovod's ``broadcast_parameters`` (same order, names and process set), for tensors of
    any memory layout, and bfloat16 ones (their bits go as int16)."""
    import horovod.torch as hvd

    if not isinstance(params, (dict, list)):
        params = compat.param_list(params)  # e.g. named_parameters(), a generator
    items = params.items() if isinstance(params, dict) else \
        [p if isinstance(p, tuple) else (None, p) for p in params]
    refused = [(n, p) for n, p in items if _refused(p)]
    if not refused:
        return hvd.broadcast_parameters(params, root_rank, **kwargs)
    copies = {}
    for _, p in refused:
        c = p.detach().contiguous()
        copies[id(p)] = c.view(_AS_BITS[c.dtype]) if c.dtype in _AS_BITS else c
    if isinstance(params, dict):
        stand_in = {k: copies.get(id(v), v) for k, v in params.items()}
    else:  # (None, tensor) is how Horovod takes a bare tensor itself
        stand_in = [(n, copies.get(id(p), p)) for n, p in items]
    hvd.broadcast_parameters(stand_in, root_rank, **kwargs)
    with torch.no_grad():
        for _, p in refused:
            p.copy_(copies[id(p)].view(p.dtype))


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, **kwargs):
    """Horovod's ``broadcast_optimizer_state``; for an hvd_sparse optimizer, also take the
    root's replicated state before the next exchange. Call it on every rank."""
    import horovod.torch as hvd

    where = {"process_set": kwargs["process_set"]} if "process_set" in kwargs else {}
    if _any_rank(hvd, _holds_refused(optimizer), where):  # Horovod's would fail on them
        return broadcast_state_as_object(
            optimizer, root_rank, lambda obj, root: hvd.broadcast_object(obj, root, **where))
    held = _parameters_before_initialising_step(optimizer)
    with warnings.catch_warnings():  # the state dict it reads is not a checkpoint
        warnings.simplefilter("ignore", ShardedStateWarning)
        hvd.broadcast_optimizer_state(optimizer, root_rank, model=model, **kwargs)
    with torch.no_grad():
        for p, before in held:
            p.copy_(before)
    if len(optimizer.state) == 0:  # (the same on every rank: the same optimizer class)
        _broadcast_options(optimizer, root_rank,
                           lambda obj, root: hvd.broadcast_object(obj, root, **where))
    engine = getattr(optimizer, "_hs_engine", None)
    if engine is not None:
        engine.request_agreement(root_rank)


def _broadcast_options(optimizer, root_rank, broadcast_object) -> None:
    """The root's hyper-parameters (every group's, all but its parameters) on every rank.
    Horovod's broadcast returns early for an optimizer that holds no state even after its
    initialising step (SGD without momentum), before it reaches the groups' options: each
    rank kept its own learning rate and the replicas drifted apart from the first step, where
    the Horovod-free front ends, which send the whole state dict, gave every rank the root's."""
    mine = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    root = broadcast_object(mine, root_rank)
    if len(root) != len(optimizer.param_groups):
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} has {len(root)} "
                         f"parameter groups, this rank {len(optimizer.param_groups)}")
    for group, options in zip(optimizer.param_groups, root):
        group.update(options)


def _parameters_before_initialising_step(optimizer) -> list:
    """Horovod's broadcast gives an optimizer without state one step on zero gradients to
    create it, after the parameters were broadcast; with weight decay (SGD's, AdamW's) or
    ASGD's averaging that step moves this rank's weights, and a rank resumed from a
    checkpoint, which takes no such step, kept the others' replicas apart for good. The
    parameters as they are, to be put back after it (none when there is state: no step)."""
    if len(optimizer.state) > 0:
        return []
    return [(p, p.detach().clone()) for group in optimizer.param_groups
            for p in group["params"] if p.requires_grad]


def _initialise_state(optimizer) -> None:
    """What Horovod's broadcast does to an optimizer without state, so that the front ends
    without Horovod give its numbers: one wrapped step on zero gradients creates the state
    (Adam's step count 1, zero moments; the root's, broadcast next, then replaces it where the
    root has state), the parameters put back as they were (see
    :func:`_parameters_before_initialising_step`)."""
    held = _parameters_before_initialising_step(optimizer)
    if not held or isinstance(optimizer, torch.optim.LBFGS):
        return
    for p, _ in held:
        p.grad = torch.zeros_like(p)
        if isinstance(optimizer, torch.optim.SparseAdam):
            p.grad = p.grad.to_sparse()
    base = getattr(optimizer, "_hs_base", None)  # the wrapped step: no exchange
    (base.step(optimizer) if base is not None else optimizer.step())
    with torch.no_grad():
        for p, before in held:
            p.copy_(before)


def _holds_refused(optimizer) -> bool:
    """Parameters or state Horovod's in-place broadcast refuses: bfloat16, or a memory layout
    other than row-major (a ``channels_last`` or transposed parameter, whose moments torch
    creates in the same layout)?"""
    return any(_refused(p) for g in optimizer.param_groups for p in g["params"]) \
        or any(_refused(v) for st in optimizer.state.values() for v in st.values())


def _any_rank(hvd, mine: bool, where) -> bool:
    """``mine`` on some rank? One small allreduce, so that every rank takes the same path
    where only some hold state (a job resumed on the root alone)."""
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    return bool(hvd.allreduce(flag, op=hvd.Sum, name="hvd_sparse.state.path", **where).item())


def broadcast_state_as_object(optimizer, root_rank, broadcast_object):
    """``broadcast_optimizer_state`` for the Horovod-free front ends: the root's state dict,
    less the per-rank part, travels whole as one object (``broadcast_object``, the front
    end's), so a fresh optimizer needs no initialising step; the replicated state is taken
    before the next exchange. Each rank keeps its own uplink residuals."""
    _initialise_state(optimizer)
    with warnings.catch_warnings():  # the state dict read here is not a checkpoint
        warnings.simplefilter("ignore", ShardedStateWarning)
        sd = optimizer.state_dict()
    sd.pop("hvd_sparse", None)
    optimizer.load_state_dict(broadcast_object(sd, root_rank))
    engine = getattr(optimizer, "_hs_engine", None)
    if engine is not None:
        engine.request_agreement(root_rank)


class _IsSparseOptimizer(type):
    def __instancecheck__(cls, obj):
        from .optimizer import is_sparse_optimizer

        return is_sparse_optimizer(obj)


class _SparseOptimizers(metaclass=_IsSparseOptimizer):
    """``isinstance(x, _SparseOptimizers)``: is ``x`` an optimizer made by
    ``hvd_sparse.DistributedOptimizer``? (Its class is made per wrapped class, as Horovod's
    is, so there is no one class to name.) What Horovod's elastic handler registry matches."""


def register_elastic_sync() -> None:
    """Have Horovod's elastic ``TorchState.sync()`` bring an hvd_sparse optimizer into line
    with this module's ``broadcast_optimizer_state`` instead of Horovod's: a rank that joins
    fresh then keeps the weights just broadcast where the optimizer decays them (Horovod's
    initialising step on zero gradients moved them, and the replicas stayed apart), takes the
    root's hyper-parameters where the optimizer holds no state, and asks for the agreement of
    the replicated state. Through Horovod's own registry of state handlers (its extension
    point), ahead of its entry for every optimizer; once per process; nothing without Horovod."""
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:
        return
    registry = list(elastic_state.get_handler_registry())
    if any(kind is _SparseOptimizers for kind, _ in registry):
        return

    class SparseOptimizerStateHandler(elastic_state.OptimizerStateHandler):
        def sync(self):
            broadcast_optimizer_state(self.value, root_rank=0)

    elastic_state.set_handler_registry([(_SparseOptimizers, SparseOptimizerStateHandler)]
                                       + registry)
