"""Fast fused kernels equal the torch reference exactly, on every backend present."""
import pytest
import torch

from hvd_sparse import kernels
from hvd_sparse.kernels import cpu, cuda, reference

BACKENDS = [pytest.param(cpu, id="numba", marks=pytest.mark.skipif(
    not cpu.available(), reason="numba is not installed: the CPU fast path is not exercised")),
    pytest.param(cuda, id="cupy", marks=pytest.mark.skipif(
        not cuda.available(), reason="no CUDA device with CuPy here: the GPU kernels are "
                                     "exercised only on a machine that has one"))]


def inputs(kind, n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        grad, res = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.3
    elif kind == "heavy":
        grad = torch.randn(n, generator=g) / torch.rand(n, generator=g).clamp_min(1e-3)
        res = torch.zeros(n)
    elif kind == "all_equal":
        grad, res = torch.full((n,), 0.5), torch.zeros(n)
    elif kind == "quantised":  # many exact ties at the boundary
        grad = torch.randint(-3, 4, (n,), generator=g).float()
        res = torch.randint(-1, 2, (n,), generator=g).float()
    elif kind == "negative_zero":
        grad = -torch.zeros(n)
        grad[::7] = -1.0
        res = torch.zeros(n)
    else:
        raise ValueError(kind)
    return grad.to(device), res.to(device)


def check(impl, device, kind, n, k):
    grad, res = inputs(kind, n, n + k, device)
    r_fast, r_ref = res.clone(), res.clone()
    i1, v1 = impl.fused_topk(grad, r_fast, k)
    i2, v2 = reference.fused_topk(grad, r_ref, k)
    assert torch.equal(i1.cpu(), i2.cpu()), (kind, n, k)
    assert torch.equal(v1.cpu(), v2.cpu())
    assert torch.equal(r_fast.cpu(), r_ref.cpu())


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("kind", ["random", "heavy", "all_equal", "quantised", "negative_zero"])
@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (17, 0), (17, 17), (1000, 10), (300_000, 300),
                                 (300_000, 30_000), (1 << 20, 1000)])
def test_fused_topk_equals_reference(impl, kind, n, k):
    check(impl, "cuda" if impl is cuda else "cpu", kind, n, k)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_topk_threaded_equals_reference(impl, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in ("random", "quantised"):
            check(impl, "cuda" if impl is cuda else "cpu", kind, 2_000_003, 2000)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 1.0000001, 2.5, 1e9])
def test_fused_threshold_equals_reference(impl, threshold):
    device = "cuda" if impl is cuda else "cpu"
    grad, res = inputs("random", 500_000, 3, device)
    r_fast, r_ref = res.clone(), res.clone()
    i1, v1 = impl.fused_threshold(grad, r_fast, threshold)
    i2, v2 = reference.fused_threshold(grad, r_ref, threshold)
    assert torch.equal(i1.cpu(), i2.cpu()) and torch.equal(v1.cpu(), v2.cpu())
    assert torch.equal(r_fast.cpu(), r_ref.cpu())


def test_dispatch_and_fallback(monkeypatch):
    f32, f64 = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    assert kernels.backend_for(f64) == "torch"
    assert kernels.backend_for(f32) == ("numba" if cpu.available() else "torch")
    monkeypatch.setenv("HVD_SPARSE_KERNELS", "torch")
    assert kernels.backend_for(f32) == "torch"
    # the CuPy module imports and reports itself unavailable where there is no GPU
    assert cuda.available() == (cuda.HAVE_CUPY and torch.cuda.is_available())
    grad, res = inputs("random", 1000, 0)
    r2 = res.clone()
    i, v = kernels.fused_topk(grad, res, 7)
    j, w = reference.fused_topk(grad, r2, 7)
    assert torch.equal(i, j) and torch.equal(res, r2)
