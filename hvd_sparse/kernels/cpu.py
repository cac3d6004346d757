"""CPU selection primitives with numba: read-only scans near memory speed, multi-threaded.

The methods in :mod:`hvd_sparse.kernels.select` are written once against four primitives; this
module is their numba form for float32 CPU tensors (``g`` is the gradient, or ``None`` on the
downlink where the residual already holds the aggregate; ``acc = g + r``):

* :func:`scan` - one read of ``g`` and ``r``: counts the candidates (``acc >= t_hi`` or
  ``acc <= -t_lo``) per 16-entry block (one cache line) and flags NaN/Inf, writing nothing;
* :func:`gather` - copies the candidates, in index order and in parallel (per-chunk offsets
  come from the scan), visiting only the blocks the scan marked;
* :func:`kth_magnitude` - the exact k-th largest ``|acc|`` (radix histogram on the float bits),
  for the rare case where a sampled threshold aimed too high;
* :func:`commit` - ``r += g`` and the selected positions set to what the wire could not carry.

Nothing writes the residual before :func:`commit`, so a step that some rank has to skip (a
NaN anywhere) leaves every residual exactly as it was. Fast math is on except for the NaN/Inf
assumptions, which would remove the non-finite check. numba is optional: without it
:func:`available` is False and the torch reference serves.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

try:
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_NUMBA = False

BLOCK = 16  # one 64-byte cache line of float32: the unit the gather skips or visits
BINS = 1 << 16
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}  # not nnan/ninf: NaN must be seen
FLT_MAX = np.float32(3.4028234663852886e38)

name = "numba"


def available() -> bool:
    return HAVE_NUMBA


if HAVE_NUMBA:
    @njit(fastmath=FASTMATH, cache=True)
    def _scan_chunk(g, r, thi, tlo, bc):
        """Candidates per block into ``bc``; returns (total, count of non-finite entries,
        sum of acc^2)."""
        n = r.size
        full = n // BLOCK
        total = 0
        bad = 0
        energy = 0.0
        for b in range(full):  # fixed-length inner loop: vectorised
            lo = b * BLOCK
            m = np.int32(0)
            nb = np.int32(0)
            e = np.float32(0)
            for j in range(BLOCK):
                if g is None:
                    a = r[lo + j]
                else:
                    a = g[lo + j] + r[lo + j]
                m += np.int32((a >= thi) | (a <= -tlo))
                nb += np.int32(not (abs(a) <= FLT_MAX))
                e += a * a
            bc[b] = m
            total += m
            bad += nb
            energy += e
        if full * BLOCK < n:
            m = np.int32(0)
            for i in range(full * BLOCK, n):
                if g is None:
                    a = r[i]
                else:
                    a = g[i] + r[i]
                m += np.int32((a >= thi) | (a <= -tlo))
                bad += np.int32(not (abs(a) <= FLT_MAX))
                energy += a * a
            bc[full] = m
            total += m
        return total, bad, energy

    @njit(fastmath=FASTMATH, cache=True)
    def _gather_chunk(g, r, thi, tlo, bc, base, out_idx, out_val, pos, end):
        """Copy (base + i, acc[i]) of the candidates of the marked blocks, in index order."""
        n = r.size
        for b in range(bc.size):
            if bc[b] != 0:
                lo = b * BLOCK
                hi = min(n, lo + BLOCK)
                for i in range(lo, hi):
                    if g is None:
                        a = r[i]
                    else:
                        a = g[i] + r[i]
                    if ((a >= thi) | (a <= -tlo)) and pos < end:
                        out_idx[pos] = base + i
                        out_val[pos] = a
                        pos += 1
        return pos

    @njit(parallel=True, cache=True)
    def _scan_par(g, r, thi, tlo, bc, counts, bads, energies, chunk):
        per = chunk // BLOCK
        for c in prange(counts.size):
            lo = c * chunk
            hi = min(r.size, lo + chunk)
            if g is None:
                t, nb, e = _scan_chunk(None, r[lo:hi], thi, tlo, bc[c * per:(c + 1) * per])
            else:
                t, nb, e = _scan_chunk(g[lo:hi], r[lo:hi], thi, tlo, bc[c * per:(c + 1) * per])
            counts[c] = t
            bads[c] = nb
            energies[c] = e

    @njit(parallel=True, cache=True)
    def _gather_par(g, r, thi, tlo, bc, offsets, chunk, out_idx, out_val):
        per = chunk // BLOCK
        for c in prange(offsets.size - 1):
            lo = c * chunk
            hi = min(r.size, lo + chunk)
            if g is None:
                _gather_chunk(None, r[lo:hi], thi, tlo, bc[c * per:(c + 1) * per], lo,
                              out_idx, out_val, offsets[c], offsets[c + 1])
            else:
                _gather_chunk(g[lo:hi], r[lo:hi], thi, tlo, bc[c * per:(c + 1) * per], lo,
                              out_idx, out_val, offsets[c], offsets[c + 1])

    @njit(cache=True)
    def _histogram_chunk(bits, h):
        h[:] = 0
        for i in range(bits.size):
            h[(bits[i] & 0x7FFFFFFF) >> 16] += 1

    @njit(parallel=True, cache=True)
    def _histogram_par(bits, hist, chunk):
        for c in prange(hist.shape[0]):
            lo = c * chunk
            _histogram_chunk(bits[lo:min(bits.size, lo + chunk)], hist[c])


def _threads():
    """Follow torch's thread count (OMP_NUM_THREADS, torch.set_num_threads): extra spinning
    threads on oversubscribed cores, as with several ranks per machine, cost far more than
    they give."""
    want = min(numba.config.NUMBA_NUM_THREADS, torch.get_num_threads())
    if want <= 1:
        return 1  # never start numba's pool (its idle OpenMP workers would spin)
    if numba.get_num_threads() != want:
        numba.set_num_threads(want)
    return want


def _chunks(n: int):
    """Chunk count and length (a multiple of BLOCK) for ``n`` entries."""
    threads = _threads()
    nchunks = 1 if threads == 1 else max(1, min(threads * 4, (n + 65535) // 65536))
    chunk = -(-max(n, 1) // nchunks)
    chunk = -(-chunk // BLOCK) * BLOCK
    return -(-max(n, 1) // chunk), chunk


def _np(t):
    if t is None:
        return None
    if t.dtype != torch.float32:
        raise TypeError("the numba kernels take float32")
    return t.detach().contiguous().numpy()


class Scan(NamedTuple):
    count: int
    nonfinite: bool
    t_hi: np.float32
    t_lo: np.float32
    blocks: np.ndarray  # candidates per block
    offsets: np.ndarray  # where each chunk's candidates start (length nchunks + 1)
    chunk: int
    energy: float  # sum of acc^2 (the compression-error statistic needs no extra pass)


def scan(g, r, t_hi, t_lo) -> Scan:
    """Count ``acc >= t_hi or acc <= -t_lo`` and look for NaN/Inf; reads only."""
    gn, rn = _np(g), _np(r)
    thi, tlo = np.float32(t_hi), np.float32(t_lo)
    nchunks, chunk = _chunks(rn.size)
    bc = np.empty(nchunks * (chunk // BLOCK), dtype=np.uint8)
    counts = np.empty(nchunks, dtype=np.int64)
    bads = np.empty(nchunks, dtype=np.int64)
    energies = np.empty(nchunks, dtype=np.float64)
    if nchunks == 1:  # on the calling thread: numba's pool stays asleep
        counts[0], bads[0], energies[0] = _scan_chunk(gn, rn, thi, tlo, bc)
    else:
        _scan_par(gn, rn, thi, tlo, bc, counts, bads, energies, chunk)
    offsets = np.zeros(nchunks + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Scan(int(offsets[-1]), bool(bads.any()), thi, tlo, bc, offsets, chunk,
                float(energies.sum()))


def gather(g, r, s: Scan):
    """The candidates of scan ``s`` as (int64 indices, float32 acc values), in index order."""
    gn, rn = _np(g), _np(r)
    cidx = np.empty(s.count, dtype=np.int64)
    cval = np.empty(s.count, dtype=np.float32)
    if s.offsets.size == 2:
        _gather_chunk(gn, rn, s.t_hi, s.t_lo, s.blocks, 0, cidx, cval, 0, s.count)
    else:
        _gather_par(gn, rn, s.t_hi, s.t_lo, s.blocks, s.offsets, s.chunk, cidx, cval)
    return torch.from_numpy(cidx), torch.from_numpy(cval)


def sample(g, r, positions: np.ndarray) -> np.ndarray:
    """``acc`` at the given positions, on the host (float32)."""
    rn = _np(r)
    return rn[positions] if g is None else _np(g)[positions] + rn[positions]


def kth_magnitude(g, r, k: int) -> np.float32:
    """A float32 ``t`` with at least ``k`` entries ``|acc| >= t`` and at most those of the bin of
    the k-th largest magnitude: the floor of that bin in a 16-bit radix histogram of the float
    bits (for non-negative floats the bit pattern orders like the value)."""
    rn = _np(r)
    acc = rn if g is None else _np(g) + rn
    bits = acc.view(np.uint32)
    nchunks, chunk = _chunks(bits.size)
    hist = np.empty((nchunks, BINS), dtype=np.int64)
    if nchunks == 1:
        _histogram_chunk(bits, hist[0])
    else:
        _histogram_par(bits, hist, chunk)
    from_top = np.cumsum(hist.sum(axis=0)[::-1])
    b = BINS - 1 - int(np.searchsorted(from_top, k))
    return np.array([b << 16], dtype=np.uint32).view(np.float32)[0]


def pick_topk(cidx: torch.Tensor, cval: torch.Tensor, k: int, sign: int = 0):
    """The k largest of the candidates (by ``|v|``, or by ``sign * v``), ties by lowest index;
    candidates come in index order and so do the results."""
    v = cval.numpy()
    score = np.abs(v) if sign == 0 else (v if sign > 0 else -v)
    if k >= score.size:
        return cidx, cval
    kth = np.partition(score, score.size - k)[score.size - k]
    keep = score > kth
    ties = np.flatnonzero(score == kth)[:k - int(keep.sum())]
    keep[ties] = True
    keep_t = torch.from_numpy(keep)
    return cidx[keep_t], cval[keep_t]


def commit(g, r, idx, remainder) -> None:
    """``r += g`` (torch's threaded add), then ``r[idx] = remainder``."""
    if g is not None:
        r.add_(g)
    if idx.numel():
        r[idx] = remainder


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel, serial and threaded variants."""
    if not HAVE_NUMBA:
        return
    import sys

    from . import select

    me = sys.modules[__name__]
    g = torch.randn(1 << 18)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for grad in (g, None):
                r = torch.randn(1 << 18) * 0.1
                select.topk(me, grad, r, 100)
                select.topk(me, grad, r, 1 << 17)
                kth_magnitude(grad, r, 100)
        finally:
            torch.set_num_threads(old)
    from .. import golomb
    golomb.decode(golomb.encode(np.array([1, 5, 90]), 3), 3, 3)
