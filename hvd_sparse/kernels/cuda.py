"""GPU selection primitives with CuPy, on torch's current stream.

The same primitives as :mod:`hvd_sparse.kernels.cpu` (see :mod:`.select` for the methods built
on them), for float32 CUDA tensors:

* :func:`scan` - one read-only kernel over ``acc = g + r`` that counts ``acc >= t_hi or
  acc <= -t_lo``, flags NaN/Inf and, when the caller says how many to expect, already compacts
  the candidates into room for twice that (one atomic per warp and tile of 256 entries that
  holds any);
  the count and the flag come back in one host read;
* :func:`gather` - the candidates in index order: those the scan collected (sorted by index, so
  the order is the CPU's whatever the thread schedule), or a second pass with exact room when
  the scan's room was short;
* :func:`kth_magnitude`, :func:`pick_topk` and :func:`commit` use torch on the device (the
  stable sort breaks ties by lowest index without a host read).

Launch overhead is kept off the hot path: tensors go to the kernels as raw device pointers (no
DLPack wrapping per call), counters come from torch's caching allocator, and the CuPy stream
that wraps torch's current stream is made once per stream. Host reads per bucket: the sample
(a few thousand floats, for the threshold) and the scan's count. Requires CuPy and a CUDA device;
:func:`available` says whether both are there.
"""
from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import torch

from . import reference
from .select import NORMAL_TINY

try:  # CuPy is optional
    import cupy as cp

    HAVE_CUPY = True
except Exception:  # ImportError, or a CuPy without a usable CUDA runtime
    cp = None
    HAVE_CUPY = False

name = "cupy"

ITEMS = 8  # entries per thread per tile: a warp takes a slot range once per 256 entries

_SCAN_SRC = r"""
#define ITEMS 8
extern "C" __global__
void scan(const float* __restrict__ g, const float* __restrict__ r, const int has_g,
          const float thi, const float tlo, const long long n,
          long long* __restrict__ out_idx, float* __restrict__ out_val,
          unsigned long long* __restrict__ counters, const unsigned long long cap) {
    // counters[0]: candidates seen, counters[1]: NaN/Inf seen. A warp reads a tile of
    // 32 * ITEMS consecutive entries (coalesced), counts its lanes' hits, and reserves their
    // slots with one atomic for the whole tile; the tile loop is uniform across the warp.
    const unsigned lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long tile = 32LL * ITEMS;
    unsigned bad = 0;
    for (long long base = warp * tile; base < n; base += warps * tile) {
        float a[ITEMS];
        unsigned hits = 0;
        #pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
            const long long i = base + it * 32 + lane;
            a[it] = 0.0f;
            if (i < n) {
                a[it] = has_g ? g[i] + r[i] : r[i];
                hits |= (unsigned)((a[it] >= thi) | (a[it] <= -tlo)) << it;
                bad |= !(fabsf(a[it]) <= 3.402823466e38f);
            }
        }
        const unsigned mine = __popc(hits);
        unsigned before = mine;  // inclusive prefix over the lanes
        #pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const unsigned v = __shfl_up_sync(0xffffffffu, before, off);
            if (lane >= off) before += v;
        }
        const unsigned total = __shfl_sync(0xffffffffu, before, 31);
        if (total == 0) continue;
        unsigned long long slot = 0;
        if (lane == 0) slot = atomicAdd(counters, (unsigned long long)total);
        slot = __shfl_sync(0xffffffffu, slot, 0) + (before - mine);
        #pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
            if ((hits >> it) & 1u) {
                if (slot < cap) { out_idx[slot] = base + it * 32 + lane; out_val[slot] = a[it]; }
                ++slot;
            }
        }
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(counters + 1, 1ull);
}
"""

_kernels = {}
_streams = {}


def available() -> bool:
    """CuPy importable and a CUDA device visible to torch."""
    return HAVE_CUPY and torch.cuda.is_available()


def _kernel(kname, src):
    if kname not in _kernels:
        _kernels[kname] = cp.RawKernel(src, kname)
    return _kernels[kname]


def _grid(n):
    threads = 256
    per_block = threads * ITEMS
    blocks = max(1, min(4096, (n + per_block - 1) // per_block))
    return (blocks,), (threads,)


def _ptr(t):
    """A tensor as a kernel argument: its device address (the kernel's pointer parameter
    takes the 8 bytes as they are; no DLPack wrapper is built per call)."""
    return np.uint64(t.data_ptr())


def _check(g, r):
    if r.dtype != torch.float32 or (g is not None and g.dtype != torch.float32):
        raise TypeError("the CuPy kernels take float32")
    if not r.is_contiguous():
        raise ValueError("the CuPy kernels take a contiguous residual")
    return r if g is None else g.contiguous()


def _stream(t):
    """The CuPy stream for torch's current stream on ``t``'s device (made once per stream)."""
    ts = torch.cuda.current_stream(t.device)
    key = (t.device.index, ts.cuda_stream)
    s = _streams.get(key)
    if s is None:
        import warnings

        with warnings.catch_warnings():  # ExternalStream is the form every CuPy >= 9 has
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cp.cuda.ExternalStream(ts.cuda_stream, t.device.index)
        _streams[key] = s
    return s


class Scan(NamedTuple):
    count: int
    nonfinite: bool
    t_hi: np.float32
    t_lo: np.float32
    energy: None = None  # not measured here: the engine computes it after the commit
    idx: torch.Tensor = None  # the candidates, when the room sufficed (in slot order)
    values: torch.Tensor = None


def kernel_threshold(t) -> np.float32:
    """``t`` as the scan kernel compares it. CuPy compiles every kernel with ``-ftz=true``, so
    a subnormal threshold (the selection's floor TINY, meant to keep zeros out) would read as
    zero there and make every zero a candidate: such a threshold is raised to the smallest
    normal float. The kernel's own sums flush the same way, so a subnormal entry reads as zero
    either way; no other threshold changes."""
    t = np.float32(t)
    return NORMAL_TINY if np.float32(0) < t < NORMAL_TINY else t


def _launch(g, r, thi, tlo, cap):
    """One scan kernel with room for ``cap`` candidates: (count, bad, idx, values)."""
    n = r.numel()
    gc = _check(g, r)
    counters = torch.zeros(2, dtype=torch.int64, device=r.device)
    idx = torch.empty(cap, dtype=torch.int64, device=r.device)
    val = torch.empty(cap, dtype=torch.float32, device=r.device)
    grid, block = _grid(n)
    with cp.cuda.Device(r.device.index), _stream(r):
        _kernel("scan", _SCAN_SRC)(grid, block, (
            _ptr(gc), _ptr(r), np.int32(g is not None), thi, tlo, np.int64(n),
            _ptr(idx), _ptr(val), _ptr(counters), np.uint64(cap)))
    count, bad = counters.tolist()  # the bucket's one count read
    return count, bool(bad), idx, val


def scan(g, r, t_hi, t_lo, expect=None) -> Scan:
    """Count (and, given ``expect``, collect into room for about twice that) the entries with
    ``acc >= t_hi or acc <= -t_lo``; look for NaN/Inf. Reads ``g`` and ``r`` once."""
    thi, tlo = kernel_threshold(t_hi), kernel_threshold(t_lo)
    cap = 0 if expect is None else min(r.numel(), 2 * int(expect) + 1024)
    count, bad, idx, val = _launch(g, r, thi, tlo, cap)
    if count <= cap and not bad:
        return Scan(count, False, thi, tlo, None, idx[:count], val[:count])
    return Scan(count, bad, thi, tlo)


def gather(g, r, s: Scan):
    """The candidates of scan ``s`` as (int64 indices, float32 acc values), in index order."""
    if s.idx is not None:
        cidx, cval = s.idx, s.values
    elif s.count:  # the scan had no room or too little: once more with exact room
        _, _, cidx, cval = _launch(g, r, s.t_hi, s.t_lo, s.count)
    else:
        return (torch.empty(0, dtype=torch.int64, device=r.device),
                torch.empty(0, dtype=torch.float32, device=r.device))
    if cidx.numel() > 1:  # slots come in any order: restore index order
        cidx, order = torch.sort(cidx)
        cval = cval[order]
    return cidx, cval


#: entries: up to this length ``torch.topk`` of the whole vector beats the sample-and-scan plan,
#: whose fixed cost (two host reads, a dozen launches) is about 1 ms per call. Measured with
#: benchmarks/topk_paths.py on an H100, two runs: up to 4M entries the direct form took half the
#: scan's time in both (0.39-0.68 ms against 0.81-1.37 ms at 1M); at 8M and 16M it won in one
#: run and lost at density 0.001 in the other; at 32M the scan won in both
DIRECT_TOPK_MAX = 1 << 23


def topk_direct(g, r, k: int):
    """Exact Top-K of ``acc = g + r`` (``r`` when ``g`` is None) for a short vector, with one
    host read, the NaN/Inf flag: the k-th largest magnitude ``t`` from ``torch.topk``, then
    every entry above ``t`` and the lowest-index entries equal to it (the definition's tie
    rule) compacted in index order with no count read. For ``0 < k < n``."""
    from .select import Selection, _empty

    acc = r if g is None else g + r
    keep = _top_mask(acc.abs(), k)
    if not bool(torch.isfinite(acc).all()):  # the one host read
        return _empty(r, True)
    idx = reference.nonzero_k(keep, k)
    values = acc[idx]
    return Selection(idx, values, values)


#: entries: up to this length SBC takes :func:`sbc_direct` instead of the sample-and-scan plan,
#: whose host reads and small launches (about a dozen reads per selection) left SBC's GPU step
#: at 2.6-2.9x Top-K's (benchmarks/results/gpu_profile_2026-11-27: 3.3 ms of device work in a
#: 9.4 ms step at 11.4M). Measured on an H200 in one run (gpu_sbc_direct_2026-11-27), engine
#: step: 11.4M entries 6.1 ms direct against 7.1 by the scan; 32M 10.5 against 7.7 (two
#: ``torch.topk`` of 320k out of 32M cost more than the scan saves). The bound lies between
#: and was not measured closer
DIRECT_SBC_MAX = 1 << 24


def sbc_direct(g, r, k: int):
    """SBC's selection (:func:`hvd_sparse.kernels.select.sbc`) of ``acc = g + r`` (``r`` when
    ``g`` is None) by whole-vector torch operations and two host reads: the count of each sign
    with the NaN/Inf flag, then both sides' means together. Each side: every entry of its sign
    when it has at most k, else the k largest by ``torch.topk`` and the lowest-index ties (the
    definition's rule), in index order. Plain torch, so it runs (and is tested) on a CPU too."""
    from .select import _empty, binary_choice

    acc = r if g is None else g + r
    pos, neg = acc > 0, acc < 0
    n_pos, n_neg, finite = torch.stack([pos.sum(), neg.sum(),
                                        torch.isfinite(acc).all().long()]).tolist()
    if not finite:
        return _empty(r, True)
    pi = _sbc_side(acc, pos, n_pos, k)
    ni = _sbc_side(-acc, neg, n_neg, k)
    return binary_choice(pi, acc[pi], ni, acc[ni])


def _sbc_side(score, mask, count: int, k: int):
    """The positions of SBC's side whose entries are ``mask`` (``score > 0``), in index order."""
    if count <= k:
        return reference.nonzero_k(mask, count)
    return reference.nonzero_k(_top_mask(score, k), k)  # (above zero: more than k are)


def _top_mask(score, k: int):
    """Where the ``k`` largest of ``score`` lie (``0 < k < n``): every entry above the k-th
    largest (``torch.topk``'s) and the lowest-index entries equal to it, the definition's tie
    rule, with no host read."""
    t = torch.topk(score, k, sorted=False).values.min()
    above = score > t
    ties = score == t
    return above | (ties & (torch.cumsum(ties, 0) <= k - above.sum()))


def segmented_topk(g, r, segments, counts):
    """Each segment's own exact Top-K of ``|g + r|`` (``counts[i]`` of segment ``i``, ties by
    lowest index; a segment of at most that many entries gives all of them), the segments
    contiguous and covering the bucket: (int64 indices ascending, acc values). The layer-wise
    selection of a bucket of several tensors (``layer_floor=1``) with no host read, where the
    floor rule's global selection, per-segment reads and refinement took several reads and a
    launch or more per starved tensor. Consecutive segments are ranked together, up to
    :data:`SORT_CHUNK` entries at a time, by one stable sort of a key (segment, magnitude
    descending); a longer segment by :func:`_segment_direct`. The same answer as the numba
    backend's :func:`hvd_sparse.kernels.cpu.segmented_topk`. Plain torch, so it runs (and is
    tested) on a CPU too. Reads only; NaN/Inf must have been ruled out."""
    acc = (r if g is None else g.to(r.dtype) + r).contiguous().reshape(-1)
    if not segments or segments[-1][1] != acc.numel():
        raise ValueError(f"segmented_topk: segments {segments} do not cover {acc.numel()} "
                         "entries")
    parts = []
    for lo, hi, plan in _segment_plan(tuple(segments), tuple(counts), acc.device):
        if isinstance(plan, int):  # one long segment, and its count
            parts.append(_segment_direct(acc[lo:hi], plan) + lo)
        elif plan[-1]:  # anything to take
            parts.append(_segments_sorted(acc[lo:hi], *plan) + lo)
    idx = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else \
        torch.empty(0, dtype=torch.int64, device=acc.device)
    return idx, acc[idx]


#: entries ranked by one sort (its buffers take about 40 bytes an entry while it runs)
SORT_CHUNK = 1 << 23


def _segments_sorted(a, ids, lengths, starts, ks, offsets, total):
    """The positions (ascending, relative to ``a``) of each segment's top ``ks[i]``: the
    magnitude's float32 bits with the sign cleared (-0 and +0 alike, as the CPU ranks them)
    under the segment number, sorted stably (ties stay in index order); segment i's block of
    the sorted order starts where the segment does."""
    key = a.float().view(torch.int32).to(torch.int64)
    key.bitwise_and_(0x7FFFFFFF).neg_().add_(0x7FFFFFFF)  # largest magnitude first
    seg = torch.repeat_interleave(ids, lengths, output_size=a.numel())
    seg <<= 31
    key.bitwise_or_(seg)
    del seg
    order = torch.sort(key, stable=True).indices
    del key
    within = torch.arange(total, device=a.device) \
        - torch.repeat_interleave(offsets, ks, output_size=total)
    take = torch.repeat_interleave(starts, ks, output_size=total) + within
    return torch.sort(order[take]).values


def _segment_direct(a, k):
    """The positions (ascending) of one long segment's top ``k`` (:func:`_top_mask`, as
    :func:`topk_direct` finds them): memory in the segment's length once, not a sort's."""
    if k >= a.numel():
        return torch.arange(a.numel(), device=a.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=a.device)
    return reference.nonzero_k(_top_mask(a.abs(), k), k)


_plans = collections.OrderedDict()


def _segment_plan(segments, counts, device):
    """The chunks :func:`segmented_topk` ranks, made once per bucket, density and device (the
    most recent 256 kept): ``(lo, hi, plan)`` with ``plan`` the count of one long segment, else
    the small per-segment tensors :func:`_segments_sorted` takes (numbers, lengths, starts
    within the chunk, counts, output offsets) and the chunk's output length."""
    key = (segments, counts, str(device))
    plan = _plans.get(key)
    if plan is not None:
        _plans.move_to_end(key)
        return plan
    ends = [0] + [hi for _, hi in segments[:-1]]
    if any(lo != end or hi < lo for (lo, hi), end in zip(segments, ends)):
        raise ValueError(f"segmented_topk takes contiguous segments from 0, got {segments}")
    chunks, run = [], []

    def close():
        if run:
            lo0 = run[0][0][0]
            lengths = [hi - lo for (lo, hi), _ in run]
            ks = [min(max(int(k), 0), hi - lo) for (lo, hi), k in run]
            offsets = [0]
            for k in ks[:-1]:
                offsets.append(offsets[-1] + k)

            def t(values):
                return torch.tensor(values, dtype=torch.int64, device=device)
            chunks.append((lo0, run[-1][0][1], (
                t(list(range(len(run)))), t(lengths), t([lo - lo0 for (lo, _), _ in run]),
                t(ks), t(offsets), sum(ks))))
            run.clear()

    size = 0
    for seg, k in zip(segments, counts):
        n = seg[1] - seg[0]
        if n > SORT_CHUNK:
            close()
            size = 0
            chunks.append((seg[0], seg[1], int(k)))
            continue
        if size + n > SORT_CHUNK:
            close()
            size = 0
        run.append((seg, k))
        size += n
    close()
    if len(_plans) >= 256:
        _plans.popitem(last=False)
    _plans[key] = chunks
    return chunks


sample = reference.sample
kth_magnitude = reference.kth_magnitude
pick_topk = reference.pick_topk
commit = reference.commit
scatter_add = reference.scatter_add
set_at = reference.set_at
support_sum = reference.support_sum
magnitude_histogram = reference.magnitude_histogram
