"""Each sparsifier's defining property, against numpy references (single process)."""
import math

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse import golomb, wire
from hvd_sparse.dgc import MomentumCorrection, clip_local, warmup_density
from hvd_sparse.sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold, RandomK,
                                    SelectionContext, SparseBinary, k_for_density,
                                    threshold_for_k)
from hvd_sparse.transport import LocalTransport

CTX = SelectionContext("bucket")


def sample(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g) * 0.01 + 0.001
    if kind == "student_t2":  # heavy tails: infinite variance
        z = torch.randn(n, generator=g)
        chi = torch.randn(n, 2, generator=g).pow(2).sum(1)
        return z / (chi / 2).sqrt()
    if kind == "laplace":
        u = torch.rand(n, generator=g) - 0.5
        return -u.sign() * torch.log1p(-2 * u.abs())
    if kind == "sparse_spiky":  # mostly tiny, a few huge
        x = torch.randn(n, generator=g) * 1e-4
        x[torch.randperm(n, generator=g)[:50]] = 100.0
        return x
    raise ValueError(kind)


def is_threshold_set(x, idx):
    """Every selected magnitude >= every unselected one."""
    mask = np.zeros(x.numel(), bool)
    mask[idx.numpy()] = True
    mag = x.abs().numpy()
    return mask.all() or (~mask).all() or mag[mask].min() >= mag[~mask].max()


@pytest.mark.parametrize("kind", ["gaussian", "student_t2", "laplace", "sparse_spiky"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_gaussiank_count_within_its_bounds(kind, density):
    gk = GaussianK(slack=2.0, max_passes=3)
    for seed in range(3):
        x = sample(kind, 100_000, seed)
        idx = gk.select(x, density, CTX)
        k = k_for_density(x.numel(), density)
        lo, hi = gk.bounds(k)
        assert lo <= idx.numel() <= hi, (kind, idx.numel(), k)
        assert 1 <= gk.last_passes <= 3
        assert torch.equal(idx, torch.sort(idx).values) and idx.unique().numel() == idx.numel()
        assert is_threshold_set(x, idx)


@pytest.mark.parametrize("x", [torch.zeros(5000), torch.full((5000,), 0.25),
                               torch.cat([torch.zeros(4990), torch.ones(10)])],
                         ids=["zeros", "constant", "mostly_zero"])
def test_gaussiank_degenerate_inputs(x):
    gk = GaussianK()
    idx = gk.select(x, 0.01, CTX)
    lo, hi = gk.bounds(50)
    assert lo <= idx.numel() <= hi and is_threshold_set(x, idx)


def test_gaussiank_on_gaussian_data_needs_no_fallback():
    gk = GaussianK()
    gk.select(sample("gaussian", 200_000, 0), 0.01, CTX)
    assert not gk.last_fallback and gk.last_passes == 1


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.5, 100.0])
def test_hard_threshold_selects_exactly_above_lambda(lam):
    x = sample("laplace", 10_000, 1)
    idx = HardThreshold(lam).select(x, 0.01, CTX).numpy()
    assert np.array_equal(idx, np.flatnonzero(np.abs(x.numpy()) >= lam))
    if lam == 100.0:
        assert idx.size == 0


def test_threshold_rules_of_thumb():
    x = sample("laplace", 50_000, 2)
    lam = threshold_for_k(x, 500, rule="sample")
    assert HardThreshold(lam).select(x, 0, CTX).numel() == 500
    lam_c = threshold_for_k(x, 500, rule="chebyshev")
    assert HardThreshold(lam_c).select(x, 0, CTX).numel() <= 500
    with pytest.raises(ValueError):
        threshold_for_k(x, 5, rule="guess")


def test_adaptive_stays_within_budget_and_follows_the_error():
    n, density, steps = 10_000, 0.01, 200
    budget = density * n * steps
    g = torch.Generator().manual_seed(0)
    ad = AdaptiveTopK(total_steps=steps, gamma=1.0)
    ks = []
    for t in range(steps):
        ctx = SelectionContext("b", step=t)
        x = torch.randn(n, generator=g)
        ks.append(ad.select(x, density, ctx).numel())
        # the gradient energy jumps by 10x in the second half of every 50-step period
        scale = 10.0 if (t // 25) % 2 else 1.0
        ad.observe(x * scale, ctx)
    assert sum(ks) <= budget
    assert sum(ks) >= 0.8 * budget  # and the budget is actually used
    lo, hi = k_for_density(n, density / 10), k_for_density(n, density * 10)
    assert all(lo <= k <= hi for k in ks)
    ks = np.array(ks)
    loud = [t for t in range(1, steps) if ((t - 1) // 25) % 2 == 1]
    quiet = [t for t in range(1, steps) if ((t - 1) // 25) % 2 == 0]
    assert ks[loud].mean() > 2 * ks[quiet].mean()  # more k where the error would be larger


def test_adaptive_k_rises_when_error_grows():
    ad = AdaptiveTopK(total_steps=100)
    ctx = SelectionContext("b")
    ad.observe(torch.ones(1000), ctx)
    k_flat = ad.k_for_step(1000, 0.05, "b")
    ad.observe(torch.ones(1000) * 3, ctx)
    assert ad.k_for_step(1000, 0.05, "b") > k_flat
    ad2 = AdaptiveTopK(total_steps=100)
    ad2.observe(torch.ones(1000), ctx)
    ad2.observe(torch.ones(1000) * 0.2, ctx)
    assert ad2.k_for_step(1000, 0.05, "b") < k_flat
    with pytest.raises(ValueError, match="total_steps"):
        AdaptiveTopK(total_steps=0)


def test_sbc_payload_one_value_per_position_with_the_right_sign():
    for seed, shift in ((0, 0.5), (1, -0.5), (2, 0.0)):
        x = sample("laplace", 20_000, seed) + shift
        idx, vals = SparseBinary().compress(x, 0.01, CTX)
        k = k_for_density(x.numel(), 0.01)
        pos_mean = torch.topk(x, k).values.mean()
        neg_mean = torch.topk(-x, k).values.mean()  # magnitude of the negative side
        sign = 1.0 if pos_mean >= neg_mean else -1.0
        assert idx.numel() == k
        assert torch.all(torch.sign(x[idx]) == sign)
        expected_mean = pos_mean if sign > 0 else -neg_mean
        assert torch.allclose(vals[0], expected_mean.to(vals.dtype), rtol=1e-6)
        buf = wire.encode(idx, vals, index_dtype=torch.int32, tag=7, numel=x.numel(),
                          index_coding="golomb", constant=True)
        (p,) = wire.decode_all(buf, 1, tag=7, numel=x.numel(), bucket="b")
        assert torch.equal(p.indices, idx)
        assert p.values.numel() == k and torch.all(p.values == vals[0])
        bits_per_position = (buf.numel() - 16 - 8 - 8) * 8 / k
        assert bits_per_position < 32  # far below int32 indices


@pytest.mark.parametrize("case", ["random", "empty", "all_ones", "single_last", "huge_gap",
                                  "adjacent_pairs"])
@pytest.mark.parametrize("b", [0, 1, 4, 9, 17])
def test_golomb_rice_round_trips(case, b):
    rng = np.random.default_rng(b)
    n = 5000
    positions = {
        "random": np.flatnonzero(rng.random(n) < 0.01),
        "empty": np.array([], dtype=np.int64),
        "all_ones": np.arange(n),
        "single_last": np.array([n - 1]),
        "huge_gap": np.array([0, 3_000_000]),
        "adjacent_pairs": np.array([10, 11, 500, 501, 4998, 4999]),
    }[case]
    data = golomb.encode(positions, b)
    assert np.array_equal(golomb.decode(data, positions.size, b), positions)
    with pytest.raises(ValueError):
        golomb.encode(np.array([3, 3]), b)


def test_golomb_rice_known_stream():
    # gaps 5, 0, 2 with b = 2: 1 0 01 | 0 00 | 0 10 -> 10010000 10 (padded with zeros)
    assert golomb.encode(np.array([5, 6, 9]), 2) == bytes([0b10010000, 0b10000000])


GOLOMB_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", GOLOMB_DEVICES)
@pytest.mark.parametrize("b", [0, 3, 6, 33])
def test_golomb_coder_forms_agree(device, b):
    """The compiled CPU coder, the vectorised one (the GPU's) and the decoder agree, bit for
    bit, on the device where the positions lie."""
    rng = np.random.default_rng(b)
    n = 2**36 if b == 33 else 300_000
    positions = np.unique(rng.integers(0, n, 4000 if b else 400))
    t = torch.from_numpy(positions).to(device)
    compiled = golomb.encode(positions, b)
    coded = golomb.encode_tensor(t, b)
    assert coded.device.type == device
    assert coded.cpu().numpy().tobytes() == compiled
    assert golomb.encode_vectorised(t, b).cpu().numpy().tobytes() == compiled
    assert np.array_equal(golomb.decode(compiled, positions.size, b), positions)
    with pytest.raises(ValueError):
        golomb.encode_tensor(torch.tensor([4, 2], device=device), b)


@pytest.mark.parametrize("device", GOLOMB_DEVICES)
@pytest.mark.parametrize("b", [0, 1, 4, 9, 33])
@pytest.mark.parametrize("case", ["random", "one", "first_and_second", "last", "dense_run"])
def test_golomb_tensor_decoder_equals_the_sequential_walk(device, b, case):
    """The GPU's decoder (pointer doubling, no host read) gives the sequential walk's positions,
    and on a cut stream says so exactly when the walk runs out of bits."""
    rng = np.random.default_rng(b)
    n = 2**36 if b == 33 else 300_000
    positions = {
        "random": np.unique(rng.integers(0, n, 3000 if b else 300)),
        "one": np.array([12345]),
        "first_and_second": np.array([0, 1]),
        "last": np.array([n - 1]),
        "dense_run": np.arange(40, 90),
    }[case]
    data = golomb.encode(positions, b)
    stream = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    got, complete = golomb.decode_tensor(stream, positions.size, b)
    assert got.device.type == device and bool(complete)
    assert np.array_equal(got.cpu().numpy(), positions)
    for cut in sorted({0, 1, len(data) // 2, len(data) - 1}):
        try:
            walked = golomb.decode(data[:cut], positions.size, b)
        except ValueError:
            walked = None
        got, complete = golomb.decode_tensor(stream[:cut], positions.size, b)
        assert bool(complete) == (walked is not None)
        if walked is not None:
            assert np.array_equal(got.cpu().numpy(), walked)


@pytest.mark.parametrize("device", GOLOMB_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_adaptive_signal_is_order_free_and_leaves_its_input(device, dtype):
    """Adaptive k's signal, the aggregate's squared norm: the same bits for any order of the
    same values (so every rank, device and thread count picks the same k), within 2**-17 of
    the exact sum, and computed without writing the caller's tensor."""
    from fractions import Fraction

    from hvd_sparse.sparsifiers.adaptive import square_sum

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(50_000, generator=g) * torch.rand(50_000, generator=g) ** 8 * 1e-3)
    x = x.to(dtype).to(device)
    before = x.clone()
    total = square_sum(x)
    assert torch.equal(x, before)
    exact = sum(Fraction(v) ** 2 for v in x.double().cpu().tolist())
    assert abs(Fraction(total) - exact) <= exact * Fraction(1, 2**17)
    for seed in range(3):
        order = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))
        assert square_sum(x[order.to(device)]) == total
    assert square_sum(x[:0]) == 0.0
    assert square_sum(torch.tensor([3.0, -4.0], device=device)) == 25.0


@pytest.mark.parametrize("device", GOLOMB_DEVICES)
def test_fixed_point_sum_is_order_free_with_both_signs(device):
    """SBC's one mean per sign and adaptive k's signal come from this sum: the same bits for
    any order, within its stated bound of the exact sum, NaN/Inf passed through."""
    from fractions import Fraction

    from hvd_sparse.kernels.sums import fixed_point_sum

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(20_000, generator=g, dtype=torch.float64) *
         torch.rand(20_000, generator=g, dtype=torch.float64) ** 4).to(device)
    total = fixed_point_sum(x)
    exact = sum(Fraction(v) for v in x.cpu().tolist())
    peak = Fraction(float(x.abs().max()))
    assert abs(Fraction(total) - exact) <= peak * x.numel() * Fraction(1, 2**(62 - 15))
    order = torch.randperm(x.numel(), generator=g).to(device)
    assert fixed_point_sum(x[order]) == total
    assert math.isnan(fixed_point_sum(torch.tensor([1.0, math.nan], device=device)))
    assert fixed_point_sum(torch.tensor([1.0, -math.inf], device=device)) == -math.inf


def test_fixed_point_sum_compiled_form_has_the_torch_form_bits(monkeypatch):
    """The CPU's compiled loop and the torch operations (the GPU's form) give the same bits,
    squared or not, from tiny to huge magnitudes."""
    from hvd_sparse.kernels import sums

    if sums._fixed_point is None:
        pytest.skip("numba is not installed: only the torch form exists")
    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(100_000, generator=g), torch.randn(999, generator=g) * 1e20,
             torch.randn(300, generator=g, dtype=torch.float64) * 1e-150,
             torch.zeros(3), torch.tensor([-2.5])]
    compiled = [sums.fixed_point_sum(x, square) for x in cases for square in (False, True)]
    monkeypatch.setattr(sums, "_fixed_point", None)
    assert compiled == [sums.fixed_point_sum(x, square) for x in cases for square in (False, True)]


@pytest.mark.parametrize("device", GOLOMB_DEVICES)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_fixed_point_sums_read_together_give_each_sums_bits(device, compiled, monkeypatch):
    """SBC's two side means are read from a device in one go: the same bits as one sum at a
    time, with an empty list entry, a NaN and an Inf among them."""
    from hvd_sparse.kernels import sums

    if not compiled:
        monkeypatch.setattr(sums, "_fixed_point", None)
    g = torch.Generator().manual_seed(8)
    cases = [torch.randn(50_000, generator=g), torch.zeros(0), torch.randn(7, generator=g) * 1e9,
             torch.tensor([1.0, math.nan]), torch.tensor([2.0, -math.inf]),
             torch.rand(3000, generator=g, dtype=torch.float64)]
    cases = [x.to(device) for x in cases]
    for square in (False, True):
        one_by_one = [sums.fixed_point_sums([x], square)[0] for x in cases]
        together = sums.fixed_point_sums(cases, square)
        assert [repr(v) for v in together] == [repr(v) for v in one_by_one]  # NaN == NaN
        assert together[1] == 0.0 and math.isnan(together[3])
        assert together[0] == sums.fixed_point_sum(cases[0], square)


@pytest.mark.parametrize("density,expected", [(0.001, 11.49), (0.01, 8.11)])
def test_golomb_bits_approach_the_entropy_bound(density, expected):
    rng = np.random.default_rng(0)
    positions = np.flatnonzero(rng.random(2_000_000) < density)
    b = golomb.optimal_parameter(density)
    bits = len(golomb.encode(positions, b)) * 8 / positions.size
    assert abs(bits - expected) < 0.1
    assert bits < golomb.entropy_bits_per_position(density) * 1.02


def test_randomk_leaves_the_global_rng_alone_and_agrees_on_the_downlink():
    x = torch.randn(10_000)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    rk = RandomK(seed=5)
    up0 = rk.select(x, 0.01, SelectionContext("b", step=3, rank=0, direction="up"))
    up1 = rk.select(x, 0.01, SelectionContext("b", step=3, rank=1, direction="up"))
    d0 = rk.select(x, 0.01, SelectionContext("b", step=3, rank=0, direction="down"))
    d1 = rk.select(x, 0.01, SelectionContext("b", step=3, rank=1, direction="down"))
    assert torch.equal(torch.rand(3), before)  # global stream untouched
    assert up0.numel() == 100 and not torch.equal(up0, up1) and torch.equal(d0, d1)
    assert torch.equal(up0, rk.select(x, 0.01, SelectionContext("b", 3, 0, "up")))


def test_dgc_aids():
    sched = [warmup_density(t, 0.001, 100) for t in range(120)]
    assert sched[0] > 0.9 and sched[-1] == 0.001
    assert all(a >= b for a, b in zip(sched, sched[1:]))
    mc = MomentumCorrection(0.9)
    u = mc.apply(torch.ones(4)).clone()
    u2 = mc.apply(torch.ones(4))
    assert torch.allclose(u2, 1.9 * u)
    mc.mask(torch.tensor([1, 2]))
    assert mc.velocity.tolist() == pytest.approx([1.9, 0, 0, 1.9])
    g = torch.full((100,), 1.0)
    clip_local(g, clip_norm=2.0, world_size=4)
    assert torch.linalg.vector_norm(g).item() == pytest.approx(1.0, rel=1e-5)


SPARSIFIER_ARGS = {
    "topk": {}, "gaussiank": {}, "randomk": {}, "sbc": {},
    "threshold": {"threshold": 0.05}, "adaptive": {"total_steps": 20},
}


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("name", sorted(SPARSIFIER_ARGS))
def test_every_sparsifier_conserves_mass_in_the_optimizer(name):
    torch.manual_seed(0)
    m = torch.nn.Linear(100, 50)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
        density=0.05, bidirectional=False, sparsifier=name, min_sparse_numel=0,
        transport=LocalTransport(), **SPARSIFIER_ARGS[name])
    for step in range(5):
        views = list(opt.engine_state().values())
        before = {n: (views[i].uplink if views[i].uplink is not None else torch.zeros(p.numel()))
                  for i, (n, p) in enumerate(m.named_parameters())}
        opt.zero_grad()
        m(torch.randn(16, 100)).pow(2).mean().backward()
        acc = {n: p.grad.reshape(-1) + before[n] for n, p in m.named_parameters()}
        opt.step()
        for i, (n, p) in enumerate(m.named_parameters()):
            rebuilt = p.grad.reshape(-1) + list(opt.engine_state().values())[i].uplink
            if name == "sbc":  # sent values are a mean, not the entries: one rounding
                assert torch.allclose(rebuilt, acc[n], rtol=0, atol=1e-6)
            else:
                assert torch.equal(rebuilt, acc[n]), (name, n, step)
    stats = opt.communication_stats()
    assert stats["totals"]["compression_error"] > 0


@pytest.mark.parametrize("numel,density,k", [(100, 0.07, 7), (10_000, 0.07, 700),
                                             (3_000, 0.55, 1_650), (700, 0.07, 49),
                                             (100, 0.14, 14), (3, 0.5, 2), (1_000, 0.0015, 2)])
def test_k_is_the_ceiling_of_the_density_as_written(numel, density, k):
    """``0.07 * 100`` is 7.000000000000001 in floating point: its ceiling kept 8 entries."""
    from hvd_sparse.sparsifiers import k_for_density

    assert k_for_density(numel, density) == k


def test_gaussiank_band_rounds_its_lower_bound_up():
    """k = 3 with slack 2 accepts 2 to 6 entries: a count of 1 lies below k / slack (1.5)."""
    assert GaussianK(slack=2.0).bounds(3) == (2, 6)
    assert GaussianK(slack=2.0).bounds(4) == (2, 8)


def test_adaptive_refuses_a_floor_above_the_density():
    """``min_density`` above the run's density would spend past the budget every step."""
    s = AdaptiveTopK(total_steps=20, min_density=0.05)
    with pytest.raises(ValueError, match="min_density <= density"):
        s.k_for_step(10_000, 0.01, "b")
    assert AdaptiveTopK(total_steps=20, min_density=0.005).k_for_step(10_000, 0.01, "b") > 0


def test_wire_golomb_without_numel_and_constant_payload_edges():
    """Golomb positions coded without the vector's length take its bound from the last index
    (the Rice parameter was 0: unary gaps, 24x the size); an expanded constant value (as
    decoding hands it back) encodes; an empty constant payload's size is what encode writes."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(1_000_000, generator=g)[:1000].sort().values.to(torch.int32)
    vals = torch.randn(1000, generator=g)
    known = wire.encode(idx, vals, index_dtype=torch.int32, tag=1, numel=1_000_000,
                        index_coding="golomb")
    guessed = wire.encode(idx, vals, index_dtype=torch.int32, tag=1, index_coding="golomb")
    assert guessed.numel() <= known.numel() * 1.05
    (p,) = wire.decode_all(guessed, 1, tag=1, numel=1_000_000, bucket="b")
    assert torch.equal(p.indices.to(torch.int32), idx) and torch.equal(p.values, vals)
    shared = torch.tensor([0.25]).expand(1000)
    buf = wire.encode(idx, shared, index_dtype=torch.int32, tag=2, numel=1_000_000,
                      constant=True)
    (p,) = wire.decode_all(buf, 1, tag=2, numel=1_000_000, bucket="b")
    assert torch.equal(p.indices.to(torch.int32), idx) and bool((p.values == 0.25).all())
    empty = wire.encode(idx[:0], vals[:0], index_dtype=torch.int32, tag=3, constant=True)
    assert wire.payload_nbytes(0, torch.int32, torch.float32, constant=True) == empty.numel()
    assert wire.payload_nbytes(5, torch.int32, torch.float32, constant=True) == wire.encode(
        idx[:5], vals[:5], index_dtype=torch.int32, tag=3, constant=True).numel()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_multi_parameter_downlink_selection_lands_in_each_parameter(dtype):
    """Bidirectional, a bucket of several parameters (one of them unused, so its range of the
    selection is empty) in a dtype the numba grouping does not take: the selection is split by
    one search of every parameter's edges. Each parameter's gradient plus both residuals must
    rebuild what entered the step, entry for entry (a wrong split moves mass between
    parameters or drops it)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20),
                            torch.nn.Linear(20, 5)).to(dtype)
    unused = torch.nn.Parameter(torch.zeros(17, dtype=dtype))
    m.register_parameter("unused", unused)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
        density=0.05, bidirectional=True, min_sparse_numel=0, scope="model",
        transport=LocalTransport())
    params = list(m.parameters())
    for step in range(4):
        (view,) = opt.engine_state().values()
        assert len(view.parameters) == len(params)
        zero = torch.zeros(view.numel, dtype=torch.float64)
        up = zero if view.uplink is None else view.uplink.double()
        down = zero if view.downlink is None else view.downlink.double()
        opt.zero_grad()
        m(torch.randn(8, 40, dtype=dtype)).pow(2).mean().backward()
        unused.grad = torch.zeros_like(unused)
        entering = torch.cat([p.grad.reshape(-1).double() for p in params]) + up + down
        opt.step()
        (view,) = opt.engine_state().values()
        written = torch.cat([p.grad.reshape(-1).double() for p in params])
        assert int((written != 0).sum()) > 0 and not unused.grad.any()
        rebuilt = written + view.uplink.double() + view.downlink.double()
        tol = 1e-12 if dtype == torch.float64 else 1e-2
        assert torch.allclose(rebuilt, entering, rtol=0, atol=tol), (dtype, step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("exchange", ["update", "gradient"])
def test_a_multi_parameter_bucket_on_cuda_follows_the_cpu(exchange):
    """The GPU forms of the per-parameter work (one search for the selection's split, one
    multi-tensor zeroing, copy to and from the anchor, one finiteness read) against the CPU's
    per-parameter loops: a few steps of the same model end at the same weights."""
    import copy

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30),
                               torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    x, y = torch.randn(8, 40), torch.randn(8, 5)
    ends = []
    for device in ("cpu", "cuda"):
        m = copy.deepcopy(base).to(device)
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), density=0.05, bidirectional=True,
            min_sparse_numel=0, scope="model", exchange=exchange, transport=LocalTransport())
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x.to(device)), y.to(device)).backward()
            opt.step()
        ends.append(torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()]))
    assert not torch.equal(ends[0], torch.cat([p.reshape(-1) for p in base.parameters()]))
    assert torch.allclose(ends[0], ends[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_gaussiank_whose_sample_holds_only_zeros_sends_no_zeros(backend):
    """The sample of a sparse vector can hold zeros only (a normal fit of mean = std = 0):
    the threshold of 0 made every zero a candidate (the whole vector collected, then the k
    largest of it, zeros among them where fewer than k are non-zero). Floored as every
    threshold, it collects the non-zeros, here within GaussianK's band: all of them go, and
    no zero."""
    from hvd_sparse.kernels import cpu, reference, select
    from hvd_sparse.sparsifiers import GaussianK, SelectionContext

    if backend == "numba" and not cpu.available():
        pytest.skip("numba is not installed")
    ops = reference if backend == "torch" else cpu
    n, density = 1 << 20, 0.001
    sampled = np.zeros(n, dtype=bool)
    sampled[select.sample_positions(n)] = True
    free = np.flatnonzero(~sampled)
    r = torch.zeros(n)
    where = torch.from_numpy(free[:: len(free) // 900][:900])
    r[where] = torch.linspace(0.5, 2.0, 900)
    sel = GaussianK().fused(ops, None, r.clone(), density, SelectionContext("b"))
    assert int((sel.values == 0).sum()) == 0
    assert torch.equal(torch.sort(sel.idx).values, torch.sort(where).values)
