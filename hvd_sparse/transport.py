"""Collective back ends. The optimizer sees only this small interface, so an mpi4py back end
can stand beside the Horovod one.

``allgather_async`` takes one rank's uint8 payload (sizes may differ per rank) and returns, at
``wait``, the concatenation of every rank's payload in rank order. ``allreduce_async`` is used for
tensors sent dense (too small to be worth sparsifying).
"""
from __future__ import annotations

import torch


class Transport:
    """Interface of a collective back end."""

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

    def wait(self, handle) -> torch.Tensor:
        raise NotImplementedError


class HorovodTransport(Transport):
    """Horovod's asynchronous collectives; names match across ranks, so launch order may differ."""

    def __init__(self, process_set=None):
        import horovod.torch as hvd

        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def included(self) -> bool:
        return self.process_set.included()

    def allgather_async(self, payload, name):
        return self._hvd.allgather_async(payload, name=name, process_set=self.process_set)

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        op = self._hvd.Average if average else self._hvd.Sum
        return self._hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                          postscale_factor=postscale,
                                          process_set=self.process_set)

    def wait(self, handle):
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

    def wait(self, handle):
        return handle
