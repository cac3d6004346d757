"""Top-K over a bucket of several tensors with a per-tensor floor: between layer-wise and global.

One Top-K over a whole model (``scope="model"``) lets the layers compete for the budget, which
the character LSTM gains from (benchmarks/convergence.py), but a layer whose gradients are
small then waits many steps for its turn, which costs the Fashion-MNIST ResNet accuracy
(benchmarks/accuracy.py): layer-wise selection (DGC, Lin et al. 2018) never starves a layer,
global selection (Shi et al., 2019) spends the budget where the magnitudes are. The floor takes
both: each tensor first keeps its own top ``ceil(floor * k_i)`` entries (``k_i``: its own Top-K
at the density), then the rest of the bucket's budget goes to the largest remaining entries of
any tensor. ``floor=0`` is global Top-K, ``floor=1`` is layer-wise Top-K in one bucket.

Order everywhere: magnitude descending, then position ascending (the ties rule of
:func:`~hvd_sparse.sparsifiers.base.topk_of`), so the result is a function of the values only.
"""
from __future__ import annotations

import functools
import math
from typing import List, Sequence, Tuple

import torch

from .base import k_for_density, topk_of


def floors(segments: Sequence[Tuple[int, int]], density: float, floor: float) -> List[int]:
    """Each segment's guaranteed count: ``ceil(floor * k_i)``, at most its length."""
    return list(_floors(tuple(segments), density, floor))


@functools.lru_cache(maxsize=256)
def _floors(segments, density, floor):
    # asked several times a step per bucket (hundreds of tensors in a shared bucket): once
    # per bucket and density
    out = []
    for lo, hi in segments:
        n = hi - lo
        out.append(min(n, math.ceil(floor * k_for_density(n, density))) if floor > 0 else 0)
    return tuple(out)


def budget(numel: int, segments, density: float, floor: float) -> int:
    """The bucket's count: its own Top-K at the density, or the floors' sum where the floors'
    rounding asks for more."""
    return min(numel, max(k_for_density(numel, density), sum(floors(segments, density, floor))))


def select(mag: torch.Tensor, density: float, segments, floor: float) -> torch.Tensor:
    """The plain definition on non-negative scores: positions ascending."""
    k = budget(mag.numel(), segments, density, floor)
    chosen = [lo + topk_of(mag[lo:hi], f)
              for (lo, hi), f in zip(segments, floors(segments, density, floor)) if f]
    kept = torch.cat(chosen) if chosen else mag.new_empty(0, dtype=torch.int64)
    rest = k - kept.numel()
    if rest > 0:
        masked = mag.clone()
        masked[kept] = -1.0  # below every score: never chosen again
        kept = torch.cat([kept, topk_of(masked, rest)])
    return torch.sort(kept).values


def refine(idx: torch.Tensor, acc_values: torch.Tensor, segments, counts: Sequence[int],
           starved, k: int):
    """From the bucket's global top ``k`` (``idx``, ``acc_values``), the floor selection of
    :func:`select` with the same ``k``: each segment's top ``counts[i]`` comes from the global
    set where it holds that many of the segment (the global set holds every segment's top
    entries), else from ``starved[i]`` = (positions, acc values) computed on the segment
    alone; the rest are the first of the remaining global entries in order (each of them has
    at most ``k - 1`` entries before it in the bucket, so it lies in the global set).
    Returns (positions ascending, acc values). Sorts of the short list only."""
    device = idx.device
    # the global set in order: magnitude descending, position ascending (stable sorts)
    by_pos = torch.argsort(idx)
    order = by_pos[torch.sort(acc_values.abs()[by_pos], descending=True, stable=True).indices]
    bounds = torch.tensor([hi for _, hi in segments], dtype=idx.dtype, device=device)
    seg = torch.bucketize(idx[order], bounds, right=True)
    # each entry's rank within its segment, in that order
    grouped = torch.sort(seg, stable=True)
    starts = torch.cumsum(torch.bincount(seg, minlength=len(segments)), 0) - \
        torch.bincount(seg, minlength=len(segments))
    rank = torch.empty_like(seg)
    rank[grouped.indices] = torch.arange(seg.numel(), device=device) - starts[grouped.values]
    quota = torch.tensor(counts, dtype=seg.dtype, device=device)
    hungry = torch.zeros(len(segments), dtype=torch.bool, device=device)
    for i in starved:
        hungry[i] = True
    take = (rank < quota[seg]) & ~hungry[seg]  # floors met inside the global set
    extra_idx = [starved[i][0] for i in sorted(starved)]
    extra_val = [starved[i][1] for i in sorted(starved)]
    free = ~take & ~hungry[seg]  # a starved segment's global entries are in its floor
    rest = k - int(take.sum()) - sum(t.numel() for t in extra_idx)
    if rest > 0:
        take |= free & (torch.cumsum(free.to(torch.int64), 0) <= rest)
    chosen = order[take]
    out_idx = torch.cat([idx[chosen]] + extra_idx)
    out_val = torch.cat([acc_values[chosen]] + extra_val)
    ascending = torch.argsort(out_idx)
    return out_idx[ascending], out_val[ascending]
