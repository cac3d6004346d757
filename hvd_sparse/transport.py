"""Collective back ends. The optimizer sees only this small interface, so an mpi4py back end
can stand beside the Horovod one.

``allgather_async`` takes one rank's uint8 payload (sizes may differ per rank) and returns, at
``wait``, the concatenation of every rank's payload in rank order. ``alltoall_async`` takes the
concatenation of one uint8 part per destination rank (``splits``: their byte counts, in rank
order) and returns, at ``wait``, the concatenation of the parts every rank sent to this one, in
rank order (the sharded exchange). ``allreduce_async`` is used for tensors sent dense.
"""
from __future__ import annotations

import time

import torch
import torch.distributed

#: dtypes Horovod 0.28's collectives refuse: reduced in float32, gathered as bytes
WIDENED = (torch.bfloat16,)


class Transport:
    """Interface of a collective back end.

    ``ordered``: the back end matches collectives by the order they are started (MPI) rather than
    by name (Horovod), so the optimizer starts them in one fixed order on every rank.
    ``fuses_allreduces``: allreduces started together travel as one (Horovod's fusion buffer),
    so one more dense bucket beside others adds its bytes but no latency (the cost model).
    """

    ordered = False
    fuses_allreduces = False

    def size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def included(self) -> bool:
        return True

    def allgather_async(self, payload: torch.Tensor, name: str):
        raise NotImplementedError

    def allreduce_async(self, tensor: torch.Tensor, name: str, *, average: bool,
                        prescale: float = 1.0, postscale: float = 1.0):
        raise NotImplementedError

    def alltoall_async(self, payload: torch.Tensor, splits, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no alltoall: the sharded "
                                  "exchange needs one (collective='allgather' does not)")

    def wait(self, handle) -> torch.Tensor:
        raise NotImplementedError


class HorovodTransport(Transport):
    """Horovod's asynchronous collectives; names match across ranks, so launch order may differ."""

    fuses_allreduces = True

    def __init__(self, process_set=None):
        import horovod.torch as hvd

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self._seen = None  # (size, rank) as Horovod last gave them, together
        if hvd.is_initialized():
            self._world()

    def _world(self):
        """The process set's (size, rank); after ``hvd.shutdown()`` the last ones it gave, so
        that a checkpoint can still be taken then (``state_dict()``, as with Horovod's own
        optimizer: a script may shut down, then save). Collectives still fail there. A rank
        outside the set is on its own, (1, 0): as with Horovod's optimizer, it steps on its
        own gradient (the facade sends nothing there, see ``included``).

        A set other than the global one keeps its size and this rank's place in it, so they
        are asked once: Horovod's table of sets, read while its background thread updates it,
        at times answers "does not exist" for a registered set (seen on rank 0 at a
        ``state_dict()``, about one run in seven of a 4-rank test)."""
        ps = self.process_set
        if self._seen is not None and getattr(ps, "process_set_id", 0):
            return self._seen
        for attempt in range(100):
            try:
                if ps.included() is False:  # (None: Horovod not initialised)
                    self._seen = (1, 0)
                else:
                    self._seen = (ps.size(), ps.rank())
                return self._seen
            except ValueError as e:  # "Horovod has not been initialized", after it was
                if "not been registered" in str(e) and attempt < 99:
                    time.sleep(0.001)  # (the race above, before the first answer)
                    continue
                if self._seen is None or self._hvd.is_initialized():
                    raise
                return self._seen

    def size(self) -> int:
        return self._world()[0]

    def rank(self) -> int:
        return self._world()[1]

    def included(self) -> bool:
        return self.process_set.included()

    def allgather_async(self, payload, name):
        if payload.dtype in WIDENED:  # gathered as its bytes (a flat vector's concatenation)
            return ("bytes", payload.dtype, self._hvd.allgather_async(
                payload.contiguous().reshape(-1).view(torch.uint8), name=name,
                process_set=self.process_set))
        return self._hvd.allgather_async(payload, name=name, process_set=self.process_set)

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        op = self._hvd.Average if average else self._hvd.Sum
        if tensor.dtype in WIDENED:  # Horovod has no bfloat16 reduction: float32 on the wire,
            wide = tensor.float()   # the result written back in place as Horovod would
            return ("widened", tensor, self._hvd.allreduce_async_(
                wide, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                process_set=self.process_set))
        return self._hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                          postscale_factor=postscale,
                                          process_set=self.process_set)

    def alltoall_async(self, payload, splits, name):
        splits = torch.tensor(list(splits), dtype=torch.int32)
        return ("alltoall", self._hvd.alltoall_async(payload, splits=splits, name=name,
                                                     process_set=self.process_set))

    def wait(self, handle):
        if isinstance(handle, tuple) and handle[0] == "alltoall":
            output, _received_splits = self._hvd.synchronize(handle[1])
            return output
        if isinstance(handle, tuple) and handle[0] == "widened":
            return handle[1].copy_(self._hvd.synchronize(handle[2]))
        if isinstance(handle, tuple) and handle[0] == "bytes":
            return self._hvd.synchronize(handle[2]).view(handle[1])
        return self._hvd.synchronize(handle)


class LocalTransport(Transport):
    """A world of one rank: no communication at all.

    For single-process runs and tests of the optimizer's own logic (selection, error feedback,
    checkpoints) without Horovod or MPI.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def allgather_async(self, payload, name):
        return payload

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor.mul_(prescale * postscale)

    def alltoall_async(self, payload, splits, name):
        return payload

    def wait(self, handle):
        return handle


class MPITransport(Transport):
    """mpi4py back end for clusters without Horovod: ``Iallgatherv`` / ``Iallreduce``.

    MPI matches collectives by call order, so ``ordered`` is set and the optimizer starts buckets
    in a fixed order on every rank. Per-rank sizes are exchanged with a tiny ``Allgather`` before
    the ``Iallgatherv``. CUDA tensors go to MPI as device buffers when MPI is CUDA-aware
    (``HVD_SPARSE_CUDA_AWARE_MPI=1``, or Open MPI reporting CUDA support), otherwise through host
    memory.
    """

    ordered = True

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.cuda_aware = _cuda_aware_mpi()

    def size(self) -> int:
        return self.comm.Get_size()

    def rank(self) -> int:
        return self.comm.Get_rank()

    def _staged(self, tensor):
        if tensor.device.type == "cpu" or self.cuda_aware:
            return tensor.contiguous()
        return tensor.detach().cpu()

    def _buffer(self, t):
        """An MPI byte buffer over a torch tensor's memory (host or CUDA-aware device)."""
        if t.device.type == "cpu":
            return t.view(torch.uint8).numpy()
        torch.cuda.current_stream(t.device).synchronize()  # the data must be complete
        return t.view(torch.uint8)  # exposes __cuda_array_interface__

    def allgather_async(self, payload, name):
        import numpy as np

        MPI = self.MPI
        src = self._staged(payload).reshape(-1)
        nbytes = src.numel() * src.element_size()
        counts = np.empty(self.size(), dtype=np.int64)
        seq = self._start()
        self._complete(self.comm.Iallgather(np.array([nbytes], dtype=np.int64), counts), seq)
        unit, unit_counts, displs = gatherv_layout(counts)
        out = torch.empty(int(counts.sum()), dtype=torch.uint8, device=src.device)
        dtype = MPI.BYTE if unit == 1 else self._unit_type(unit)
        req = self.comm.Iallgatherv([self._buffer(src), dtype],
                                    [self._buffer(out), unit_counts, displs, dtype])
        self._track(seq, req, (src, out))
        return ("gather", req, out, src, payload.dtype, payload.device, seq)

    def _watch(self):
        """The front end's watch over ``comm`` for ranks that left
        (:class:`hvd_sparse.mpi_guard.PeerExitWatch`), or None where there is none."""
        from . import mpi_guard

        return mpi_guard.watch(self.comm)

    def _start(self):
        """The number of the collective this rank starts now where ``comm`` is watched, else
        None."""
        w = self._watch()
        return None if w is None else w.post()

    def _track(self, seq, req, buffers) -> None:
        w = self._watch() if seq is not None else None
        if w is not None:
            w.track(seq, req if isinstance(req, list) else [req], buffers)

    def _complete(self, req, seq) -> None:
        """Wait for ``req`` (one request or a list), through the watch when there is one
        (none where the collective started unwatched, or ``shutdown`` came in between)."""
        reqs = req if isinstance(req, list) else [req]
        w = self._watch() if seq is not None else None
        if w is None:
            self.MPI.Request.Waitall(reqs)
        else:
            w.wait(reqs, seq)

    def alltoall_async(self, payload, splits, name):
        """Byte counts go first in a tiny ``Alltoall``, then the parts in an ``Ialltoallv``."""
        import numpy as np

        MPI = self.MPI
        src = self._staged(payload).reshape(-1)
        send = np.asarray(list(splits), dtype=np.int64)
        recv = np.empty(self.size(), dtype=np.int64)
        seq = self._start()
        self._complete(self.comm.Ialltoall(send, recv), seq)
        unit, send_units, send_displs = gatherv_layout(send)
        unit_r, recv_units, recv_displs = gatherv_layout(recv)
        if unit != 1 or unit_r != 1:  # past 2 GiB either way: MPI's counts are C ints
            raise ValueError("an all-to-all of more than 2**31 - 1 bytes per rank is not "
                             "supported by the mpi4py transport")
        out = torch.empty(int(recv.sum()), dtype=torch.uint8, device=src.device)
        req = self.comm.Ialltoallv([self._buffer(src), send_units, send_displs, MPI.BYTE],
                                   [self._buffer(out), recv_units, recv_displs, MPI.BYTE])
        self._track(seq, req, (src, out))
        return ("gather", req, out, src, payload.dtype, payload.device, seq)

    def _unit_type(self, unit):
        types = self.__dict__.setdefault("_unit_types", {})
        if unit not in types:
            types[unit] = self.MPI.BYTE.Create_contiguous(unit).Commit()
        return types[unit]

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        MPI = self.MPI
        work = self._staged(tensor).reshape(-1)
        wire_dtype = work.dtype
        if work.dtype in (torch.float16, torch.bfloat16):  # MPI has no half-precision SUM
            work = work.float()
        else:
            work = work.clone()
        if prescale != 1.0:
            work.mul_(prescale)
        out = torch.empty_like(work)
        mpi_type = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}[work.dtype]
        if work.device.type == "cpu":
            bufs = [work.numpy(), out.numpy()]
        else:  # CUDA-aware MPI reads device memory: the kernels that wrote it must be done
            torch.cuda.current_stream(work.device).synchronize()
            bufs = [work, out]
        # MPI's counts are C ints: past 2**31 - 1 elements the sum goes in pieces
        n, step = work.numel(), ALLREDUCE_CHUNK
        seq = self._start()
        req = [self.comm.Iallreduce([bufs[0][lo:lo + step], mpi_type],
                                    [bufs[1][lo:lo + step], mpi_type], op=MPI.SUM)
               for lo in range(0, max(n, 1), step)]
        scale = postscale / self.size() if average else postscale
        self._track(seq, req, (work, out))
        return ("reduce", req, out, (work, scale), wire_dtype, tensor.device, seq)

    def wait(self, handle):
        """Complete a collective; returns the gathered bytes (as the payload's dtype) or the sum."""
        kind, req, out, keep, dtype, device, seq = handle
        self._complete(req, seq)
        if kind == "gather":
            result = out.view(dtype)
        else:
            _work, scale = keep  # the send buffer must live until the request completes
            if scale != 1.0:
                out.mul_(scale)
            result = out.to(dtype)
        return result.to(device) if result.device != device else result


INT_MAX = 2**31 - 1
ALLREDUCE_CHUNK = 1 << 30  # elements per Iallreduce of the mpi4py transport


def gatherv_layout(counts):
    """(unit, counts, displacements) for an ``Allgatherv`` of byte counts: MPI takes C ints,
    so past 2**31 - 1 bytes in all the exchange moves units of 8 bytes (hvd_sparse's payloads
    are padded to 8), or 2**k bytes where every count allows it."""
    import numpy as np

    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    unit = 1
    while total // unit > INT_MAX:
        if unit >= 2**20 or np.any(counts % (unit * 2)):
            raise ValueError(f"an allgather of {total} bytes in counts {counts.tolist()} does "
                             "not fit MPI's int counts in any common unit")
        unit *= 2
    unit_counts = counts // unit
    displs = np.concatenate([[0], np.cumsum(unit_counts)[:-1]]).astype(np.int64)
    return unit, unit_counts, displs


def cuda_in_library_version(text: str) -> bool:
    """Does an MPI library version string announce CUDA support? ("--without-cuda" does not.)"""
    import re

    for token in re.findall(r"[\w=+-]*cuda[\w=+-]*", text.lower()):
        if not re.search(r"(without|disable|no)[-_]?cuda|cuda[-_=]?(no|off|false)\b", token):
            return True
    return False


def _cuda_aware_mpi() -> bool:
    import os

    flag = os.environ.get("HVD_SPARSE_CUDA_AWARE_MPI")
    if flag is not None:
        return flag == "1"
    try:
        from mpi4py import MPI

        return cuda_in_library_version(MPI.Get_library_version()) and \
            os.environ.get("OMPI_MCA_opal_cuda_support", "true") != "false"
    except Exception:  # pragma: no cover
        return False


def _beside_horovod(t: "MPITransport") -> "MPITransport":
    """mpi4py collectives in a job where Horovod is initialised too (``transport="mpi"`` with
    the Horovod front end: no Horovod background cycle per collective). They must see Horovod's
    ranks (under ``horovodrun --gloo`` each process is an MPI world of its own), and when
    Horovod's own thread calls MPI the library must allow calls from several threads; the
    collectives then run on a duplicate of COMM_WORLD, apart from Horovod's."""
    import os

    try:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            launched = os.environ.get("HOROVOD_SIZE")  # set by horovodrun's Gloo launcher
            if launched and launched.isdigit() and int(launched) != t.size():
                # Horovod's own optimizer refuses this with the same words; picking mpi4py
                # here would give each process a world of its own and no exchange at all
                raise ValueError(
                    "Horovod has not been initialized; use hvd.init() (this process was "
                    f"launched as one of {launched} Horovod ranks, but mpi4py sees a world of "
                    f"{t.size()}: call hvd.init() before wrapping the optimizer)")
            return t
    except ImportError:
        return t
    if (t.size(), t.rank()) != (hvd.size(), hvd.rank()):
        raise ValueError(
            f"transport='mpi': mpi4py sees rank {t.rank()} of {t.size()} but Horovod rank "
            f"{hvd.rank()} of {hvd.size()}; launch with mpirun (or horovodrun's MPI mode) or "
            "use transport='horovod'")
    if hvd.mpi_enabled() and not hvd.mpi_threads_supported():
        raise ValueError("transport='mpi' beside Horovod's MPI controller needs an MPI "
                         "initialised with MPI_THREAD_MULTIPLE; use transport='horovod'")
    t.comm = t.comm.Dup()
    return t


def make_transport(spec=None, process_set=None) -> Transport:
    """The ``transport=`` keyword: an instance, ``"horovod"``, ``"mpi"``, ``"torch"``
    (:mod:`hvd_sparse.torch_transport`), ``"local"`` or ``None``.

    ``None`` (or the environment variable ``HVD_SPARSE_TRANSPORT``) picks Horovod when it is
    installed and initialised, else ``torch.distributed`` when its process group is up, else
    mpi4py when it is installed, else Horovod (whose error then says what is missing).
    """
    import os

    if isinstance(spec, Transport):
        if process_set is not None:
            raise ValueError("pass process_set to the transport, not with transport=")
        return spec
    spec = spec or os.environ.get("HVD_SPARSE_TRANSPORT") or None
    if spec is None:
        try:
            import horovod.torch as hvd

            if hvd.is_initialized():
                spec = "horovod"
        except ImportError:
            pass
        if spec is None and torch.distributed.is_available() \
                and torch.distributed.is_initialized():
            spec = "torch"
        if spec is None:
            try:
                import mpi4py  # noqa: F401

                spec = "mpi"
            except ImportError:
                spec = "horovod"
    if spec == "horovod":
        try:
            return HorovodTransport(process_set)
        except ImportError as e:
            raise ImportError("transport='horovod' needs Horovod (launch/setup.sh builds it); "
                              f"or use transport='mpi' with mpi4py ({e})") from e
    if process_set is not None:
        raise ValueError(f"process_set is a Horovod feature; transport={spec!r} does not take it")
    if spec == "mpi":
        return _beside_horovod(MPITransport())
    if spec == "local":
        return LocalTransport()
    if spec == "torch":
        from .torch_transport import TorchDistributedTransport

        return TorchDistributedTransport()
    raise ValueError(f"transport={spec!r} is not one of 'horovod', 'mpi', 'torch', 'local' or "
                     "a Transport")
