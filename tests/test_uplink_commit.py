"""The uplink commit. Computed during collective waits (hvd_sparse.engine.overlap): the same bits
as the pass after the waits, every residual as it was when another rank's payload says NaN,
and a bucket whose work was cut short completed before use. Zeroing p.grad in its pass lets
the aggregate of a unidirectional exchange be summed straight into p.grad: the same bits as
the sum in a separate buffer."""
import re

import pytest
import torch

import hvd_sparse
from hvd_sparse import wire
from hvd_sparse.engine import overlap
from hvd_sparse.kernels import cpu
from hvd_sparse.transport import LocalTransport

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")


class _SlowPeer(LocalTransport):
    """Two ranks, the other one sending this rank's bytes; every collective answers "not
    complete" to its first ``polls`` tests. ``nan_at``: the exchange numbers (counted from 0)
    at which the other rank's payload carries the NaN/Inf flag."""

    def __init__(self, polls):
        self.polls = polls
        self.nan_at = set()
        self.exchanges = 0

    def size(self):
        return 2

    def allgather_async(self, payload, name):
        other = payload.clone()
        if re.match(r"hvd_sparse\.\d+\.", name):  # a bucket's payload
            if self.exchanges in self.nan_at:
                other[3] |= wire.NONFINITE  # the value-code byte of the header
            self.exchanges += 1
        return [torch.cat([payload, other]), self.polls]

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return [tensor, self.polls]

    def ready(self, handle):
        handle[1] -= 1
        return handle[1] < 0

    def wait(self, handle):
        return handle[0]


def _run(steps, polls, nan_at=(), adam=False, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 9))
    transport = _SlowPeer(polls)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3) if adam else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd_sparse.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(), density=0.05, min_sparse_numel=0,
        cost_model="off", collective="allgather", check_config=False, transport=transport, **kw)
    buckets = len(opt.engine_state())
    transport.nan_at = {s * buckets for s in nan_at}  # the first bucket of those steps
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        x = torch.randn(16, 40, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        before = {k: v.uplink for k, v in opt.engine_state().items()}
        opt.step()
        history.append((before, {k: v.uplink for k, v in opt.engine_state().items()}))
    return model, opt, history


def _bits(model, opt):
    state = opt.engine_state()
    return ([p.detach().clone() for p in model.parameters()],
            [state[k].uplink for k in sorted(state)], [state[k].downlink for k in sorted(state)])


def _same(a, b):
    return all(x is y is None or (x is not None and y is not None and torch.equal(x, y))
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.fixture(autouse=True)
def ahead_on(monkeypatch):
    monkeypatch.setenv("HVD_SPARSE_COMMIT_AHEAD", "on")


@pytest.fixture
def in_place(monkeypatch):
    def run(*args, **kw):
        monkeypatch.setenv("HVD_SPARSE_COMMIT_AHEAD", "off")
        try:
            return _run(*args, **kw)
        finally:
            monkeypatch.setenv("HVD_SPARSE_COMMIT_AHEAD", "on")
    return run


@pytest.mark.parametrize("ranks_here, cores, want", [
    (None, 2, True),  # one process on two cores
    ("2", 2, False),  # the development machine: one core per rank
    ("4", 16, True), ("8", 8, False), ("1", 1, False)])
def test_auto_commits_ahead_only_with_a_core_to_spare(monkeypatch, ranks_here, cores, want):
    from hvd_sparse import core_sharing

    monkeypatch.setattr(core_sharing, "node_cores", lambda root="/sys/fs/cgroup": cores)
    monkeypatch.setattr(core_sharing.os, "sched_getaffinity", lambda pid: set(range(cores)),
                        raising=False)
    env = {} if ranks_here is None else {"OMPI_COMM_WORLD_LOCAL_SIZE": ranks_here}
    assert overlap.enabled(env) is want
    assert overlap.enabled({**env, "HVD_SPARSE_COMMIT_AHEAD": "on"}) is True
    assert overlap.enabled({**env, "HVD_SPARSE_COMMIT_AHEAD": "off"}) is False


@pytest.mark.parametrize("adam", [False, True], ids=["sgd-gradients", "adamw-updates"])
@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_commits_ahead_give_the_bits_of_the_pass_after_the_wait(in_place, scope, adam):
    # scope="model": one multi-parameter bucket, whose concatenated gradient takes acc itself;
    # AdamW exchanges weight changes, held in the engine's own buffer too
    model, opt, _ = _run(12, polls=50, scope=scope, adam=adam)
    ref_model, ref_opt, _ = in_place(12, polls=50, scope=scope, adam=adam)
    assert opt.communication_stats()["exchange"] == ("update" if adam else "gradient")
    commits = opt.communication_stats()["totals"]["uplink_commits"]
    assert commits["ahead"] == len(opt.engine_state()) * 12 and commits["in_place"] == 0
    assert ref_opt.communication_stats()["totals"]["uplink_commits"]["ahead"] == 0
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    assert any(v.uplink.abs().sum() > 0 for v in opt.engine_state().values())


def test_without_a_wait_the_commit_stays_in_place():
    _, opt, _ = _run(4, polls=0)
    assert opt.communication_stats()["totals"]["uplink_commits"] == {
        "ahead": 0, "in_place": len(opt.engine_state()) * 4}


def test_work_cut_short_is_completed_before_use(monkeypatch, in_place):
    # pieces of 1,000 entries and one test per collective: the 12,000-entry bucket is left
    # partly done, the others are not started; all must still give the in-place bits
    monkeypatch.setattr(overlap, "PIECE", 1000)
    model, opt, _ = _run(8, polls=1)
    ref_model, ref_opt, _ = in_place(8, polls=1)
    commits = opt.communication_stats()["totals"]["uplink_commits"]
    assert commits["ahead"] > 0 and commits["in_place"] > 0
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))


@pytest.mark.parametrize("mode", ["propagate", "skip"])
def test_a_nan_from_another_rank_leaves_every_residual_as_it_was(mode, in_place):
    model, opt, history = _run(6, polls=50, nan_at=[4], nonfinite=mode)
    before, after = history[4]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt.communication_stats()["nonfinite_steps"] == 1
    ref_model, ref_opt, _ = in_place(6, polls=50, nan_at=[4], nonfinite=mode)
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    # the step after the NaN still committed ahead, from the untouched residual
    assert opt.communication_stats()["totals"]["uplink_commits"]["ahead"] == \
        len(opt.engine_state()) * 5




@pytest.mark.parametrize("ahead", ["on", "off"])
def test_unidirectional_sum_lands_in_p_grad_exactly(monkeypatch, ahead):
    """Two ranks sending the same bytes: the average is what was sent, so p.grad plus the
    uplink residual left must be exactly grad plus the residual before (one of the two is
    zero at every position)."""
    monkeypatch.setenv("HVD_SPARSE_COMMIT_AHEAD", ahead)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 9))
    names = [n for n, _ in model.named_parameters()]
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), density=0.05, min_sparse_numel=0,
        cost_model="off", collective="allgather", check_config=False, bidirectional=False,
        transport=_SlowPeer(5))
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(16, 40, generator=gen)).pow(2).mean().backward()
        raw = {n: p.grad.reshape(-1).clone() for n, p in model.named_parameters()}
        before = {k: v.uplink for k, v in opt.engine_state().items()}
        opt.synchronize()
        after = {k: v.uplink for k, v in opt.engine_state().items()}
        for n, p in model.named_parameters():
            got = p.grad.reshape(-1)
            assert not bool(((got != 0) & (after[n] != 0)).any())
            assert torch.equal(got + after[n], raw[n] + before[n]), n
            assert bool(got.any())
        with opt.skip_synchronize():
            opt.step()
    assert set(names) == set(after)
