"""Horovod's training API over ``torch.distributed``: ``import hvd_sparse.torchdist as hvd``
under ``torchrun``, with neither Horovod nor mpi4py.

What a data-parallel script calls around its optimizer, with Horovod's names and meanings:
``init`` (starts the process group from torchrun's environment unless one is up: NCCL where
CUDA is, else gloo), ``rank``, ``size``, ``local_rank``, ``local_size``, ``cross_rank``,
``cross_size``, ``broadcast_parameters``, ``broadcast_optimizer_state`` (hvd_sparse's
replicated state too), ``broadcast_object``, ``allgather_object``, ``allreduce`` (``Average``
or ``Sum``), ``shutdown``, and a ``DistributedOptimizer`` over
:class:`hvd_sparse.torch_transport.TorchDistributedTransport`. Like MPI, torch.distributed
matches collectives by call order: every rank must call them in the same order.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .compat import Average, Compression, Sum  # noqa: F401 - Horovod's names, Compression too
from .optimizer import DistributedOptimizer as _DistributedOptimizer
from .state_broadcast import broadcast_state_as_object
from .torch_transport import TorchDistributedTransport


def init(backend=None, **kwargs):
    """Start the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...) unless one is up; ``backend``: NCCL where CUDA is, else gloo. Under
    NCCL each process takes GPU ``local_rank()`` as Horovod's examples do by hand."""
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
                else "gloo"
        dist.init_process_group(backend, **kwargs)
    if "nccl" in str(dist.get_backend()).lower():
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group():
    if not is_initialized():
        raise ValueError("hvd_sparse.torchdist has not been initialized: call "
                         "hvd_sparse.torchdist.init() first (under torchrun)")
    return None


def shutdown():
    if is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    _group()
    return dist.get_rank()


def size() -> int:
    _group()
    return dist.get_world_size()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def cross_rank() -> int:
    return int(os.environ.get("GROUP_RANK", rank() // max(local_size(), 1)))


def cross_size() -> int:
    return max(size() // max(local_size(), 1), 1)


def _device():
    """Where the backend takes tensors: the current GPU for NCCL, else the host."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj, root_rank=0, name=None):
    """``obj`` as rank ``root_rank`` has it, on every rank (pickled)."""
    _group()
    box = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, device=_device())
    return box[0]


def allgather_object(obj, name=None) -> list:
    """Every rank's ``obj``, in rank order."""
    _group()
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0):
    """Horovod's ``allreduce`` of a float tensor (``Average`` unless ``op=Sum`` or
    ``average=False``): a new tensor, on the input's device."""
    _group()
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum):
        raise ValueError("hvd_sparse.torchdist.allreduce takes op=Average or op=Sum")
    if not tensor.dtype.is_floating_point:
        raise TypeError("hvd_sparse.torchdist.allreduce takes floating-point tensors")
    t = TorchDistributedTransport()
    out = t.wait(t.allreduce_async(tensor, name or "allreduce", average=op == Average,
                                   prescale=prescale_factor, postscale=postscale_factor))
    return out.view(tensor.shape)


def broadcast_parameters(params, root_rank=0):
    """Copy rank ``root_rank``'s tensors to every rank, in place: a dict (a state_dict, taken
    in sorted key order) or a list of tensors or of (name, tensor) pairs, in its order."""
    _group()
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    where = _device()
    with torch.no_grad():
        for _, p in items:
            if not isinstance(p, torch.Tensor):
                continue
            buf = p.detach()
            staged = buf if buf.device == where and buf.is_contiguous() else \
                buf.to(where).contiguous()
            dist.broadcast(staged, src=root_rank)
            if staged is not buf:
                buf.copy_(staged)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyper-parameters; for an
    hvd_sparse optimizer, also its replicated state (downlink residuals, counters), taken before
    the next exchange. Each rank keeps its own uplink residuals. Call it on every rank."""
    broadcast_state_as_object(optimizer, root_rank, broadcast_object)


def DistributedOptimizer(optimizer, named_parameters=None, *args, **kwargs):
    """:func:`hvd_sparse.DistributedOptimizer` over torch.distributed (see its documentation;
    Horovod's arguments may come by position, as there)."""
    _group()
    kwargs.setdefault("transport", TorchDistributedTransport())
    return _DistributedOptimizer(optimizer, named_parameters, *args, **kwargs)
