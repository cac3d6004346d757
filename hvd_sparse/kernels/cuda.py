"""GPU fused feedback + selection with CuPy, on the current torch stream, zero-copy via DLPack.

Same plan as the CPU kernel (:mod:`hvd_sparse.kernels.cpu`): a threshold ``t`` from a sample of
``acc`` (on the device), one fused kernel that writes ``acc = grad + residual`` into the residual
and counts ``|acc| >= t`` (warp-reduced, one atomic per warp), one read of that count to the host
(the only device-to-host transfer per bucket: it sizes the candidate buffer), one compaction
kernel, then an exact pick among the candidates by (magnitude desc, index asc) with torch ops on
the short list. If the sample aimed too high, exact ``torch.topk`` on the device is the fallback.

Every CuPy launch goes on torch's current stream, so there is no race with the kernels that
produced the gradient or with Horovod's use of the result. Requires CuPy and a CUDA device;
:func:`available` says whether both are there.
"""
from __future__ import annotations

import torch

try:  # CuPy is optional
    import cupy as cp

    HAVE_CUPY = True
except Exception:  # ImportError, or a CuPy without a usable CUDA runtime
    cp = None
    HAVE_CUPY = False

_ADD_COUNT_SRC = r"""
extern "C" __global__
void add_count(const float* __restrict__ g, float* __restrict__ r, const float* __restrict__ tp,
               const long long n, unsigned long long* __restrict__ count) {
    const float t = *tp;  // the threshold stays on the device: no host round trip
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int mine = 0;
    for (; i < n; i += stride) {
        float a = g[i] + r[i];
        r[i] = a;
        mine += fabsf(a) >= t;
    }
    for (int off = 16; off > 0; off >>= 1) mine += __shfl_down_sync(0xffffffffu, mine, off);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(count, (unsigned long long)mine);
}
"""

_COMPACT_SRC = r"""
extern "C" __global__
void compact(const float* __restrict__ r, const float* __restrict__ tp, const long long n,
             long long* __restrict__ out_idx, float* __restrict__ out_val,
             unsigned long long* __restrict__ pos, const unsigned long long cap) {
    const float t = *tp;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float v = r[i];
        if (fabsf(v) >= t) {
            unsigned long long p = atomicAdd(pos, 1ull);
            if (p < cap) { out_idx[p] = i; out_val[p] = v; }
        }
    }
}
"""

_kernels = {}


def available() -> bool:
    """CuPy importable and a CUDA device visible to torch."""
    return HAVE_CUPY and torch.cuda.is_available()


def _kernel(name, src):
    if name not in _kernels:
        _kernels[name] = cp.RawKernel(src, name)
    return _kernels[name]


def _cupy(t: torch.Tensor):
    return cp.from_dlpack(t)


def _grid(n):
    threads = 256
    blocks = max(1, min(4096, (n + threads - 1) // threads))
    return (blocks,), (threads,)


def _sample_threshold(acc_sample: torch.Tensor, n: int, k: int):
    s = acc_sample.numel()
    expected = s * k / n
    rank = int(2.5 * expected + 3.0 * expected ** 0.5 + 2)
    if rank >= s:
        return None
    t = torch.kthvalue(acc_sample.abs(), s - rank + 1).values  # stays on the device
    return torch.clamp_min(t, torch.finfo(torch.float32).tiny)  # never every entry (see cpu.py)


def _pick_exact(cidx: torch.Tensor, cval: torch.Tensor, k: int):
    """The k largest magnitudes among the candidates, ties by lowest index, with no host sync:
    a stable descending sort of index-ordered candidates puts equal magnitudes in index order."""
    order = torch.argsort(cidx)
    cidx, cval = cidx[order], cval[order]
    top = torch.sort(cval.abs(), descending=True, stable=True).indices[:k]
    top = torch.sort(top).values  # back to index order
    return cidx[top], cval[top]


def _run(grad: torch.Tensor, residual: torch.Tensor, t: torch.Tensor):
    """Fused add+count then compaction at threshold ``t`` (a 1-element float32 device tensor)."""
    n = residual.numel()
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream(residual.device).cuda_stream)
    with stream:
        counter = cp.zeros(1, dtype=cp.uint64)
        grid, block = _grid(n)
        _kernel("add_count", _ADD_COUNT_SRC)(
            grid, block, (_cupy(grad), _cupy(residual), _cupy(t), cp.int64(n), counter))
        m = int(counter.get(stream=stream)[0])  # the one device-to-host read of the bucket
        cidx = torch.empty(m, dtype=torch.int64, device=residual.device)
        cval = torch.empty(m, dtype=torch.float32, device=residual.device)
        if m:
            pos = cp.zeros(1, dtype=cp.uint64)
            _kernel("compact", _COMPACT_SRC)(
                grid, block, (_cupy(residual), _cupy(t), cp.int64(n), _cupy(cidx), _cupy(cval),
                              pos, cp.uint64(m)))
    return m, cidx, cval


def fused_topk(grad: torch.Tensor, residual: torch.Tensor, k: int):
    """Exact Top-K with error feedback on float32 CUDA tensors (see module docstring)."""
    n = residual.numel()
    g = grad.detach().contiguous()
    if k >= n or k <= 0 or n < 65536:
        from .reference import fused_topk as ref
        return ref(g, residual, k)
    step = max(1, n // 32768)
    sample = g[::step][:32768] + residual[::step][:32768]
    t = _sample_threshold(sample, n, k)
    if t is None:
        from .reference import fused_topk as ref
        return ref(g, residual, k)
    m, cidx, cval = _run(g, residual, t.reshape(1).float().contiguous())
    if m < k:  # the sample aimed too high; acc is already in the residual
        from ..sparsifiers.base import topk_indices
        idx = topk_indices(residual, k)
        vals = residual[idx].clone()
        residual[idx] = 0
        return idx, vals
    idx, vals = _pick_exact(cidx, cval, k)
    residual[idx] = 0
    return idx, vals


def fused_threshold(grad: torch.Tensor, residual: torch.Tensor, threshold: float):
    """Hard threshold with error feedback on float32 CUDA tensors."""
    import numpy as np

    t32 = np.float32(threshold)
    if t32 < threshold:  # |acc| >= threshold exactly, also when it is not a float32
        t32 = np.nextafter(t32, np.float32(np.inf))
    t = torch.tensor([float(t32)], dtype=torch.float32).to(residual.device)  # host-to-device
    m, cidx, cval = _run(grad.detach().contiguous(), residual, t)
    order = torch.argsort(cidx)
    idx, vals = cidx[order], cval[order]
    residual[idx] = 0
    return idx, vals
