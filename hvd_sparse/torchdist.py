"""Horovod's training API over ``torch.distributed``: ``import hvd_sparse.torchdist as hvd``
under ``torchrun``, with neither Horovod nor mpi4py.

What a data-parallel script calls around its optimizer, with Horovod's names and meanings:
``init`` (starts the process group from torchrun's environment unless one is up: NCCL where
CUDA is, else gloo), ``rank``, ``size``, ``local_rank``, ``local_size``, ``cross_rank``,
``cross_size``, ``broadcast_parameters``, ``broadcast_optimizer_state`` (hvd_sparse's
replicated state too), ``broadcast_object``, ``allgather_object``, ``allreduce``/``allreduce_``
(``Average``, ``Sum``, ``Min``, ``Max``, ``Product``; integers too; differentiable),
``allgather`` (uneven first dimensions; differentiable), ``broadcast``/``broadcast_``,
``shutdown``, and a ``DistributedOptimizer`` over
:class:`hvd_sparse.torch_transport.TorchDistributedTransport`. Like MPI, torch.distributed
matches collectives by call order: every rank must call them in the same order.
"""
from __future__ import annotations

import hashlib
import math
import os

import torch
import torch.distributed as dist

from .compat import Average, Compression, Sum  # noqa: F401 - Horovod's names, Compression too
from . import compat
from .mpi_collectives import Max, Min, Product  # noqa: F401 - Horovod's values
from .mpi_collectives import finish_reduction, prescaled
from .mpi_guard import HorovodInternalError, check_root, missing_name, named, pickled, unpickled
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
    """Destroy the process group. Call :func:`barrier` first when the ranks end together: gloo
    torn down on one rank while another's last collective drains can abort that process."""
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


def _check_root(root_rank) -> int:
    return check_root(root_rank, size())


def barrier(process_set=None):
    """Every rank waits for all the others (Horovod's ``barrier``)."""
    _group()
    _global_only(process_set)
    dist.barrier()


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """``obj`` as rank ``root_rank`` has it, on every rank (cloudpickled where it is installed,
    as Horovod's; an object the root cannot pickle raises on every rank, not on the root
    alone while the others wait)."""
    _group()
    _global_only(process_set)
    root_rank = _check_root(root_rank)
    box = [pickled(obj) if rank() == root_rank else b""]
    dist.broadcast_object_list(box, src=root_rank, device=_device())  # (bytes: plain pickle)
    if rank() == root_rank and box[0][:1] == b"o":
        return obj
    return unpickled(box, "broadcast_object", first=root_rank)[0]


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's ``obj``, in rank order (cloudpickled where it is installed)."""
    _group()
    _global_only(process_set)
    out = [None] * size()
    dist.all_gather_object(out, pickled(obj))  # (bytes: plain pickle carries them)
    return unpickled(out, "allgather_object")


def _agree(what: str, **fields) -> None:
    """Horovod's check that every rank starts the same collective with the same dtype, shape
    and op: a digest of this rank's description through one small all-gather, and where they
    differ the descriptions themselves, so that every rank raises
    :class:`HorovodInternalError` naming them (torch.distributed moves bytes: another shape
    returned garbage or hung, another dtype was reinterpreted)."""
    if size() == 1:
        return
    mine = repr((what, sorted(fields.items()))).encode()
    digest = torch.frombuffer(bytearray(hashlib.sha256(mine).digest()), dtype=torch.uint8)
    where = _device()
    everyone = [torch.empty(32, dtype=torch.uint8, device=where) for _ in range(size())]
    dist.all_gather(everyone, digest.to(where))
    if all(bool(torch.equal(e.cpu(), digest)) for e in everyone):
        return
    texts = [None] * size()
    dist.all_gather_object(texts, mine.decode(errors="replace"))
    raise HorovodInternalError(
        f"Mismatched {what}: ranks started it differently - "
        + "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
        + " (every rank must pass tensors of the same dtype and shape, the same op and root, "
          "in the same order)")


class _Allreduce(torch.autograd.Function):
    """Differentiable as Horovod's: the gradient is reduced the same way (Average, Sum)."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.args = (op, prescale, postscale)
        return _reduce(tensor.detach(), op, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        return _Allreduce.apply(grad, *ctx.args), None, None, None


def _reduce(tensor, op, prescale, postscale):
    """Floats under Average/Sum through the transport (its float32 widening of half types);
    everything else with the backend's own op on a copy, integers scaled, averaged and
    truncated toward zero as Horovod's."""
    if tensor.dtype.is_floating_point and op in (Average, Sum):
        t = TorchDistributedTransport()
        out = t.wait(t.allreduce_async(tensor, "allreduce", average=op == Average,
                                       prescale=prescale, postscale=postscale))
        return out.view(tensor.shape)
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise TypeError(f"hvd_sparse.torchdist.allreduce does not reduce {tensor.dtype}")
    work = prescaled(tensor.detach().to(_device(), copy=True).contiguous(), prescale)
    reduce_op = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
                 Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(work, op=reduce_op)
    return finish_reduction(work, tensor, op, postscale, size()).view(tensor.shape)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Horovod's ``allreduce``, with its signature: a new tensor on the input's device,
    reduced with ``op`` (``Average`` unless ``average=False``; ``Sum``, ``Min``, ``Max``,
    ``Product``), integers too (their average truncated as Horovod's), differentiable for
    Average and Sum. ``compression`` (``Compression.fp16``) is applied as Horovod applies it:
    the tensor is compressed, reduced in the narrow type and decompressed."""
    _group()
    _global_only(process_set)
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of "
                         "them.")
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"op={op!r}: hvd_sparse.torchdist reduces with Average, Sum, Min, "
                         "Max or Product")
    _agree("allreduce", dtype=str(tensor.dtype), shape=tuple(tensor.shape), op=str(op),
           prescale=float(prescale_factor), postscale=float(postscale_factor), **named(name))
    packed, ctx = (compression or Compression.none).compress(tensor)
    if packed.requires_grad and op in (Average, Sum) and torch.is_grad_enabled():
        out = _Allreduce.apply(packed, op, prescale_factor, postscale_factor)
    else:
        out = _reduce(packed, op, prescale_factor, postscale_factor)
    return (compression or Compression.none).decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In place: ``tensor`` holds the reduction."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor.detach(), average, name, op=op,
                               prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set))
    return tensor


class _Allgather(torch.autograd.Function):
    """Differentiable as Horovod's: each rank's gradient is the average over ranks of the
    gradient's rows that came from it (Horovod's ``HorovodAllgather.backward``)."""

    @staticmethod
    def forward(ctx, tensor):
        out, ctx.rows = _gather(tensor.detach())
        return out

    @staticmethod
    def backward(ctx, grad):
        summed = _reduce(grad.contiguous(), Average, 1.0, 1.0)
        lo = sum(ctx.rows[:rank()])
        return summed[lo:lo + ctx.rows[rank()]]


def _gather(tensor):
    """Every rank's ``tensor`` concatenated along the first dimension (rows may differ), by
    the transport's byte all-gather (sizes first, padded, cut again), and each rank's row
    count, read from those sizes: the same collectives on every rank whether or not its
    tensor requires grad (an extra gather of the counts on some ranks only had the others
    read its bytes as their tensor's)."""
    trailing = tuple(tensor.shape[1:])
    row_bytes = tensor.element_size() * math.prod(trailing)
    if row_bytes == 0:  # rows of no bytes (the trailing shape is agreed: on every rank)
        rows = allgather_object(tensor.shape[0] if tensor.dim() else 1)
        return tensor.new_empty((sum(rows),) + trailing), rows
    t = TorchDistributedTransport()
    mine = tensor.contiguous().reshape(-1).view(torch.uint8)
    handle = t.allgather_async(mine, "allgather")
    counts = handle[2][1]  # (the transport's record of every rank's byte count)
    out = t.wait(handle)
    return out.view(tensor.dtype).reshape((-1,) + trailing), [c // row_bytes for c in counts]


def allgather(tensor, name=None, process_set=None):
    """Horovod's ``allgather``: every rank's tensor concatenated along the first dimension, in
    rank order (first dimensions may differ; the others must not); differentiable."""
    _group()
    _global_only(process_set)
    _agree("allgather", dtype=str(tensor.dtype), dims=tensor.dim(),
           trailing_shape=tuple(tensor.shape[1:]), **named(name))
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor)
    return _gather(tensor)[0]


def broadcast_(tensor, root_rank=0, name=None, process_set=None):
    """In place: ``tensor`` takes rank ``root_rank``'s values."""
    _group()
    _global_only(process_set)
    root_rank = _check_root(root_rank)
    _agree("broadcast", dtype=str(tensor.dtype), shape=tuple(tensor.shape), root=root_rank,
           **named(name))
    return _broadcast_into(tensor, root_rank)


def _broadcast_into(tensor, root_rank):
    """The copy from the root into ``tensor``, once every rank agreed on it."""
    with torch.no_grad():
        work = tensor.detach().to(_device()).contiguous()  # the tensor itself where it can be
        dist.broadcast(work, src=root_rank)
        if work.data_ptr() != tensor.data_ptr():
            tensor.copy_(work)
    return tensor


_Broadcast = compat.differentiable_broadcast(
    _broadcast_into, lambda grad: _reduce(grad.contiguous(), Average, 1.0, 1.0), lambda: rank())


def broadcast(tensor, root_rank=0, name=None, process_set=None):
    """A new tensor with rank ``root_rank``'s values (differentiable, as Horovod's)."""
    _group()
    _global_only(process_set)
    root_rank = _check_root(root_rank)
    # agreed here, once, whichever way each rank goes on: a parameter on the root and a
    # plain tensor elsewhere is Horovod's common case
    _agree("broadcast", dtype=str(tensor.dtype), shape=tuple(tensor.shape), root=root_rank,
           **named(name))
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank)
    return _broadcast_into(tensor.detach().clone(), root_rank)


def _global_only(process_set):
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError("hvd_sparse.torchdist works on the default process group only "
                         "(Horovod's process sets are Horovod's)")


def broadcast_parameters(params, root_rank=0):
    """Copy rank ``root_rank``'s tensors to every rank, in place: a dict (a state_dict, taken
    in sorted key order) or a list of tensors or of (name, tensor) pairs, in its order."""
    _group()
    root_rank = _check_root(root_rank)
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in compat.param_list(params)]
    tensors = [(n, p) for n, p in items if isinstance(p, torch.Tensor)]
    _agree("broadcast_parameters", root=root_rank,  # (names, dtypes and shapes: Horovod's
           tensors=tuple((n, str(p.dtype), tuple(p.shape)) for n, p in tensors))  # check)
    where = _device()
    with torch.no_grad():
        for _, p in tensors:
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


def __getattr__(name):
    return missing_name(__name__, name)
