"""Selection methods written once over a backend's primitives (numba, CuPy or torch).

Each function looks at ``acc = g + r`` without writing anything and returns a
:class:`Selection`: the positions, the values to send, and ``acc`` at those positions (so the
caller can later leave ``acc - sent`` in the residual with :func:`commit`). The plan is the same
for every method: a threshold from a small fixed sample of ``acc``, one read-only scan that
counts candidates per cache line and looks for NaN/Inf, one gather of the candidates, and an
exact decision among them on a short list. Results equal the methods' plain torch definitions
(``Sparsifier.compress`` on ``acc``) exactly, ties included.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .sums import fixed_point_sum, fixed_point_sums

INF = np.float32(np.inf)
TINY = np.nextafter(np.float32(0), np.float32(1))  # the smallest positive float32
#: the smallest normal float32: the floor instead of TINY where subnormals flush to zero
NORMAL_TINY = np.finfo(np.float32).tiny
_ONE = np.float32(1)


def tiny() -> np.float32:
    """The floor of every threshold, so that zeros are never candidates: TINY, or where the
    calling thread flushes subnormals to zero (``torch.set_flush_denormal(True)``, under which
    TINY itself reads as zero and a threshold at it would take every zero) the smallest normal
    float, which compares alike in every thread, numba's workers included (they keep their
    own floating-point mode). Subnormal entries then count as zeros."""
    return TINY if TINY * _ONE > 0 else NORMAL_TINY


@dataclass
class Selection:
    """What a method chose from ``acc``; ``nonfinite`` means ``acc`` held NaN/Inf and nothing
    was chosen."""

    idx: torch.Tensor  # int64, ascending unless ``ordered`` is False
    values: torch.Tensor  # what goes on the wire (before the value codec)
    acc_values: torch.Tensor  # acc[idx]
    nonfinite: bool = False
    passes: int = 1  # scans that counted candidates (GaussianK's corrections)
    fallback: bool = False  # an exact Top-K decided (GaussianK out of its band)
    energy: Optional[float] = None  # sum of acc^2 over the whole vector, when the scan gave it
    ordered: bool = True  # idx ascending (False: in no particular order, from a watch)


def _empty(r, nonfinite=False):
    e = torch.empty(0, dtype=torch.int64, device=r.device)
    v = r[:0].clone()
    return Selection(e, v, v, nonfinite)


@functools.lru_cache(maxsize=512)
def sample_positions(n: int) -> Optional[np.ndarray]:
    """A fixed, cache-friendly sample of a vector of ``n`` entries (up to 65,536 entries in
    evenly spaced blocks of 64, four cache lines each), the same on every rank and backend;
    ``None`` when the vector is too short for one to pay. Made once per length, since every
    step of a bucket asks again: callers must not write it.

    Narrow blocks keep the sample proportional where a bucket holds several tensors: with
    64 blocks of 1,024 (before the twenty-third session) a small tensor of large gradients
    at a bucket's end (an output layer) filled a whole block, a share of the sample many
    times its share of the bucket, and the threshold aimed too high: at 0.1% over the whole
    11.4M-entry MLP the exact fallback (a radix histogram and a second scan) ran every step."""
    size = 64 * max(64, min(1024, n // 1024))
    if size * 4 >= n:
        return None
    width = 64
    blocks = size // width
    starts = (np.arange(blocks, dtype=np.int64) * (n - width)) // (blocks - 1)
    return (starts[:, None] + np.arange(width)[None, :]).reshape(-1)


@functools.lru_cache(maxsize=64)
def all_positions(n: int) -> np.ndarray:
    """Every position of a short vector (GaussianK samples all of it), made once per length."""
    return np.arange(n, dtype=np.int64)


def sampled_threshold(scores: np.ndarray, n: int, k: int) -> Optional[np.float32]:
    """A score that about 1.6 k of the ``n`` entries reach, from the sample's ``scores`` (a
    margin of four standard deviations of the sample's count and 60% for structure the sample
    misses, so one scan nearly always finds at least k; when it does not, an exact radix
    threshold and a second scan follow)."""
    expected = scores.size * k / n
    rank = int(np.ceil(1.6 * expected + 4.0 * np.sqrt(expected) + 8))
    if rank >= scores.size:
        return None
    # a zero threshold would make every entry a candidate (a sparse aggregate plus a young
    # residual is mostly zeros): take only non-zeros. Partitioning only those gives the same
    # rank-th score and avoids numpy's slow selection among many equal values
    floor = tiny()
    positive = scores[scores >= floor]
    if rank > positive.size:
        return floor
    t = np.partition(positive, positive.size - rank)[positive.size - rank]
    return max(np.float32(t), floor)


def topk(ops, g, r, k: int, watch=None) -> Selection:
    """Exact Top-K by magnitude, ties by lowest index. ``watch``: a
    :class:`~hvd_sparse.kernels.watch.ResidualWatch` of the downlink residual ``r`` (``g`` is
    None), which may answer from the positions it tracks instead of a scan."""
    if watch is not None and g is None:
        return watch.topk(ops, r, k)
    direct = getattr(ops, "topk_direct", None)  # a backend's form for short vectors
    if direct is not None and 0 < k < r.numel() <= ops.DIRECT_TOPK_MAX:
        return direct(g, r, k)
    return topk_scanned(ops, g, r, k)[0]


def topk_floored(ops, g, r, density: float, segments, floor: float) -> Selection:
    """Top-K with a per-segment floor (:mod:`hvd_sparse.sparsifiers.layer_floor`): the
    bucket's global Top-K by one scan, then the floor rule on that short list; a segment the
    global set holds too few of (starved) is read once more on its own. (The downlink's watch
    is not used: the floor changes the selection it would keep its list for.)"""
    from ..sparsifiers import layer_floor
    from ..sparsifiers.base import topk_of

    if floor >= 1.0 and getattr(ops, "segmented_topk", None) is not None:
        return topk_layerwise(ops, g, r, layer_floor.floors(segments, density, 1.0),
                              segments)
    n = r.numel()
    k = layer_floor.budget(n, segments, density, floor)
    sel = topk(ops, g, r, k)
    if sel.nonfinite or k >= n:
        return sel
    counts = layer_floor.floors(segments, density, floor)
    bounds = torch.tensor([hi for _, hi in segments], dtype=sel.idx.dtype,
                          device=sel.idx.device)
    have = torch.bincount(torch.bucketize(sel.idx, bounds, right=True),
                          minlength=len(segments)).tolist()
    starved = {}
    for i, ((lo, hi), f) in enumerate(zip(segments, counts)):
        if f > have[i]:
            acc = _acc_segment(ops, g, r, lo, hi)
            pos = topk_of(acc.abs(), f)
            starved[i] = (pos + lo, acc[pos].clone())
    idx, val = layer_floor.refine(sel.idx, sel.acc_values, segments, counts, starved, k)
    return Selection(idx, val, val, energy=sel.energy)


def topk_layerwise(ops, g, r, counts, segments) -> Selection:
    """Each segment's own Top-K (``counts``), the floor rule at ``floor=1`` where the floors
    are the whole budget: one scan for NaN/Inf (which also writes ``acc`` where the backend
    accumulates), then every segment ranked in one call of the backend's
    ``segmented_topk``. The same selection as one bucket per tensor, without a Python round
    of sampling, scanning and picking per tensor (about 0.3 ms each on the CPU, more than
    the selection itself below some 100,000 entries)."""
    s = ops.scan(g, r, INF, INF, 0)
    if s.nonfinite:
        return _empty(r, True)
    idx, val = ops.segmented_topk(g, r, segments, counts)
    return Selection(idx, val, val, energy=s.energy)


def _acc_segment(ops, g, r, lo: int, hi: int) -> torch.Tensor:
    """``acc = g + r`` on ``[lo, hi)``: where a scan wrote it already, else computed there."""
    if getattr(ops, "written", False) and g is ops.g and r is ops.r:
        return ops.into[lo:hi]
    if getattr(ops, "pending", False) and g is ops.g:
        ops.materialize()
    if g is None:
        return r[lo:hi]
    return g[lo:hi].to(r.dtype) + r[lo:hi]


def topk_scanned(ops, g, r, k: int):
    """:func:`topk` by a scan: (selection, candidate indices, candidate values, threshold),
    where the candidates are every entry with ``|acc| >= threshold``, so every other entry is
    below it; the last three are None when no scan collected candidates."""
    n = r.numel()
    if k <= 0:
        return _empty(r, ops.scan(g, r, INF, INF).nonfinite), None, None, None
    if k >= n:
        s = ops.scan(g, r, -INF, INF, n)  # every finite entry is a candidate
        if s.nonfinite:
            return _empty(r, True), None, None, None
        idx, val = ops.gather(g, r, s)
        return Selection(idx, val, val, energy=s.energy), idx, val, np.float32(0)
    pos = sample_positions(n)
    s = None
    if pos is not None:
        t = sampled_threshold(np.abs(ops.sample(g, r, pos)), n, k)
        if t is not None:
            s = ops.scan(g, r, t, t, 3 * k)
    if s is None or (s.count < k and not s.nonfinite):  # no sample, or it aimed too high
        t = ops.kth_magnitude(g, r, k)
        s = ops.scan(g, r, t, t, 2 * k)
    if s.nonfinite:
        return _empty(r, True), None, None, None
    cidx, cval = ops.gather(g, r, s)
    idx, val = ops.pick_topk(cidx, cval, k)
    return Selection(idx, val, val, energy=s.energy), cidx, cval, t


def threshold(ops, g, r, lam: float, watch=None, expect=None) -> Selection:
    """Every entry with ``|acc| >= lam``, ``lam`` taken in the accumulation dtype (rounded to
    nearest, as torch's ``tensor >= float`` does): an explicit conversion, so the outcome does
    not depend on NumPy's promotion rules for mixed scalars (which changed in NumPy 2).
    ``watch``: as for :func:`topk`; ``expect``: about how many entries to expect (room for the
    scan to collect them in its one pass; the result does not depend on it)."""
    t = _as_dtype(lam, r.dtype)
    if watch is not None and g is None:
        return watch.threshold(ops, r, t)
    s = ops.scan(g, r, t, t, expect)
    if s.nonfinite:
        return _empty(r, True)
    idx, val = ops.gather(g, r, s)
    return Selection(idx, val, val, energy=s.energy)


def binary_mean(values: torch.Tensor) -> float:
    """Mean of ``values`` in float64, summed where they lie with an order-free sum
    (:mod:`.sums`), so every backend, device and thread count gives the same bits."""
    if values.numel() == 0:
        return 0.0
    return fixed_point_sum(values) / values.numel()


def sbc_fits(n: int, k: int) -> bool:
    """Does :func:`sbc` take the fused path for ``k`` of ``n`` (else it answers ``None``)?"""
    return sample_positions(n) is not None and 0 < k and 2 * k < n


def sbc(ops, g, r, k: int, watch=None) -> Optional[Selection]:
    """Sparse Binary Compression: the k largest positive or the k largest negative entries (a
    side with fewer than k entries takes all it has), whichever side has the larger mean
    magnitude, all sent as that one mean. ``watch``: as for :func:`topk`.

    Returns ``None`` (take the plain path) when the vector is too short for a sample to pay.
    """
    if watch is not None and g is None:
        return watch.sbc(ops, r, k)
    direct = getattr(ops, "sbc_direct", None)  # a backend's form for vectors of moderate length
    if direct is not None and sbc_fits(r.numel(), k) and r.numel() <= ops.DIRECT_SBC_MAX:
        return direct(g, r, k)
    return sbc_scanned(ops, g, r, k)[0]


def sbc_scanned(ops, g, r, k: int):
    """:func:`sbc` by a scan: (selection or None, candidate indices, candidate values,
    (t_pos, t_neg)), where every entry outside the candidates lies in ``(-t_neg, t_pos)``; the
    last three are None when no scan collected candidates."""
    n = r.numel()
    if not sbc_fits(n, k):
        return None, None, None, None
    smp = ops.sample(g, r, sample_positions(n))
    t_pos = sampled_threshold(np.maximum(smp, 0), n, k)
    t_neg = sampled_threshold(np.maximum(-smp, 0), n, k)
    if t_pos is None or t_neg is None:
        return None, None, None, None
    s = ops.scan(g, r, t_pos, t_neg, 6 * k)
    if s.nonfinite:
        return _empty(r, True), None, None, None
    cidx, cval = ops.gather(g, r, s)
    # both thresholds are positive, so a candidate's sign says its side (no split copies)
    ups = int((cval > 0).sum())
    downs = cval.numel() - ups
    # a side short of k: at the smallest positive threshold it holds every entry of its sign
    # (a sparse aggregate often has fewer than k of one sign); above it, the sample aimed too
    # high and that side is scanned again from the smallest one
    floor = tiny()
    if (ups < k and t_pos > floor) or (downs < k and t_neg > floor):
        t_pos = floor if ups < k else t_pos
        t_neg = floor if downs < k else t_neg
        s = ops.scan(g, r, t_pos, t_neg, 6 * k)
        cidx, cval = ops.gather(g, r, s)
        ups = int((cval > 0).sum())
        downs = cval.numel() - ups
    sides = getattr(ops, "pick_sides", None)  # a backend's split of the sides first
    if sides is not None:
        pi, pv, ni, nv = sides(cidx, cval, k)
    else:  # each pick passes over the other side too
        pi, pv = _side(ops, cidx, cval, k, 1, ups)
        ni, nv = _side(ops, cidx, cval, k, -1, downs)
    sel = binary_choice(pi, pv, ni, nv)
    sel.energy = s.energy
    return sel, cidx, cval, (np.float32(t_pos), np.float32(t_neg))


def _side(ops, cidx, cval, k, sign, count):
    """The k largest of one sign among the candidates, or all of them when ``count`` (how many
    there are) is at most k."""
    if count > k:
        return ops.pick_topk(cidx, cval, k, sign=sign)
    keep = cval > 0 if sign > 0 else cval < 0
    return cidx[keep], cval[keep]


def binary_choice(pi, pv, ni, nv) -> Selection:
    """SBC's decision between its two picked sides: the one of larger mean magnitude (the
    positive one on a tie), every position sent as that mean (both means :func:`binary_mean`,
    read from a device together)."""
    sum_pos, sum_neg = fixed_point_sums([pv, nv])
    mean_pos = sum_pos / pv.numel() if pv.numel() else 0.0
    mean_neg = -(sum_neg / nv.numel()) if nv.numel() else -0.0
    idx, accv, mean = (pi, pv, mean_pos) if mean_pos >= mean_neg else (ni, nv, -mean_neg)
    return Selection(idx, torch.full_like(accv, mean), accv)


def gaussian_threshold(smp: np.ndarray, n: int, k: int) -> float:
    """GaussianK's first threshold, ``|mu| + sigma * z(k/n)``, with mu and sigma from the
    fixed sample (float64, one fixed summation order)."""
    x = smp.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf: the scan reports them
        mu = float(np.sum(x) / x.size)
        sigma = float(np.sqrt(np.sum((x - mu) ** 2) / max(1, x.size - 1)))
    return abs(mu) + sigma * tail_quantile(k / n)


def tail_quantile(frac: float) -> float:
    """z with P(|N(0,1)| >= z) = frac."""
    frac = min(max(frac, 1e-12), 1.0)
    return float(torch.special.ndtri(torch.tensor(1.0 - frac / 2.0, dtype=torch.float64)))


def next_gaussian_threshold(t: float, count: int, n: int, k: int) -> Optional[float]:
    """GaussianK's correction: rescale ``t`` by ``z(k/n) / z(count/n)``; ``None`` when (nearly)
    every entry is at or above ``t`` (an all-zero or constant vector) and no rescaling helps."""
    if count == 0:
        return t * 0.5
    z_seen = tail_quantile(count / n)
    if z_seen <= 0 or t == 0.0:
        return None
    return t * (tail_quantile(k / n) / z_seen)


def sample_quantile(smp: np.ndarray, n: int, k: int) -> Optional[float]:
    """GaussianK's first correction: the magnitude that k/n of the fixed sample reach (no
    model; the residual of error feedback piles up just under the last threshold, which no
    normal fit follows); ``None`` when the sample is too small to hold one such entry."""
    rank = int(round(smp.size * k / n))
    if rank < 1:
        return None
    mags = np.abs(smp.astype(np.float64))
    mags = mags[mags > 0]
    if rank > mags.size:
        return None
    return float(np.partition(mags, mags.size - rank)[mags.size - rank])


def interpolated_threshold(seen, k: int) -> Optional[float]:
    """A later GaussianK correction, from the (threshold, count) pairs already scanned: the
    tail count of a heavy-tailed vector falls about exponentially with the threshold, so
    ``log(count)`` is interpolated linearly in ``t`` between the two closest pairs that bracket
    k (else the last two), and the result is kept inside the bracket (bisection when the line
    points outside). The normal model's rescaling converges in one step on normal data only;
    on real residuals it can overshoot back and forth."""
    above = [(t, c) for t, c in seen if c > k]  # thresholds too low
    below = [(t, c) for t, c in seen if c < k]  # thresholds too high
    if above and below:
        a = max(above)  # the highest threshold still counting too many
        b = min(below)  # the lowest threshold counting too few
    else:
        a, b = seen[-2], seen[-1]
    (ta, ca), (tb, cb) = a, b
    la, lb = math.log(max(ca, 0.5)), math.log(max(cb, 0.5))
    if ta == tb or la == lb:
        return None
    t = ta + (math.log(k) - la) * (tb - ta) / (lb - la)
    if above and below:
        lo_t, hi_t = min(ta, tb), max(ta, tb)
        if not (lo_t < t < hi_t):
            t = 0.5 * (ta + tb)
    return t if t > 0 and math.isfinite(t) else None


def gaussiank(ops, g, r, k: int, lo: int, hi: int, max_passes: int,
              watch=None) -> Selection:
    """GaussianK: the threshold of a normal fit, corrected until the count is in [lo, hi];
    past ``max_passes`` an exact Top-K among the candidates (too many) or overall (too few).
    ``watch``: as for :func:`topk`."""
    if watch is not None and g is None:
        return watch.run(ops, r, k, lambda o: gaussiank(o, None, r, k, lo, hi, max_passes))
    n = r.numel()
    if k >= n:
        return topk(ops, g, r, k)
    positions = sample_positions(n)
    if positions is None:
        positions = all_positions(n)
    smp = ops.sample(g, r, positions)
    t = gaussian_threshold(smp, n, k)
    s, passes, seen = None, 0, []
    floor = float(tiny())
    for passes in range(1, max_passes + 1):
        # (floored, as every threshold: a sample of zeros fits mean = std = 0, and a
        # threshold of 0 made every zero a candidate, sent k at a time)
        t32 = _as_dtype(max(t, floor), r.dtype)
        s = ops.scan(g, r, t32, t32, hi)
        if s.nonfinite:
            return _empty(r, True)
        if lo <= s.count <= hi:
            idx, val = ops.gather(g, r, s)
            return Selection(idx, val, val, passes=passes, energy=s.energy)
        seen.append((float(t32), s.count))
        nxt = None
        if len(seen) == 1:  # the normal fit missed: the sample's own quantile next
            nxt = sample_quantile(smp, n, k)
            if nxt is not None and _as_dtype(nxt, r.dtype) == t32:
                nxt = None
        else:
            nxt = interpolated_threshold(seen, k)
        if nxt is None:
            nxt = next_gaussian_threshold(float(t32), s.count, n, k)
        if nxt is None:
            break
        t = nxt
    if s.count > hi:
        cidx, cval = ops.gather(g, r, s)
        idx, val = ops.pick_topk(cidx, cval, k)
        return Selection(idx, val, val, passes=passes, fallback=True, energy=s.energy)
    sel = topk(ops, g, r, k)
    sel.passes, sel.fallback = passes, True
    return sel


def _as_dtype(t: float, dtype):
    return np.float32(t) if dtype == torch.float32 else t


def commit(ops, g, r, sel: Selection, sent: torch.Tensor, zero_grad: bool = False) -> None:
    """Write ``r = g + r`` and leave ``acc - sent`` at the selected positions (exactly the mass
    the wire did not carry); ``zero_grad`` also zeroes ``g`` in the same pass (the engine asks
    when ``g`` is ``p.grad`` and is about to be rewritten)."""
    if sel.idx.numel() and sel.acc_values is sent:
        remainder = torch.zeros_like(sent)
    elif sel.idx.numel():
        remainder = sel.acc_values - sent.to(sel.acc_values.dtype)
    else:
        remainder = sel.acc_values
    ops.commit(g, r, sel.idx, remainder, zero_grad)
