"""``torch.distributed`` back end: hvd_sparse under ``torchrun`` with neither Horovod nor mpi4py.

Many clusters launch PyTorch with ``torchrun`` (or a scheduler that sets its environment) and
have a process group already: ``dist.init_process_group("gloo")`` on CPUs, ``"nccl"`` on GPUs.
This transport carries the engine's exchange over that group, so ``DistributedOptimizer(...,
transport="torch")`` (picked by itself when a process group is up and Horovod is not) trains
exactly as over Horovod or mpi4py: the same payload bytes, summed in the same rank order.
(Dense buckets under ``deterministic_dense=False`` go through the backend's own allreduce,
whose summation order is its own, as Horovod's and MPI's are.)

Like MPI, ``torch.distributed`` matches collectives by the order they are started, so
``ordered`` is set and the engine starts buckets in one fixed order on every rank. Variable-size
payloads travel as one tiny all-gather of their byte counts, then an all-gather of the payloads
padded to the longest (the padding is cut off again before decoding). Tensors go to the group in
the backend's place: host memory for gloo, the current CUDA device for NCCL.
"""
from __future__ import annotations

import torch

from .transport import Transport


class TorchDistributedTransport(Transport):
    """Collectives of a ``torch.distributed`` process group (the default group unless given)."""

    ordered = True

    def __init__(self, group=None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("transport='torch' needs torch.distributed's process group: call "
                               "torch.distributed.init_process_group() first (torchrun sets "
                               "the environment it reads)")
        self.dist, self.group = dist, group
        self.backend = str(dist.get_backend(group)).lower()
        self.on_cuda = "nccl" in self.backend  # NCCL takes device tensors only
        # torch 2.13 renamed the one-tensor all-gather (the old name warns there)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def size(self) -> int:
        return self.dist.get_world_size(self.group)

    def rank(self) -> int:
        return self.dist.get_rank(self.group)

    def _staged(self, tensor, copy=False):
        """``tensor`` where the backend reads it (a copy when ``copy``: the collective writes)."""
        if self.on_cuda:  # a CUDA tensor where it lies (a model on cuda:local_rank without
            # set_device would otherwise be staged to the current device, cuda:0, every call)
            where = tensor.device if tensor.device.type == "cuda" \
                else torch.device("cuda", torch.cuda.current_device())
        else:
            where = torch.device("cpu")
        out = tensor.detach().reshape(-1)
        if out.device != where:
            return out.to(where)
        return out.clone() if copy else out.contiguous()

    def _counts(self, n: int, device) -> list:
        mine = torch.tensor([n], dtype=torch.int64, device=device)
        every = torch.empty(self.size(), dtype=torch.int64, device=device)
        self._gather(every, mine, group=self.group)
        return every.tolist()

    def allgather_async(self, payload, name):
        src = self._staged(payload)
        counts = self._counts(src.numel(), src.device)
        longest = max(counts)
        if src.numel() < longest:
            src = torch.cat([src, src.new_zeros(longest - src.numel())])
        out = torch.empty(longest * len(counts), dtype=src.dtype, device=src.device)
        work = self._gather(out, src, group=self.group, async_op=True)
        return ("gather", work, (out, counts, longest, src), payload.dtype, payload.device)

    def alltoall_async(self, payload, splits, name):
        """Byte counts first in a tiny all-to-all, then the parts."""
        src = self._staged(payload)
        splits = [int(x) for x in splits]
        send = torch.tensor(splits, dtype=torch.int64, device=src.device)
        recv = torch.empty_like(send)
        self.dist.all_to_all_single(recv, send, group=self.group)
        recv_counts = recv.tolist()
        out = torch.empty(sum(recv_counts), dtype=src.dtype, device=src.device)
        work = self.dist.all_to_all_single(out, src, output_split_sizes=recv_counts,
                                           input_split_sizes=splits,
                                           group=self.group, async_op=True)
        return ("exchange", work, (out, src), payload.dtype, payload.device)

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        work = self._staged(tensor, copy=True)
        wire_dtype = work.dtype
        if work.dtype in (torch.float16, torch.bfloat16):  # summed in float32, as over MPI
            work = work.float()
        if prescale != 1.0:
            work.mul_(prescale)
        handle = self.dist.all_reduce(work, op=self.dist.ReduceOp.SUM, group=self.group,
                                      async_op=True)
        scale = postscale / self.size() if average else postscale
        return ("reduce", handle, (work, scale), wire_dtype, tensor.device)

    def wait(self, handle):
        """Complete a collective: the gathered bytes (as the payload's dtype), the bytes sent to
        this rank, or the (scaled) sum."""
        kind, work, keep, dtype, device = handle
        work.wait()
        if kind == "gather":
            out, counts, longest, _src = keep
            if all(c == longest for c in counts):
                result = out
            else:
                result = torch.cat([out[r * longest:r * longest + c]
                                    for r, c in enumerate(counts)])
            result = result.view(dtype)
        elif kind == "exchange":
            result = keep[0].view(dtype)
        else:
            result, scale = keep
            if scale != 1.0:
                result.mul_(scale)
            result = result.to(dtype)
        return result.to(device) if result.device != device else result
