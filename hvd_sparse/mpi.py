"""Horovod-free API over mpi4py: ``import hvd_sparse.mpi as hvd`` under plain ``mpirun -np N``.

For clusters where Horovod cannot be built. It offers what a data-parallel training script needs
around the optimizer (``init``, ``rank``, ``size``, ``local_rank``, ``local_size``,
``cross_rank``, ``cross_size``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``allreduce``/``allreduce_``, ``broadcast``/``broadcast_``, ``allgather``, ``allgather_object``,
``broadcast_object``, ``Average``/``Sum``/``Min``/``Max``/``Product``, ``Compression``), the rest
of Horovod's collectives (async forms with ``poll``/``synchronize``, grouped forms, ``alltoall``,
``reducescatter``, ``join``: :mod:`hvd_sparse.mpi_collectives`, where MPI's one difference, call
order, is explained), ``SyncBatchNorm`` (:mod:`hvd_sparse.sync_batch_norm`) and a ``DistributedOptimizer`` that
uses :class:`hvd_sparse.transport.MPITransport`. It needs no Horovod (its reduction ops and
compressors are used where it is installed). Objects are pickled with cloudpickle where it is
installed (Horovod's choice: lambdas and local classes travel), else with pickle.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

from . import compat, core_sharing
from .compat import Adasum, Average, Compression, Sum  # noqa: F401
from .optimizer import DistributedOptimizer as _DistributedOptimizer
from .checkpoint import ShardedStateWarning, merge_rank_states  # noqa: F401
from .transport import MPITransport
from .state_broadcast import broadcast_state_as_object
from .mpi_collectives import (  # noqa: F401 - Horovod's names
    Max, Min, Product, allgather_async, allreduce_async, allreduce_async_, alltoall,
    alltoall_async, broadcast_async, broadcast_async_, ccl_built, cuda_built, ddl_built,
    gloo_built, gloo_enabled, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter, grouped_reducescatter_async, is_homogeneous, join, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, poll, reducescatter, reducescatter_async,
    rocm_built, start_timeline, stop_timeline, synchronize)
from . import mpi_collectives
from .mpi_guard import HorovodInternalError  # noqa: F401 - Horovod's name
from .mpi_guard import (agree, check_root, describe, missing_name, named, pickled, unpickled,
                        watched)
from . import mpi_guard
from .sync_batch_norm import SyncBatchNorm  # noqa: F401 - Horovod's name

_comm = None
_layout = {}  # what init() found out collectively: local rank and size, cross rank and size


def init(comm=None):
    """Start MPI (mpi4py does on import) and remember the communicator. Before MPI starts,
    Open MPI is asked to yield while idle where this node has fewer cores than ranks
    (:mod:`hvd_sparse.core_sharing`)."""
    global _comm
    if "mpi4py.MPI" not in sys.modules:
        core_sharing.prepare(waiting_threads=1)
    from mpi4py import MPI

    _comm = comm if comm is not None else MPI.COMM_WORLD
    if comm is None:
        _check_launcher(_comm.Get_size())
    _layout.clear()
    _layout.update(_topology(_comm))
    mpi_guard.abort_on_uncaught(_comm)
    mpi_guard.start_watch(_comm)  # a rank that leaves early: an error, not a wait


#: what other launchers tell their processes about the job's size
_LAUNCHER_SIZES = (("HOROVOD_SIZE", "horovodrun --gloo"), ("WORLD_SIZE", "torchrun"))


def _check_launcher(world: int) -> None:
    """A job started by another launcher (``horovodrun --gloo``, ``torchrun``) gives each
    process an MPI world of its own: every rank would train alone, with no error. Refused
    with the way out."""
    if world != 1:
        return
    for var, launcher in _LAUNCHER_SIZES:
        launched = os.environ.get(var, "")
        if launched.isdigit() and int(launched) > 1:
            raise ValueError(
                f"hvd_sparse.mpi sees an MPI world of one process, but {var}={launched}: this "
                f"job was started by {launcher}, whose processes mpi4py cannot see. Start it "
                "with mpirun -np N, or keep the launcher and use `import hvd_sparse as hvd` "
                "(Horovod) or hvd_sparse.torchdist (torchrun).")


def _c():
    if _comm is None:
        raise ValueError("hvd_sparse.mpi has not been initialized; call hvd_sparse.mpi.init()")
    return _comm


def is_initialized() -> bool:
    return _comm is not None


def rank() -> int:
    return _c().Get_rank()


def size() -> int:
    return _c().Get_size()


def local_rank() -> int:
    """This rank's index on its node, in the communicator :func:`init` was given (the
    launcher's variable describes COMM_WORLD, which a sub-communicator is not)."""
    if _layout:
        return _layout["local_rank"]
    _c()  # not initialised: Horovod's error
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if var in os.environ:
            return int(os.environ[var])
    return _where("local_rank")


def _topology(comm):
    """This rank's place among the nodes, found once in :func:`init` (collective there, so
    the lookups below are local, as Horovod's are)."""
    node = comm.Split_type(__import__("mpi4py").MPI.COMM_TYPE_SHARED)
    mine = min(node.allgather(comm.Get_rank()))  # a node is named by its lowest rank
    leaders = sorted(set(comm.allgather(mine)))
    sizes = set(comm.allgather(node.Get_size()))
    return {"local_rank": node.Get_rank(), "local_size": node.Get_size(),
            "cross_rank": leaders.index(mine), "cross_size": len(leaders),
            "homogeneous": len(sizes) == 1}


def _gather_ints(value) -> list:
    """Every rank's integer, in rank order (a watched collective)."""
    import numpy as np

    comm = _c()
    out = np.empty(comm.Get_size(), dtype=np.int64)
    watched(comm, lambda: comm.Iallgather(np.array([value], dtype=np.int64), out))
    return out.tolist()


def _where(key):
    _c()
    return _layout[key]


def local_size() -> int:
    """Ranks on this node."""
    return _where("local_size")


def cross_rank() -> int:
    """This node's index among the nodes (ordered by their lowest rank), as Horovod's."""
    return _where("cross_rank")


def cross_size() -> int:
    """Number of nodes."""
    return _where("cross_size")


def shutdown():
    """Leave: the other ranks' collectives that this rank will not start now raise
    ``HorovodInternalError`` (as after Horovod's shutdown) instead of waiting for it."""
    global _comm
    if _comm is not None:
        mpi_guard.stop_watch(_comm)
    _comm = None
    _layout.clear()
    mpi_collectives.forget_handles()


def barrier(process_set=None):
    _global_only(process_set)
    comm = _c()
    agree(comm, "barrier")
    watched(comm, comm.Ibarrier)


def _check_root(root_rank) -> int:
    return check_root(root_rank, _c().Get_size())


#: the most bytes one ``Bcast`` moves: MPI counts are C ints (2**31 - 1), and a 512M-entry
#: float32 tensor, or AdamW's state over 268M parameters pickled, passes that
BROADCAST_CHUNK_BYTES = 1 << 30


def _bcast_bytes(buf, root_rank) -> None:
    """``Bcast`` of a flat uint8 numpy array in chunks of at most BROADCAST_CHUNK_BYTES."""
    comm, step = _c(), BROADCAST_CHUNK_BYTES
    for lo in range(0, buf.size, step):
        chunk = buf[lo:lo + step]
        watched(comm, lambda: comm.Ibcast(chunk, root=root_rank))


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Rank ``root_rank``'s picklable object on every rank; pickled, then broadcast as bytes in
    chunks (one mpi4py ``bcast`` fails past 2 GiB). An object the root cannot pickle raises
    the same ``TypeError`` on every rank, not on the root alone."""
    import numpy as np

    _global_only(process_set)
    root_rank = _check_root(root_rank)
    comm = _c()
    agree(comm, "broadcast_object", root=root_rank, **named(name))
    data = pickled(obj) if comm.Get_rank() == root_rank else b""
    size = np.array([len(data)], dtype=np.int64)
    watched(comm, lambda: comm.Ibcast(size, root=root_rank))
    size = int(size[0])
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if data \
        else np.empty(size, dtype=np.uint8)
    _bcast_bytes(buf, root_rank)
    if comm.Get_rank() == root_rank and data[:1] == b"o":
        return obj
    return unpickled([data or buf.tobytes()], "broadcast_object", first=root_rank)[0]


def allgather_object(obj, name=None, process_set=None):
    """Every rank's picklable object, in rank order; each broadcast from its rank as bytes in
    chunks (one mpi4py ``allgather`` fails past 2 GiB)."""
    import numpy as np

    _global_only(process_set)
    comm = _c()
    agree(comm, "allgather_object", **named(name))
    mine = pickled(obj)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    watched(comm, lambda: comm.Iallgather(np.array([len(mine)], dtype=np.int64), sizes))
    sizes = sizes.tolist()
    blobs = []
    for root, size in enumerate(sizes):
        buf = np.frombuffer(bytearray(mine), dtype=np.uint8) if root == comm.Get_rank() \
            else np.empty(size, dtype=np.uint8)
        _bcast_bytes(buf, root)
        blobs.append(mine if root == comm.Get_rank() else buf.tobytes())
    return unpickled(blobs, "allgather_object")


def _reduce_op(op, average):
    """Horovod's rule for its deprecated ``average`` beside ``op`` (same messages)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
    elif average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning)
        op = compat.Average if average else compat.Sum
    else:
        op = compat.Average
    return mpi_collectives.check_op(op)


class ProcessSet:
    """Horovod's process set; here only the global one (this module works on one
    communicator: pass ``init(comm=...)`` a sub-communicator instead)."""

    def __init__(self, ranks=None):
        if ranks is not None:
            raise ValueError("hvd_sparse.mpi has the global process set only (pass "
                             "init(comm=...) a sub-communicator instead)")
        self.process_set_id = 0

    @property
    def ranks(self) -> list:
        """Every rank of the job, as Horovod's global process set lists them."""
        return list(range(size()))

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True


global_process_set = ProcessSet()


def add_process_set(process_set):
    ProcessSet(getattr(process_set, "ranks", process_set))  # refused, with the reason


def remove_process_set(process_set):
    return ProcessSet(getattr(process_set, "ranks", process_set)) is None


def _global_only(process_set):
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError("hvd_sparse.mpi works on the global communicator only (process sets "
                         "are Horovod's: pass init(comm=...) a sub-communicator instead)")


def _sum(tensor, op, name, prescale, postscale):
    """The reduction itself: floats through the transport; integers summed exactly, their
    average truncated toward zero as Horovod's (its scale by 1/size cast back to the type).
    Every rank must start it alike (:func:`hvd_sparse.mpi_guard.agree`)."""
    agree(_c(), "allreduce", **describe(tensor, op=int(op), prescale=float(prescale),
                                        postscale=float(postscale)), **named(name))
    if tensor.is_complex():  # (after the agreement: every rank refuses alike, or all mismatch)
        # the integer path below would drop the imaginary part
        raise ValueError(f"Tensor type {tensor.type()} is not supported")  # Horovod's words
    name = name or "allreduce"
    if op != compat.Average and op != compat.Sum or not tensor.dtype.is_floating_point \
            and (prescale != 1.0 or postscale != 1.0 or tensor.dtype == torch.bool):
        return mpi_collectives.reduce_blocking(tensor, op, prescale, postscale)
    t = MPITransport(_c())
    if tensor.dtype.is_floating_point:
        out = t.wait(t.allreduce_async(tensor, name, average=op == compat.Average,
                                       prescale=prescale, postscale=postscale))
        return out.view(tensor.shape)
    from mpi4py import MPI

    src = tensor.detach().cpu().contiguous()
    wide = src.to(torch.int64) if src.dtype != torch.int64 else src
    out = torch.empty_like(wide)
    comm = _c()
    watched(comm, lambda: comm.Iallreduce([wide.numpy(), MPI.INT64_T],
                                          [out.numpy(), MPI.INT64_T], op=MPI.SUM))
    if op == compat.Average:
        out = torch.div(out, size(), rounding_mode="trunc")
    return out.to(dtype=tensor.dtype, device=tensor.device).view(tensor.shape)


class _Allreduce(torch.autograd.Function):
    """Differentiable as Horovod's: the gradient is reduced the same way."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale, postscale):
        ctx.args = (op, prescale, postscale)
        return _sum(tensor.detach(), op, name, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale = ctx.args
        return _Allreduce.apply(grad, op, "allreduce.grad", prescale, postscale), \
            None, None, None, None


def allreduce(tensor, average=None, name=None, compression=compat.Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Average (default), sum, minimum, maximum or product of ``tensor`` over ranks, a new
    tensor, with Horovod's arguments (``average`` deprecated there too) and its gradient (the
    output's gradient reduced with the same op, as Horovod's)."""
    _global_only(process_set)
    op = _reduce_op(op, average)
    packed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(packed, op, name, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """:func:`allreduce` written into ``tensor`` (returned), as Horovod's in-place form."""
    _global_only(process_set)
    op = _reduce_op(op, average)
    with torch.no_grad():
        return tensor.copy_(_sum(tensor.detach(), op, name, prescale_factor,
                                 postscale_factor))


def _broadcast_into(tensor, root_rank, check=True, name=None):
    root_rank = _check_root(root_rank)
    if check:
        agree(_c(), "broadcast", **describe(tensor, root=root_rank), **named(name))
    host = tensor.detach().cpu().contiguous().clone()
    if host.numel():
        _bcast_bytes(host.reshape(-1).view(torch.uint8).numpy(), root_rank)
    with torch.no_grad():
        return tensor.copy_(host.to(tensor.device))


def broadcast_(tensor, root_rank=0, name=None, process_set=None):
    """Rank ``root_rank``'s ``tensor`` copied into ``tensor`` on every rank (returned)."""
    _global_only(process_set)
    return _broadcast_into(tensor, root_rank, name=name)


_Broadcast = compat.differentiable_broadcast(  # agreed on by broadcast() before
    lambda tensor, root: _broadcast_into(tensor, root, check=False),
    lambda grad: allreduce(grad, op=compat.Average, name="broadcast.grad"), lambda: rank())


def broadcast(tensor, root_rank=0, name=None, process_set=None):
    """A new tensor holding rank ``root_rank``'s ``tensor`` (differentiable, as Horovod's)."""
    _global_only(process_set)
    root_rank = _check_root(root_rank)
    agree(_c(), "broadcast", **describe(tensor, root=root_rank), **named(name))
    return _Broadcast.apply(tensor, root_rank)


class _Allgather(torch.autograd.Function):
    """Horovod's gradient: the output's gradient averaged over ranks, this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name):
        t = MPITransport(_c())
        src = tensor.detach().contiguous()
        agree(_c(), "allgather", dtype=str(src.dtype), dims=src.dim(),
              trailing_shape=tuple(src.shape[1:]), **named(name))
        ctx.rows = src.shape[0] if src.dim() else 1
        flat = t.wait(t.allgather_async(src.reshape(-1), name or "allgather"))
        return flat.view(-1, *src.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=compat.Average, name="allgather.grad")
        rows = _gather_ints(ctx.rows)
        return reduced.narrow(0, sum(rows[:rank()]), ctx.rows), None


def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along dimension 0 (sizes may differ; differentiable)."""
    _global_only(process_set)
    return _Allgather.apply(tensor, name)


def broadcast_parameters(params, root_rank=0):
    """Copy rank ``root_rank``'s parameters to every rank, as Horovod's: a dict (a state_dict,
    taken in sorted key order) or a list of tensors or of (name, tensor) pairs, in its order
    (any other iterable, e.g. ``named_parameters()``, is taken as such a list)."""
    root_rank = _check_root(root_rank)
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in compat.param_list(params)]
    tensors = [(n, p) for n, p in items if isinstance(p, torch.Tensor)]
    agree(_c(), "broadcast_parameters", root=root_rank,
          tensors=tuple((n, str(p.dtype), tuple(p.shape)) for n, p in tensors))
    with torch.no_grad():
        for _, p in tensors:
            _broadcast_into(p, root_rank, check=False)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyper-parameters; for an
    hvd_sparse optimizer, also its replicated state (downlink residuals, counters), taken before
    the next exchange. Each rank keeps its own uplink residuals. Call it on every rank.
    ``model`` is accepted for Horovod's signature (its sparse embeddings need nothing here:
    the state travels whole, so a fresh optimizer needs no initialising step either)."""
    broadcast_state_as_object(optimizer, root_rank, broadcast_object)


def DistributedOptimizer(optimizer, named_parameters=None, *args, **kwargs):
    """:func:`hvd_sparse.DistributedOptimizer` over mpi4py (see its documentation; Horovod's
    arguments may come by position, as there)."""
    _global_only(kwargs.pop("process_set", None))  # (the global one is this transport's)
    kwargs.setdefault("transport", MPITransport(_c()))
    return _DistributedOptimizer(optimizer, named_parameters, *args, **kwargs)


def __getattr__(name):
    return missing_name(__name__, name)
