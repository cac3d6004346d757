"""The rest of Horovod's collective API over mpi4py, for :mod:`hvd_sparse.mpi`.

A script written for ``horovod.torch`` also calls ``allreduce`` with ``Min``/``Max``/``Product``,
the ``*_async`` forms with ``poll`` and ``synchronize``, the ``grouped_*`` forms, ``alltoall``,
``reducescatter`` and ``join``; this module gives them with Horovod's arguments, results and
gradients, so that such a script runs unchanged where Horovod cannot be built.

One difference is MPI's: collectives are matched by call order, not by name as in Horovod's
background loop, so every rank must *start* them in the same order (handles may be waited for in
any order). Float averages and sums, allgathers and all-to-alls run as MPI non-blocking
collectives (``poll`` tests them); the other forms complete when started.
"""
from __future__ import annotations

import itertools
import time
import warnings

import numpy as np
import torch

from . import compat
from .mpi_guard import agree, describe, named, watched

try:  # pragma: no branch
    from horovod.torch.mpi_ops import Max, Min, Product  # noqa: F401
except ImportError:  # Horovod missing: its values
    Min, Max, Product = 3, 4, 5

#: elements per MPI call: MPI's counts are C ints
CHUNK = 1 << 30


def _mpi():
    from . import mpi

    return mpi


def _transport():
    from .transport import MPITransport

    return MPITransport(_mpi()._c())


# ----------------------------------------------------------------------- handles
class _Pending:
    """One started operation: ``test()`` says whether it completed, ``finish()`` returns its
    result (waiting if needed); ``name``: the name the user gave it, taken while it runs;
    ``done``: it completed as it started (a blocking form behind an async name)."""

    def __init__(self, test, finish, done=False):
        self.test, self.finish, self.name, self.done = test, finish, None, done


_handles = {}
_numbers = itertools.count(1)
_names_taken = {}  # a name the user gave a running operation -> its handle


def _free_name(what, name):
    """Refuse a ``name=`` that a running operation holds, as Horovod refuses a tensor named
    like one it is still processing (checked before anything starts). As there, a name is
    free again once its operation completed, synchronized or not (so a retry after an
    exception between start and ``synchronize`` works)."""
    key = None if name is None else str(name)
    held = _names_taken.get(key)
    if held is None:
        return
    pending = _handles.get(held)
    if pending is None or pending.test():
        del _names_taken[key]
        return
    raise ValueError(f"Requested to {what} a tensor with the same name as another tensor "
                     f"that is currently being processed ('{name}'). If you want to request "
                     "another tensor, use a different tensor name.")


def forget_handles() -> None:
    """At shutdown: no operation is running any more."""
    _handles.clear()
    _names_taken.clear()


def _register(test, finish, done=False) -> int:
    handle = next(_numbers)
    _handles[handle] = _Pending(test, finish, done)
    return handle


def _claim(handle, name) -> int:
    """Hold ``name`` for ``handle`` while it runs (:func:`_free_name`); an operation that
    completed as it started holds nothing."""
    pending = _handles[handle]
    if name is not None and not pending.done:
        pending.name = str(name)
        _names_taken[str(name)] = handle
    return handle


def _done(result) -> int:
    return _register(lambda: True, lambda: result, done=True)


def poll(handle) -> bool:
    """Whether the operation behind ``handle`` completed (then :func:`synchronize` does not
    block)."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"poll: unknown or already synchronized handle {handle!r}")
    return bool(pending.test())


def synchronize(handle):
    """Wait for the operation behind ``handle`` and return its result (a tensor, or a list or
    tuple of them); an unknown handle gives None, as Horovod's."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.name is not None and _names_taken.get(pending.name) == handle:
        del _names_taken[pending.name]
    return pending.finish()


def _requests_test(handle):
    req = handle[1]
    MPI = _transport().MPI
    return MPI.Request.Testall(req) if isinstance(req, list) else req.Test()


# ----------------------------------------------------------------------- reductions
def check_op(op):
    """The reduction ops this front end runs (Adasum is Horovod's own algorithm)."""
    if op in (compat.Average, compat.Sum, Min, Max, Product):
        return op
    if op == compat.Adasum:
        raise ValueError("op=Adasum is Horovod's algorithm and needs Horovod; hvd_sparse.mpi "
                         "reduces with Average, Sum, Min, Max or Product")
    raise ValueError(f"op={op!r}: hvd_sparse.mpi reduces with Average, Sum, Min, Max or "
                     "Product")


def _mpi_op(op):
    MPI = _transport().MPI
    return {compat.Sum: MPI.SUM, compat.Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX,
            Product: MPI.PROD}[op]


def _host_work(tensor, prescale):
    """A contiguous host copy MPI can reduce: half precisions widened to float32 (MPI has no
    type for them), booleans refused (as Horovod does)."""
    if tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"hvd_sparse.mpi cannot reduce a {tensor.dtype} tensor")
    work = tensor.detach().cpu().contiguous().reshape(-1)
    if work.dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    else:
        work = work.clone()
    return prescaled(work, prescale)


def prescaled(work, prescale):
    """``work`` (a copy, changed in place where it can be) times ``prescale`` as Horovod scales
    it: floats in place, integers in double and cast back (toward zero)."""
    if prescale == 1.0:
        return work
    if work.dtype.is_floating_point:
        return work.mul_(prescale)
    return torch.trunc(work.double() * prescale).to(work.dtype)


def finish_reduction(out, tensor, op, postscale, divisor):
    """Average, postscale and the input's dtype, device and shape, as Horovod's: integer
    averages truncate toward zero."""
    if not out.dtype.is_floating_point and postscale != 1.0:
        # Horovod folds the average into the postscale and truncates once
        factor = postscale / divisor if op == compat.Average else postscale
        out = torch.trunc(out.double() * factor).to(out.dtype)
    elif op == compat.Average:
        if out.dtype.is_floating_point:
            out.mul_(1.0 / divisor)
        else:
            out = torch.div(out, divisor, rounding_mode="trunc")
    if out.dtype.is_floating_point and postscale != 1.0:
        out.mul_(postscale)
    return out.to(dtype=tensor.dtype, device=tensor.device)


def reduce_blocking(tensor, op, prescale=1.0, postscale=1.0):
    """Any op over ranks with MPI's ``Allreduce`` (integers summed in 64 bits): a new tensor
    of ``tensor``'s shape."""
    comm = _mpi()._c()
    work = _host_work(tensor, prescale)
    if op in (compat.Sum, compat.Average) and not work.dtype.is_floating_point:
        work = work.to(torch.int64)  # exact, and wide enough for the sum
    out = torch.empty_like(work)
    src, dst, mop = work.numpy(), out.numpy(), _mpi_op(op)
    for lo in range(0, max(src.size, 1), CHUNK):
        a, b = src[lo:lo + CHUNK], dst[lo:lo + CHUNK]
        watched(comm, lambda: comm.Iallreduce(a, b, op=mop))
    return finish_reduction(out, tensor, op, postscale, comm.Get_size()).view(tensor.shape)


def _allreduce_start(tensor, name, op, prescale, postscale, into=None) -> int:
    """Start one allreduce; non-blocking for float averages and sums. ``into``: the tensor the
    result is written into (the in-place forms)."""
    op = check_op(op)
    agree(_mpi()._c(), "allreduce", **describe(tensor, op=int(op), prescale=float(prescale),
                                               postscale=float(postscale)), **named(name))
    if tensor.is_complex():  # after the agreement: every rank refuses alike
        raise ValueError(f"Tensor type {tensor.type()} is not supported")  # Horovod's words

    def deliver(out):
        if into is None:
            return out
        with torch.no_grad():
            return into.copy_(out)

    if tensor.dtype.is_floating_point and op in (compat.Average, compat.Sum):
        t = _transport()
        h = t.allreduce_async(tensor.detach(), name or "allreduce",
                              average=op == compat.Average, prescale=prescale,
                              postscale=postscale)
        return _register(lambda: _requests_test(h),
                         lambda: deliver(t.wait(h).view(tensor.shape)))
    return _done(deliver(reduce_blocking(tensor, op, prescale, postscale)))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None) -> int:
    """Start :func:`hvd_sparse.mpi.allreduce`; a handle for :func:`poll` and :func:`synchronize`."""
    mpi = _mpi()
    mpi._global_only(process_set)
    _free_name("allreduce", name)
    return _claim(_allreduce_start(tensor, name, mpi._reduce_op(op, average), prescale_factor,
                                   postscale_factor), name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None) -> int:
    """:func:`allreduce_async` whose result is written into ``tensor``."""
    mpi = _mpi()
    mpi._global_only(process_set)
    _free_name("allreduce", name)
    return _claim(_allreduce_start(tensor, name, mpi._reduce_op(op, average), prescale_factor,
                                   postscale_factor, into=tensor), name)


def _group(what, tensors) -> list:
    """A grouped call's tensors, once every rank has agreed on how many there are."""
    tensors = list(tensors)
    agree(_mpi()._c(), what, tensors=len(tensors))
    return tensors


def _grouped_start(tensors, name, op, prescale, postscale, in_place) -> int:
    _free_name("allreduce", name)
    tensors = _group("grouped_allreduce", tensors)
    handles = [_allreduce_start(t, f"{name or 'grouped_allreduce'}.{i}", op, prescale,
                                postscale, into=t if in_place else None)
               for i, t in enumerate(tensors)]
    return _claim(_register(lambda: all(poll(h) for h in handles),
                            lambda: tuple(synchronize(h) for h in handles)), name)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None) -> int:
    mpi = _mpi()
    mpi._global_only(process_set)
    return _grouped_start(tensors, name, mpi._reduce_op(op, average), prescale_factor,
                          postscale_factor, in_place=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None) -> int:
    mpi = _mpi()
    mpi._global_only(process_set)
    return _grouped_start(tensors, name, mpi._reduce_op(op, average), prescale_factor,
                          postscale_factor, in_place=True)


def grouped_allreduce(tensors, average=None, name=None, compression=compat.Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Each tensor reduced as by :func:`hvd_sparse.mpi.allreduce` (differentiable too)."""
    mpi = _mpi()
    tensors = _group("grouped_allreduce", tensors)
    return [mpi.allreduce(t, average=average, name=f"{name or 'grouped_allreduce'}.{i}",
                          compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
            for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ----------------------------------------------------------------------- gathers and broadcasts
def allgather_async(tensor, name=None, process_set=None) -> int:
    """Start :func:`hvd_sparse.mpi.allgather` (rows concatenated in rank order)."""
    _mpi()._global_only(process_set)
    return _claim(_allgather_start(tensor, name), name)


def _allgather_start(tensor, name) -> int:
    _free_name("allgather", name)
    t = _transport()
    src = tensor.detach().contiguous()
    agree(t.comm, "allgather", dtype=str(src.dtype), dims=src.dim(),
          trailing_shape=tuple(src.shape[1:]), **named(name))
    h = t.allgather_async(src.reshape(-1), name or "allgather")
    return _register(lambda: _requests_test(h),
                     lambda: t.wait(h).view(-1, *src.shape[1:]))


def grouped_allgather(tensors, name=None, process_set=None):
    mpi = _mpi()
    tensors = _group("grouped_allgather", tensors)
    return tuple(mpi.allgather(t, name=f"{name or 'grouped_allgather'}.{i}",
                               process_set=process_set) for i, t in enumerate(tensors))


def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    _mpi()._global_only(process_set)
    _free_name("allgather", name)
    tensors = _group("grouped_allgather", tensors)
    handles = [_allgather_start(t, f"{name or 'grouped_allgather'}.{i}")
               for i, t in enumerate(tensors)]
    return _claim(_register(lambda: all(poll(h) for h in handles),
                            lambda: tuple(synchronize(h) for h in handles)), name)


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    mpi = _mpi()
    mpi._global_only(process_set)
    _free_name("broadcast", name)
    return _done(mpi._broadcast_into(tensor.detach().clone(), root_rank, name=name))


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    mpi = _mpi()
    mpi._global_only(process_set)
    _free_name("broadcast", name)
    return _done(mpi._broadcast_into(tensor, root_rank, name=name))


# ----------------------------------------------------------------------- all-to-all
def _even_splits(rows, size):
    """Horovod's split of ``rows`` among ranks for reducescatter: equal parts, the first ranks
    one more."""
    return [rows // size + (r < rows % size) for r in range(size)]


def _alltoall_start(tensor, splits, name):
    """Start an all-to-all of rows: (transport handle, finish() -> (output, rows received
    from each rank))."""
    size = _mpi().size()
    agree(_mpi()._c(), "alltoall", dtype=str(tensor.dtype), dims=tensor.dim(),
          trailing_shape=tuple(tensor.shape[1:]), splits=splits is not None, **named(name))
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    src = tensor.detach().contiguous()
    rows = src.shape[0]
    given = None if splits is None else \
        [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if given is not None and (len(given) != size or sum(given) != rows or min(given) < 0):
        raise ValueError(f"alltoall: splits {given} must give one non-negative row count per "
                         f"rank ({size}) summing to the tensor's first dimension ({rows})")
    if given is None and rows % size:
        raise ValueError("splits not provided, but first dimension of tensor is not an even "
                         "multiple of the number of workers.")  # Horovod's words
    send = given if given is not None else [rows // size] * size
    t = _transport()
    recv_rows = np.empty(size, dtype=np.int64)
    # rows each rank sends here
    watched(t.comm, lambda: t.comm.Ialltoall(np.asarray(send, dtype=np.int64), recv_rows))
    if torch.is_tensor(splits):
        received = torch.as_tensor(recv_rows).to(dtype=splits.dtype, device=splits.device)
    else:
        received = torch.as_tensor(recv_rows, dtype=torch.int32)
    row_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * src.element_size()
    h = t.alltoall_async(src.reshape(-1), [s * row_bytes for s in send], name or "alltoall")

    def finish():
        return t.wait(h).view(-1, *src.shape[1:]), received

    return h, finish


class _Alltoall(torch.autograd.Function):
    """Horovod's gradient: the output's gradient sent back along the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name):
        _, finish = _alltoall_start(tensor, splits, name)
        out, received = finish()
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _dead):
        back, _ = _Alltoall.apply(grad.contiguous(), ctx.received, "alltoall.grad")
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Rows of ``tensor`` scattered to the ranks (``splits[r]`` rows to rank ``r``, in order;
    without ``splits`` equal parts) and the rows every rank sent
    here gathered in rank order. With ``splits``: (output, rows received from each rank), as
    Horovod's; without: the output (the rows must then divide evenly, as there)."""
    _mpi()._global_only(process_set)
    out, received = _Alltoall.apply(tensor, splits, name)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """Start :func:`alltoall`; :func:`synchronize` gives (output, received splits)."""
    _mpi()._global_only(process_set)
    _free_name("alltoall", name)
    h, finish = _alltoall_start(tensor, splits, name)
    return _claim(_register(lambda: _requests_test(h), finish), name)


# ----------------------------------------------------------------------- reduce-scatter
def _reducescatter_blocking(tensor, op, prescale, postscale, name=None):
    """The reduction of ``tensor`` over ranks, this rank's rows of it (Horovod's split: equal
    parts of the first dimension, the first ranks one row more)."""
    mpi = _mpi()
    comm, size, rank = mpi._c(), mpi.size(), mpi.rank()
    agree(comm, "reducescatter", **describe(tensor, op=int(op), prescale=float(prescale),
                                            postscale=float(postscale)), **named(name))
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    rows = _even_splits(tensor.shape[0], size)
    per_row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    work = _host_work(tensor, prescale)
    if op in (compat.Sum, compat.Average) and not work.dtype.is_floating_point:
        work = work.to(torch.int64)
    counts = [r * per_row for r in rows]
    if max(counts, default=0) > 2**31 - 1:
        raise ValueError("reducescatter of more than 2**31 - 1 elements per rank is not "
                         "supported by hvd_sparse.mpi")
    out = torch.empty(counts[rank], dtype=work.dtype)
    watched(comm, lambda: comm.Ireduce_scatter(work.numpy(), out.numpy(), recvcounts=counts,
                                               op=_mpi_op(op)))
    out = finish_reduction(out, tensor, op, postscale, size)
    return out.view(rows[rank], *tensor.shape[1:])


class _Reducescatter(torch.autograd.Function):
    """Horovod's gradient: the output's gradient allgathered (times the rank count for Sum,
    times the scale factors)."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name=None):
        ctx.args = (op, prescale, postscale)
        return _reducescatter_blocking(tensor.detach(), op, prescale, postscale, name)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale = ctx.args
        grad = grad * (_mpi().size() * prescale * postscale if op == compat.Sum
                       else prescale * postscale)
        return _mpi().allgather(grad, name="reducescatter.grad"), None, None, None, None


def _reducescatter_op(op):
    op = check_op(op)
    if op not in (compat.Average, compat.Sum):
        raise ValueError("reducescatter reduces with Average or Sum, as Horovod's")
    return op


def reducescatter(tensor, name=None, compression=compat.Compression.none, op=compat.Average,
                  process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """Average (default) or sum over ranks, of which each rank keeps its part of the first
    dimension (equal parts, the first ranks one row more), as Horovod's."""
    _mpi()._global_only(process_set)
    op = _reducescatter_op(op)
    packed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(packed, op, prescale_factor, postscale_factor, name)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=compat.Average, process_set=None,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    _mpi()._global_only(process_set)
    _free_name("reducescatter", name)
    return _done(_reducescatter_blocking(tensor, _reducescatter_op(op), prescale_factor,
                                         postscale_factor, name))


def grouped_reducescatter(tensors, name=None, compression=compat.Compression.none,
                          op=compat.Average, process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0):
    tensors = _group("grouped_reducescatter", tensors)
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                          process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors, name=None, op=compat.Average, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    _mpi()._global_only(process_set)
    op = _reducescatter_op(op)
    _free_name("reducescatter", name)
    tensors = _group("grouped_reducescatter", tensors)
    return _done(tuple(_reducescatter_blocking(t, op, prescale_factor, postscale_factor,
                                               None if name is None else f"{name}.{i}")
                       for i, t in enumerate(tensors)))


# ----------------------------------------------------------------------- join and queries
def join(device=-1) -> int:
    """Horovod's ``join`` where every rank calls it at the same point of its collectives (MPI
    cannot stand in for a rank that stopped early, as Horovod's background loop does): waits
    for all ranks and returns the rank that arrived last."""
    comm = _mpi()._c()
    now = np.array([time.time()])  # (arrival: before the agreement, which waits for everyone)
    agree(comm, "join")
    arrived = np.empty(comm.Get_size(), dtype=np.float64)
    watched(comm, lambda: comm.Iallgather(now, arrived))
    return int(np.argmax(arrived))


def mpi_threads_supported() -> bool:
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    return 0


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks (found by ``init``, as Horovod's: no
    collective here)."""
    return _mpi()._where("homogeneous")


_timeline_warned = False


def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's timeline records its background loop, which this front end has not: a
    warning, once, and nothing recorded."""
    global _timeline_warned
    if not _timeline_warned:
        warnings.warn("hvd_sparse.mpi has no Horovod timeline: start_timeline records nothing "
                      "(hvd_sparse's own per-stage times are in "
                      "optimizer.communication_stats())")
        _timeline_warned = True


def stop_timeline() -> None:
    pass
