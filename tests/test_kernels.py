"""Every sparsifier's fused form equals its torch definition exactly, on every backend present:
same positions, same values, same residual afterwards, uplink (grad + residual) and downlink
(residual alone); NaN/Inf are reported and leave the residual untouched."""
import copy

import numpy as np
import pytest
import torch

from hvd_sparse import kernels
from hvd_sparse.kernels import cpu, cuda, reference, select
from hvd_sparse.sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold, SelectionContext,
                                    SparseBinary, TopK)
from hvd_sparse.sparsifiers.base import k_for_density, topk_indices

BACKENDS = [pytest.param(reference, id="torch"),
            pytest.param(cpu, id="numba", marks=pytest.mark.skipif(
                not cpu.available(), reason="numba is not installed: the CPU fast path is not "
                                            "exercised")),
            pytest.param(cuda, id="cupy", marks=pytest.mark.skipif(
                not cuda.available(), reason="no CUDA device with CuPy here: the GPU kernels "
                                             "are exercised only on a machine that has one"))]
CTX = SelectionContext("b")


def device_of(ops):
    return "cuda" if ops is cuda else "cpu"


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
    elif kind == "mostly_zero":  # a young downlink residual: a sparse aggregate
        grad = torch.zeros(n)
        pos = torch.randperm(n, generator=g)[:max(1, n // 150)]
        grad[pos] = torch.randn(pos.numel(), generator=g)
        res = torch.zeros(n)
    else:
        raise ValueError(kind)
    return grad.to(device), res.to(device)


def run_both(ops, sparsifier, grad, res, density, downlink):
    """(fused result, residual after commit) and (definition's result, residual after settle)."""
    s_fast, s_ref = sparsifier, copy.deepcopy(sparsifier)
    r_fast, r_ref = res.clone(), res.clone()
    g = None if downlink else grad
    if downlink:
        r_fast.add_(grad)
        r_ref.add_(grad)
    sel = s_fast.fused(ops, g, r_fast, density, CTX)
    if sel is None:
        return None
    assert not sel.nonfinite
    select.commit(ops, g, r_fast, sel, sel.values)
    acc = r_ref if downlink else r_ref.add_(grad)
    idx, vals = s_ref.compress(acc, density, CTX)
    if idx.numel():
        acc[idx] = acc[idx] - vals
    return (sel.idx, sel.values, r_fast), (idx, vals, r_ref)


def assert_same(a, b, what):
    for x, y in zip(a, b):
        assert torch.equal(x.cpu(), y.cpu()), what


SPARSIFIERS = {"topk": TopK, "gaussiank": GaussianK, "sbc": SparseBinary,
               "threshold": lambda: HardThreshold(1.5),
               "adaptive": lambda: AdaptiveTopK(total_steps=10)}


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("method", list(SPARSIFIERS))
@pytest.mark.parametrize("kind", ["random", "heavy", "all_equal", "quantised", "negative_zero",
                                  "mostly_zero"])
@pytest.mark.parametrize("n,density", [(1, 1.0), (2, 0.5), (17, 1.0), (1000, 0.01),
                                       (300_000, 0.001), (300_000, 0.1), (1 << 20, 0.001)])
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_fused_equals_definition(ops, method, kind, n, density, downlink):
    grad, res = inputs(kind, n, n + int(density * 1000), device_of(ops))
    got = run_both(ops, SPARSIFIERS[method](), grad, res, density, downlink)
    if got is None:  # no fused form for this input: SBC on a vector too short to sample
        assert method == "sbc" and (select.sample_positions(n) is None
                                    or 2 * k_for_density(n, density) >= n)
        return
    assert_same(*got, (method, kind, n, density, downlink))


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_sbc_rescans_a_side_its_sample_aimed_too_high_for(ops, downlink, monkeypatch):
    """The sample sees only large negatives, while most of the k largest are small ones off
    the sampled blocks: the first scan finds fewer than k negatives above the sampled
    threshold, and the side is scanned again from the smallest positive one."""
    monkeypatch.setattr(cuda, "DIRECT_SBC_MAX", 0)  # the scan path's rule, on a GPU too
    n, density = 300_000, 0.01
    k = k_for_density(n, density)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[torch.from_numpy(select.sample_positions(n))] = True
    gen = torch.Generator().manual_seed(4)
    grad = torch.rand(n, generator=gen) + 0.5  # positives everywhere
    where = torch.nonzero(sampled).squeeze(1)
    grad[where[::20]] = -3.0  # ~900 large negatives, all inside the sample
    off = torch.nonzero(~sampled).squeeze(1)
    grad[off[:5 * k]] = -0.01 * (1 + torch.rand(5 * k, generator=gen))  # small ones outside
    grad, res = grad.to(device_of(ops)), torch.zeros(n, device=device_of(ops))
    scans = []
    real = ops.scan

    def counting(*a, **kw):
        scans.append(a[2:4])
        return real(*a, **kw)
    monkeypatch.setattr(ops, "scan", counting)
    got = run_both(ops, SparseBinary(), grad, res, density, downlink)
    assert got is not None
    assert len(scans) == 2 and float(scans[0][1]) > float(select.TINY) \
        and float(scans[1][1]) == float(select.TINY), scans
    assert_same(*got, downlink)
    (idx, vals, _), _ = got
    # the negatives' mean (900 of 3 and 2,100 of about 0.015) is below the positives' (~1.5)
    assert idx.numel() == k and bool((vals > 0).all())


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("signs", ["positive", "negative", "few_negative", "none"])
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_sbc_side_short_of_k(ops, signs, downlink):
    """A sparse aggregate often holds fewer than k entries of one sign: that side takes all it
    has (never a zero), on the fused path, equal to the definition."""
    n, density = 300_000, 0.01
    k = k_for_density(n, density)
    gen = torch.Generator().manual_seed(3)
    grad = torch.zeros(n)
    where = torch.randperm(n, generator=gen)[:3 * k]
    grad[where] = torch.rand(3 * k, generator=gen) + 0.1
    if signs == "negative":
        grad = -grad
    elif signs == "few_negative":  # k // 3 negatives, larger than every positive
        grad[where[:k // 3]] = -5.0
    elif signs == "none":
        grad.zero_()
    res = torch.zeros(n)
    grad, res = grad.to(device_of(ops)), res.to(device_of(ops))
    got = run_both(ops, SparseBinary(), grad, res, density, downlink)
    assert got is not None, "SBC left its fused path"
    assert_same(*got, (signs, downlink))
    (idx, vals, _), _ = got
    acc = grad.cpu()
    assert bool((acc[idx.cpu()] != 0).all()), "SBC sent a position holding zero"
    want = {"positive": k, "negative": k, "few_negative": k // 3, "none": 0}[signs]
    assert idx.numel() == want
    if signs == "few_negative":  # the short side wins on its mean
        assert bool((vals < 0).all()) and float(vals[0]) == -5.0


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("kind", ["random", "heavy", "all_equal", "quantised", "negative_zero",
                                  "mostly_zero"])
@pytest.mark.parametrize("n,k", [(2, 1), (1000, 10), (1000, 999), (300_000, 300)])
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_direct_topk_equals_definition(device, kind, n, k, downlink):
    """The GPU's form for short vectors (torch.topk for the k-th magnitude, the tie rule
    without a count read) keeps exactly the definition's entries; it is plain torch, so it is
    checked on the CPU too."""
    grad, res = inputs(kind, n, n + k, device)
    g = None if downlink else grad
    r = res + grad if downlink else res
    sel = cuda.topk_direct(g, r, k)
    acc = r if downlink else grad + res
    want = topk_indices(acc, k)
    assert not sel.nonfinite and sel.ordered
    assert torch.equal(sel.idx.cpu(), want.cpu())
    assert torch.equal(sel.values.cpu(), acc[want].cpu())
    r[n // 2] = float("nan")
    assert cuda.topk_direct(g, r, k).nonfinite


@pytest.mark.skipif(not cuda.available(), reason="no CUDA device with CuPy here")
def test_cupy_scan_path_equals_definition(monkeypatch):
    """With the direct form switched off, the sample-and-scan plan that longer vectors take on
    a GPU gives the definition's result on the same inputs as test_fused_equals_definition."""
    monkeypatch.setattr(cuda, "DIRECT_TOPK_MAX", 0)
    monkeypatch.setattr(cuda, "DIRECT_SBC_MAX", 0)
    for method in ("topk", "adaptive", "gaussiank", "sbc"):
        for kind in ("random", "heavy", "all_equal", "quantised", "negative_zero",
                     "mostly_zero"):
            for n, density in ((2, 0.5), (1000, 0.01), (300_000, 0.001), (1 << 20, 0.001)):
                for downlink in (False, True):
                    grad, res = inputs(kind, n, n + int(density * 1000), "cuda")
                    got = run_both(cuda, SPARSIFIERS[method](), grad, res, density, downlink)
                    if got is None:  # SBC on a vector too short to sample: the plain path
                        assert method == "sbc"
                        continue
                    assert_same(*got, (method, kind, n, density, downlink))


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_threaded_equals_definition(ops, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in ("random", "quantised"):
            grad, res = inputs(kind, 2_000_003, 5, device_of(ops))
            for method in ("topk", "sbc", "gaussiank"):
                got = run_both(ops, SPARSIFIERS[method](), grad, res, 0.001, False)
                if got is not None:
                    assert_same(*got, (kind, method, threads))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7, 1.0000001, 2.5, 1e9])
def test_fused_threshold_equals_definition(ops, threshold):
    grad, res = inputs("random", 500_000, 3, device_of(ops))
    assert_same(*run_both(ops, HardThreshold(threshold), grad, res, 0.01, False), threshold)


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method", list(SPARSIFIERS))
def test_nonfinite_is_reported_and_residual_untouched(ops, poison, method):
    grad, res = inputs("random", 200_000, 1, device_of(ops))
    grad[123_457] = poison
    r = res.clone()
    sel = SPARSIFIERS[method]().fused(ops, grad, r, 0.01, CTX)
    if sel is None:
        return
    assert sel.nonfinite and sel.idx.numel() == 0
    assert torch.equal(r, res)


@pytest.mark.parametrize("ops", BACKENDS)
def test_scan_energy_is_the_squared_norm(ops):
    grad, res = inputs("random", 300_001, 2, device_of(ops))
    s = ops.scan(grad, res, np.float32(1.0), np.float32(1.0))
    if s.energy is not None:
        want = float((grad.double() + res.double()).pow(2).sum())
        assert abs(s.energy - want) <= 1e-4 * want


@pytest.mark.parametrize("ops", BACKENDS)
@pytest.mark.parametrize("expect", [None, 1, 10_000_000])
@pytest.mark.parametrize("threads", [1, 2])
def test_scan_gather_whatever_the_room(ops, expect, threads):
    """The candidates are the same, in index order, whether the scan's room held them all,
    was too short (a second pass) or was not offered, in one chunk or several (each chunk's
    room is followed by a spare slot its scan writes)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grad, res = inputs("random", 200_003, 5, device_of(ops))
        for t in (np.float32(1.5), np.float32(0.2)):  # 13% and 85% of the entries
            s = ops.scan(grad, res, t, t, expect)
            idx, val = ops.gather(grad, res, s)
            acc = (grad + res).cpu()
            want = torch.nonzero(acc.abs() >= t).squeeze(1)
            assert s.count == want.numel() > 1026
            assert torch.equal(idx.cpu(), want) and torch.equal(val.cpu(), acc[want])
    finally:
        torch.set_num_threads(old)


def test_sample_keeps_a_small_tail_tensor_near_its_share():
    """A whole-model bucket of 11.4M entries whose last 30,000 are an output layer: the sample
    gives that tail about its share of positions (the threshold aimed too high when one wide
    block, 1,024 entries, always landed there: six times its share)."""
    n, tail = 11_388_010, 30_010
    pos = select.sample_positions(n)
    share = float((pos >= n - tail).mean()) / (tail / n)
    assert 0.5 < share < 2.0


def test_sample_positions_are_made_once_per_length():
    assert select.sample_positions(10_000_000) is select.sample_positions(10_000_000)
    assert select.sample_positions(1000) is None
    assert np.array_equal(select.all_positions(77), np.arange(77))


@pytest.mark.parametrize("kind", ["random", "heavy", "all_equal", "quantised", "negative_zero",
                                  "mostly_zero", "one_sign", "short_side"])
@pytest.mark.parametrize("n,density", [(40_000, 0.01), (300_000, 0.001), (100_003, 0.05)])
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_sbc_direct_form_equals_the_definition(kind, n, density, downlink):
    """The GPU's direct SBC (plain torch, so it runs here on the CPU) against the definition:
    both sides' picks with the lowest-index tie rule, short sides, the choice by mean."""
    if kind == "one_sign":
        grad, res = torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.1, \
            torch.zeros(n)
    elif kind == "short_side":  # fewer than k negatives, each larger than every positive
        grad, res = inputs("mostly_zero", n, 7)
        k = k_for_density(n, density)
        grad = grad.abs()
        grad[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:k // 3]] = -9.0
    else:
        grad, res = inputs(kind, n, n + 3)

    class Direct:  # the CPU torch primitives with the CUDA module's direct SBC
        sbc_direct = staticmethod(cuda.sbc_direct)
        DIRECT_SBC_MAX = cuda.DIRECT_SBC_MAX

        def __getattr__(self, name):
            return getattr(reference, name)

    got = run_both(Direct(), SparseBinary(), grad, res, density, downlink)
    assert got is not None
    assert_same(*got, (kind, n, density, downlink))


def test_sbc_direct_form_flags_nonfinite():
    g, r = torch.randn(5000), torch.zeros(5000)
    g[17] = float("nan")
    assert cuda.sbc_direct(g, r, 50).nonfinite


def test_cupy_scan_raises_a_subnormal_threshold_to_a_normal_one():
    """CuPy compiles with -ftz=true: the floor TINY would read as zero in the kernel and make
    every zero a candidate (seen on an H200: SBC's short side sent zeros). Plain CPU check of
    the rule; the CUDA cases of test_sbc_side_short_of_k run it on a GPU."""
    normal = np.finfo(np.float32).tiny
    assert cuda.kernel_threshold(select.TINY) == normal
    assert cuda.kernel_threshold(normal / 4) == normal
    for t in (0.0, -np.inf, np.inf, -1.0, normal, 2.5):
        assert cuda.kernel_threshold(t) == np.float32(t)


def test_dispatch_and_helpers(monkeypatch):
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
    acc = r2 + grad
    order = torch.sort(acc.abs(), descending=True, stable=True).indices[:7]
    assert torch.equal(i, torch.sort(order).values)
    assert torch.equal(v, acc[i]) and float(res[i].abs().sum()) == 0.0


@pytest.mark.parametrize("ops", BACKENDS)
def test_gaussiank_corrects_a_residual_piled_under_the_threshold(ops):
    """Error feedback piles residual entries up just under the last threshold: a wall of
    values that no normal fit follows. The normal guess misses the band; the sample's own
    quantile, the first correction, lands in it: two scans, no exact fallback, and the same
    selection as the torch reference."""
    n, k = 400_000, 4_000
    gen = torch.Generator().manual_seed(3)
    acc = torch.randn(n, generator=gen) * 0.01
    wall = torch.randperm(n, generator=gen)[:20_000]
    acc[wall] = (0.06 + 0.03 * torch.rand(20_000, generator=gen)) * torch.sign(
        torch.randn(20_000, generator=gen))
    acc = acc.to(device_of(ops))
    lo, hi = GaussianK().bounds(k)
    sel = select.gaussiank(ops, None, acc, k, lo, hi, 3)
    assert not sel.fallback and sel.passes == 2 and lo <= sel.idx.numel() <= hi
    want = select.gaussiank(reference, None, acc.cpu(), k, lo, hi, 3)
    assert torch.equal(sel.idx.cpu(), want.idx) and torch.equal(sel.values.cpu(), want.values)


# ------------------------------------------------------------ streaming zero-fill
@pytest.mark.parametrize("start,length", [(0, 1 << 20), (3, (1 << 20) + 5), (1, 100)],
                         ids=["aligned", "unaligned-ends", "small"])
def test_stream_zero_fills_exactly_its_range_and_moves_the_version(start, length):
    from hvd_sparse.kernels import stream

    base = torch.randn(start + length + 7)
    keep = base.clone()
    view = base[start:start + length]
    version = view._version
    assert stream.zero_(view) is view
    assert torch.count_nonzero(view) == 0
    assert torch.equal(base[:start], keep[:start])
    assert torch.equal(base[start + length:], keep[start + length:])
    assert view._version > version


def test_stream_zero_can_be_turned_off(monkeypatch):
    from hvd_sparse.kernels import stream

    monkeypatch.setattr(stream, "_state", {"fn": None, "tried": False, "engine": None})
    monkeypatch.setenv("HVD_SPARSE_STREAM_ZERO", "off")
    assert not stream.available()
    t = torch.randn(1 << 19)
    stream.zero_(t)
    assert torch.count_nonzero(t) == 0


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
@pytest.mark.parametrize("method", ["topk", "sbc", "gaussiank"])
@pytest.mark.parametrize("downlink", [False, True], ids=["up", "down"])
def test_flush_denormal_keeps_zeros_out(method, downlink):
    """Under ``torch.set_flush_denormal(True)`` the smallest positive float reads as zero, so a
    threshold floored there would make every zero of a sparse vector a candidate (SBC would
    send zeros). The floor is then the smallest normal float: the same selection as without
    the flag."""
    n, density = 300_000, 0.01
    k = k_for_density(n, density)
    gen = torch.Generator().manual_seed(5)
    grad = torch.zeros(n)
    where = torch.randperm(n, generator=gen)[:k // 2]  # fewer non-zeros than k
    grad[where] = torch.randn(k // 2, generator=gen)
    grad[grad > 0] *= 0.1  # SBC sends the negatives (had zeros joined them, their mean falls)
    res = torch.zeros(n)
    plain = run_both(cpu, SPARSIFIERS[method](), grad, res, density, downlink)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        assert select.tiny() == np.finfo(np.float32).tiny
        flushed = run_both(cpu, SPARSIFIERS[method](), grad, res, density, downlink)
    finally:
        torch.set_flush_denormal(False)
    assert select.tiny() == select.TINY
    assert plain is not None and flushed is not None
    assert_same(plain[0], flushed[0], "flushed")
    if method == "sbc":  # (Top-K's definition takes k entries, zeros by lowest index)
        idx = flushed[0][0]
        assert 0 < idx.numel() <= k // 2 and bool((grad[idx] != 0).all()), "sent a zero"


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed: the merged support "
                                                "sum is the numba backend's")
@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_support_sum_merged_equals_the_scatter(ranks, scale, monkeypatch):
    """Adaptive k's signal: the aggregate's non-zero values, merged by position (no scratch)
    or scattered into a zero scratch (beyond MERGE_MAX_PAYLOADS, forced here too), give the
    same values bit for bit, cancellations dropped, and the same order-free square sum as
    the torch reference; the scratch is left all zero."""
    from hvd_sparse.kernels.sums import fixed_point_sum
    from hvd_sparse.wire import Payload

    n = 5000
    g = torch.Generator().manual_seed(ranks)
    payloads = []
    for r in range(ranks):
        idx = torch.randperm(n, generator=g)[:400].sort().values
        vals = torch.randn(400, generator=g)
        if r == 1:  # exact cancellations with rank 0 at shared positions, and a zero
            shared = idx[torch.isin(idx, payloads[0].indices)]
            where = torch.searchsorted(payloads[0].indices, shared)
            vals[torch.searchsorted(idx, shared)] = -payloads[0].values[where]
            vals[0] = 0.0
        payloads.append(Payload(idx, vals, 0))
    payloads.append(Payload(torch.zeros(0, dtype=torch.int64), torch.zeros(0), 0))
    scratch = torch.zeros(n)

    def results():
        out = cpu.support_sum(payloads, scale, torch.float32, "cpu", lambda: scratch)
        assert torch.count_nonzero(scratch) == 0
        return out

    merged = results()
    monkeypatch.setattr(cpu, "MERGE_MAX_PAYLOADS", 0)
    scattered = results()
    assert (merged != 0).all() and (scattered != 0).all()
    assert torch.equal(merged.sort().values, scattered.sort().values)
    ref = reference.support_sum(payloads, scale, torch.float32, "cpu")
    assert torch.equal(merged.sort().values, ref[ref != 0].sort().values)
    assert fixed_point_sum(merged, square=True) == fixed_point_sum(ref, square=True)


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed: the twin scatter is "
                                                "the numba backend's")
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_scatter_add_twin_equals_an_add_then_a_copy(scale):
    """Exchanged weight changes without the downlink selection: each payload is added into the
    anchor and the new values are written to the parameters in one loop. Payloads share
    positions (a later one adds onto the earlier one's result); the anchor and the twin get
    the bits of torch's index_add followed by a gather-and-set, and the twin is untouched
    elsewhere."""
    n = 4000
    g = torch.Generator().manual_seed(3)
    anchor = torch.randn(n, generator=g)
    twin = anchor.clone()
    twin[::7] = 123.0  # positions never touched keep what they held
    ref_anchor, ref_twin = anchor.clone(), twin.clone()
    first = torch.randperm(n, generator=g)[:300]
    second = torch.cat([first[:100], torch.randperm(n, generator=g)[:200]]).unique()
    for idx in (first, second):
        vals = torch.randn(idx.numel(), generator=g)
        ref_anchor.index_add_(0, idx, vals * scale)
        ref_twin[idx] = ref_anchor[idx]
        cpu.scatter_add_twin(anchor, twin, idx, vals, scale)
    assert torch.equal(anchor, ref_anchor)
    assert torch.equal(twin, ref_twin)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[torch.cat([first, second])] = False
    assert torch.all(twin[untouched & (torch.arange(n) % 7 == 0)] == 123.0)


@pytest.mark.skipif(not cpu.available(), reason="numba is not installed: the CPU fast path is "
                                                "not exercised")
@pytest.mark.parametrize("minus", [False, True])
def test_numba_sample_equals_indexing(minus):
    """The numba sample (whole vector, or pieces of a bucket's gradient, less the anchor) reads
    the same floats as torch's indexing: the sampled threshold, and so the scan's candidates,
    are the same on every backend."""
    n = 300_000
    gen = torch.Generator().manual_seed(3)
    grad, res, anchor = (torch.randn(n, generator=gen) for _ in range(3))
    pos = select.sample_positions(n)
    want = reference.sample(grad, res, pos)
    assert np.array_equal(cpu.sample(grad, res, pos), want)
    assert np.array_equal(cpu.sample(None, res, pos), reference.sample(None, res, pos))
    cuts = [0, 1000, 123_457, n]
    parts = [(grad[a:e].numpy(), a) for a, e in zip(cuts, cuts[1:])]
    if minus:
        want = (res + (grad - anchor))[torch.from_numpy(pos)].numpy()
    assert np.array_equal(cpu.sample_parts(parts, res, pos, anchor if minus else None), want)
    # a gap no piece covers reads the residual alone there
    got = cpu.sample_parts(parts[1:], res, pos, anchor if minus else None)
    low = pos < 1000
    assert np.array_equal(got[low], res.numpy()[pos[low]])
    assert np.array_equal(got[~low], want[~low])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compression_errors_from_several_devices_sum_in_one_read_each(device):
    """A GPU model's buckets hand their errors over as device tensors (CuPy's scan measures no
    energy) or as CPU numbers (a half-precision bucket's reference scan, a method's plain
    path); one stack of them all failed on the mixed devices at the end of the step."""
    from hvd_sparse.stats import CommunicationStats

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the mixed-device case needs one")
    stats = CommunicationStats()
    errors = [torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.25, device=device),
              torch.tensor(2.0, dtype=torch.float16, device=device)]
    for i, e in enumerate(errors):
        stats.record(f"b{i}", sent=8, received=8, dense=16, selected=1, numel=2, error=e)
    stats.end_step()
    assert stats.as_dict()["compression_error"] == 3.75
    stats.end_step()  # a step without errors
    assert stats.as_dict()["compression_error"] == 0.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("static", [True, False])
def test_nonzero_k_pads_with_the_fill_and_falls_back_the_same(device, static, monkeypatch):
    """The positions the Golomb device decoder and the CUDA selections take: the first k set
    entries, padded with ``fill_value`` when fewer are set; the counted form (a torch without
    ``nonzero_static`` on the device) gives the same positions."""
    monkeypatch.setitem(reference._STATIC_NONZERO, "ok", static)
    mask = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.bool, device=device)
    assert reference.nonzero_k(mask, 4).tolist() == [1, 3, 4, 7]
    assert reference.nonzero_k(mask, 6, fill_value=8).tolist() == [1, 3, 4, 7, 8, 8]
    assert reference.nonzero_k(mask, 3, fill_value=8).tolist() == [1, 3, 4]
    none = torch.zeros(5, dtype=torch.bool, device=device)
    assert reference.nonzero_k(none, 2, fill_value=5).tolist() == [5, 5]
