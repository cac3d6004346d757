"""GPU selection primitives with CuPy, on torch's current stream.

The same primitives as :mod:`hvd_sparse.kernels.cpu` (see :mod:`.select` for the methods built
on them), for float32 CUDA tensors:

* :func:`scan` - one read-only kernel over ``acc = g + r`` that counts ``acc >= t_hi or
  acc <= -t_lo``, flags NaN/Inf and, when the caller says how many to expect, already compacts
  the candidates into room for twice that (warp-aggregated: one atomic per warp that has any);
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

from typing import NamedTuple

import numpy as np
import torch

from . import reference

try:  # CuPy is optional
    import cupy as cp

    HAVE_CUPY = True
except Exception:  # ImportError, or a CuPy without a usable CUDA runtime
    cp = None
    HAVE_CUPY = False

name = "cupy"

_SCAN_SRC = r"""
extern "C" __global__
void scan(const float* __restrict__ g, const float* __restrict__ r, const int has_g,
          const float thi, const float tlo, const long long n,
          long long* __restrict__ out_idx, float* __restrict__ out_val,
          unsigned long long* __restrict__ counters, const unsigned long long cap) {
    // counters[0]: candidates seen, counters[1]: NaN/Inf seen. Each warp walks the vector in
    // the same uniform steps, so the warp votes below always have all 32 lanes.
    const unsigned lane = threadIdx.x & 31;
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned bad = 0;
    for (long long base = (long long)blockIdx.x * blockDim.x; base < n; base += stride) {
        const long long i = base + threadIdx.x;
        float a = 0.0f;
        bool hit = false;
        if (i < n) {
            a = has_g ? g[i] + r[i] : r[i];
            hit = (a >= thi) | (a <= -tlo);
            bad |= !(fabsf(a) <= 3.402823466e38f);
        }
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (mask) {
            const int leader = __ffs(mask) - 1;
            unsigned long long slot = 0;
            if (lane == leader) slot = atomicAdd(counters, (unsigned long long)__popc(mask));
            slot = __shfl_sync(0xffffffffu, slot, leader);
            if (hit) {
                const unsigned long long p = slot + __popc(mask & ((1u << lane) - 1u));
                if (p < cap) { out_idx[p] = i; out_val[p] = a; }
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
    blocks = max(1, min(4096, (n + threads - 1) // threads))
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
    thi, tlo = np.float32(t_hi), np.float32(t_lo)
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


sample = reference.sample
kth_magnitude = reference.kth_magnitude
pick_topk = reference.pick_topk
commit = reference.commit
scatter_add = reference.scatter_add
set_at = reference.set_at
support_sum = reference.support_sum
