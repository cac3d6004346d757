"""When a sparse exchange stops paying: the per-bucket dense fallback.

Two rules. ``"time"`` (the default) weighs measured time: the sparse path's own compute per
bucket (timed on the first steps, the maximum over ranks) plus the link's latency and
bandwidth (timed with real collectives at start-up), against the time of a dense allreduce of
the bucket on the same link. ``"bytes"`` compares bytes only (below). Both use only numbers
every rank holds alike, so every rank makes the same decision.

The bytes rule:

Per rank, an allgather of P payloads of k entries receives about ``P * k * (index + value bytes)``
while a ring allreduce of the dense bucket moves ``2 (P - 1) / P * n * value bytes`` (the
bandwidth term of the standard latency + bytes/bandwidth model; latency terms are similar for
both, a few steps per collective, and are left out). Once ``P * density`` approaches the ratio
of those byte counts, the dense allreduce is cheaper. The decision uses only the bucket size, the
target density, the world size and the dtypes, so every rank makes the same one.
"""
from __future__ import annotations

from . import golomb


def sparse_bytes(numel: int, k: int, world_size: int, index_bytes: int, value_bytes: int,
                 header_bytes: int = 16) -> float:
    """Bytes one rank receives from an allgather of fixed-k payloads."""
    return world_size * (k * (index_bytes + value_bytes) + header_bytes)


def dense_bytes(numel: int, world_size: int, value_bytes: int) -> float:
    """Bytes one rank sends (and receives) in a ring allreduce."""
    return 2.0 * (world_size - 1) / world_size * numel * value_bytes


def dense_gather_bytes(numel: int, world_size: int, value_bytes: int) -> float:
    """Bytes one rank receives when the dense vectors are gathered (the deterministic path)."""
    return world_size * numel * value_bytes


def dense_regions_bytes(numel: int, world_size: int, value_bytes: int,
                        sum_value_bytes: int) -> float:
    """Bytes one rank receives when a dense bucket is summed by regions
    (:mod:`hvd_sparse.engine.dense_regions`): (P - 1) / P of the vector, then of the sums."""
    return (world_size - 1) / world_size * numel * (value_bytes + sum_value_bytes)


def prefer_dense(numel: int, k: int, world_size: int, index_bytes: int, value_bytes: int,
                 dense_value_bytes: int, dense_by: str = "ring",
                 sum_value_bytes: int = 0) -> bool:
    """True when the dense exchange (``"ring"`` allreduce, ``"gather"`` or ``"regions"``,
    whose sums travel with ``sum_value_bytes`` each) would move no more bytes than the sparse
    allgather."""
    if world_size <= 1:
        return False
    if dense_by == "regions":
        dense = dense_regions_bytes(numel, world_size, dense_value_bytes,
                                    sum_value_bytes or dense_value_bytes)
    elif dense_by == "ring":
        dense = dense_bytes(numel, world_size, dense_value_bytes)
    else:
        dense = dense_gather_bytes(numel, world_size, dense_value_bytes)
    return sparse_bytes(numel, k, world_size, index_bytes, value_bytes) >= dense


class Link:
    """Latency and bandwidth of the two collectives, fitted from timed transfers of two sizes.

    ``gather_*``: seconds and bytes-received-per-second of an allgather; ``reduce_*``: of an
    allreduce, per byte of the tensor (the ring factor and the reduction are in the figure).
    """

    def __init__(self, gather_latency_s, gather_bandwidth_Bps, reduce_latency_s,
                 reduce_bandwidth_Bps):
        self.gather_latency_s = float(gather_latency_s)
        self.gather_bandwidth_Bps = float(gather_bandwidth_Bps)
        self.reduce_latency_s = float(reduce_latency_s)
        self.reduce_bandwidth_Bps = float(reduce_bandwidth_Bps)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fit_line(size_small, t_small, size_large, t_large):
    """(latency, bandwidth) of ``t = latency + size / bandwidth`` through two timings."""
    slope = max(t_large - t_small, 1e-9) / max(size_large - size_small, 1)
    return max(t_small - size_small * slope, 0.0), 1.0 / slope


def sparse_time(compute_s: float, received_bytes: float, link: Link) -> float:
    """One bucket's sparse step: own compute plus an allgather of ``received_bytes``."""
    return compute_s + link.gather_latency_s + received_bytes / link.gather_bandwidth_Bps


def dense_time(nbytes: float, world_size: int, link: Link, by: str = "reduce",
               fused: bool = False, sums_nbytes: float = None) -> float:
    """One bucket's dense step: an allreduce of ``nbytes`` (``by="gather"``: an allgather of P
    copies; ``"regions"``: :mod:`hvd_sparse.engine.dense_regions`).
    ``fused``: the step makes an allreduce anyway (tensors that are always dense), and
    Horovod fuses the ones that are ready together, so the bucket adds its bytes and no
    latency of its own. ``sums_nbytes``: by regions, the sums' bytes (in the accumulation
    dtype; default ``nbytes``)."""
    if by == "gather":
        return link.gather_latency_s + world_size * nbytes / link.gather_bandwidth_Bps
    if by == "regions":  # an all-to-all of the vector, then an allgather of P sums' regions
        sums = nbytes if sums_nbytes is None else sums_nbytes
        return 2 * link.gather_latency_s + (nbytes + sums) / link.gather_bandwidth_Bps
    return (0.0 if fused else link.reduce_latency_s) + nbytes / link.reduce_bandwidth_Bps


def sharded_time(compute_s: float, payload_bytes: float, world_size: int, link: Link,
                 downlink_ratio: float = 1.0, histogram_bytes: float = 0.0) -> float:
    """One bucket's sharded step: own compute, an all-to-all of this rank's payload of
    ``payload_bytes`` and an allgather of the owners' selections (``downlink_ratio`` payloads'
    worth in all); two latencies. The link's gather bandwidth is in bytes gathered (every
    rank's part, its own included) per second, and in that measure an all-to-all of a payload
    of ``s`` per rank costs ``s`` on a shared link and on a switched one alike (each rank
    receives ``(P - 1) / P`` of ``s`` where an allgather of ``s`` in all receives that too);
    charging only the ``(P - 1) / P`` share, as before the thirty-sixth session, priced the
    sharded exchange ``P / (P - 1)`` times too cheap (at 2 ranks half: a bucket went sharded
    where the allgather was faster). ``histogram_bytes``: the global rule's two histogram
    allreduces of this size in all (their latencies are charged in full, though buckets share
    them)."""
    t = (compute_s + 2 * link.gather_latency_s
         + payload_bytes * (1.0 + downlink_ratio) / link.gather_bandwidth_Bps)
    if histogram_bytes:
        t += 2 * link.reduce_latency_s + histogram_bytes / link.reduce_bandwidth_Bps
    return t


def golomb_trade(entries: float, world_size: int, numel: int, index_bytes: int,
                 encode_s: float, decode_s: float, link: Link) -> tuple:
    """What Golomb-Rice positions would change in one bucket's allgather of ``entries``
    positions in all (``world_size`` payloads): ``(codec seconds added, wire seconds saved,
    bytes saved)``. A rank codes its own payload once (``encode_s`` per position) and decodes
    the others' (``decode_s`` per position; its own is never decoded); the positions shrink from
    ``index_bytes`` each to the code's expected length at the payloads' density (at 1%, 8.1
    bits against 32), which holds for positions in any arrangement, since the gaps of k
    positions in n sum to at most n."""
    per_rank = entries / max(world_size, 1)
    density = min(1.0, per_rank / max(numel, 1))
    bits = golomb.expected_bits_per_position(density) if density > 0 else 0.0
    saved_bytes = max(0.0, entries * (index_bytes - bits / 8.0))
    codec_s = per_rank * encode_s + (entries - per_rank) * decode_s
    return codec_s, saved_bytes / link.gather_bandwidth_Bps, saved_bytes
