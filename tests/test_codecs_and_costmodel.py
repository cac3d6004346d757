"""Wire value types, the cost model, and the transport choice (single process)."""
import pytest
import torch

import hvd_sparse
from hvd_sparse import costmodel
from hvd_sparse.transport import LocalTransport, MPITransport, make_transport

from conftest import echo_transport


@pytest.mark.parametrize("vdtype", [torch.float16, torch.bfloat16, torch.float32])
def test_value_dtype_on_the_wire_keeps_rounding_in_the_residual(vdtype):
    m = torch.nn.Linear(100, 20, bias=False)
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                          named_parameters=m.named_parameters(), density=0.1,
                                          bidirectional=False, value_dtype=vdtype,
                                          transport=LocalTransport())
    torch.manual_seed(0)
    m(torch.randn(4, 100)).sin().sum().backward()
    raw = m.weight.grad.detach().clone().reshape(-1)
    opt.step()
    applied = m.weight.grad.reshape(-1)
    sent = applied != 0
    assert int(sent.sum()) == 200
    assert torch.equal(applied[sent], raw[sent].to(vdtype).float())
    assert torch.equal(applied + list(opt.engine_state().values())[0].uplink, raw)
    vb = torch.empty(0, dtype=vdtype).element_size()
    assert opt.communication_stats()["bytes_sent"] == 16 + 200 * 4 + 200 * vb


def test_cost_model_crossover():
    n = 1_000_000
    # 2 ranks at 1%: allgather receives 2 * 10k * 8 B = 160 kB, ring allreduce 4 MB
    assert not costmodel.prefer_dense(n, n // 100, 2, 4, 4, 4)
    # 64 ranks at 1%: 5.1 MB < 2 * 63/64 * 4 MB = 7.9 MB; 128 ranks: 10.2 MB > 7.9 MB
    assert not costmodel.prefer_dense(n, n // 100, 64, 4, 4, 4)
    assert costmodel.prefer_dense(n, n // 100, 128, 4, 4, 4)
    # against the dense gather (deterministic path) only density near 1/2 flips it
    assert not costmodel.prefer_dense(n, n // 3, 8, 4, 4, 4, dense_by="gather")
    assert costmodel.prefer_dense(n, n // 2, 8, 4, 4, 4, dense_by="gather")
    assert not costmodel.prefer_dense(n, n, 1, 4, 4, 4)


def test_transport_choice():
    assert isinstance(make_transport("local"), LocalTransport)
    with pytest.raises(ValueError, match="not one of"):
        make_transport("carrier-pigeon")
    pytest.importorskip("mpi4py")
    assert isinstance(make_transport("mpi"), MPITransport)
    with pytest.raises(ValueError, match="process_set"):
        make_transport("mpi", process_set=object())


def test_wrapping_before_hvd_init_under_horovodrun_gloo_is_refused():
    """Under ``horovodrun --gloo`` every process is an MPI world of one: an optimizer wrapped
    before ``hvd.init()`` must not fall back to mpi4py (no exchange at all, replicas apart)
    but say what Horovod's own optimizer says. A fresh process, so Horovod is uninitialised."""
    pytest.importorskip("mpi4py")
    pytest.importorskip("horovod.torch")
    import os
    import subprocess
    import sys

    code = ("import torch, hvd_sparse\n"
            "m = torch.nn.Linear(4, 2)\n"
            "hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),\n"
            "    named_parameters=m.named_parameters())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**env, "HOROVOD_SIZE": "2", "HOROVOD_RANK": "0"})
    assert proc.returncode != 0
    assert "Horovod has not been initialized; use hvd.init()" in proc.stderr


_EchoTransport = echo_transport()  # two ranks that send the same bytes


def _echo_optimizer(m, **options):
    """hvd_sparse over ``m`` on two echoing ranks, calibrated after its first step."""
    options = {"density": 0.01, "min_sparse_numel": 0, "transport": _EchoTransport(),
               "calibration_steps": 1, **options}
    return hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                           named_parameters=m.named_parameters(),
                                           check_config=False, **options)


def _step(m, opt):
    opt.zero_grad()
    m(torch.randn(8, m.in_features)).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize("fast", ["reduce", "gather"])
def test_time_cost_model_decides_from_the_agreed_figures(monkeypatch, fast):
    from hvd_sparse.engine import calibration

    def link(transport, device, large):  # times at the probe's large size
        if fast == "reduce":  # allreduce 100 us + 10 GB/s, allgather 50 ms latency: dense wins
            return [0.05, 0.05 + 2 * large / 1e8, 1e-4, 1e-4 + large / 1e10]
        return [1e-4, 1e-4 + 2 * large / 1e10, 1.0, 1.0 + large / 1e6]  # sparse wins

    monkeypatch.setattr(calibration, "measure_link", link)
    torch.manual_seed(0)
    m = torch.nn.Linear(100, 50)
    opt = _echo_optimizer(m)
    for _ in range(3):
        _step(m, opt)
    report = opt.communication_stats()["cost_model"]
    assert report["calibrated_at_step"] == 1
    # the link probes' bytes, counted apart from the steps' exchanges
    # (probes no larger than the model's largest bucket, 64 KiB at least)
    assert opt.communication_stats()["totals"]["calibration_bytes"] \
        == calibration.probe_bytes(64 << 10)
    want = "dense" if fast == "reduce" else "sparse"
    assert {b["mode"] for b in report["buckets"].values()} == {want}
    s = opt.communication_stats()
    assert (s["selected"] == s["numel"]) == (want == "dense")
    saved = opt.state_dict()["hvd_sparse"]["buckets"]
    assert {v["mode"] for v in saved.values()} == {want}
    if want == "dense":  # error feedback was flushed into the dense exchange and released
        assert all(v.uplink is None for v in opt.engine_state().values())


@pytest.mark.parametrize("largest,expect_large", [(36 << 20, 16 << 20), (8 << 20, 8 << 20),
                                                  (1 << 20, 1 << 20), (1 << 10, 64 << 10)])
def test_calibration_grows_the_transfer_past_a_cycle_locked_latency(monkeypatch, largest,
                                                                    expect_large):
    """Collectives that start on a 5 ms cycle time back to back at a whole cycle until the
    transfer outlasts it: the large size grows (up to the largest bucket) until its time
    dominates, so the fitted bandwidth is the link's, not an unbounded one; it starts no
    larger than the largest bucket."""
    from hvd_sparse import costmodel
    from hvd_sparse.engine import calibration

    cycle, rate = 5e-3, 1e9  # bytes per second, both collectives
    sizes = []

    def locked(transport, device, large_bytes):
        sizes.append(large_bytes)
        t = max(cycle, large_bytes / rate)
        return [cycle, 2 * t, cycle, t]  # the allgather receives P = 2 copies

    monkeypatch.setattr(calibration, "measure_link", locked)
    times, large, sent = calibration.agreed_link(_EchoTransport(), "cpu", largest)
    # no probe larger than the largest bucket (64 KiB at least): a small model's probes
    # were 4 MiB, more bytes than its whole training run sent
    assert large == expect_large and sizes[-1] == large
    assert sizes[0] == min(4 << 20, max(64 << 10, largest))
    assert sent == sum(calibration.probe_bytes(s) for s in sizes)  # every probe counted
    link = calibration.link_from(times, 2, large)
    if large == 16 << 20:  # the transfer dominates: the bandwidth is the link's, near enough
        assert 0.5 * rate < link.reduce_bandwidth_Bps < 2 * rate
        assert costmodel.dense_time(36 << 20, 2, link) > 0.02  # not one cycle
    else:  # stopped at the largest bucket: what that size costs is what the model sees
        bucket = large
        assert costmodel.dense_time(bucket, 2, link) == pytest.approx(times[3], rel=1e-6)


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("bandwidth,numba,want", [(1e6, True, "golomb"), (1e12, True, "plain"),
                                                  (1e6, False, "plain")])
def test_index_coding_auto_follows_the_link(monkeypatch, bandwidth, numba, want):
    """``index_coding="auto"``: Golomb-Rice positions where the wire time they save exceeds
    their codec time (here 10 ns per position each way), plain where the link is fast or
    numba is missing (the walk would be a Python loop); the payloads then really carry the
    chosen code, and the choice survives a checkpoint."""
    from hvd_sparse.engine import calibration
    from hvd_sparse.kernels import cpu

    if not numba:
        monkeypatch.setattr(cpu, "available", lambda: False)

    mib4 = 4 << 20
    link = [1e-4, 1e-4 + 2 * mib4 / bandwidth, 1.0, 1.0 + mib4 / 1e6]  # dense costs seconds
    monkeypatch.setattr(calibration, "measure_link",
                        lambda transport, device, large_bytes: list(link))
    monkeypatch.setattr(calibration, "measure_codec", lambda density: [1e-8, 1e-8])
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100)
    opt = _echo_optimizer(m)
    sent = []
    for _ in range(4):
        _step(m, opt)
        sent.append(opt.communication_stats()["bytes_sent"])  # this step's
    report = opt.communication_stats()["cost_model"]
    assert report["golomb_s_per_position"] == ([1e-8, 1e-8] if numba else None)
    weight = report["buckets"]["weight"]
    assert weight["mode"] == "sparse" and weight["index_coding"] == want
    if want == "plain" and numba:  # the code was priced and lost
        assert weight["golomb_allgather_s"] >= weight["allgather_s"]
    # step 0 is before calibration (plain); the last step sends the chosen code
    assert (sent[-1] < 0.8 * sent[0]) == (want == "golomb")
    # the choice is part of the checkpoint: a resumed run sends the same code at once
    m2 = torch.nn.Linear(1000, 100)
    m2.load_state_dict(m.state_dict())
    opt2 = _echo_optimizer(m2)
    opt2.load_state_dict(opt.state_dict())
    _step(m2, opt2)
    assert (opt2.communication_stats()["bytes_sent"] < 0.8 * sent[0]) == (want == "golomb")


def test_golomb_trade():
    """The codec's time is charged once for this rank's payload and once per other rank's;
    the bytes saved are the positions' length against the code's expected length."""
    from hvd_sparse import costmodel, golomb

    link = costmodel.Link(0.0, 1e8, 0.0, 1e8)
    codec_s, saved_s, saved = costmodel.golomb_trade(4000, 4, 100_000, 4, 1e-8, 2e-8, link)
    bits = golomb.expected_bits_per_position(0.01)
    assert saved == pytest.approx(4000 * (4 - bits / 8))
    assert saved_s == pytest.approx(saved / 1e8)
    assert codec_s == pytest.approx(1000 * 1e-8 + 3000 * 2e-8)


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("always_dense", [False, True])
def test_dense_bucket_joining_an_allreduce_pays_no_latency(monkeypatch, always_dense):
    """With a tensor that is always dense, the step makes an allreduce anyway and a bucket
    that goes dense joins it (Horovod fuses them): its price is its bytes, not a latency of
    its own. Links: 1 s latency both ways; the bucket's dense bytes cost 0.5 s (long against
    the sparse path's measured compute, so a loaded machine cannot change the choice)."""
    from hvd_sparse.engine import calibration

    weight_bytes = 50 * 100 * 4
    bw = weight_bytes / 0.5
    monkeypatch.setattr(calibration, "measure_link", lambda transport, device, large: [
        1.0, 1.0 + 2 * large / 1e12, 1.0, 1.0 + large / bw])
    torch.manual_seed(0)
    m = torch.nn.Linear(100, 50)  # weight 5,000 entries; bias 50
    opt = _echo_optimizer(m, min_sparse_numel=1000 if always_dense else 0)
    for _ in range(3):
        _step(m, opt)
    weight = opt.communication_stats()["cost_model"]["buckets"]["weight"]
    assert weight["dense_s"] == pytest.approx(0.5 + (0 if always_dense else 1.0), rel=1e-2)
    # a transport that sends each allreduce by itself (MPI) charges every one its latency
    mpi_like = _EchoTransport()
    mpi_like.fuses_allreduces = False
    m = torch.nn.Linear(100, 50)
    opt = _echo_optimizer(m, min_sparse_numel=1000 if always_dense else 0, transport=mpi_like)
    for _ in range(3):
        _step(m, opt)
    assert opt.communication_stats()["cost_model"]["buckets"]["weight"]["dense_s"] == \
        pytest.approx(1.5, rel=1e-2)
    # the sparse price is the 1 s gather latency plus a little compute
    assert weight["mode"] == ("dense" if always_dense else "sparse")


def test_time_cost_model_calibrates_after_the_density_warm_up(monkeypatch):
    """Under a density warm-up the cost model times steps at the configured density only:
    timed on a warm-up step (up to all of a bucket sent), a link where sparse wins priced the
    bucket by its warm-up bytes and compute, and the 11.4M MLP went dense for good at
    1 Gbit/s."""
    from hvd_sparse.engine import calibration

    mib4 = 4 << 20
    link = [1e-4, 1e-4 + 2 * mib4 / 1e10, 1.0, 1.0 + mib4 / 1e6]  # allreduce slow: sparse wins
    monkeypatch.setattr(calibration, "measure_link",
                        lambda transport, device, large_bytes: list(link))
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 50, bias=False)
    opt = _echo_optimizer(m, density_warmup_steps=5, index_coding="plain")
    for step in range(8):
        _step(m, opt)
        stats = opt.communication_stats()
        assert stats["cost_model"]["calibrated_at_step"] == (None if step < 5 else 6)
    costs = opt.communication_stats()["cost_model"]["buckets"]["weight"]
    k = int(0.01 * m.weight.numel())
    # two payloads of k (index, value) pairs of 8 bytes and a small header each: the warm-up's
    # first step sent 46% of the bucket
    assert costs["gathered_bytes"] <= 2 * (8 * k + 256) and costs["mode"] == "sparse"


class _EchoWorld(_EchoTransport):
    """``size`` ranks that all send the same bytes."""

    def __init__(self, size):
        super().__init__()
        self._size = size

    def size(self):
        return self._size

    def allgather_async(self, payload, name):
        return torch.cat([payload] * self._size)


def _link(monkeypatch, slow_reduce):
    from hvd_sparse.engine import calibration

    mib4 = 4 << 20
    link = [1e-4, 1e-4 + 2 * mib4 / 1e10, 1.0, 1.0 + mib4 / 1e6] if slow_reduce else \
        [1e-3, 1e-3 + 2 * mib4 / 1e7, 1e-4, 1e-4 + mib4 / 1e10]
    monkeypatch.setattr(calibration, "measure_link",
                        lambda transport, device, large_bytes: list(link))


def _resumed(m, opt, **options):
    """A fresh process's optimizer over ``m``, loaded from ``opt``'s checkpoint."""
    again = _echo_optimizer(m, **options)
    again.load_state_dict(opt.state_dict())
    return again


def test_a_resumed_run_recalibrates_from_the_saved_measurements(monkeypatch):
    """Dense on a fast link, then resumed and recalibrated on a slow one: the measurements
    live in the process, so the resumed run had none for its dense bucket and kept it dense
    for good; it now prices the last measurement saved with the choice."""
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)
    _link(monkeypatch, slow_reduce=False)
    opt = _echo_optimizer(m, recalibrate_every=4, index_coding="plain")
    for _ in range(3):
        _step(m, opt)
    assert opt.communication_stats()["cost_model"]["buckets"]["weight"]["mode"] == "dense"
    _link(monkeypatch, slow_reduce=True)
    opt = _resumed(m, opt, recalibrate_every=4, index_coding="plain")
    for _ in range(5):
        _step(m, opt)
    report = opt.communication_stats()["cost_model"]
    assert report["calibrated_at_step"] == 5 and report["buckets"]["weight"]["mode"] == "sparse"


def test_a_run_resumed_on_another_world_size_recalibrates(monkeypatch):
    """Priced sparse at 2 ranks, resumed at 16, where 16 payloads cost more than a dense
    allreduce: the 2-rank choice stood for the rest of the run; it is priced again at the
    first step on the new world."""
    from hvd_sparse.engine import calibration

    mib4 = 4 << 20  # 10 MB/s for both collectives (an allgather brings P payloads)
    monkeypatch.setattr(calibration, "measure_link", lambda transport, device, large_bytes: [
        1e-3, 1e-3 + transport.size() * mib4 / 1e7, 1e-3, 1e-3 + mib4 / 1e7])
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)
    kw = dict(index_coding="plain", density=0.05, calibration_steps=2, collective="allgather",
              deterministic_dense=False)  # dense: one allreduce, whatever the world size
    opt = _echo_optimizer(m, **kw)
    for _ in range(2):
        _step(m, opt)
    assert opt.communication_stats()["cost_model"]["buckets"]["weight"]["mode"] == "sparse"
    with pytest.warns(UserWarning, match="loaded on rank 0 of 16"):
        opt = _resumed(m, opt, transport=_EchoWorld(16), **kw)
    _step(m, opt)
    report = opt.communication_stats()["cost_model"]
    assert report["calibrated_at_step"] == 3 and report["buckets"]["weight"]["mode"] == "dense"


def test_the_first_step_of_a_resumed_process_is_not_priced(monkeypatch):
    """Resumed one step before its calibration: that step pays compilation and first
    allocations; priced, it sent the bucket dense for good (0.77 s against 6-26 ms). What is
    priced is the timing the stopped process saved with its state (without it the price was
    zero: every bucket sparse, where the run that did not stop chose dense)."""
    _link(monkeypatch, slow_reduce=True)
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)
    opt = _echo_optimizer(m, calibration_steps=3)
    for _ in range(2):
        _step(m, opt)
    saved = opt.state_dict()["hvd_sparse"]["measured"]["compute"]["weight"]
    assert saved > 0
    opt = _resumed(m, opt, calibration_steps=3)
    _step(m, opt)
    report = opt.communication_stats()["cost_model"]
    assert report["calibrated_at_step"] == 3
    assert report["buckets"]["weight"]["compute_s"] == saved  # nothing priced from that step


def test_adaptive_topk_is_priced_at_its_mean_payload(monkeypatch):
    """Adaptive Top-K's k follows the gradient's energy over a 100x range: the time model
    priced a bucket at the largest payload it had seen (3x the run's mean), which tips
    buckets dense; it prices the mean per exchange."""
    _link(monkeypatch, slow_reduce=True)
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)
    opt = _echo_optimizer(m, sparsifier="adaptive", total_steps=60, recalibrate_every=20,
                          index_coding="plain", calibration_steps=3)
    gathered = []
    for step in range(41):
        opt.zero_grad()
        spike = 10.0 if step % 7 == 0 else 1.0  # a few steps of large gradients: large k
        (spike * (m(torch.randn(8, 1000)) - torch.randn(8, 100)).pow(2).mean()).backward()
        opt.step()
        s = opt.communication_stats()
        assert s["nonfinite_steps"] == 0 and s["selected"] < m.weight.numel()
        gathered.append(s["bytes_sent"] + s["bytes_received"])  # this step's allgather
    report = opt.communication_stats()["cost_model"]
    seen = gathered[:report["calibrated_at_step"]]  # the exchanges before the last calibration
    assert max(seen) > 1.5 * (sum(seen) / len(seen))  # k did vary
    priced = report["buckets"]["weight"]["gathered_bytes"]
    assert priced == pytest.approx(sum(seen) / len(seen), rel=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_two_ranks_price_the_sharded_exchange_above_the_allgather(monkeypatch, bidirectional):
    """At 2 ranks the sharded exchange moves at least the allgather's bytes (an all-to-all of
    half a payload each way, then the owners' selections: with the downlink selection about a
    payload in all, without it each owner's whole region sum) and pays two latencies. Its
    price had charged the all-to-all's wire share against a bandwidth measured in bytes
    gathered, half the true cost at 2 ranks: a 1 Gbit/s run of the 11.4M MLP with updates
    exchanged sent its largest bucket sharded and moved 1.34 MB a step instead of 0.72."""
    from hvd_sparse.engine import calibration

    mib4 = 4 << 20  # bytes dominate: 1 us latencies, 10 MB/s
    monkeypatch.setattr(calibration, "measure_link", lambda transport, device, large_bytes: [
        1e-6, 1e-6 + 2 * mib4 / 1e7, 1e-6, 1e-6 + mib4 / 1e7])
    torch.manual_seed(0)
    m = torch.nn.Linear(2000, 500, bias=False)
    opt = _echo_optimizer(m, index_coding="plain", collective="auto",
                          bidirectional=bidirectional, exchange="update" if not bidirectional
                          else "gradient")
    for _ in range(2):
        _step(m, opt)
    costs = opt.communication_stats()["cost_model"]["buckets"]["weight"]
    assert costs["collective"] == "allgather"
    assert costs["sharded_s"] > costs["allgather_s"]
    # without the downlink selection the owners' sums add a payload's worth: half the
    # allgather's wire time more
    wire = costs["allgather_s"] - costs["compute_s"]
    if not bidirectional:
        assert costs["sharded_s"] - costs["allgather_s"] > 0.4 * wire


@pytest.mark.parametrize("switched", [None, False, True])
def test_a_state_saved_with_gradients_resumes_dense_only_after_the_switch(monkeypatch, switched):
    """Adam, whose updates the library exchanges, resumed from a state saved with gradients:
    densely for good only where the state says the all-dense switch to Horovod's step was
    taken ("horovods_step"; a state without the flag, older, is taken for one), else its
    gradients stay sparse where the link says so. Before the flag every such state resumed
    dense for good."""
    _link(monkeypatch, slow_reduce=True)  # sparse wins
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)

    def make(**kw):
        return hvd_sparse.DistributedOptimizer(
            torch.optim.Adam(m.parameters(), lr=1e-3),
            named_parameters=m.named_parameters(), check_config=False, density=0.01,
            min_sparse_numel=0, transport=_EchoTransport(), calibration_steps=1,
            recalibrate_every=2, index_coding="plain", **kw)

    old = make(exchange="gradient")
    for _ in range(3):
        _step(m, old)
    sd = old.state_dict()
    del old  # (its hooks stay on the parameters while it lives)
    assert sd["hvd_sparse"]["horovods_step"] is False
    if switched is None:
        del sd["hvd_sparse"]["horovods_step"]  # as saved before the flag existed
    else:
        sd["hvd_sparse"]["horovods_step"] = switched
    opt = make()
    assert opt.communication_stats()["exchange"] == "update"
    opt.load_state_dict(sd)
    assert opt.communication_stats()["exchange"] == "gradient"
    for _ in range(4):
        _step(m, opt)
    report = opt.communication_stats()["cost_model"]
    assert report["calibrated_at_step"] > 3  # priced again after the resume
    assert report["buckets"]["weight"]["mode"] == ("sparse" if switched is False else "dense")


def test_sgd_resumed_from_a_state_saved_with_gradients_keeps_its_updates(monkeypatch):
    """SGD with momentum saved while the library exchanged its gradients (before the
    thirty-sixth session) resumes with its updates, as every rank that did not load the
    state has them (rank 0 loads, then broadcast_optimizer_state; or an elastic join): the
    gradient residuals are dropped with the warning that says so."""
    _link(monkeypatch, slow_reduce=True)
    torch.manual_seed(0)
    m = torch.nn.Linear(1000, 100, bias=False)

    def make(**kw):
        return hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
            named_parameters=m.named_parameters(), check_config=False, density=0.01,
            min_sparse_numel=0, transport=_EchoTransport(), calibration_steps=1, **kw)

    old = make(exchange="gradient")
    for _ in range(3):
        _step(m, old)
    sd = old.state_dict()
    del old
    del sd["hvd_sparse"]["horovods_step"]
    opt = make()
    with pytest.warns(UserWarning, match="residuals hold the other kind"):
        opt.load_state_dict(sd)
    assert opt.communication_stats()["exchange"] == "update"
    _step(m, opt)
    assert opt.communication_stats()["exchange"] == "update"


def test_the_bytes_rule_keeps_buckets_without_a_downlink_selection_on_the_allgather():
    """Before calibration (and under cost_model "bytes" or "off") the sharded exchange is
    chosen from 4 ranks, where each rank receives about two payloads against the allgather's
    P - 1; without the downlink selection each owner sends its region's whole sum (the union
    of the ranks' selections there), up to P payloads in all, so those buckets stay on the
    allgather (a 4-rank run of SGD's updates sent 4.5% of dense's bytes sharded, 3.1% by
    allgather with gradients)."""
    torch.manual_seed(0)

    def collectives(**kw):
        m = torch.nn.Linear(1000, 100, bias=False)
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
            named_parameters=m.named_parameters(), check_config=False, density=0.01,
            min_sparse_numel=0, transport=_EchoWorld(4), cost_model="off",
            sharded_selection="region", **kw)  # (the global rule gathers a bucket this small)
        return sorted({v.collective for v in opt.engine_state().values() if v.sparse})

    assert collectives(exchange="gradient") == ["sharded"]
    assert collectives(exchange="gradient", bidirectional=False) == ["allgather"]
    assert collectives() == ["allgather"]  # SGD's updates, without the downlink selection
    assert collectives(exchange="update", bidirectional=True) == ["sharded"]
