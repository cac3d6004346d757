"""A dense bucket's deterministic exchange from 3 ranks on, in about an allreduce's bytes.

From 3 ranks on an allreduce's summation order (MPI's, with Horovod's fusion deciding which
tensors travel together) can change between runs, so ``deterministic_dense`` sums dense
buckets in rank order. Gathering every rank's whole vector does that, but each rank then
receives P - 1 vectors and adds P of them. Here the bucket is cut into P equal regions: an
all-to-all brings each rank its region from every rank, the owner adds them in rank order
(the same additions as after a gather, so the same bits for every finite value; a NaN
from float16 may carry another payload, as torch widens halves in its vector loop and its
scalar tail differently), and an allgather of the P region sums
hands every rank the result: about (P - 1) / P of the vector received in each of the two
collectives, as a ring allreduce receives, and one region summed per rank instead of the whole
vector. Small buckets keep the gather, whose one collective costs one latency instead of two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

import torch

from ..transport import Transport

#: buckets of at least this many bytes on the wire go by regions (smaller ones: the gather)
REGIONS_FROM_BYTES = 256 << 10
#: Horovod's all-to-all splits are 32-bit counts
MAX_BYTES = 2 ** 31 - 1


def applies(transport, size: int, nbytes: int, wire_itemsize: int, acc_itemsize: int) -> bool:
    """By regions? From the bucket's bytes on the wire, its value sizes and the world size
    alone, so every rank agrees; only where the transport has an all-to-all, and where it
    receives fewer bytes than the gather: the sums travel in the accumulation dtype (float32
    for float16 on the wire), so float16 gains only from 4 ranks."""
    return size > 2 and REGIONS_FROM_BYTES <= nbytes <= MAX_BYTES \
        and wire_itemsize * size > wire_itemsize + acc_itemsize \
        and type(transport).alltoall_async is not Transport.alltoall_async


def edges(numel: int, size: int) -> List[int]:
    """Where each rank's region starts, then ``numel``."""
    return [numel * r // size for r in range(size + 1)]


@dataclass
class Regions:
    """A bucket between the two collectives: the all-to-all's handle, then the allgather's."""

    exchange: object
    edges: List[int]
    wire_dtype: torch.dtype
    name: str
    gather: object = None
    received_bytes: int = 0


def start(transport, wire_t: torch.Tensor, name: str) -> Regions:
    """Send region r of this rank's (compressed) vector to rank r, as bytes (every transport
    counts bytes alike)."""
    flat = wire_t.reshape(-1).contiguous()
    size = transport.size()
    e = edges(flat.numel(), size)
    item = flat.element_size()
    splits = [(e[r + 1] - e[r]) * item for r in range(size)]
    handle = transport.alltoall_async(flat.view(torch.uint8), splits, name)
    return Regions(handle, e, flat.dtype, name)


def sum_region(transport, regions: Regions, got: torch.Tensor, decompress: Callable,
               acc_dtype: torch.dtype, average: bool, buffer: Callable) -> None:
    """Add this rank's region from every rank (``got``: what the all-to-all brought) in rank
    order in ``acc_dtype`` (then divide by P for an average, as after a gather) and start the
    allgather of the sums, written into ``buffer(numel, dtype, device)``."""
    size, rank = transport.size(), transport.rank()
    lo, hi = regions.edges[rank], regions.edges[rank + 1]
    got = got.reshape(-1)
    item = regions.wire_dtype.itemsize
    if got.numel() * got.element_size() != size * (hi - lo) * item:
        raise RuntimeError(f"{regions.name}: received {got.numel() * got.element_size()} bytes "
                           f"for a region of {hi - lo} entries from {size} ranks; the ranks "
                           "disagree on the bucket (its parameters or their dtype)")
    parts = got.view(torch.uint8).view(regions.wire_dtype).view(size, hi - lo)
    out = torch.add(decompress(parts[0]).to(acc_dtype), decompress(parts[1]).to(acc_dtype),
                    out=buffer(hi - lo, acc_dtype, parts.device))
    for r in range(2, size):
        out.add_(decompress(parts[r]).to(acc_dtype))
    if average:
        out.mul_(1.0 / size)
    regions.gather = transport.allgather_async(out, regions.name + ".sum")
    regions.received_bytes = (size - 1) * (hi - lo) * item \
        + (regions.edges[-1] - (hi - lo)) * out.element_size()


def result(transport, regions: Regions) -> torch.Tensor:
    """The summed vector (``acc_dtype``), the same bits on every rank."""
    return transport.wait(regions.gather).reshape(-1)


def sent_bytes(regions: Regions, acc_itemsize: int, rank: int) -> int:
    """What this rank sends: the other ranks' regions of its vector, then its region's sum."""
    lo, hi = regions.edges[rank], regions.edges[rank + 1]
    item = regions.wire_dtype.itemsize
    return (regions.edges[-1] - (hi - lo)) * item + (hi - lo) * acc_itemsize
