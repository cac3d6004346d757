"""Top-K with a per-tensor floor in a bucket of several tensors (``layer_floor``): the plain
definition's properties, its fused form equal to it bit for bit on every CPU backend, and the
engine giving the same bits on its fused and plain paths."""
import types

import pytest
import torch

import hvd_sparse
from hvd_sparse import kernels
from hvd_sparse.kernels import cpu, cuda
from hvd_sparse.sparsifiers import TopK, layer_floor
from hvd_sparse.sparsifiers.base import SelectionContext, k_for_density, topk_indices
from hvd_sparse.transport import LocalTransport


def _bucket(seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 3000, (int(torch.randint(2, 7, (1,), generator=gen)),),
                          generator=gen).tolist()
    segments, off = [], 0
    for n in sizes:
        segments.append((off, off + n))
        off += n
    # tensors whose magnitudes differ by orders, as a model's layers do
    scales = (10.0 ** (torch.rand(len(sizes), generator=gen) * 4 - 3)).tolist()
    g = torch.cat([torch.randn(n, generator=gen) * s for n, s in zip(sizes, scales)])
    if ties:
        g = (g * 4).round() / 4
    r = torch.randn(off, generator=gen) * 0.01
    return g, r, tuple(segments)


def _ctx(segments, floor):
    return SelectionContext("bucket", segments=segments, layer_floor=floor)


@pytest.mark.parametrize("floor", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(8))
def test_each_tensor_keeps_its_floor_and_the_count_is_the_budget(seed, floor):
    g, _, segments = _bucket(seed)
    density = 0.02
    idx = TopK().select(g, density, _ctx(segments, floor))
    assert idx.numel() == layer_floor.budget(g.numel(), segments, density, floor)
    assert torch.equal(idx, torch.unique(idx))  # ascending, unique
    for (lo, hi), f in zip(segments, layer_floor.floors(segments, density, floor)):
        mine = idx[(idx >= lo) & (idx < hi)]
        assert mine.numel() >= f
        # the tensor's own top f entries are among them
        assert set((lo + topk_indices(g[lo:hi], f)).tolist()) <= set(mine.tolist())


def test_floor_one_is_layerwise_and_zero_is_global():
    g, _, segments = _bucket(3)
    density = 0.05
    per_tensor = torch.cat([lo + topk_indices(g[lo:hi], k_for_density(hi - lo, density))
                            for lo, hi in segments])
    assert torch.equal(TopK().select(g, density, _ctx(segments, 1.0)), per_tensor)
    ctx = _ctx(segments, 0.0)
    assert not ctx.floored
    assert torch.equal(TopK().select(g, density, ctx),
                       topk_indices(g, k_for_density(g.numel(), density)))


def test_a_starved_tensor_gets_entries_that_global_topk_denies_it():
    g, _, segments = _bucket(5)
    lo, hi = segments[0]
    g[lo:hi] *= 1e-6  # far below every other tensor
    k = k_for_density(g.numel(), 0.02)
    assert not ((topk_indices(g, k) >= lo) & (topk_indices(g, k) < hi)).any()
    idx = TopK().select(g, 0.02, _ctx(segments, 0.5))
    assert ((idx >= lo) & (idx < hi)).sum() == layer_floor.floors(segments, 0.02, 0.5)[0]


def _segmented_cases():
    for seed in range(8):
        g, r, segments = _bucket(seed, ties=seed % 2 == 1)
        for density in (0.003, 0.05, 0.4, 1.0):
            counts = layer_floor.floors(segments, density, 1.0)
            yield g, r, segments, counts
    # whole segments (count at or above the length), a zero segment, one segment
    g, r, segments = _bucket(2)
    lo, hi = segments[1]
    g[lo:hi] = 0.0
    r[lo:hi] = 0.0
    yield g, r, segments, [hi - lo + 5 if i == 0 else 7 for i in range(len(segments))]
    yield g[:100], r[:100], ((0, 100),), [10]
    # an empty segment, a count of 0, and -0.0 against +0.0 with subnormals among the ties
    a = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0, -2.0, 0.0, 3.0])
    yield a, torch.zeros(8), ((0, 0), (0, 4), (4, 4), (4, 6), (6, 8)), [1, 3, 2, 0, 1]


@pytest.mark.parametrize("chunk", [1 << 23, 1000, 1])
def test_the_sorted_segmented_topk_is_each_tensors_own_topk(chunk, monkeypatch):
    """The GPU backend's segmented Top-K (sorts of consecutive segments, and ``torch.topk``
    for a segment longer than a sort takes; plain torch, run here on CPU tensors): each
    segment's own exact Top-K, ties by lowest index, as the definition and the numba backend
    give it. Small chunks put every path (several sorts, long segments alone) into play."""
    monkeypatch.setattr(cuda, "SORT_CHUNK", chunk)
    monkeypatch.setattr(cuda, "_plans", type(cuda._plans)())
    for g, r, segments, counts in _segmented_cases():
        for grad in (g, None):
            acc = r if grad is None else grad + r
            idx, val = cuda.segmented_topk(grad, r, segments, counts)
            want = torch.cat([lo + topk_indices(acc[lo:hi], min(k, hi - lo))
                              for (lo, hi), k in zip(segments, counts)])
            assert torch.equal(idx, want), (segments, counts)
            assert torch.equal(val, acc[want])
            if cpu.available():
                c_idx, c_val = cpu.segmented_topk(grad, r, segments, counts)
                assert torch.equal(idx, c_idx) and torch.equal(val, c_val)
    with pytest.raises(ValueError, match="cover"):
        cuda.segmented_topk(None, torch.ones(10), ((0, 5),), [1])
    with pytest.raises(ValueError, match="contiguous"):
        cuda.segmented_topk(None, torch.ones(10), ((0, 5), (6, 10)), [1, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by "
                    "benchmarks/gpu_check.sh on a GPU machine)")
def test_the_sorted_segmented_topk_on_cuda_equals_the_cpus():
    for g, r, segments, counts in _segmented_cases():
        for grad in (g, None):
            got = cuda.segmented_topk(None if grad is None else grad.cuda(), r.cuda(),
                                      segments, counts)
            want = cuda.segmented_topk(grad, r, segments, counts)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def _backends():
    out = [kernels.reference]
    if cpu.available():
        out.append(kernels.cpu)
    return out


def _backends_and_gpu():
    """(ops, scan): the CPU backends, and the CUDA kernels by their direct Top-K and by the
    sample-and-scan plan that longer buckets take."""
    skip = pytest.mark.skipif(not cuda.available(), reason="no CUDA device with CuPy here: "
                              "the GPU forms run in benchmarks/gpu_check.sh")
    out = [pytest.param(o, False, id=o.__name__.split(".")[-1]) for o in _backends()]
    # the CPU primitives with the GPU backend's sorted segmented Top-K (plain torch): the path
    # a packed bucket takes on a GPU at floor 1, run here
    sorted_segments = types.SimpleNamespace(**{k: v for k, v in vars(kernels.reference).items()
                                               if not k.startswith("__")},
                                            segmented_topk=cuda.segmented_topk)
    out += [pytest.param(sorted_segments, False, id="torch-sorted-segments")]
    out += [pytest.param(cuda, False, id="cupy-direct", marks=skip),
            pytest.param(cuda, True, id="cupy-scan", marks=skip)]
    return out


@pytest.mark.parametrize("ops,scan", _backends_and_gpu())
@pytest.mark.parametrize("floor", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_fused_form_equals_the_definition(ops, scan, floor, seed, monkeypatch):
    if scan:
        monkeypatch.setattr(cuda, "DIRECT_TOPK_MAX", 0)
    device = "cuda" if ops is cuda else "cpu"
    g, r, segments = _bucket(seed, ties=seed % 2 == 1)
    for density in (0.003, 0.05, 0.4):
        ctx = _ctx(segments, floor)
        acc = g + r
        want = TopK().select(acc, density, ctx)
        for grad, res in ((g, r.clone()), (None, acc.clone())):  # uplink, downlink
            grad = None if grad is None else grad.to(device)
            sel = TopK().fused(ops, grad, res.to(device), density, ctx)
            assert torch.equal(sel.idx.cpu(), want), (density, floor)
            assert torch.equal(sel.values.cpu(), acc[want])


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
def test_fused_form_reads_the_gradient_in_pieces():
    """The engine's path for a multi-parameter bucket on one thread: the scan reads p.grad's
    pieces and writes acc into a buffer; a starved tensor is then read from that buffer."""
    g, r, segments = _bucket(11)
    g[segments[1][0]:segments[1][1]] *= 1e-6
    acc = g + r
    parts = [(g[lo:hi].clone(), lo) for lo, hi in segments]
    into = torch.full_like(g, float("nan"))
    ops = cpu.AccumulatingOps(into, r, into, parts)
    ctx = _ctx(segments, 0.5)
    sel = TopK().fused(ops, into, r, 0.01, ctx)
    want = TopK().select(acc, 0.01, ctx)
    assert torch.equal(sel.idx, want) and torch.equal(sel.values, acc[want])


class _PlainTopK(TopK):
    """The same method without its fused form: the engine's plain path."""

    def fused(self, ops, grad, residual, density, ctx):
        return None


def _train(sparsifier, floor, bidirectional, steps=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 200), torch.nn.ReLU(),
                                torch.nn.Linear(200, 7))
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), sparsifier=sparsifier, density=0.02,
        scope="model", layer_floor=floor, bidirectional=bidirectional, min_sparse_numel=0,
        cost_model="off", check_config=False, transport=LocalTransport())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 30, generator=gen), torch.randint(0, 7, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("bidirectional", [True, False])
def test_engine_fused_and_plain_paths_give_the_same_bits(bidirectional):
    model, opt = _train(TopK(), 0.5, bidirectional)
    ref, ref_opt = _train(_PlainTopK(), 0.5, bidirectional)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    stats = opt.communication_stats()
    assert stats["selected"] == stats["target"] == layer_floor.budget(
        sum(p.numel() for p in model.parameters()),
        [(0, 6000), (6000, 6200), (6200, 7600), (7600, 7607)], 0.02, 0.5)


def test_floor_is_refused_for_a_method_without_one():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="layer_floor"):
        hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            sparsifier="gaussiank", layer_floor=0.5, transport=LocalTransport())
    with pytest.raises(ValueError, match="layer_floor"):
        hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            layer_floor=1.5, transport=LocalTransport())


def _long_bucket(seed, kind):
    """Tensors long enough for the per-segment sample (above 16,384 entries) next to short
    ones: ``kind`` "normal", "ties" (few distinct magnitudes: many entries at the threshold,
    more than the candidates' room), "sparse" (a downlink residual: mostly zeros, some
    tensors with fewer non-zeros than their k)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [17000, 3000, 40000, 20000, 1500, 70000]
    scales = [1.0, 1e-3, 10.0, 1e-5, 0.1, 1.0]
    g = torch.cat([torch.randn(n, generator=gen) * s for n, s in zip(sizes, scales)])
    if kind == "ties":
        g = torch.sign(g) * (g.abs() > 0.5).float() * torch.tensor(2.0)
    if kind == "sparse":
        keep = torch.rand(g.numel(), generator=gen) < 0.004
        g = g * keep
    segments, off = [], 0
    for n in sizes:
        segments.append((off, off + n))
        off += n
    return g, tuple(segments)


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse"])
@pytest.mark.parametrize("threads", [1, 2])
def test_layerwise_selection_of_long_tensors_equals_each_tensors_own_topk(kind, threads):
    """``layer_floor=1`` on the CPU ranks every tensor in one call (a sampled threshold per
    tensor, an exact pick among its candidates, the whole tensor where the sample misses):
    the same positions and values as one Top-K per tensor, ties and zeros included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g, segments = _long_bucket(7, kind)
        for density in (0.001, 0.01, 0.3):
            k = [k_for_density(hi - lo, density) for lo, hi in segments]
            want = torch.cat([lo + topk_indices(g[lo:hi], kk)
                              for (lo, hi), kk in zip(segments, k)])
            for grad, res in ((g * 0.5, g * 0.5), (None, g.clone())):  # uplink, downlink
                sel = TopK().fused(cpu, grad, res, density, _ctx(segments, 1.0))
                assert torch.equal(sel.idx, want), (kind, density)
                assert torch.equal(sel.values, g[want])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
def test_layerwise_selection_sees_nan():
    g, segments = _long_bucket(1, "normal")
    g[segments[2][0] + 5] = float("nan")
    sel = TopK().fused(cpu, None, g, 0.01, _ctx(segments, 1.0))
    assert sel.nonfinite and sel.idx.numel() == 0
