"""GPU selection primitives with CuPy, on torch's current stream, zero-copy via DLPack.

The same four primitives as :mod:`hvd_sparse.kernels.cpu` (see :mod:`.select` for the methods
built on them), for float32 CUDA tensors:

* :func:`scan` - one read-only kernel: counts ``acc >= t_hi or acc <= -t_lo`` (warp-reduced, one
  atomic per warp) and flags NaN/Inf; the count and the flag come back in one host read, which
  sizes the candidate buffer;
* :func:`gather` - a compaction kernel (atomic slots), then a sort of the short candidate list
  by index, so the order is the same as on the CPU whatever the thread schedule;
* :func:`kth_magnitude`, :func:`pick_topk` and :func:`commit` use torch on the device (the
  stable sort breaks ties by lowest index without a host read).

Host reads per bucket: the sample (a few thousand floats, for the threshold) and the scan's
count. Every CuPy launch goes on torch's current stream, so there is no race with the kernels
that produced the gradient or with a collective that uses the result. Requires CuPy and a CUDA
device; :func:`available` says whether both are there.
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
          unsigned long long* __restrict__ out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int mine = 0, bad = 0;
    for (; i < n; i += stride) {
        float a = has_g ? g[i] + r[i] : r[i];
        mine += (a >= thi) | (a <= -tlo);
        bad |= !(fabsf(a) <= 3.402823466e38f);
    }
    for (int off = 16; off > 0; off >>= 1) {
        mine += __shfl_down_sync(0xffffffffu, mine, off);
        bad |= __shfl_down_sync(0xffffffffu, bad, off);
    }
    if ((threadIdx.x & 31) == 0) {
        if (mine) atomicAdd(out, (unsigned long long)mine);
        if (bad) atomicOr(out + 1, 1ull);
    }
}
"""

_GATHER_SRC = r"""
extern "C" __global__
void gather(const float* __restrict__ g, const float* __restrict__ r, const int has_g,
            const float thi, const float tlo, const long long n,
            long long* __restrict__ out_idx, float* __restrict__ out_val,
            unsigned long long* __restrict__ pos, const unsigned long long cap) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float a = has_g ? g[i] + r[i] : r[i];
        if ((a >= thi) | (a <= -tlo)) {
            unsigned long long p = atomicAdd(pos, 1ull);
            if (p < cap) { out_idx[p] = i; out_val[p] = a; }
        }
    }
}
"""

_kernels = {}


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


def _args(g, r):
    if r.dtype != torch.float32 or (g is not None and g.dtype != torch.float32):
        raise TypeError("the CuPy kernels take float32")
    rc = cp.from_dlpack(r.detach())
    gc = cp.from_dlpack(g.detach().contiguous()) if g is not None else rc
    return gc, rc, np.int32(g is not None)


def _stream(t):
    return cp.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)


class Scan(NamedTuple):
    count: int
    nonfinite: bool
    t_hi: np.float32
    t_lo: np.float32
    energy: None = None  # not measured here: the engine computes it after the commit


def scan(g, r, t_hi, t_lo, expect=None) -> Scan:
    n = r.numel()
    thi, tlo = np.float32(t_hi), np.float32(t_lo)
    gc, rc, has_g = _args(g, r)
    stream = _stream(r)
    with stream:
        out = cp.zeros(2, dtype=cp.uint64)
        grid, block = _grid(n)
        _kernel("scan", _SCAN_SRC)(grid, block, (gc, rc, has_g, thi, tlo, cp.int64(n), out))
        count, bad = (int(x) for x in out.get(stream=stream))  # the bucket's count read
    return Scan(count, bool(bad), thi, tlo)


def gather(g, r, s: Scan):
    n = r.numel()
    cidx = torch.empty(s.count, dtype=torch.int64, device=r.device)
    cval = torch.empty(s.count, dtype=torch.float32, device=r.device)
    if s.count:
        gc, rc, has_g = _args(g, r)
        with _stream(r):
            pos = cp.zeros(1, dtype=cp.uint64)
            grid, block = _grid(n)
            _kernel("gather", _GATHER_SRC)(
                grid, block, (gc, rc, has_g, s.t_hi, s.t_lo, cp.int64(n),
                              cp.from_dlpack(cidx), cp.from_dlpack(cval), pos,
                              cp.uint64(s.count)))
        order = torch.argsort(cidx)  # atomic slots come in any order: restore index order
        cidx, cval = cidx[order], cval[order]
    return cidx, cval


sample = reference.sample
kth_magnitude = reference.kth_magnitude
pick_topk = reference.pick_topk
commit = reference.commit
scatter_add = reference.scatter_add
set_at = reference.set_at
support_sum = reference.support_sum
