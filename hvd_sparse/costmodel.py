"""When a sparse allgather stops paying: the per-bucket dense fallback.

Per rank, an allgather of P payloads of k entries receives about ``P * k * (index + value bytes)``
while a ring allreduce of the dense bucket moves ``2 (P - 1) / P * n * value bytes`` (the
bandwidth term of the standard latency + bytes/bandwidth model; latency terms are similar for
both, a few steps per collective, and are left out). Once ``P * density`` approaches the ratio
of those byte counts, the dense allreduce is cheaper. The decision uses only the bucket size, the
target density, the world size and the dtypes, so every rank makes the same one.
"""
from __future__ import annotations


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


def prefer_dense(numel: int, k: int, world_size: int, index_bytes: int, value_bytes: int,
                 dense_value_bytes: int, dense_by: str = "ring") -> bool:
    """True when the dense exchange (``"ring"`` allreduce or ``"gather"``) would move no more
    bytes than the sparse allgather."""
    if world_size <= 1:
        return False
    dense = dense_bytes(numel, world_size, dense_value_bytes) if dense_by == "ring" \
        else dense_gather_bytes(numel, world_size, dense_value_bytes)
    return sparse_bytes(numel, k, world_size, index_bytes, value_bytes) >= dense
