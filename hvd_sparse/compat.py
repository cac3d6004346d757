"""Horovod's reduction ops and compressors, or stand-ins where Horovod is not installed.

hvd_sparse must import (and its mpi4py transport must run) on clusters where Horovod cannot be
built, so Horovod is optional at import time.
"""
from __future__ import annotations

try:  # pragma: no branch
    from horovod.torch.compression import Compression  # noqa: F401
    from horovod.torch.mpi_ops import Adasum, Average, Sum  # noqa: F401

    HAVE_HOROVOD = True
except ImportError:  # Horovod missing: same names and meanings
    HAVE_HOROVOD = False
    Average, Sum, Adasum = 0, 1, 2

    class _NoneCompressor:
        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class _FP16Compressor:
        @staticmethod
        def compress(tensor):
            ctx = tensor.dtype
            return (tensor.half() if tensor.dtype.is_floating_point else tensor), ctx

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.to(ctx) if ctx.is_floating_point else tensor

    class Compression:  # type: ignore[no-redef]
        none = _NoneCompressor
        fp16 = _FP16Compressor


def differentiable_broadcast(copy_from_root, average, my_rank):
    """Horovod's differentiable ``broadcast`` over a front end's own primitives, as an autograd
    Function: the forward is ``copy_from_root(tensor, root_rank)`` on a copy of the input; the
    gradient is averaged over the ranks (``average(grad)``) and kept by the root alone
    (``my_rank()``), as Horovod's ``HorovodBroadcast.backward``."""
    import torch

    class Broadcast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor, root_rank):
            ctx.root_rank = root_rank
            return copy_from_root(tensor.detach().clone(), root_rank)

        @staticmethod
        def backward(ctx, grad):
            reduced = average(grad)
            return (reduced if my_rank() == ctx.root_rank else reduced * 0), None

    return Broadcast


def param_list(params) -> list:
    """A ``broadcast_parameters`` argument other than a dict as a list (a list, a tuple,
    ``named_parameters()``), or Horovod's ``ValueError`` for what is no collection at all."""
    try:
        return list(params)
    except TypeError:
        raise ValueError(f"invalid params of type: {type(params)}") from None
