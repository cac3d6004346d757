"""CPU fused feedback + selection with numba, near memory speed, multi-threaded.

Exact Top-K in two passes over the gradient, using a threshold estimated from a sample:

1. a small, cache-friendly sample of ``acc = grad + residual`` (64 contiguous blocks) gives a
   magnitude ``t`` that about 2.5 k entries exceed (a generous margin over the sample's noise);
2. one fused pass adds the gradient into the residual (which becomes ``acc``) and counts, per
   chunk, the entries with ``|acc| >= t``;
3. one pass copies those candidates, in index order and in parallel (per-chunk offsets are known),
   into a short list, where the exact rank by (magnitude desc, index asc) picks the k.

If the sample overestimated ``t`` (fewer than k candidates), an exact radix select on the float
bits of ``|acc|`` (for non-negative floats the bit pattern, read as an unsigned integer, orders
like the value) finds the bin of the k-th magnitude instead, and the same gather follows. Either
way the result equals the torch reference exactly. Memory traffic: 16 bytes per float32 (read
grad and residual, write residual, read residual once more) against a 12-byte floor.

Only float32 is taken here; other dtypes use the torch reference. numba is optional: without it
:func:`available` is False and callers fall back.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import numba
    from numba import njit, prange

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - depends on the installation
    HAVE_NUMBA = False

BINS = 1 << 16
BLOCK = 64  # candidates are counted per block so the gather pass can skip empty blocks


def available() -> bool:
    return HAVE_NUMBA


if HAVE_NUMBA:
    # Inner loops run on contiguous chunk slices (so LLVM vectorises them); the outer
    # ``prange`` loops spread chunks over threads.

    @njit(fastmath=True, cache=True)
    def _add_count_chunk(g, r, t):
        m = 0
        for i in range(g.size):
            a = g[i] + r[i]
            r[i] = a
            m += np.int64(abs(a) >= t)
        return m

    @njit(fastmath=True, cache=True)
    def _add_count_blocks_chunk(g, r, t, bc):
        """r += g, counting |r| >= t per 64-entry block into bc; returns the chunk's total."""
        total = 0
        full = g.size // BLOCK
        for b in range(full):  # fixed-length inner loop: vectorised and unrolled
            lo = b * BLOCK
            m = np.int32(0)
            for j in range(BLOCK):
                a = g[lo + j] + r[lo + j]
                r[lo + j] = a
                m += np.int32(abs(a) >= t)
            bc[b] = m
            total += m
        if full < bc.size:
            m = np.int32(0)
            for i in range(full * BLOCK, g.size):
                a = g[i] + r[i]
                r[i] = a
                m += np.int32(abs(a) >= t)
            bc[full] = m
            total += m
        for b in range(full + 1, bc.size):
            bc[b] = 0
        return total

    @njit(cache=True)
    def _gather_range(r, t, lo, hi, base, out_idx, out_val, pos):
        """Copy (base + i, r[i]) for |r[i]| >= t, i in [lo, hi); returns the next position."""
        for i in range(lo, hi):
            v = r[i]
            if abs(v) >= t:
                out_idx[pos] = base + i
                out_val[pos] = v
                pos += 1
        return pos

    @njit(cache=True)
    def _gather_blocks_chunk(r, t, bc, base, out_idx, out_val, pos):
        """Like _gather_chunk, visiting only blocks that hold a candidate."""
        for b in range(bc.size):
            if bc[b] != 0:
                lo = b * BLOCK
                pos = _gather_range(r, t, lo, min(r.size, lo + BLOCK), base, out_idx, out_val,
                                    pos)

    @njit(parallel=True, cache=True)
    def _add_count_blocks(g, r, t, counts, bc, chunk):
        n = g.size
        per = chunk // BLOCK
        for c in prange(counts.size):
            lo = c * chunk
            hi = min(n, lo + chunk)
            counts[c] = _add_count_blocks_chunk(g[lo:hi], r[lo:hi], t, bc[c * per:(c + 1) * per])

    @njit(parallel=True, cache=True)
    def _gather_blocks(r, t, bc, offsets, chunk, out_idx, out_val):
        n = r.size
        per = chunk // BLOCK
        for c in prange(offsets.size):
            lo = c * chunk
            hi = min(n, lo + chunk)
            _gather_blocks_chunk(r[lo:hi], t, bc[c * per:(c + 1) * per], lo, out_idx, out_val,
                                 offsets[c])

    @njit(fastmath=True, cache=True)
    def _count_chunk(r, t):
        m = 0
        for i in range(r.size):
            m += np.int64(abs(r[i]) >= t)
        return m

    @njit(cache=True)
    def _histogram_chunk(rbits, h):
        h[:] = 0
        for i in range(rbits.size):
            h[(rbits[i] & 0x7FFFFFFF) >> 16] += 1

    @njit(cache=True)
    def _gather_chunk(r, t, base, out_idx, out_val, pos):
        _gather_range(r, t, 0, r.size, base, out_idx, out_val, pos)

    @njit(parallel=True, cache=True)
    def _add_count(g, r, t, counts, chunk):
        """r += g; counts[c] = #{i in chunk c : |r[i]| >= t}."""
        n = g.size
        for c in prange(counts.size):
            lo = c * chunk
            hi = min(n, lo + chunk)
            counts[c] = _add_count_chunk(g[lo:hi], r[lo:hi], t)

    @njit(parallel=True, cache=True)
    def _count(r, t, counts, chunk):
        n = r.size
        for c in prange(counts.size):
            lo = c * chunk
            hi = min(n, lo + chunk)
            counts[c] = _count_chunk(r[lo:hi], t)

    @njit(parallel=True, cache=True)
    def _histogram(rbits, hist, chunk):
        """Per-chunk histogram of the top 16 bits of |r|'s float pattern."""
        n = rbits.size
        for c in prange(hist.shape[0]):
            lo = c * chunk
            hi = min(n, lo + chunk)
            _histogram_chunk(rbits[lo:hi], hist[c])

    @njit(parallel=True, cache=True)
    def _gather(r, t, offsets, chunk, out_idx, out_val):
        """Copy (i, r[i]) with |r[i]| >= t, chunk by chunk, in index order."""
        n = r.size
        for c in prange(offsets.size):
            lo = c * chunk
            hi = min(n, lo + chunk)
            _gather_chunk(r[lo:hi], t, lo, out_idx, out_val, offsets[c])

    @njit(cache=True)
    def _zero_at(r, idx):
        for j in range(idx.size):
            r[idx[j]] = 0.0


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
    chunk = -(-n // nchunks)
    chunk = -(-chunk // BLOCK) * BLOCK
    return -(-n // chunk), chunk


def _add_count_blocks_any(g, r, t, counts, bc, chunk):
    if counts.size == 1:
        counts[0] = _add_count_blocks_chunk(g, r, t, bc)
    else:
        _add_count_blocks(g, r, t, counts, bc, chunk)


def _gather_blocks_any(r, t, bc, offsets, chunk, out_idx, out_val):
    if offsets.size == 1:
        _gather_blocks_chunk(r, t, bc, 0, out_idx, out_val, 0)
    else:
        _gather_blocks(r, t, bc, offsets, chunk, out_idx, out_val)


# With one chunk the loops run on the calling thread, never entering numba's thread pool,
# whose idle workers spin and would steal the cores other ranks on the machine need.
def _add_count_any(g, r, t, counts, chunk):
    if counts.size == 1:
        counts[0] = _add_count_chunk(g, r, t)
    else:
        _add_count(g, r, t, counts, chunk)


def _count_any(r, t, counts, chunk):
    if counts.size == 1:
        counts[0] = _count_chunk(r, t)
    else:
        _count(r, t, counts, chunk)


def _histogram_any(rbits, hist, chunk):
    if hist.shape[0] == 1:
        _histogram_chunk(rbits, hist[0])
    else:
        _histogram(rbits, hist, chunk)


def _gather_any(r, t, offsets, chunk, out_idx, out_val):
    if offsets.size == 1:
        _gather_chunk(r, t, 0, out_idx, out_val, 0)
    else:
        _gather(r, t, offsets, chunk, out_idx, out_val)


def _views(grad: torch.Tensor, residual: torch.Tensor):
    if grad.dtype != torch.float32 or residual.dtype != torch.float32:
        raise TypeError("the numba kernels take float32")
    g = grad.detach().contiguous().numpy()
    r = residual.numpy()  # shares memory: updates land in the torch tensor
    return g, r, r.view(np.uint32)


def _sample_threshold(g, r, k):
    """A magnitude about 2.5 k entries of acc = g + r exceed, from 64 contiguous blocks."""
    n = g.size
    blocks, width = 64, max(64, min(4096, n // 256))
    if blocks * width * 4 >= n:
        return None
    starts = (np.arange(blocks, dtype=np.int64) * (n - width)) // (blocks - 1)
    sel = (starts[:, None] + np.arange(width)[None, :]).reshape(-1)
    mag = np.abs(g[sel] + r[sel])
    expected = sel.size * k / n
    rank = int(np.ceil(2.5 * expected + 3.0 * np.sqrt(expected) + 2))
    if rank >= sel.size:
        return None
    t = np.partition(mag, sel.size - rank)[sel.size - rank]
    # a zero threshold would make every entry a candidate (a sparse aggregate plus a young
    # residual is mostly zeros): take only non-zeros; too few falls back to the exact radix path
    return max(t, np.nextafter(np.float32(0), np.float32(1)))


def _collect(r, t, counts, chunk, bc=None):
    """Copy the entries with |r| >= t (``counts`` per chunk) in index order; ``bc`` (per-block
    counts from the fused pass) lets the copy skip blocks without a candidate."""
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    m = int(counts.sum())
    cidx = np.empty(m, dtype=np.int64)
    cval = np.empty(m, dtype=np.float32)
    if bc is None:
        _gather_any(r, t, offsets, chunk, cidx, cval)
    else:
        _gather_blocks_any(r, t, bc, offsets, chunk, cidx, cval)
    return cidx, cval


def _bin_floor(r, rbits, k, chunk, nchunks):
    """Exact radix step: the smallest float whose top-16-bit bin holds the k-th magnitude."""
    hist = np.empty((nchunks, BINS), dtype=np.int64)
    _histogram_any(rbits, hist, chunk)
    from_top = np.cumsum(hist.sum(axis=0)[::-1])
    b = BINS - 1 - int(np.searchsorted(from_top, k))
    return np.array([b << 16], dtype=np.uint32).view(np.float32)[0]


def fused_topk(grad: torch.Tensor, residual: torch.Tensor, k: int):
    """:func:`hvd_sparse.kernels.reference.fused_topk`, fast, on float32 CPU tensors."""
    g, r, rbits = _views(grad, residual)
    n = r.size
    if k >= n or k <= 0:
        residual.add_(grad)
        if k <= 0:
            return torch.empty(0, dtype=torch.int64), residual[:0].clone()
        vals = residual.clone()
        residual.zero_()
        return torch.arange(n), vals
    nchunks, chunk = _chunks(n)
    counts = np.empty(nchunks, dtype=np.int64)
    t = _sample_threshold(g, r, k)
    bc = None
    if t is not None:
        bc = np.empty(nchunks * (chunk // BLOCK), dtype=np.int32)
        _add_count_blocks_any(g, r, np.float32(t), counts, bc, chunk)
    else:
        r += g
    if t is None or counts.sum() < k:  # no sample, or it aimed too high: exact radix bin
        t = _bin_floor(r, rbits, k, chunk, nchunks)
        _count_any(r, t, counts, chunk)
        bc = None
    cidx, cval = _collect(r, np.float32(t), counts, chunk, bc)
    # exact rank among the candidates: larger magnitude first, then lower index
    mag = np.abs(cval)
    kth = np.partition(mag, mag.size - k)[mag.size - k]
    keep = mag > kth
    ties = np.flatnonzero(mag == kth)[:k - int(keep.sum())]  # candidates are in index order
    keep[ties] = True
    idx, vals = cidx[keep], cval[keep]
    _zero_at(r, idx)
    return torch.from_numpy(idx), torch.from_numpy(vals)


def fused_threshold(grad: torch.Tensor, residual: torch.Tensor, threshold: float):
    """:func:`hvd_sparse.kernels.reference.fused_threshold`, fast, on float32 CPU tensors."""
    g, r, _ = _views(grad, residual)
    t32 = np.float32(threshold)
    if t32 < threshold:  # keep |acc| >= threshold exact when threshold is not a float32
        t32 = np.nextafter(t32, np.float32(np.inf))
    nchunks, chunk = _chunks(r.size)
    counts = np.empty(nchunks, dtype=np.int64)
    _add_count_any(g, r, t32, counts, chunk)
    cidx, cval = _collect(r, t32, counts, chunk)
    _zero_at(r, cidx)
    return torch.from_numpy(cidx), torch.from_numpy(cval)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel, serial and threaded variants."""
    if not HAVE_NUMBA:
        return
    g = torch.randn(1 << 18)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fused_topk(g, torch.zeros_like(g), 100)
            fused_topk(g, torch.zeros_like(g), 1 << 17)
            fused_threshold(g, torch.zeros_like(g), 1.0)
        finally:
            torch.set_num_threads(old)
    from .. import golomb
    golomb.decode(golomb.encode(np.array([1, 5, 90]), 3), 3, 3)
