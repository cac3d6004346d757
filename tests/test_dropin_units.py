"""Single-process regressions for drop-in behaviour: LR schedulers made before wrapping, fp16 on
the wire, adaptive Top-K's defaults, payload validation, MPI layout helpers, NaN under "ignore",
and the class Horovod's broadcast_optimizer_state recognises."""
import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hvd_sparse
from hvd_sparse import wire
from hvd_sparse.sparsifiers import AdaptiveTopK, SelectionContext
from hvd_sparse.transport import LocalTransport, cuda_in_library_version, gatherv_layout


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def _wrap(m, base=None, **kw):
    kw.setdefault("density", 0.1)
    kw.setdefault("min_sparse_numel", 0)
    kw.setdefault("cost_model", "off")
    base = base or torch.optim.SGD(m.parameters(), lr=0.1)
    return hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                           transport=LocalTransport(), **kw)


def _train(m, opt, steps, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        (scale * F.cross_entropy(m(x), y)).backward()
        opt.step()


def test_lr_scheduler_made_before_wrapping_keeps_the_exchange():
    m = _net()
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = _wrap(m, base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            _train(m, opt, 1)
            sched.step()
    assert opt.communication_stats()["steps"] == 3  # every step went through the exchange
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


def test_lr_scheduler_made_before_wrapping_survives_load_state_dict():
    """torch's load_state_dict puts new group dicts in place; a scheduler made on the base
    optimizer holds the old ones, shared with the wrapper: they must stay the ones read."""
    m = _net()
    base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = _wrap(m, base)
    _train(m, opt, 2)
    saved = opt.state_dict()
    saved["param_groups"][0]["momentum"] = 0.5  # loaded values are really taken
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["momentum"] == 0.5
    assert opt.param_groups[0] is base.param_groups[0]
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    _train(m, opt, 1)
    assert opt.communication_stats()["steps"] == 3  # the step counter came back too


def test_class_is_recognised_by_horovods_broadcast_optimizer_state():
    """Horovod initialises a fresh optimizer's state with the base step() (no collective) only
    for optimizers whose module is its DistributedOptimizer's."""
    m = _net()
    opt = _wrap(m, torch.optim.Adam(m.parameters(), lr=0.01))
    assert opt.__module__ == "horovod.torch.optimizer"
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    super(opt.__class__, opt).step()  # what Horovod's function calls
    assert len(opt.state_dict()["state"]) == 4
    assert opt.communication_stats()["steps"] == 0  # no exchange happened


def test_fp16_wire_overflow_stays_finite_and_keeps_the_mass():
    m = _net()
    opt = _wrap(m, value_dtype=torch.float16)
    _train(m, opt, 3, scale=1e7)  # gradients far past fp16's 65504
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    for v in opt.engine_state().values():
        if v.sparse:
            assert bool(torch.isfinite(v.uplink).all()) and bool(torch.isfinite(v.downlink).all())
            assert float(v.uplink.abs().max()) > 65504  # the clipped part waits in the residual


def test_fp16_compression_overflow_stays_finite():
    m = _net()
    opt = _wrap(m, compression=hvd_sparse.compat.Compression.fp16)
    _train(m, opt, 3, scale=1e7)
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())


def test_adaptive_without_total_steps_spends_its_average_budget():
    sp = AdaptiveTopK()  # the run's length is unknown: a rolling horizon
    n, density = 10_000, 0.01
    spent = 0
    for t in range(300):
        k = sp.k_for_step(n, density, "b")
        sp._take("b", k)
        sp.observe(torch.randn(50) * (1 + (t % 7)), SelectionContext("b"))
        spent += k
    assert abs(spent / (300 * n) - density) < 0.1 * density


def test_adaptive_with_bytes_fallback_comes_back_from_dense():
    """target_count is the k this step would take, so one dense step does not freeze it."""
    sp = AdaptiveTopK(total_steps=100)
    ctx = SelectionContext("b")
    assert sp.target_count(1000, 0.01, ctx) == sp.k_for_step(1000, 0.01, "b") == 10
    sp._take("b", 100)  # a large step: the budget left shrinks, and so does the next target
    assert sp.target_count(1000, 0.01, ctx) < 10
    assert "b" in sp.buckets and sp.target_count(1000, 0.01, SelectionContext("c")) == 10
    assert "c" not in sp.buckets  # reading the target changes no state


def test_adaptive_observe_is_the_same_for_any_thread_count():
    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(1))
    out = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            sp = AdaptiveTopK(total_steps=10)
            sp.observe(x, SelectionContext("b"))
            out.append(sp.buckets["b"]["signal"])
    finally:
        torch.set_num_threads(threads)
    assert out[0] == out[1]


def _payload(idx, vals, numel=100, coding="plain", constant=False, nonfinite=False):
    return wire.encode(torch.tensor(idx, dtype=torch.int64), torch.tensor(vals),
                       index_dtype=torch.int32, tag=wire.fingerprint("b", numel), numel=numel,
                       index_coding=coding, constant=constant, nonfinite=nonfinite)


def _decode(buf, numel=100, ranks=1):
    return wire.decode_all(buf, ranks, tag=wire.fingerprint("b", numel), numel=numel,
                           bucket="b")


@pytest.mark.parametrize("case,match", [
    ("negative", "outside bucket"), ("unsorted", "unsorted or repeated"),
    ("duplicate", "unsorted or repeated"), ("huge_count", "more than the bucket"),
    ("truncated_golomb", "Golomb"), ("truncated_header", "header"),
    ("huge_rice_parameter", "Rice parameter"), ("zeros", "hvd.join"),
])
def test_malformed_payloads_end_in_payload_error_naming_rank_and_bucket(case, match):
    good = _payload([1, 5, 9], [1.0, 2.0, 3.0])
    if case == "negative":
        buf = _payload([-3, 5, 9], [1.0, 2.0, 3.0])
    elif case == "unsorted":
        buf = _payload([5, 1, 9], [1.0, 2.0, 3.0])
    elif case == "duplicate":
        buf = _payload([1, 5, 5], [1.0, 2.0, 3.0])
    elif case == "huge_count":
        buf = good.clone()
        buf[8:16] = torch.tensor([2**40], dtype=torch.int64).view(torch.uint8)
    elif case == "truncated_golomb":
        buf = _payload([1, 5, 9], [1.0, 2.0, 3.0], coding="golomb")[:20]
    elif case == "huge_rice_parameter":  # would shift past 63 bits (and allocate count * b)
        buf = _payload([1, 5, 9], [1.0, 2.0, 3.0], coding="golomb")
        buf[wire.HEADER_BYTES + 4] = 200
    elif case == "zeros":  # what a rank inside hvd.join() puts in an allgather
        buf = torch.zeros_like(good)
    else:
        buf = good[:10]
    bufs = torch.cat([good, buf])
    with pytest.raises(wire.PayloadError, match=match) as e:
        _decode(bufs, ranks=2)
    assert "rank 1" in str(e.value) and "'b'" in str(e.value)


def test_the_first_rank_with_bad_positions_is_named_when_several_are_bad():
    """The position checks of all payloads come back in one read (one wait on a device);
    the error still names the lowest bad rank, as when each was read in turn."""
    good = _payload([1, 5, 9], [1.0, 2.0, 3.0])
    unsorted = _payload([5, 1, 9], [1.0, 2.0, 3.0])
    outside = _payload([1, 5, 150], [1.0, 2.0, 3.0])
    with pytest.raises(wire.PayloadError, match="rank 1 sent unsorted"):
        _decode(torch.cat([good, unsorted, outside]), ranks=3)
    with pytest.raises(wire.PayloadError, match="rank 0 sent an index outside"):
        _decode(torch.cat([outside, unsorted, good]), ranks=3)


def test_flagged_empty_constant_payload_round_trips():
    """SBC's payload when its gradient held NaN: no positions, no mean, the flag set."""
    buf = _payload([], [], constant=True, nonfinite=True)
    (p,) = _decode(buf)
    assert p.nonfinite and p.indices.numel() == 0 and p.values.numel() == 0
    (q,) = _decode(_payload([2, 7], [0.5, 0.5], constant=True))
    assert q.values.tolist() == [0.5, 0.5]


def test_gatherv_layout_fits_mpi_int_counts():
    unit, counts, displs = gatherv_layout([8, 16, 24])
    assert unit == 1 and counts.tolist() == [8, 16, 24] and displs.tolist() == [0, 8, 24]
    big = [3 * 2**30, 3 * 2**30]  # 6 GiB in all: past 2**31 - 1 in bytes
    unit, counts, displs = gatherv_layout(big)
    assert unit > 1 and int(displs[-1] + counts[-1]) * unit == sum(big)
    assert max(int(displs[-1] + counts[-1]), *counts.tolist()) <= 2**31 - 1
    with pytest.raises(ValueError, match="int counts"):
        gatherv_layout([2**31 + 1, 2**31])


def test_cuda_awareness_is_not_fooled_by_without_cuda():
    assert not cuda_in_library_version("Open MPI v4.1.4, configured --without-cuda")
    assert not cuda_in_library_version("Open MPI v4.1.4, package: Debian OpenMPI")
    assert cuda_in_library_version("MVAPICH2-GDR 2.3.7 (CUDA 12.2)")


def test_nan_under_ignore_matches_the_torch_reference(monkeypatch):
    """The fused CPU Top-K hands a vector with NaN to the plain path, so the result is the
    torch reference's, NaN included, on every backend."""
    out = []
    for kernels in ("numba", "torch"):
        if kernels == "torch":
            monkeypatch.setenv("HVD_SPARSE_KERNELS", "torch")
        m = _net()
        opt = _wrap(m, nonfinite="ignore", density=0.05)
        _train(m, opt, 2)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
        x[0, :4] = float("nan")
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        out.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*out):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_checkpoint_loaded_with_map_location_keeps_training():
    """Anchors and velocity are moved to the parameters' device on load (here CPU to CPU; the
    CUDA case needs a GPU)."""
    m = _net()
    opt = _wrap(m, momentum_correction=0.9, local_steps=2)
    _train(m, opt, 4)
    sd = torch.load(__import__("io").BytesIO(_save(opt.state_dict())), map_location="cpu",
                    weights_only=False)
    m2 = _net()
    opt2 = _wrap(m2, momentum_correction=0.9, local_steps=2)
    opt2.load_state_dict(sd)
    _train(m2, opt2, 2)
    assert all(bool(torch.isfinite(p).all()) for p in m2.parameters())


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_default_nonfinite_policy_is_amp_compatible():
    import inspect

    sig = inspect.signature(hvd_sparse.DistributedOptimizer)
    assert sig.parameters["nonfinite"].default == "propagate"
    m = _net()
    opt = _wrap(m)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
    x[0, 0] = float("inf")
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    assert any(not bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    assert all(v.uplink is None or bool(torch.isfinite(v.uplink).all())
               for v in opt.engine_state().values())
    assert opt.communication_stats()["nonfinite_steps"] == 1


@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_all_dense_step_with_nan(policy):
    """Every bucket dense (nothing to roll back): under "propagate" p.grad is Horovod's result
    with no extra read; under "skip" the NaN is still found and the step skipped."""
    m = _net()
    opt = _wrap(m, min_sparse_numel=10**9, nonfinite=policy)  # every bucket dense
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
    x[0, 0] = float("inf")
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.cross_entropy(m(x), y).backward()
        opt.synchronize()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    stats = opt.communication_stats()
    if policy == "propagate":
        assert not finite and stats["nonfinite_steps"] == 0
    else:
        assert finite and stats["nonfinite_steps"] == 1 and stats["skipped_steps"] == 1


@pytest.mark.parametrize("lam", [0.7, 0.1, 1 / 3, 2.0, 12345.678])
def test_fused_threshold_takes_lambda_as_torch_does(lam):
    """An entry equal to float32(lam) is selected exactly when the torch definition selects it
    (float32(0.7) < 0.7: NumPy 2's promotion rules once made the fused path disagree)."""
    from hvd_sparse.kernels import cpu, reference, select
    from hvd_sparse.sparsifiers import HardThreshold

    edge = float(np.float32(lam))
    x = torch.tensor([0.0, edge, -edge, np.nextafter(np.float32(edge), np.float32(0)), 2 * lam],
                     dtype=torch.float32)
    want = HardThreshold(lam).select(x, 0.1, SelectionContext("b")).tolist()
    for ops in (cpu, reference):
        assert select.threshold(ops, None, x.clone(), lam).idx.tolist() == want


def test_update_exchange_at_full_density_follows_the_wrapped_optimizer():
    """exchange="update": each rank steps its own AdamW and the weight change is exchanged; on
    one rank at density 1 that is AdamW itself (up to the rounding of anchor + change)."""
    m, ref = _net(), _net()
    opt = _wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), exchange="update", density=1.0)
    base = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
        for model, o in ((m, opt), (ref, base)):
            o.zero_grad()
            F.cross_entropy(model(x), y).backward()
            o.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    before = [p.grad.clone() for p in m.parameters()]
    opt.synchronize()  # gradients stay this rank's own: only finiteness is agreed
    assert all(torch.equal(a, p.grad) for a, p in zip(before, m.parameters()))
    with pytest.raises(ValueError, match="exchange must be one of"):
        _wrap(_net(), exchange="weights")


def test_exchange_auto_picks_updates_for_adaptive_optimizers():
    class MyAdam(torch.optim.Adam):
        pass

    def exchange(make_base, **kw):
        m = _net()
        return _wrap(m, make_base(m.parameters()), **kw).communication_stats()["exchange"]

    assert exchange(lambda p: torch.optim.AdamW(p, lr=1e-3)) == "update"
    assert exchange(lambda p: torch.optim.RMSprop(p, lr=1e-3)) == "update"
    assert exchange(lambda p: MyAdam(p, lr=1e-3)) == "update"
    assert exchange(lambda p: torch.optim.Adam(p, lr=1e-3), backward_passes_per_step=2) \
        == "gradient"
    assert exchange(lambda p: torch.optim.Adam(p, lr=1e-3), exchange="gradient") == "gradient"
    assert exchange(lambda p: torch.optim.SGD(p, lr=0.1), exchange="update") == "update"
    # nothing sparsified: Horovod's own step; a sum of gradients: not P updates
    assert exchange(lambda p: torch.optim.Adam(p, lr=1e-3), density=1.0) == "gradient"
    assert exchange(lambda p: torch.optim.Adam(p, lr=1e-3), op=hvd_sparse.Sum) == "gradient"
    assert exchange(lambda p: torch.optim.Adam(p, lr=1e-3), op=hvd_sparse.Average) == "update"


def test_exchange_auto_picks_updates_for_sgd_with_momentum():
    """SGD's updates where it has momentum (each rank's velocity integrates its own dense
    gradient: better on every SGD workload measured); gradients for plain SGD, for SBC, with
    momentum correction or accumulation, and for optimizers of unknown kind."""
    class MySGD(torch.optim.SGD):
        pass

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1, "momentum": 0.9})

        def step(self, closure=None):
            pass

    def exchange(make_base, **kw):
        m = _net()
        return _wrap(m, make_base(m.parameters()), **kw).communication_stats()["exchange"]

    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    assert exchange(sgd) == "update"
    assert exchange(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)) \
        == "update"
    assert exchange(lambda p: MySGD(p, lr=0.1, momentum=0.5)) == "update"
    # momentum in one parameter group is enough
    assert exchange(lambda p: torch.optim.SGD([{"params": list(p)[:2], "momentum": 0.9},
                                               {"params": list(p)[2:]}], lr=0.1)) == "update"
    assert exchange(lambda p: torch.optim.SGD(p, lr=0.1)) == "gradient"
    assert exchange(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.0)) == "gradient"
    assert exchange(Custom) == "gradient"
    assert exchange(sgd, sparsifier="sbc") == "gradient"
    assert exchange(sgd, sparsifier="Sparse-Binary") == "gradient"
    assert exchange(sgd, sparsifier=hvd_sparse.sparsifiers.SparseBinary()) == "gradient"
    assert exchange(sgd, sparsifier="gaussiank") == "update"
    # the hard threshold's absolute threshold is chosen from gradients
    assert exchange(sgd, sparsifier="threshold", threshold=1e-3) == "gradient"
    assert exchange(sgd, sparsifier=hvd_sparse.sparsifiers.HardThreshold(1e-3)) == "gradient"
    assert exchange(sgd, backward_passes_per_step=2) == "gradient"
    assert exchange(sgd, density=1.0) == "gradient"
    assert exchange(sgd, op=hvd_sparse.Sum) == "gradient"
    assert exchange(sgd, exchange="gradient") == "gradient"
    assert exchange(sgd, momentum_correction=0.9) == "gradient"
    # masking asks for updates, with accumulation too (set at wrapping or later)
    assert exchange(sgd, backward_passes_per_step=2, momentum_masking=0.5) == "update"
    # accumulation set later turns the library's updates into gradients, not where momentum
    # masking (which needs updates) was asked for
    m = _net()
    opt = _wrap(m, sgd(m.parameters()))
    opt.set_backward_passes_per_step(2)
    assert opt.communication_stats()["exchange"] == "gradient"
    m = _net()
    opt = _wrap(m, sgd(m.parameters()), momentum_masking=0.5)
    opt.set_backward_passes_per_step(2)
    assert opt.communication_stats()["exchange"] == "update"


def test_downlink_selection_by_default_where_gradients_are_exchanged_only():
    """bidirectional=None (default): the aggregate is re-sparsified where gradients are
    exchanged, not where each step's weight update is (those runs ended better without it:
    benchmarks/convergence.py); an explicit value is kept, and when gradient accumulation turns
    the library's choice of updates into gradients, the downlink selection comes back too."""
    def stats(make_base, **kw):
        m = _net()
        s = _wrap(m, make_base(m.parameters()), **kw).communication_stats()
        return s["exchange"], s["bidirectional"]

    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    assert stats(adam) == ("update", False)
    assert stats(sgd) == ("gradient", True)
    assert stats(sgd, exchange="update") == ("update", False)
    assert stats(adam, bidirectional=True) == ("update", True)
    assert stats(sgd, bidirectional=False) == ("gradient", False)
    assert stats(sgd, local_steps=2) == ("update", True)  # SBC's delay keeps it
    m = _net()
    opt = _wrap(m, adam(m.parameters()))
    opt.set_backward_passes_per_step(2)
    assert opt.communication_stats()["bidirectional"] is True
    m = _net()
    opt = _wrap(m, adam(m.parameters()), bidirectional=False)
    opt.set_backward_passes_per_step(2)
    assert opt.communication_stats()["bidirectional"] is False
    with pytest.raises(TypeError, match="bidirectional must be True or False"):
        _wrap(_net(), bidirectional="yes")


def test_gradient_accumulation_set_later_turns_auto_updates_into_gradients():
    """set_backward_passes_per_step(2) after wrapping an adaptive optimizer: the library's
    choice of updates gives way before any was exchanged (as the constructor's would); an
    explicit exchange="update", or one already under way, stays (accumulated gradients, one
    local step, then the update exchanged; it raised ValueError where Horovod goes on)."""
    m = _net()
    opt = _wrap(m, torch.optim.Adam(m.parameters(), lr=1e-3))
    assert opt.communication_stats()["exchange"] == "update"
    opt.set_backward_passes_per_step(2.0)  # a whole float, as Horovod takes it
    assert opt.communication_stats()["exchange"] == "gradient"
    assert opt.backward_passes_per_step == 2
    _train(m, opt, 1)  # two backward passes per step now: one step is fine
    m2 = _net()
    forced = _wrap(m2, torch.optim.Adam(m2.parameters(), lr=1e-3), exchange="update")
    forced.set_backward_passes_per_step(2)
    assert forced.communication_stats()["exchange"] == "update"
    with pytest.raises(ValueError, match="positive whole number"):
        opt.set_backward_passes_per_step(1.5)


def test_horovod_keywords_readable_and_taken_as_horovod_takes_them():
    m = _net()
    opt = _wrap(m, backward_passes_per_step=1.0, sparse_as_dense=1,
                gradient_predivide_factor=2.0)
    assert opt.op == hvd_sparse.Average and opt.gradient_predivide_factor == 2.0
    assert opt.sparse_as_dense is True and opt.backward_passes_per_step == 1
    assert _wrap(_net(), op=hvd_sparse.Sum).op == hvd_sparse.Sum
    with pytest.raises(ValueError, match="positive whole number"):
        _wrap(_net(), backward_passes_per_step=0)


def test_no_second_exchange_after_synchronize_but_every_step_exchanges():
    """Horovod re-averages identical values when step() follows synchronize() without
    skip_synchronize(): nothing changes, and here the gradient written by the exchange is not
    compressed again. A step() with no backward since the last one is exchanged, as under
    Horovod (whether a rank has something new is its own knowledge: skipping alone would
    leave the other ranks' collectives unpaired), and so is a gradient set by hand."""
    m = _net()
    opt = _wrap(m, density=0.05)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    synced = [p.grad.clone() for p in m.parameters()]
    before = [p.detach().clone() for p in m.parameters()]
    steps = opt.communication_stats()["steps"]
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    assert opt.communication_stats()["steps"] == steps
    for a, p, w in zip(synced, m.parameters(), before):
        assert torch.equal(p.grad, a)
        assert torch.equal(p.detach(), w.add(a, alpha=-0.1))  # the synchronised gradient
    opt.step()  # no backward since: the held gradient goes through the exchange again
    assert opt.communication_stats()["steps"] == steps + 1
    for p in m.parameters():  # a gradient written by hand is exchanged (sparsified)
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.communication_stats()["steps"] == steps + 2
    assert any(bool((p.grad == 0).any()) for p in m.parameters())
    for _ in range(2):  # so is one handed to synchronize() again before any step()
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.synchronize()
    assert opt.communication_stats()["steps"] == steps + 4


def test_update_exchange_step_fills_missing_gradients_and_warns_after_synchronize():
    """Exchanged updates: step() without a backward gives every parameter a zero gradient, as
    Horovod's synchronize() does, so decoupled weight decay still applies; step() after
    synchronize() without skip_synchronize() warns as Horovod's does."""
    m = _net()
    opt = _wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.5))
    assert opt.communication_stats()["exchange"] == "update"
    before = [p.detach().clone() for p in m.parameters()]
    opt.zero_grad(set_to_none=True)
    opt.step()
    assert all(p.grad is not None and not bool(p.grad.any()) for p in m.parameters())
    assert any(not torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before))
    opt.zero_grad()
    F.cross_entropy(m(torch.randn(4, 32)), torch.tensor([0, 1, 2, 0])).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def test_density_cooldown_schedule_and_sent_counts():
    """Over the last ``density_cooldown_steps`` of ``total_steps`` the density rises
    geometrically to ``cooldown_density`` (then stays there); before, the target. The engine
    sends that many entries: counted from the statistics, step by step."""
    from hvd_sparse.dgc import cooldown_density

    sched = [cooldown_density(t, 0.01, 0.1, 100, 10) for t in range(105)]
    assert sched[:90] == [0.01] * 90 and sched[99] == pytest.approx(0.1)
    assert all(b > a for a, b in zip(sched[89:100], sched[90:100]))
    assert sched[104] == pytest.approx(0.1)  # past the run's end: the final density
    assert cooldown_density(50, 0.01, 0.1, None, 10) == 0.01
    m = _net()
    opt = _wrap(m, density=0.05, total_steps=6, density_cooldown_steps=2, cooldown_density=0.5,
                bidirectional=False)
    n = sum(p.numel() for p in m.parameters())
    sent = []
    for step in range(6):
        _train(m, opt, 1, seed=step)
        sent.append(opt.communication_stats()["selected"])
    base = sent[0]
    assert sent[:4] == [base] * 4 and base < 0.06 * n
    assert base < sent[4] < sent[5] and sent[5] >= 0.45 * n


def test_density_cooldown_needs_the_runs_length():
    with pytest.raises(ValueError, match="needs total_steps"):
        _wrap(_net(), density_cooldown_steps=10)
    with pytest.raises(ValueError, match="cooldown_density"):
        _wrap(_net(), total_steps=10, density_cooldown_steps=2, cooldown_density=1.5)
    with pytest.raises(ValueError, match="total_steps"):
        _wrap(_net(), total_steps=0)
    _wrap(_net(), sparsifier="topk", total_steps=10)  # a run length any method accepts
    m = _net()
    with pytest.warns(UserWarning, match="adaptive optimizer"):
        _wrap(m, torch.optim.AdamW(m.parameters()), total_steps=10, density_cooldown_steps=2)


def test_a_write_to_the_handed_gradient_is_reported_once():
    """GradScaler's plain scaler.step(optimizer) unscales p.grad after backward handed it to
    the exchange, which then writes the exchanged (still scaled) gradient over it: reported,
    once; the documented pattern (synchronize, unscale_, skip_synchronize) is quiet."""
    m = _net()
    opt = _wrap(m, density=0.05)
    g = torch.Generator().manual_seed(5)

    def backward():
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        (1024.0 * F.cross_entropy(m(x), y)).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward()
        opt.synchronize()
        for p in m.parameters():
            p.grad.mul_(1 / 1024.0)  # after synchronize: the documented place
        with opt.skip_synchronize():
            opt.step()
    backward()
    for p in m.parameters():
        p.grad.mul_(1 / 1024.0)  # before step(): the exchange has the scaled gradient
    with pytest.warns(UserWarning, match="written in place after backward"):
        opt.step()
    backward()
    for p in m.parameters():
        p.grad.mul_(1 / 1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough
        opt.step()


def test_a_parameter_added_after_wrapping_is_reported_once():
    """add_param_group after wrapping: the new parameter is stepped by each rank's own
    gradient (as under Horovod); said once."""
    m = _net()
    opt = _wrap(m)
    extra = torch.nn.Parameter(torch.zeros(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(m, opt, 1)  # nothing added yet: quiet
    opt.add_param_group({"params": [extra]})

    def step():
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(4, 32)), torch.tensor([0, 1, 2, 0])).backward()
        extra.grad = torch.ones(5)
        opt.step()

    with pytest.warns(UserWarning, match="not exchanged"):
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("density", [0.2, 1.0])
def test_sparse_gradient_handed_back_in_horovods_layout(sparse_as_dense, density):
    """An embedding's sparse gradient is exchanged as the dense vector it stands for and handed
    back sparse as Horovod hands it back: by rows (values of shape [rows, dim], what code
    reading ``grad._values()`` of an embedding expects) by default, entry by entry under
    ``sparse_as_dense`` (Horovod's ``to_sparse()``); the same values either way."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 6, sparse=True)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters(),
        density=density, min_sparse_numel=0, cost_model="off", sparse_as_dense=sparse_as_dense,
        transport=LocalTransport())
    emb(torch.tensor([[1, 5, 5], [7, 1, 30]])).square().sum().backward()
    raw = emb.weight.grad.to_dense().clone()
    opt.synchronize()
    g = emb.weight.grad
    assert g.is_sparse
    if sparse_as_dense:
        assert (g.sparse_dim(), g.dense_dim()) == (2, 0)
    else:
        assert (g.sparse_dim(), g.dense_dim()) == (1, 1)
        assert g._values().shape[1:] == (6,)
        assert set(g.coalesce().indices()[0].tolist()) <= {1, 5, 7, 30}
    if density == 1.0:
        assert torch.equal(g.to_dense(), raw)
    with opt.skip_synchronize():
        opt.step()


def test_every_horovod_name_is_horovods_but_the_optimizer_and_init():
    """``import hvd_sparse as hvd`` in a Horovod script: each public name of
    ``horovod.torch`` is Horovod's own object (a submodule of ours named like a Horovod
    function, e.g. ``broadcast``, would shadow it), except the documented replacements."""
    real = pytest.importorskip("horovod.torch", reason="Horovod is not installed "
                               "(run launch/setup.sh)")
    import hvd_sparse.elastic  # noqa: F401 - Horovod's module under our path (its objects)

    ours = {"DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters", "init",
            "join", "optimizer", "elastic"}
    different = [n for n in dir(real) if not n.startswith("_")
                 and getattr(hvd_sparse, n) is not getattr(real, n)]
    assert sorted(different) == sorted(ours)
    assert all(getattr(hvd_sparse.elastic, n) is getattr(real.elastic, n)
               for n in dir(real.elastic) if not n.startswith("__"))
    assert callable(hvd_sparse.broadcast) and callable(hvd_sparse.allreduce_)


@pytest.mark.parametrize("exchange", ["gradient", "update"])
def test_a_dropped_optimizer_and_its_model_are_freed(exchange):
    """The gradient hooks live on the parameters, where Python's collector cannot see them:
    an optimizer (residuals, anchors) and its model must still be freed once the user drops
    them, as a plain torch optimizer is (they leaked, one full model per optimizer made)."""
    import gc
    import weakref

    def make():
        model = torch.nn.Linear(300, 200)
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(), density=0.05, cost_model="off",
            exchange=exchange, transport=LocalTransport())
        model(torch.randn(4, 300)).sum().backward()
        opt.step()
        assert opt._hs_hook_handles, "no hooks: nothing tested"
        return weakref.ref(model.weight), weakref.ref(opt)

    weight, opt = make()
    gc.collect()
    assert opt() is None and weight() is None


def test_an_adaptive_optimizer_is_freed_without_the_cycle_collector():
    """Adam under exchange="auto" agrees its all-dense switch through the engine, which
    calls back into the optimizer: that call must not hold it (a cycle through a bound
    method kept every dropped optimizer, its state and model until a collection ran)."""
    import gc
    import weakref

    from conftest import echo_transport

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        model = torch.nn.Linear(64, 64)
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
            transport=echo_transport()(), check_config=False, min_sparse_numel=0,
            cost_model="off")
        assert opt._hs_engine.switchable, "not switchable: nothing tested"
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
    finally:
        if was:
            gc.enable()


def _update_exchange(opt_cls, lr, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 200), torch.nn.ReLU(),
                                torch.nn.Linear(200, 7)).to(dtype)
    opt = hvd_sparse.DistributedOptimizer(
        opt_cls(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
        density=0.05, cost_model="off", check_config=False, transport=LocalTransport(),
        min_sparse_numel=100, **kw)
    return model, opt


def _train_batches(model, opt, gen, steps, dtype=torch.float32, after=None):
    for _ in range(steps):
        x, y = torch.randn(16, 30, generator=gen).to(dtype), torch.randint(0, 7, (16,),
                                                                            generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        if after is not None:
            after()


def _flat(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(exchange="update"), dict(exchange="update",
                                                              bidirectional=True),
                                dict(local_steps=2)])
def test_exchanged_updates_leave_parameters_at_their_anchor(dtype, kw):
    """After each exchange the parameters equal the anchor bit for bit, so the check for
    changes made outside the optimizer never fires on a plain loop (a false one would
    re-anchor, a copy per step, at the parameters' own precision)."""
    model, opt = _update_exchange(lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
                                  0.05, dtype, **kw)
    _train_batches(model, opt, torch.Generator().manual_seed(1), 12, dtype)
    assert opt.communication_stats()["totals"]["outside_changes"] == 0


def test_weights_reloaded_into_the_model_stand_under_exchanged_updates():
    """``model.load_state_dict(earlier)`` mid-run with AdamW (updates exchanged): the next
    step starts from the reloaded weights, as under Horovod; it was taken for part of the
    update and mostly reverted by error feedback."""
    model, opt = _update_exchange(torch.optim.AdamW, 0.01)
    gen = torch.Generator().manual_seed(1)
    _train_batches(model, opt, gen, 3)
    earlier = {k: v.clone() for k, v in model.state_dict().items()}
    _train_batches(model, opt, gen, 10)
    before_reload = _flat(model)
    model.load_state_dict(earlier)
    _train_batches(model, opt, gen, 1)
    now, start = _flat(model), torch.cat([v.reshape(-1) for v in earlier.values()])
    assert float((now - start).norm()) < 0.5 * float((now - before_reload).norm())
    assert opt.communication_stats()["totals"]["outside_changes"] > 0


def test_a_weight_clip_after_each_step_holds_under_exchanged_updates():
    """WGAN's critic: RMSprop, weights clamped to [-c, c] through ``p.data`` after each
    step. The clamp must hold the weights near c; taken for part of the next update, it
    drove them away (to 8.0 in 20 steps at c = 0.01)."""
    model, opt = _update_exchange(torch.optim.RMSprop, 5e-3)

    def clamp():
        for p in model.parameters():
            p.data.clamp_(-0.01, 0.01)

    _train_batches(model, opt, torch.Generator().manual_seed(1), 20, after=clamp)
    opt.zero_grad()
    x = torch.randn(16, 30)
    F.cross_entropy(model(x), torch.randint(0, 7, (16,))).backward()
    opt.step()
    assert float(_flat(model).abs().max()) < 0.5


def test_a_model_cast_after_wrapping_is_reported_once():
    """``model.double()`` after wrapping: the buckets keep float32, so the gradients are
    rounded in the exchange; said once, at the first exchange (Horovod's allreduce would take
    the new dtype), and not for a model cast before wrapping."""
    m = _net()
    opt = _wrap(m)
    m.double()
    x, y = torch.randn(16, 32, dtype=torch.float64), torch.randint(0, 3, (16,))
    with pytest.warns(UserWarning, match="was torch.float32 when the optimizer was wrapped"):
        F.cross_entropy(m(x), y).backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        m2 = _net().double()
        opt2 = _wrap(m2)
        F.cross_entropy(m2(x), y).backward()
        opt2.step()


@pytest.mark.parametrize("n", [1, 2, 9, 100, 2 ** 24 + 4, 51_200_000, 100_000_000])
def test_probe_positions_stay_inside_the_parameter(n):
    from hvd_sparse.engine.updates import probe_positions
    got = probe_positions(n, 8)
    assert got.dtype == torch.long and int(got.min()) == 0 and int(got.max()) == n - 1
    assert got.numel() == min(n, 8) and bool((got[1:] > got[:-1]).all())


def test_exchanged_updates_of_a_parameter_beyond_two_to_the_24_entries():
    """AdamW (updates exchanged) over an embedding of 2**24 + 4 entries: the check for
    changes made outside the optimizer probed position n itself (a float32 linspace rounds
    n - 1 up) and the second step raised IndexError."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(2 ** 22 + 1, 4)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.AdamW(emb.parameters(), lr=1e-3), named_parameters=emb.named_parameters(),
        density=0.001, cost_model="off", transport=LocalTransport())
    for step in range(3):
        opt.zero_grad()
        emb(torch.tensor([0, 5, 2 ** 22])).square().sum().backward()
        opt.step()
    stats = opt.communication_stats()
    assert stats["steps"] == 3 and stats["totals"]["outside_changes"] == 0


def test_half_precision_gradients_summing_past_65504_are_finite():
    """AdamW (updates exchanged) over a float16 parameter of 70,000 entries, every gradient
    entry 1.0: the finite check summed in float16, read Inf and skipped the local step every
    step, silently, under the default ``nonfinite``."""
    p = torch.nn.Parameter(torch.zeros(70_000, dtype=torch.float16))
    opt = hvd_sparse.DistributedOptimizer(torch.optim.AdamW([p], lr=1e-3),
                                          named_parameters=[("p", p)], density=0.01,
                                          cost_model="off", transport=LocalTransport())
    for _ in range(3):
        opt.zero_grad()
        p.grad = torch.ones_like(p)
        opt.step()
    assert bool((p != 0).any()) and opt.communication_stats()["nonfinite_steps"] == 0


def test_byte_strings_are_gathered_in_units_of_eight():
    """The allgather behind configuration checks and a rank-0 resume's state: each rank's
    bytes padded to 8 (past 2 GiB in all, MPI's int counts fit only in units of 8; an odd
    length raised ValueError there) and read back exactly."""
    from hvd_sparse import safety
    from hvd_sparse.transport import gatherv_layout

    texts = [b"a", b"", b"0123456789abcdefg"]
    sent = []

    class Three(LocalTransport):
        def size(self):
            return 3

        def allgather_async(self, payload, name):
            sent.append(payload.numel())
            others = [torch.frombuffer(bytearray(len(t).to_bytes(8, "little") + t
                                                 + bytes(-len(t) % 8)), dtype=torch.uint8)
                      for t in texts[1:]]
            return torch.cat([payload] + others)

    assert safety._gather_bytes(Three(), texts[0], "t") == texts
    assert sent[0] % 8 == 0
    # why: past 2**31 bytes an odd count fits no unit; padded, one of 8 does
    with pytest.raises(ValueError):
        gatherv_layout([2**31 + 9, 16])
    assert gatherv_layout([2**31 + 16, 16])[0] > 1


@pytest.mark.parametrize("schedule", ["warmup", "cooldown"])
def test_adaptive_topk_keeps_its_budget_through_the_density_schedules(schedule):
    """A scheduled step takes the schedule's k and costs the run's budget its share at the
    configured density: charged in full, a warm-up of 20 of 200 steps at 1% spent most of the
    budget (the rest of the run at k_min, a tenth of the density) and a cool-down went
    nearly dense."""
    torch.manual_seed(0)
    total, n = 200, 20_000
    m = torch.nn.Linear(200, 100, bias=False)
    kw = dict(density_warmup_steps=20) if schedule == "warmup" else \
        dict(density_cooldown_steps=20, cooldown_density=0.1)
    opt = _wrap(m, density=0.01, sparsifier="adaptive", total_steps=total, scope="tensor",
                check_config=False, **kw)
    g = torch.Generator().manual_seed(1)
    selected = []
    for _ in range(total):
        opt.zero_grad()
        (m(torch.randn(8, 200, generator=g)) - torch.randn(8, 100, generator=g)).pow(2) \
            .mean().backward()
        opt.step()
        selected.append(opt.communication_stats()["selected"])  # this step's
    steady = selected[20:] if schedule == "warmup" else selected[:-20]
    assert 0.8 * 0.01 * n <= sum(steady) / len(steady) <= 1.2 * 0.01 * n
    if schedule == "cooldown":  # the schedule's own k, rising to 10%
        assert selected[-1] == int(0.1 * n) and sum(selected[-20:]) < 0.5 * 0.1 * n * 20


def test_density_schedules_count_optimizer_steps_under_communication_delay():
    """``local_steps=4`` (one exchange per 4 optimizer steps) with a cool-down over the last 40
    of ``total_steps=200`` optimizer steps and a warm-up over the first 20: scheduled by
    exchanges, the cool-down never began (50 exchanges, all at 1%) and the warm-up lasted 80
    optimizer steps."""
    torch.manual_seed(0)
    m = torch.nn.Linear(200, 100, bias=False)
    opt = _wrap(m, density=0.01, total_steps=200, local_steps=4, density_cooldown_steps=40,
                cooldown_density=0.1, density_warmup_steps=20, scope="tensor",
                check_config=False)
    n, exchanged = m.weight.numel(), {}
    g = torch.Generator().manual_seed(1)
    for step in range(200):
        opt.zero_grad()
        (m(torch.randn(8, 200, generator=g)) - torch.randn(8, 100, generator=g)).pow(2) \
            .mean().backward()
        opt.step()
        stats = opt.communication_stats()
        if stats["steps"] > len(exchanged):
            exchanged[step] = stats["selected"] / n
    assert len(exchanged) == 50
    assert exchanged[199] == pytest.approx(0.1) and 0.01 < exchanged[163] < 0.02
    assert all(d == pytest.approx(0.01) for s, d in exchanged.items() if 20 <= s < 160)
    assert exchanged[3] > 0.3 and exchanged[15] > 0.01


def test_local_clip_norm_clips_the_gradients_where_updates_are_exchanged():
    """AdamW (updates exchanged) with ``local_clip_norm=1``: a gradient spike must reach Adam's
    moments clipped, as under exchanged gradients; the weight change was clipped instead, far
    below the limit, and the spike went through whole."""
    m = _net()
    opt = _wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-3), local_clip_norm=1.0,
                scope="tensor")
    assert opt.communication_stats()["exchange"] == "update"
    _train(m, opt, 2)
    _train(m, opt, 1, scale=1e4)  # the spike
    top = max(float(opt.state[p]["exp_avg_sq"].max()) for p in m.parameters())
    assert top < 1.0  # unclipped: ~1e4 and above


@pytest.mark.parametrize("local_steps", [1, 3])
def test_local_clip_norm_leaves_the_exchanged_weight_change_whole(local_steps):
    """Where updates are exchanged the gradient is clipped before the local step, and the
    weight change it makes is sent as it is: a limit above every gradient's norm but below
    the change's (a large rate) changes nothing. The change was clipped too (wherever the
    uplink reads it whole: every time a clip is asked for)."""
    def run(clip):
        torch.manual_seed(0)
        m = torch.nn.Linear(50, 40)
        opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=3.0), exchange="update",
                    local_clip_norm=clip, density=0.5, local_steps=local_steps)
        g, most = torch.Generator().manual_seed(1), 0.0
        for _ in range(6):
            x, y = torch.randn(8, 50, generator=g), torch.randn(8, 40, generator=g)
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            most = max([most] + [float(p.grad.norm()) for p in m.parameters()])
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]), most

    free, most = run(None)
    clipped, _ = run(2.0)
    assert most < 2.0  # the limit never binds on a gradient (one rank: the limit is 2)
    assert torch.equal(free, clipped)


def test_a_non_finite_step_counts_what_it_sent():
    """Under the default ``nonfinite="propagate"`` a step whose gradient holds Inf sends the
    flagged payload, then the raw gradient dense: ``communication_stats()`` counted 0 bytes."""
    m = _net()
    opt = _wrap(m, scope="tensor")
    _train(m, opt, 2)
    dense = opt.communication_stats()["dense_bytes"]
    _train(m, opt, 1, scale=float("inf"))
    stats = opt.communication_stats()
    assert stats["nonfinite_steps"] == 1 and stats["selected"] == 0
    assert stats["bytes_sent"] >= dense and stats["dense_bytes"] == dense


@pytest.mark.parametrize("midrun", [False, True])
def test_exchanged_updates_with_gradient_accumulation(midrun):
    """AdamW, updates exchanged, two backward passes per step (from the start, or set after
    updates were exchanged, as a Horovod script may): at density 1 over two ranks that send
    the same bytes, every step equals AdamW's own over the accumulated gradient."""
    class Echo(LocalTransport):
        def size(self):
            return 2

        def allgather_async(self, payload, name):
            return torch.cat([payload, payload])

    m, ref = _net(), _net()
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.AdamW(m.parameters(), lr=1e-2), named_parameters=m.named_parameters(),
        exchange="update", density=1.0, cost_model="off", transport=Echo(),
        backward_passes_per_step=1 if midrun else 2, check_config=False, min_sparse_numel=0,
        variance_correction=False)  # (AdamW's own step: the correction has its own tests)
    base = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        passes = 1 if midrun and step == 0 else 2
        if midrun and step == 1:
            opt.set_backward_passes_per_step(2)
        batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 3, (8,), generator=g))
                   for _ in range(passes)]
        for model, o in ((m, opt), (ref, base)):
            o.zero_grad()
            for x, y in batches:
                F.cross_entropy(model(x), y).backward()
            o.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-6), step
    assert opt.communication_stats()["exchange"] == "update"


@pytest.mark.parametrize("deterministic", [True, False])
def test_join_names_deterministic_dense_where_it_gathers_the_dense_buckets(deterministic):
    """At 3 or more ranks ``deterministic_dense=True`` (the default) allgathers the dense
    buckets, which a joined rank cannot stand in for: the refusal says so and names the
    switch (it spoke of a sparse exchange where none was); with it off they are allreduced
    and nothing blocks the join."""
    import gc

    import hvd_sparse
    from hvd_sparse.optimizer import join_blockers

    class Three(LocalTransport):
        def size(self):
            return 3

    gc.collect()
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))  # small tensors only
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        density=0.1, check_config=False, transport=Three(), deterministic_dense=deterministic)
    try:
        blocked, gathers = join_blockers()
        if not deterministic:
            assert blocked == [] and not gathers
            return
        assert blocked and gathers
        with pytest.raises(RuntimeError, match="deterministic_dense=False"):
            hvd_sparse.join()
    finally:
        del opt
        gc.collect()


@pytest.mark.parametrize("local_steps,warmup", [(4, 0), (1, 20)])
def test_adaptive_topk_spends_its_budget_over_the_exchanges_it_makes(local_steps, warmup):
    """``total_steps`` counts optimizer steps; adaptive Top-K selects once per exchange, one
    per ``local_steps`` of them and none in a dense warm-up. Planned over optimizer steps, the
    last exchanges still saw most of the run ahead: the budget was never spent to its end
    (nor capped there), the quiet and loud steps' k chosen against the wrong horizon."""
    torch.manual_seed(0)
    m = torch.nn.Linear(200, 100, bias=False)
    total = 80
    opt = _wrap(m, density=0.01, sparsifier="adaptive", total_steps=total,
                sparsifier_options={"gamma": 2.0},
                local_steps=local_steps, dense_warmup_steps=warmup, scope="tensor",
                check_config=False)
    n, picked = m.weight.numel(), []
    g = torch.Generator().manual_seed(1)
    for step in range(total):
        opt.zero_grad()
        loud = 30.0 if step % 12 < 3 else 1.0  # the signal adaptive k follows
        (loud * (m(torch.randn(8, 200, generator=g)) - torch.randn(8, 100, generator=g))) \
            .pow(2).mean().backward()
        opt.step()
        s = opt.communication_stats()
        if s["steps"] > len(picked) and step >= warmup:
            picked.append(s["selected"])
    exchanges = (total - warmup) // local_steps
    budget = 0.01 * n * exchanges
    assert len(picked) == exchanges
    assert 0.97 * budget <= sum(picked) <= budget + 1


@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_a_parameter_listed_twice_is_refused_at_wrapping(scope):
    """torch only warns about a parameter listed twice in a group; each copy then took a
    place in a bucket (twice the budget, the second write zeroing the first's entries) or,
    per tensor, failed with an unrelated message about bucket names."""
    m = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 2))
    params = list(m.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about the duplicate
        base = torch.optim.SGD(params + [params[0]], lr=0.1)
    with pytest.raises(ValueError, match="'0.weight' is listed twice"):
        hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                        scope=scope, transport=LocalTransport())


def _discard_after_synchronize(density, exchange="gradient", stepped=False):
    """Warnings about a discarded exchange over two rounds of backward, synchronize(),
    [step(),] zero_grad()."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        density=density, cost_model="off", exchange=exchange, transport=LocalTransport())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            m(torch.randn(4, 64)).sum().backward()
            opt.synchronize()
            if stepped:
                with opt.skip_synchronize():
                    opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen if "discarded" in str(w.message)]


def test_a_sparse_exchange_discarded_by_zero_grad_warns_once():
    """Horovod's GAN pattern (``synchronize()`` then ``zero_grad()``, no ``step()``) throws the
    exchanged gradient away; under error feedback its unsent part stays in the residuals and
    reaches the weights later, so the user is told, once, how to keep it out. Nothing is said
    where the exchange was stepped, was dense (density 1) or exchanged no gradients."""
    got = _discard_after_synchronize(0.05)
    assert len(got) == 1 and "requires_grad_(False)" in got[0]
    assert _discard_after_synchronize(0.05, stepped=True) == []
    assert _discard_after_synchronize(1.0) == []
    assert _discard_after_synchronize(0.05, exchange="update") == []


def test_the_cost_models_timings_travel_with_the_state_dict():
    """A process resumed between its first timed step and the calibration had no timing of
    its own sparse compute and priced it at zero (every bucket sparse, where the run that did
    not stop chose dense): a rank's timings are in its state dict, like its residuals."""
    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(256, 64)
        return m, hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
            density=0.05, transport=LocalTransport(), calibration_steps=5)

    m, opt = make()
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 256)).sum().backward()
        opt.step()
    saved = opt.state_dict()["hvd_sparse"]["measured"]
    assert saved["compute"]["weight"] > 0 and saved["wire"]["weight"][2] >= 1
    m2, opt2 = make()
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state_dict()["hvd_sparse"]["measured"] == saved


@pytest.mark.parametrize("saved, resumed", [("gradient", "update"), ("update", "gradient")])
def test_a_state_saved_under_the_other_exchange_drops_its_residuals(saved, resumed):
    """Gradient residuals loaded where weight changes are exchanged moved the weights 55 times
    as far as a step does, uphill (a peer's probe); the reverse lost the mass silently. Now the
    residuals are dropped with a warning, the counters kept, and the first step after the
    resume moves the weights as a fresh optimizer's does."""
    m = _net()
    opt = _wrap(m, exchange=saved, density=0.02)
    _train(m, opt, 6)
    sd = opt.state_dict()
    assert sd["hvd_sparse"]["exchange"] == saved
    assert any(v["uplink"] is not None and bool(v["uplink"].any())
               for v in sd["hvd_sparse"]["buckets"].values())

    def first_step(load):
        m2 = _net()
        m2.load_state_dict(m.state_dict())
        opt2 = _wrap(m2, exchange=resumed, density=0.02)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if load:
                opt2.load_state_dict(sd)
        before = [p.detach().clone() for p in m2.parameters()]
        _train(m2, opt2, 1, seed=7)
        moved = torch.sqrt(sum(((p.detach() - q) ** 2).sum()
                               for p, q in zip(m2.parameters(), before)))
        return float(moved), opt2, [str(w.message) for w in seen]

    moved, opt2, seen = first_step(load=True)
    fresh, _, _ = first_step(load=False)
    assert any(f'exchange="{saved}"' in w and "dropped" in w for w in seen), seen
    assert moved == pytest.approx(fresh, rel=1e-5)  # nothing of the other kind applied
    assert opt2.engine_state() is not None
    assert opt2.state_dict()["hvd_sparse"]["steps"] == 7  # counters restored, one step on


@pytest.mark.parametrize("saved_prefix, loaded_prefix", [("_orig_mod.", ""), ("", "_orig_mod.")])
def test_a_compiled_models_state_resumes_on_the_plain_model(saved_prefix, loaded_prefix):
    """torch.compile names every parameter "_orig_mod.<name>"; torch and Horovod load optimizer
    states by position, so a checkpoint of the compiled model resumes on the plain one (and
    back). hvd_sparse matches its buckets by name: it refused both ways (a peer's probe)."""
    m = _net()

    def named(model, prefix):
        return [(prefix + n, p) for n, p in model.named_parameters()]

    base = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = hvd_sparse.DistributedOptimizer(
        base, named_parameters=named(m, saved_prefix), density=0.1, min_sparse_numel=0,
        cost_model="off", transport=LocalTransport(), sparsifier="adaptive", total_steps=20)
    _train(m, opt, 4)
    sd = opt.state_dict()
    m2 = _net()
    opt2 = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=named(m2, loaded_prefix),
        density=0.1, min_sparse_numel=0, cost_model="off", transport=LocalTransport(),
        sparsifier="adaptive", total_steps=20)
    opt2.load_state_dict(sd)
    again = opt2.state_dict()["hvd_sparse"]
    for name, entry in sd["hvd_sparse"]["buckets"].items():
        twin = again["buckets"][loaded_prefix + name[len(saved_prefix):]]
        for key in ("uplink", "downlink"):
            assert (entry[key] is None) == (twin[key] is None)
            assert entry[key] is None or torch.equal(entry[key], twin[key])
    assert len(again["sparsifier"]["buckets"]) == len(sd["hvd_sparse"]["sparsifier"]["buckets"]) > 0
    assert all(k.startswith(loaded_prefix) for k in again["sparsifier"]["buckets"])
    _train(m2, opt2, 2)
    assert all(bool(torch.isfinite(p).all()) for p in m2.parameters())


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("names", ["unnamed", "in_a_container"])
def test_a_state_saved_under_other_parameter_names_resumes_by_position(names):
    """Torch and Horovod load optimizer states by position: a checkpoint made without
    ``named_parameters`` (names "allreduce.noname.*") or of a model since wrapped in a
    container (names "model.*") resumes where the buckets agree in number and size. hvd_sparse
    refused both (a peer's probe)."""
    import copy

    m = _net()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    _train(m, opt, 3)
    sd = copy.deepcopy(opt.state_dict())  # (torch's holds the live momentum buffers)
    m2 = _net()
    base = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    named = None if names == "unnamed" else [("model." + n, p) for n, p in m2.named_parameters()]
    opt2 = hvd_sparse.DistributedOptimizer(base, named_parameters=named, density=0.1,
                                           min_sparse_numel=0, cost_model="off",
                                           transport=LocalTransport())
    opt2.load_state_dict(sd)
    saved = list(sd["hvd_sparse"]["buckets"].values())
    again = list(opt2.state_dict()["hvd_sparse"]["buckets"].values())
    assert len(saved) == len(again) == 4
    for entry, twin in zip(saved, again):
        assert entry["uplink"] is not None and torch.equal(entry["uplink"], twin["uplink"])
    assert opt2.state_dict()["hvd_sparse"]["steps"] == 3
    # and then trains as the uninterrupted run does, bit for bit
    m2.load_state_dict(m.state_dict())
    _train(m, opt, 2, seed=5)
    _train(m2, opt2, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_a_state_saved_at_another_density_resumes_and_names_what_it_drops():
    """Finishing a sparse run dense (density 1.0, every bucket dense) or the reverse: the
    wrapped optimizer's state and the counters load, a sparse bucket's unsent mass with no
    sparse bucket to go to is dropped with a warning, and a bucket sparse only here starts
    afresh (no warning: nothing lost). hvd_sparse refused both ways, naming the scope."""
    import warnings

    m = _net()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), density=0.01)
    _train(m, opt, 3)
    sparse_sd = opt.state_dict()
    m2 = _net()
    dense = _wrap(m2, torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9), density=1.0)
    with pytest.warns(UserWarning, match="dropped"):
        dense.load_state_dict(sparse_sd)
    assert dense.state_dict()["hvd_sparse"]["steps"] == 3
    assert all("momentum_buffer" in dense.state[p] for p in m2.parameters())
    _train(m2, dense, 2)
    dense_sd = dense.state_dict()
    m3 = _net()
    back = _wrap(m3, torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9), density=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is lost that way
        back.load_state_dict(dense_sd)
    assert back.state_dict()["hvd_sparse"]["steps"] == 5
    _train(m3, back, 2)
    assert all(bool(torch.isfinite(p).all()) for p in m3.parameters())


def test_a_checkpoint_of_another_model_is_refused_before_anything_loads():
    """A bucket of another size under the same name is a model mismatch: the error comes before
    the wrapped optimizer's own state is loaded (it was loaded, then the engine refused,
    leaving the optimizer half-resumed)."""
    m = _net()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    _train(m, opt, 2)
    sd = opt.state_dict()
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3))
    opt2 = _wrap(other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="another model"):
        opt2.load_state_dict(sd)
    assert len(opt2.state) == 0  # nothing of it loaded
    assert opt2.state_dict()["hvd_sparse"]["steps"] == 0


@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("method", ["topk", "gaussiank", "threshold", "adaptive", "sbc"])
def test_a_state_dict_taken_between_backward_and_step_resumes_exactly(method, scope):
    """A checkpoint hook after backward(): methods exchanged by their plain form had folded the
    step's gradient into the residual (and adaptive k had moved on), so repeating the backward
    after a resume counted it twice. The state as the step found it is what is saved."""
    import copy

    options = {"threshold": {"threshold": 1e-3}, "adaptive": {"total_steps": 10}}.get(method, {})

    def make():
        m = _net()
        return m, _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                        sparsifier=method, scope=scope, density=0.05, **options)

    def batch(i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)

    m, opt = make()
    for i in range(5):
        x, y = batch(i)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        if i == 2:
            saved = (copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()))
        opt.step()
    m2, opt2 = make()
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    for i in range(2, 5):
        x, y = batch(i)
        opt2.zero_grad()
        F.cross_entropy(m2(x), y).backward()
        opt2.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_numbers_from_numpy_and_torch_are_taken_and_wrong_types_named():
    """Config files and schedules hand over NumPy scalars and 0-d tensors: taken as the
    numbers they are. A string threshold, a missing bucket size or a bool density is refused
    with the keyword named (not a raw TypeError deep inside)."""
    m = _net()
    assert _wrap(m, density=np.float64(0.05))._hs_engine.config.density == 0.05
    assert _wrap(_net(), density=torch.tensor(0.25))._hs_engine.config.density == 0.25
    c = _wrap(_net(), calibration_steps=np.int64(3), local_steps=np.int32(1))._hs_engine.config
    assert type(c.calibration_steps) is int and c.calibration_steps == 3
    for kw, name in ((dict(sparsifier="threshold", threshold="0.1"), "threshold"),
                     (dict(bucket_cap_mb=None), "bucket_cap_mb"),
                     (dict(bucket_cap_mb=0), "bucket_cap_mb"),
                     (dict(density=True), "density"),
                     (dict(verify_every=2.5), "verify_every")):
        with pytest.raises(ValueError, match=name):
            _wrap(_net(), **kw)


def test_downlink_density_without_a_downlink_selection_warns():
    with pytest.warns(UserWarning, match="downlink_density=0.001 has no effect"):
        _wrap(_net(), downlink_density=0.001, bidirectional=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _wrap(_net(), downlink_density=0.001, bidirectional=True)


def test_layer_floor_with_one_tensor_per_bucket_warns():
    """The floor shares a bucket's budget among its tensors: per-tensor buckets have none to
    share, so the option would silently do nothing."""
    with pytest.warns(UserWarning, match="layer_floor=0.5 has no effect"):
        _wrap(_net(), layer_floor=0.5, scope="tensor")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _wrap(_net(), layer_floor=0.5, scope="model")


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd_momentum"])
def test_a_layer_frozen_under_exchanged_updates_stays_where_it_was(optimizer):
    """``requires_grad_(False)`` after wrapping, weight updates exchanged: error feedback holds
    the layer's unsent change from before, and releasing it would move a layer the user
    stopped training (Adagrad moved it by the size of its weights). It stays at the value of
    the last exchange, as Horovod leaves it with Adagrad's zero-gradient step."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 60),
                            torch.nn.Tanh(), torch.nn.Linear(60, 3))
    base = torch.optim.Adagrad(m.parameters(), lr=0.05) if optimizer == "adagrad" \
        else torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    opt = hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                          density=0.01, cost_model="off", exchange="update",
                                          transport=LocalTransport())
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        if i == 4:
            m[2].requires_grad_(False)
            frozen = [p.detach().clone() for p in m[2].parameters()]
            others = [p.detach().clone() for p in m[4].parameters()]
        opt.zero_grad()
        m(torch.randn(8, 40, generator=g)).pow(2).mean().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(m[2].parameters(), frozen))
    assert not all(torch.equal(p, q) for p, q in zip(m[4].parameters(), others))
    # the layer trains again once unfrozen
    m[2].requires_grad_(True)
    opt.zero_grad()
    m(torch.randn(8, 40, generator=g)).pow(2).mean().backward()
    opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(m[2].parameters(), frozen))


def test_a_model_wrapped_anew_while_the_old_optimizer_lives_says_so():
    """Switching optimizers mid-run (Adam, then SGD) while an LR scheduler still holds the old
    wrapper: its hooks count the next backward too, and the error named only
    backward_passes_per_step (a peer's probe). Without the old one alive, it trains."""
    m = _net()
    old = _wrap(m, torch.optim.Adam(m.parameters(), lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(old, 1)
    _train(m, old, 2)
    new = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(AssertionError, match="backward_passes_per_step.*still alive.*del it"):
        _train(m, new, 2)
    del old, sched, new
    import gc
    gc.collect()
    again = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    _train(m, again, 2)


def test_a_hand_written_adaptive_optimizer_is_told_how_to_exchange_its_updates():
    """exchange="auto" knows torch's adaptive classes only; a hand-written Adam (or Lion,
    LAMB) got gradients silently and trained 3 points behind dense in a peer's probe (1 with
    exchange="update"). Now a warning names the choice; torch's SGD and Adam subclasses get
    none."""
    import warnings

    class MyAdam(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

        def step(self, closure=None):
            return None

    class Subclassed(torch.optim.Adam):
        pass

    m = _net()
    with pytest.warns(UserWarning, match='exchange="update"'):
        _wrap(m, MyAdam(m.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _wrap(m, MyAdam(m.parameters()), exchange="gradient")
        _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        opt = _wrap(m, Subclassed(m.parameters()))
        assert opt.communication_stats()["exchange"] == "update"


def test_a_refused_checkpoint_leaves_the_exchange_as_it_was():
    """A checkpoint saved with gradients exchanged is followed by an optimizer whose updates
    were the library's choice (the switch to Horovod's step, once every bucket went dense);
    a checkpoint refused as another model's switched it all the same (a review of the
    session's diff)."""
    m = _net()
    grad_opt = _wrap(m, torch.optim.Adam(m.parameters(), lr=0.01), exchange="gradient")
    _train(m, grad_opt, 2)
    sd = grad_opt.state_dict()
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3))
    opt = _wrap(other, torch.optim.Adam(other.parameters(), lr=0.01))
    assert opt.communication_stats()["exchange"] == "update"
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(sd)
    assert opt.communication_stats()["exchange"] == "update"
    m2 = _net()
    follows = _wrap(m2, torch.optim.Adam(m2.parameters(), lr=0.01))
    follows.load_state_dict(sd)
    assert follows.communication_stats()["exchange"] == "gradient"


@pytest.mark.usefixtures("one_bucket_per_tensor")
def test_a_checkpoint_of_another_layer_split_does_not_move_mass_between_layers():
    """Position matching is for names foreign to the model: where the saved buckets are this
    model's own parameters that are not sparse here (layer b trained and saved, then b
    frozen and a trained), b's unsent mass went into a's residual, by size alone (a review
    of the session's diff). It is dropped, with the warning that names it."""
    import copy

    torch.manual_seed(0)
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})

    def run(opt, steps):
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(8, 16, generator=g)
            opt.zero_grad()
            m["b"](m["a"](x)).pow(2).mean().backward()
            opt.step()

    m["a"].requires_grad_(False)
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    run(opt, 3)
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["hvd_sparse"]["buckets"]) == {"b.weight", "b.bias"}
    m["a"].requires_grad_(True)
    m["b"].requires_grad_(False)
    opt2 = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="b.weight"):
        opt2.load_state_dict(sd)
    assert all(v["uplink"] is None for v in opt2.state_dict()["hvd_sparse"]["buckets"].values())


@pytest.mark.parametrize("entry", ["not a state", 3, ["a", "list"]])
def test_a_state_dict_whose_hvd_sparse_entry_is_not_a_dict_is_refused_clearly(entry):
    """A hand-edited or foreign checkpoint: a TypeError naming the entry (was an
    AttributeError from deep inside, 'str' object has no attribute 'get'), and nothing
    loaded."""
    m = _net()
    opt = _wrap(m)
    sd = opt.state_dict()
    sd["hvd_sparse"] = entry
    before = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(TypeError, match="'hvd_sparse' entry"):
        opt.load_state_dict(sd)
    assert opt.state_dict()["state"].keys() == before.keys()


# ----------------------------------------------------------------- naming, as Horovod checks it
def test_duplicate_parameter_names_are_refused_as_by_horovod():
    """Two parameters under one name would share a bucket's name and its collectives."""
    m = _net()
    named = [("same", p) for p in m.parameters()]
    with pytest.raises(ValueError, match="unique"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=named, transport=LocalTransport())


def test_parameters_left_out_of_named_parameters_are_refused_as_by_horovod():
    m = _net()
    named = list(m.named_parameters())[:-1]
    with pytest.raises(ValueError, match="not named"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=named, transport=LocalTransport())


def test_unnamed_parameters_in_two_groups_get_unique_names_the_same_each_time():
    """Without named_parameters each parameter is named from its group and place, as Horovod
    names them: unique across groups, and the same in every process that builds the same
    optimizer (the collectives' names must match across ranks)."""
    def build():
        m = _net()
        groups = [{"params": list(m[0].parameters())},
                  {"params": list(m[2].parameters()), "lr": 0.05}]
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(groups, lr=0.1), density=0.1, min_sparse_numel=0,
            cost_model="off", scope="tensor", transport=LocalTransport())
        return m, opt

    m, opt = build()
    names = [n for v in opt.engine_state().values() for n in v.parameters]
    assert len(names) == 4 and len(set(names)) == 4
    assert names == [n for v in build()[1].engine_state().values() for n in v.parameters]
    before = [p.detach().clone() for p in m.parameters()]
    _train(m, opt, 2)
    assert all(not torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_num_groups_is_taken_as_horovods_deprecated_spelling_of_groups():
    m = _net()
    with pytest.warns(Warning, match="num_groups"):
        opt = _wrap(m, num_groups=2)
    _train(m, opt, 2)
    assert opt.communication_stats()["steps"] == 2


def test_the_compressors_without_horovod_give_horovods_results():
    """Where Horovod is not installed (the mpi4py and torch front ends), ``Compression`` is
    hvd_sparse's stand-in: fp16 for floating tensors only, back to the input's dtype, and
    ``none`` as is; the same tensors as Horovod's own compressors give."""
    import subprocess
    import sys

    script = r'''
import sys, torch
sys.modules["horovod"] = None  # as if it were not installed
from hvd_sparse import compat
assert not compat.HAVE_HOROVOD
x64 = torch.tensor([1.0, 1e-4 + 1e-9, 70000.0, -3.3333333], dtype=torch.float64)
for t in (x64, x64.float(), torch.arange(5), torch.tensor([True, False])):
    c, ctx = compat.Compression.fp16.compress(t)
    back = compat.Compression.fp16.decompress(c, ctx)
    n, nctx = compat.Compression.none.compress(t)
    print(t.dtype, c.dtype, back.dtype, back.tolist(), compat.Compression.none.decompress(n, nctx) is t)
'''
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("torch.float64 torch.float16 torch.float64")
    assert lines[1].startswith("torch.float32 torch.float16 torch.float32")
    assert lines[2].startswith("torch.int64 torch.int64 torch.int64")
    assert lines[3].startswith("torch.bool torch.bool torch.bool")
    assert all(line.endswith("True") for line in lines)
    try:
        from horovod.torch.compression import Compression
    except ImportError:
        return
    x = torch.tensor([1.0, 1e-4 + 1e-9, 70000.0, -3.3333333], dtype=torch.float64)
    for t, line in zip((x, x.float(), torch.arange(5), torch.tensor([True, False])), lines):
        c, ctx = Compression.fp16.compress(t)
        want = Compression.fp16.decompress(c, ctx)
        assert str(want.tolist()) in line, (line, want.tolist())


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy"])
@pytest.mark.parametrize("exchange", ["gradient", "update"])
def test_step_hooks_fire_once_per_step_after_a_load_or_a_copy(how, exchange):
    """torch's ``__setstate__`` (run by ``load_state_dict`` and ``deepcopy``) wraps a class's
    step in its hook runner unless the step says it runs them itself: ours fires them by hand,
    so the hooks ran twice per step after a resume (an EMA in a post-hook counted double, and
    in Horovod's rank-0 resume the ranks fired them unequally)."""
    m = _net()
    opt = _wrap(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), exchange=exchange)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _train(m, opt, 2)
    assert calls == ["pre", "post"] * 2
    if how == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    else:
        copy.deepcopy(opt)
    calls.clear()
    _train(m, opt, 2, seed=1)
    assert calls == ["pre", "post"] * 2


@pytest.mark.parametrize("exchange", ["gradient", "update", "gradient-bidirectional"])
@pytest.mark.parametrize("sparsifier", ["topk", "gaussiank", "adaptive", "sbc"])
@pytest.mark.parametrize("magnitude", [1e20, 3e38])
def test_huge_finite_gradients_are_exchanged_sparsely_not_taken_for_nan(
        magnitude, sparsifier, exchange):
    """A finite gradient entry of magnitude 1e19 or more overflowed the uplink scan's float32
    sum of squares (its NaN/Inf check) and a sum of such entries the plain check: the step
    was taken for a non-finite one (sent dense, or skipped under "skip"), and SBC's downlink
    selection failed on the flag. It is now sparse, as any other, and counted as finite; a
    real NaN still is not."""
    n, density = 70000, 0.05  # SBC's downlink keeps its candidate list at this length
    exchange, _, bidirectional = exchange.partition("-")
    for bad in (magnitude, float("nan")):
        p = torch.nn.Parameter(torch.zeros(n))
        base = torch.optim.SGD([p], lr=1e-3, momentum=0.9 if exchange == "update" else 0)
        opt = hvd_sparse.DistributedOptimizer(
            base, named_parameters=[("w", p)], transport=LocalTransport(), density=density,
            cost_model="off", min_sparse_numel=0, sparsifier=sparsifier, exchange=exchange,
            nonfinite="skip", bidirectional=bool(bidirectional) or None)
        gen = torch.Generator().manual_seed(0)
        p.grad = torch.randn(n, generator=gen)  # a first step: the downlink's list
        opt.step()
        before = p.detach().clone()
        g = torch.randn(n, generator=gen)
        g[7], g[4000] = bad, -bad
        p.grad = g
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        stats = opt.communication_stats()
        moved = p.detach() - before
        if bad != bad:  # NaN: skipped, nothing moved where gradients are exchanged (where
            # updates are, the local step is skipped: what the residual holds still goes)
            assert bool(torch.isfinite(p).all())
            if exchange == "gradient":
                assert int((moved != 0).sum()) == 0 and stats["nonfinite_steps"] == 1
        else:
            assert stats["nonfinite_steps"] == 0
            assert bool(torch.isfinite(p).all())
            assert 0 < int((moved != 0).sum()) <= 2 * density * n  # not every entry
            if sparsifier == "sbc":  # one sign's mean goes: the larger's (a tie here)
                assert float(moved[7]) < 0 or float(moved[4000]) > 0
            else:  # the largest went first
                assert float(moved[7]) < 0 and float(moved[4000]) > 0


def test_adaptive_topk_takes_float64_gradients_whose_squares_overflow():
    """Adaptive Top-K's signal, a float64 sum of squares, overflowed for finite float64
    entries past 1e154 (inf over an inf mean: k from NaN, and the step raised). The signal is
    capped at the largest float; a state that holds inf (saved before) still answers."""
    p = torch.nn.Parameter(torch.zeros(100, dtype=torch.float64))
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)], transport=LocalTransport(),
        density=0.1, cost_model="off", min_sparse_numel=0, sparsifier="adaptive",
        exchange="gradient", bidirectional=True)
    for s in range(3):
        p.grad = torch.randn(100, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(s)) * 1e160
        opt.step()
        assert bool(torch.isfinite(p).all())
        assert 1 <= opt.communication_stats()["selected"] <= 100
    sp = AdaptiveTopK(total_steps=10)
    sp.load_state_dict({"buckets": {"b": {"steps": 2, "spent": 20, "signal": float("inf"),
                                          "mean": float("inf")}}})
    assert 1 <= sp.k_for_step(100, 0.1, "b") <= 100
    def k_at(signal, mean):
        sp.load_state_dict({"buckets": {"b": {"steps": 2, "spent": 20, "signal": signal,
                                              "mean": mean}}})
        return sp.k_for_step(100, 0.1, "b")
    # a signal over its mean past the largest float: the most the budget allows, as for a
    # large finite ratio
    assert k_at(1e308, 1e-300) == k_at(1e6, 1.0) > k_at(1.0, 1.0)


@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_hard_threshold_at_zero_sends_no_zeros(kernels, monkeypatch):
    """``threshold=0`` took every zero as a candidate (``|acc| >= 0``): 4096 pairs, twice the
    dense bytes, for 10 entries that carry mass. Floored as every other method's threshold,
    it sends exactly the non-zeros, on both kernel paths, and applies them whole."""
    if kernels == "torch":
        monkeypatch.setenv("HVD_SPARSE_KERNELS", "torch")
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)], transport=LocalTransport(),
        cost_model="off", min_sparse_numel=0, sparsifier="threshold", threshold=0.0,
        exchange="gradient")
    g = torch.zeros(4096)
    where = torch.arange(0, 4096, 410)[:10]
    g[where] = torch.linspace(-1, 1, 10) + 0.05
    p.grad = g.clone()
    opt.step()
    stats = opt.communication_stats()
    assert stats["selected"] == 10
    assert stats["totals"]["bytes_sent"] < stats["totals"]["dense_bytes"] / 10
    assert torch.equal(p.detach(), -g)
