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
