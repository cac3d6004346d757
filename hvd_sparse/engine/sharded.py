"""The sharded exchange: every rank serves one region of each bucket's index space.

With an allgather every rank receives all P ranks' selections, so its traffic grows with P. Here
(the reduce-scatter-then-allgather form of Ok-Topk and SparCML, and the server-free reading of
bidirectional Top-K: each rank is the server for one shard):

    uplink      each rank's selection, cut at the region bounds, one payload per owner
    all-to-all  owner r receives, from every rank in rank order, the entries of region r
    owner       sums them in rank order into its own downlink residual for the region,
                selects from it and keeps what it did not send
    allgather   the owners' selections, so every rank writes the same update; regions are in
                rank order, so the concatenated positions are already ascending

Per rank about ``k_up (P-1)/P`` pairs go out and come in on the all-to-all and ``k_down``
pairs arrive on the allgather, whatever P. What an owner selects: for Top-K under the global
rule, everything at or above one threshold for the whole bucket, found from every owner's
magnitude histograms (two small allreduces; :func:`coarse_bin`, :func:`fine_threshold`), and a
bucket too small for those histograms to pay goes by allgather instead
(:func:`allgather_is_cheaper`); otherwise the downlink density of the region's length (the
per-region rule, measured against exact global Top-K in ``benchmarks/sharded.py``). Regions
start as equal slices and follow the load counted from the gathered downlink positions
(:func:`load_counts`, :func:`balanced_bounds`) where the selection does not depend on a
region's length. A region's downlink residual lives on its owner alone: it is in that rank's
``state_dict`` and is restored on the same rank of a job of the same size, or from
:func:`hvd_sparse.merge_rank_states` of every rank's on a job of any size.

Methods that observe the aggregate (adaptive k) observe the gathered downlink selection, which
every rank holds, instead of the whole aggregate, which no rank holds.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from .. import wire
from ..kernels import select


def region_bounds(numel: int, size: int) -> Tuple[int, ...]:
    """``size + 1`` bounds of equal regions (the first ``numel % size`` one entry longer);
    regions are empty when the bucket has fewer entries than ranks."""
    base, extra = divmod(numel, size)
    out, at = [0], 0
    for r in range(size):
        at += base + (1 if r < extra else 0)
        out.append(at)
    return tuple(out)


LOAD_BINS = 1024  # position bins of a bucket's load statistic
REBALANCE_AT = 1.5  # busiest region's load over the mean that moves the bounds
COLD_SHARE = 0.25  # share of the balancing weight given by length rather than load


def load_counts(idx: torch.Tensor, numel: int, into=None) -> torch.Tensor:
    """How many of the positions ``idx`` fall in each of ``min(LOAD_BINS, numel)`` equal
    position bins, added to ``into`` when it has that many bins (float64 on ``idx``'s device,
    exact: summed over steps as the load statistic, and moved to the host only when the load
    is checked)."""
    bins = max(1, min(LOAD_BINS, numel))
    if into is None or into.numel() != bins:
        into = torch.zeros(bins, dtype=torch.float64, device=idx.device)
    if idx.numel():
        # index_add_ rather than bincount: no read of the largest index back to the host
        one = torch.ones((), dtype=torch.float64, device=idx.device).expand(idx.numel())
        into.index_add_(0, idx * bins // numel, one)
    return into


def region_loads(counts: torch.Tensor, bounds, numel: int) -> torch.Tensor:
    """The load of each region from the binned counts, a bin counted in the region that holds
    its first position (exact once bounds lie on bin edges, as re-balanced ones do)."""
    counts = counts.double().cpu()
    bins = counts.numel()
    starts = -(-torch.arange(bins, dtype=torch.int64) * numel // bins)  # first position of a bin
    owner = torch.searchsorted(torch.tensor(bounds[1:-1], dtype=torch.int64), starts,
                               right=True)
    return torch.zeros(len(bounds) - 1, dtype=torch.float64).index_add_(0, owner, counts)


def balanced_bounds(counts: torch.Tensor, numel: int, size: int) -> Tuple[int, ...]:
    """Region bounds on bin edges that share the expected load equally. The weight of a bin
    is its share of the load counts, mixed with its share of the length (``COLD_SHARE`` of
    the weight), so no region grows past 1 / COLD_SHARE times the equal length (its owner
    also scans it). Pure arithmetic on replicated counts: every rank gets the same bounds."""
    counts = counts.double().cpu()
    bins = counts.numel()
    total = float(counts.sum())
    load = counts.double() / total if total > 0 else torch.full((bins,), 1.0 / bins,
                                                                dtype=torch.float64)
    w = (1.0 - COLD_SHARE) * load + COLD_SHARE / bins
    cum = torch.cumsum(w, 0)
    targets = cum[-1] * torch.arange(1, size, dtype=torch.float64) / size
    edges = torch.searchsorted(cum, targets).clamp(max=bins - 1) + 1  # bins before the cut
    inner = (-(-edges * numel // bins)).tolist()  # the first position of bin ``edges``
    return tuple([0] + [int(x) for x in inner] + [numel])


def whole_from_regions(numel: int, pieces, dtype) -> Tuple[torch.Tensor, int]:
    """A bucket's whole downlink residual from the regions that owners of an earlier world
    still hold, ``(lo, hi, residual)`` each, in any order (the same region twice counts
    once); positions no piece covers (a departed owner's) are zeros. The pieces come from one
    world (the last agreed one), so they do not overlap. Returns the residual and how many
    positions the pieces covered."""
    whole = torch.zeros(numel, dtype=dtype)
    covered, seen = 0, set()
    for lo, hi, res in pieces:
        if (lo, hi) in seen or not 0 <= lo <= hi <= numel or res.numel() != hi - lo:
            continue
        seen.add((lo, hi))
        whole[lo:hi] = res.reshape(-1).to(dtype)
        covered += hi - lo
    return whole, covered


def cut_points(idx: torch.Tensor, bounds) -> List[int]:
    """Where each region's entries start and end in the ascending positions ``idx`` (one host
    read for all regions)."""
    inner = torch.tensor(bounds[1:-1], dtype=idx.dtype, device=idx.device)
    cuts = torch.searchsorted(idx, inner).tolist() if inner.numel() else []
    return [0] + cuts + [idx.numel()]


def encode_parts(idx, wire_values, bounds, *, constant, **encode_args):
    """One payload per region owner, concatenated, and their byte counts."""
    cuts = cut_points(idx, bounds)
    parts = []
    for r in range(len(bounds) - 1):
        a, e = cuts[r], cuts[r + 1]
        values = wire_values if constant else wire_values[a:e]
        parts.append(wire.encode(idx[a:e], values, constant=constant, **encode_args))
    return torch.cat(parts), [p.numel() for p in parts]


def check_region(payloads, lo: int, hi: int, bucket: str) -> None:
    """Every received position lies in this owner's region (one host read)."""
    firsts = [p.indices[:1] for p in payloads if p.indices.numel()]
    lasts = [p.indices[-1:] for p in payloads if p.indices.numel()]
    if not firsts:
        return
    smallest, largest = torch.stack([torch.cat(firsts).min(), torch.cat(lasts).max()]).tolist()
    if smallest < lo or largest >= hi:
        raise wire.PayloadError(
            f"a rank sent positions {smallest}..{largest} of bucket '{bucket}' to the owner of "
            f"{lo}..{hi - 1}: the ranks disagree on the world size or the collective")


HIST_SHIFT = 20  # first round: 2048 bins of |x|, the exponent and 3 mantissa bits
BINS = 1 << (31 - HIST_SHIFT)
FINE_SHIFT = 9  # second round, inside the bin that holds the k-th: the next 11 bits
FINE_BINS = 1 << (HIST_SHIFT - FINE_SHIFT)
TINY = float(np.nextafter(np.float32(0), np.float32(1)))


HISTOGRAM_TENSOR_BYTES = (BINS + FINE_BINS) * 8  # one bucket's two histograms, float64 counts


def histogram_bytes(size: int) -> int:
    """Bytes one rank receives for one bucket's two histograms (a ring allreduce moves
    2 (P-1)/P of the tensor to each rank)."""
    return int(2 * (size - 1) / size * HISTOGRAM_TENSOR_BYTES)


def allgather_is_cheaper(k_up: int, k_down: int, size: int, pair_bytes: int) -> bool:
    """Whether an allgather of the uplink selections receives no more bytes per rank than the
    sharded exchange with the global rule's histograms: P - 1 selections against an
    all-to-all and an allgather of about (P-1)/P of one selection each, plus the histograms.
    Small buckets at a few ranks (every bucket at two): their exact global Top-K is cheapest
    when every rank picks it from all the selections itself."""
    gathered = (size - 1) * k_up * pair_bytes
    sharded = (size - 1) / size * (k_up + k_down) * pair_bytes + histogram_bytes(size)
    return gathered <= sharded


def _bits_to_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def coarse_bin(hist, k: int):
    """First round, from the whole bucket's coarse histogram: the bin holding the k-th
    largest magnitude and how many entries lie above that bin; ``None`` when k reaches into
    the zeros (then every non-zero entry is selected)."""
    counts = hist.double().cpu().numpy().copy()
    counts[0xFF << (23 - HIST_SHIFT):] = 0  # exponent 255: Inf/NaN (reported by flags)
    counts[0] = 0  # zeros and the smallest denormals
    at_or_above = np.cumsum(counts[::-1])[::-1]  # at_or_above[b]: entries in bins >= b
    if k <= 0 or at_or_above[0] < k:
        return None
    b = int(np.searchsorted(-at_or_above, -k, side="right")) - 1  # last bin with >= k above
    above = int(at_or_above[b + 1]) if b + 1 < counts.size else 0
    return b, above


def fine_threshold(b: int, above: int, fine, k: int) -> float:
    """Second round: inside coarse bin ``b`` (``above`` entries lie higher), the finer edge
    whose count of entries at or above it is closest to ``k`` (ties: the lower, more)."""
    counts = fine.double().cpu().numpy()
    at_or_above = above + np.cumsum(counts[::-1])[::-1]
    j = int(np.searchsorted(-at_or_above, -k, side="right")) - 1
    j = max(j, 0)
    if j + 1 < counts.size and at_or_above[j] - k > k - at_or_above[j + 1]:
        j += 1
    if b == 0 and j == 0:
        return float(select.tiny())  # TINY, unless subnormals flush to zero
    return _bits_to_float((b << HIST_SHIFT) | (j << FINE_SHIFT))
