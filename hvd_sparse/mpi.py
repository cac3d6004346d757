"""Horovod-free API over mpi4py: ``import hvd_sparse.mpi as hvd`` under plain ``mpirun -np N``.

For clusters where Horovod cannot be built. It offers what a data-parallel training script needs
around the optimizer (``init``, ``rank``, ``size``, ``local_rank``, ``local_size``,
``cross_rank``, ``cross_size``, ``broadcast_parameters``, ``broadcast_optimizer_state``,
``allreduce``/``allreduce_``, ``broadcast``/``broadcast_``, ``allgather``, ``allgather_object``,
``broadcast_object``, ``Average``/``Sum``, ``Compression``) and a ``DistributedOptimizer`` that
uses :class:`hvd_sparse.transport.MPITransport`. It never imports Horovod.
"""
from __future__ import annotations

import os
import pickle
import sys
import warnings

import torch

from . import compat, core_sharing
from .compat import Adasum, Average, Compression, Sum  # noqa: F401
from .optimizer import DistributedOptimizer as _DistributedOptimizer
from .checkpoint import ShardedStateWarning, merge_rank_states  # noqa: F401
from .transport import MPITransport

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
    _layout.clear()
    _layout.update(_topology(_comm))


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
    return {"local_rank": node.Get_rank(), "local_size": node.Get_size(),
            "cross_rank": leaders.index(mine), "cross_size": len(leaders)}


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
    global _comm
    _comm = None
    _layout.clear()


def barrier():
    _c().Barrier()


#: the most bytes one ``Bcast`` moves: MPI counts are C ints (2**31 - 1), and a 512M-entry
#: float32 tensor, or AdamW's state over 268M parameters pickled, passes that
BROADCAST_CHUNK_BYTES = 1 << 30


def _bcast_bytes(buf, root_rank) -> None:
    """``Bcast`` of a flat uint8 numpy array in chunks of at most BROADCAST_CHUNK_BYTES."""
    comm, step = _c(), BROADCAST_CHUNK_BYTES
    for lo in range(0, buf.size, step):
        comm.Bcast(buf[lo:lo + step], root=root_rank)


def broadcast_object(obj, root_rank=0, name=None):
    """Rank ``root_rank``'s picklable object on every rank; pickled, then broadcast as bytes in
    chunks (one mpi4py ``bcast`` fails past 2 GiB)."""
    import numpy as np

    comm = _c()
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) \
        if comm.Get_rank() == root_rank else b""
    size = comm.bcast(len(data), root=root_rank)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if data \
        else np.empty(size, dtype=np.uint8)
    _bcast_bytes(buf, root_rank)
    return obj if comm.Get_rank() == root_rank else pickle.loads(buf.tobytes())


def allgather_object(obj, name=None):
    """Every rank's picklable object, in rank order; each broadcast from its rank as bytes in
    chunks (one mpi4py ``allgather`` fails past 2 GiB)."""
    import numpy as np

    comm = _c()
    mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = comm.allgather(len(mine))
    out = []
    for root, size in enumerate(sizes):
        buf = np.frombuffer(bytearray(mine), dtype=np.uint8) if root == comm.Get_rank() \
            else np.empty(size, dtype=np.uint8)
        _bcast_bytes(buf, root)
        out.append(pickle.loads(mine if root == comm.Get_rank() else buf.tobytes()))
    return out


def allreduce(tensor, op=None, name=None):
    """Average (default) or sum of ``tensor`` over ranks; returns a new tensor."""
    t = MPITransport(_c())
    op = compat.Average if op is None else op
    if op != compat.Average and op != compat.Sum:
        raise ValueError(f"op={op!r}: hvd_sparse.mpi reduces with Average or Sum only")
    out = t.wait(t.allreduce_async(tensor.detach(), name or "allreduce",
                                   average=op == compat.Average))
    return out.view(tensor.shape)


def allreduce_(tensor, op=None, name=None):
    """:func:`allreduce` written into ``tensor`` (returned), as Horovod's in-place form."""
    with torch.no_grad():
        return tensor.copy_(allreduce(tensor, op=op, name=name))


def broadcast_(tensor, root_rank=0, name=None):
    """Rank ``root_rank``'s ``tensor`` copied into ``tensor`` on every rank (returned)."""
    host = tensor.detach().cpu().contiguous().clone()
    if host.numel():
        _bcast_bytes(host.reshape(-1).view(torch.uint8).numpy(), root_rank)
    with torch.no_grad():
        return tensor.copy_(host.to(tensor.device))


def broadcast(tensor, root_rank=0, name=None):
    """A new tensor holding rank ``root_rank``'s ``tensor``."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def allgather(tensor, name=None):
    """Concatenate every rank's tensor along dimension 0 (sizes may differ)."""
    t = MPITransport(_c())
    flat = t.wait(t.allgather_async(tensor.contiguous().reshape(-1), name or "allgather"))
    return flat.view(-1, *tensor.shape[1:])


def broadcast_parameters(params, root_rank=0):
    """Copy rank ``root_rank``'s parameters (a state_dict or named parameters) to every rank."""
    items = params.items() if isinstance(params, dict) else params
    comm = _c()
    with torch.no_grad():
        for _, p in sorted(items, key=lambda kv: kv[0]):
            if not isinstance(p, torch.Tensor):
                continue
            broadcast_(p, root_rank)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Give every rank rank ``root_rank``'s optimizer state and hyper-parameters; for an
    hvd_sparse optimizer, also its replicated state (downlink residuals, counters), taken before
    the next exchange. Each rank keeps its own uplink residuals. Call it on every rank."""
    with warnings.catch_warnings():  # the state dict read here is not a checkpoint
        warnings.simplefilter("ignore", ShardedStateWarning)
        sd = optimizer.state_dict()
    sd.pop("hvd_sparse", None)
    optimizer.load_state_dict(broadcast_object(sd, root_rank))
    engine = getattr(optimizer, "_hs_engine", None)
    if engine is not None:
        engine.request_agreement(root_rank)


def DistributedOptimizer(optimizer, named_parameters=None, **kwargs):
    """:func:`hvd_sparse.DistributedOptimizer` over mpi4py (see its documentation)."""
    kwargs.setdefault("transport", MPITransport(_c()))
    return _DistributedOptimizer(optimizer, named_parameters, **kwargs)
