"""The uplink commit. On the numba backend the selection's scan also writes acc = grad + residual
into a buffer of the engine's own, and the commit is an O(k) write and a buffer swap: the same
bits as the commit pass it replaces (``HVD_SPARSE_ACC_IN_SCAN=off``), every residual as it was
when another rank's payload says NaN, and the plain path's input intact when a method gives up
after its scan. Zeroing p.grad in the commit lets the aggregate of a unidirectional exchange be
summed straight into p.grad: the same bits as the sum in a separate buffer. On one thread the
scan reads a multi-parameter bucket's gradient in its p.grad pieces, with no copy into one
buffer first: the same bits as the copy."""
import re

import numpy as np
import pytest
import torch

import hvd_sparse
import hvd_sparse.sparsifiers
from hvd_sparse import wire
from hvd_sparse.kernels import cpu
from hvd_sparse.transport import LocalTransport

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")


class _MirrorPeer(LocalTransport):
    """Two ranks, the other one sending this rank's bytes. ``nan_at``: the exchange numbers
    (counted from 0) at which the other rank's payload carries the NaN/Inf flag."""

    def __init__(self):
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
        return torch.cat([payload, other])

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor

    def wait(self, handle):
        return handle


def _run(steps, nan_at=(), adam=False, data=None, hidden=300, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 9))
    transport = _MirrorPeer()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3) if adam else \
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not adam:  # SGD's gradients, the path these tests follow
        kw.setdefault("exchange", "gradient")
    opt = hvd_sparse.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(), density=kw.pop("density", 0.05),
        min_sparse_numel=0, cost_model="off", collective="allgather", check_config=False,
        transport=transport, **kw)
    buckets = len(opt.engine_state())
    transport.nan_at = {s * buckets for s in nan_at}  # the first bucket of those steps
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        x = torch.randn(16, 40, generator=gen) if data is None else data(gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        before = {k: v.uplink for k, v in opt.engine_state().items()}
        opt.step()
        history.append((before, {k: v.uplink for k, v in opt.engine_state().items()}))
    return model, opt, history


def _same(a, b):
    return all(x is y is None or (x is not None and y is not None and torch.equal(x, y))
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _bits(model, opt):
    state = opt.engine_state()
    return ([p.detach().clone() for p in model.parameters()],
            [state[k].uplink for k in sorted(state)], [state[k].downlink for k in sorted(state)])


@pytest.fixture
def with_a_pass(monkeypatch):
    """``_run`` with acc left to a commit pass after the collective (the reference)."""
    def run(*args, **kw):
        monkeypatch.setenv("HVD_SPARSE_ACC_IN_SCAN", "off")
        try:
            return _run(*args, **kw)
        finally:
            monkeypatch.delenv("HVD_SPARSE_ACC_IN_SCAN")
    return run


def _commits(opt):
    return opt.communication_stats()["totals"]["uplink_commits"]


@pytest.mark.parametrize("into_g", [False, True], ids=["spare", "in-place"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_scan_writes_acc_and_finds_the_same_candidates(into_g, symmetric):
    gen = torch.Generator().manual_seed(3)
    n = 100_003  # a tail after the last 32-entry block
    g, r = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.5
    t_hi, t_lo = (2.0, 2.0) if symmetric else (1.5, 2.5)
    want = cpu.scan(g, r, t_hi, t_lo, expect=n)
    assert want.complete
    acc = g + r
    into = g.clone() if into_g else torch.full((n,), float("nan"))
    got = cpu.scan(into if into_g else g, r, t_hi, t_lo, expect=n, into=into)
    assert torch.equal(into, acc)
    # the sum of squares is a statistic: each kernel variant's fast-math reduction may add in
    # its own order (the cached builds of the two did, in one order of the test files)
    assert got.count == want.count and got.energy == pytest.approx(want.energy, rel=1e-7)
    assert torch.equal(got.idx, want.idx) and torch.equal(got.values, want.values)
    # too little room for the candidates: gather scans again, from acc alone (in place, g
    # holds acc by then, so reading g + r again would be wrong)
    into = g.clone() if into_g else torch.empty(n)
    s = cpu.scan(into if into_g else g, r, t_hi, t_lo, expect=1, into=into)
    assert not s.complete and s.count == want.count
    idx, val = cpu.gather(None, None, s)
    assert torch.equal(idx, want.idx) and torch.equal(val, want.values)


@pytest.mark.parametrize("adam", [False, True], ids=["sgd-gradients", "adamw-updates"])
@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_acc_in_scan_gives_the_bits_of_the_commit_pass(with_a_pass, scope, adam):
    # scope="tensor": one-parameter buckets, acc into a spare buffer; scope="model": one
    # multi-parameter bucket, whose concatenated gradient takes acc itself; AdamW exchanges
    # weight changes, held in the engine's own buffer too
    model, opt, _ = _run(12, scope=scope, adam=adam)
    ref_model, ref_opt, _ = with_a_pass(12, scope=scope, adam=adam)
    assert opt.communication_stats()["exchange"] == ("update" if adam else "gradient")
    assert _commits(opt) == {"in_scan": len(opt.engine_state()) * 12, "in_place": 0}
    assert _commits(ref_opt) == {"in_scan": 0, "in_place": len(opt.engine_state()) * 12}
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    assert any(v.uplink.abs().sum() > 0 for v in opt.engine_state().values())


@pytest.mark.parametrize("scope", ["tensor", "model"])
@pytest.mark.parametrize("mode", ["propagate", "skip"])
def test_a_nan_from_another_rank_leaves_every_residual_as_it_was(mode, scope, with_a_pass):
    model, opt, history = _run(6, nan_at=[4], nonfinite=mode, scope=scope)
    before, after = history[4]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt.communication_stats()["nonfinite_steps"] == 1
    ref_model, ref_opt, _ = with_a_pass(6, nan_at=[4], nonfinite=mode, scope=scope)
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    assert _commits(opt)["in_scan"] == len(opt.engine_state()) * 5


class _GivesUpAfterItsScan(hvd_sparse.sparsifiers.TopK):
    """A method whose fused form scans and then declines every other step (as a user's method
    may, when its fast form does not cover the input): the plain path follows."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def fused(self, ops, grad, residual, density, ctx):
        sel = super().fused(ops, grad, residual, density, ctx)
        self.calls += 1
        return None if grad is not None and self.calls % 2 else sel


@pytest.mark.parametrize("threads", [None, 1], ids=["copied", "in-pieces"])
def test_a_method_that_gives_up_after_its_scan_gets_the_gradient_back(with_a_pass, threads):
    # with one multi-parameter bucket, acc was written into the concatenated gradient by then
    # (on one thread: the scan read the p.grad pieces and wrote acc there), which the plain
    # path must not read as the gradient
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        kw = dict(scope="model", density=0.3, hidden=600)
        model, opt, _ = _run(6, sparsifier=_GivesUpAfterItsScan(), **kw)
        ref_model, ref_opt, _ = with_a_pass(6, sparsifier=_GivesUpAfterItsScan(), **kw)
    finally:
        torch.set_num_threads(old)
    assert _commits(opt)["in_place"] + _commits(opt)["in_scan"] < 6  # some steps went plain
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    if threads == 1:
        assert opt.communication_stats()["totals"]["gradient_reads"]["in_pieces"] == 6


def test_sbc_with_a_sign_short_of_k_stays_on_the_fused_path(with_a_pass, monkeypatch):
    """At 30% density (positive inputs) a side of SBC's holds fewer than k entries on some
    steps: that side takes what it has, and every step stays fused, with the bits of the
    commit pass."""
    from hvd_sparse.kernels import select

    sizes = []
    choose = select.binary_choice

    def recording(pi, pv, ni, nv):
        sizes.append((pi.numel(), ni.numel()))
        return choose(pi, pv, ni, nv)
    monkeypatch.setattr(select, "binary_choice", recording)

    def positive(gen):
        return torch.rand(16, 40, generator=gen) + 1.0

    kw = dict(scope="model", sparsifier="sbc", density=0.3, data=positive, hidden=600)
    model, opt, _ = _run(6, **kw)
    assert any(a != b for a, b in sizes), sizes  # both are k unless a side was short
    ref_model, ref_opt, _ = with_a_pass(6, **kw)
    assert _commits(opt)["in_place"] + _commits(opt)["in_scan"] == 6
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))


def test_nan_under_ignore_flows_through_the_plain_path(with_a_pass):
    def with_inf(gen):
        x = torch.randn(16, 40, generator=gen)
        x[0, 0] = float("inf")
        return x

    kw = dict(scope="model", nonfinite="ignore", data=with_inf)
    model, opt, _ = _run(2, **kw)
    ref_model, ref_opt, _ = with_a_pass(2, **kw)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.isnan(), q.isnan())
        assert torch.equal(torch.nan_to_num(p.detach()), torch.nan_to_num(q.detach()))


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("in_scan", ["on", "off"])
def test_unidirectional_sum_lands_in_p_grad_exactly(monkeypatch, in_scan):
    """Two ranks sending the same bytes: the average is what was sent, so p.grad plus the
    uplink residual left must be exactly grad plus the residual before (one of the two is
    zero at every position)."""
    monkeypatch.setenv("HVD_SPARSE_ACC_IN_SCAN", in_scan)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 9))
    names = [n for n, _ in model.named_parameters()]
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(), density=0.05, min_sparse_numel=0,
        cost_model="off", collective="allgather", check_config=False, bidirectional=False,
        exchange="gradient", transport=_MirrorPeer())
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


# ------------------------------------------------ multi-parameter gradients read in pieces
@pytest.fixture
def one_thread():
    """The uplink scan reads a multi-parameter bucket's p.grad pieces only on one thread
    (several ranks per machine); the reference copies them into one buffer first."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _pieces(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, generator=gen) for n in sizes]
    offsets = [0]
    for t in parts[:-1]:
        offsets.append(offsets[-1] + t.numel())
    return parts, offsets


@pytest.mark.parametrize("room", [None, 1], ids=["room", "short"])
def test_scan_of_pieces_finds_what_the_scan_of_their_concatenation_finds(room):
    parts, offsets = _pieces([1, 70_001, 33, 0, 40_000, 5], seed=4)
    g = torch.cat(parts)
    r = torch.randn(g.numel(), generator=torch.Generator().manual_seed(5)) * 0.5
    want = cpu.scan(g, r, 2.0, 2.0, expect=g.numel())
    into = torch.full_like(g, float("nan"))
    got = cpu.scan_parts([(t.numpy(), off) for t, off in zip(parts, offsets)], r, 2.0, 2.0,
                         room, into)
    assert torch.equal(into, g + r)
    assert got.count == want.count and not got.nonfinite
    assert got.energy == pytest.approx(want.energy, rel=1e-5)
    idx, val = cpu.gather(None, None, got)
    assert torch.equal(idx, want.idx) and torch.equal(val, want.values)
    pos = np.arange(0, g.numel(), 7, dtype=np.int64)
    assert np.array_equal(cpu.sample_parts([(t.numpy(), off) for t, off in zip(parts, offsets)],
                                           r, pos), cpu.sample(g, r, pos))


def test_a_piece_with_more_than_its_share_of_candidates_needs_no_second_scan(monkeypatch):
    """A small last piece of large entries (an output layer in a whole-model bucket) holds
    most of the candidates: the pieces share one output, so they fit in the room the whole
    bucket was given, and no second scan of the bucket follows."""
    parts, offsets = _pieces([200_000, 3_000], seed=8)
    parts[1].mul_(100.0)
    g = torch.cat(parts)
    r = torch.zeros_like(g)
    want = cpu.scan(g, r, 5.0, 5.0, expect=g.numel())
    assert want.count > 2_000  # nearly all in the small piece, far above its share

    def no_second_scan(*args, **kwargs):
        raise AssertionError("the whole bucket was scanned again")

    monkeypatch.setattr(cpu, "scan", no_second_scan)
    got = cpu.scan_parts([(t.numpy(), off) for t, off in zip(parts, offsets)], r, 5.0, 5.0,
                         want.count, torch.empty_like(g))
    assert got.complete and got.count == want.count
    idx, val = cpu.gather(None, None, got)
    assert torch.equal(idx, want.idx) and torch.equal(val, want.values)


def test_scan_of_pieces_sees_nan():
    parts, offsets = _pieces([5000, 3000], seed=6)
    parts[1][17] = float("nan")
    into = torch.empty(8000)
    s = cpu.scan_parts([(t.numpy(), off) for t, off in zip(parts, offsets)], torch.zeros(8000),
                       1.0, 1.0, None, into)
    assert s.nonfinite


@pytest.mark.parametrize("edges", [
    [0, 10, 10, 500, 2000, 2001, 5000],
    # long: the table's slots span many positions, and short ranges sit inside one slot
    [0, 3, 3, 7, 1_000_000, 1_000_001, 1_000_002, 1_000_002, 9_999_999, 10_000_000]])
def test_group_splits_a_selection_by_parameter_like_a_sort(edges):
    gen = torch.Generator().manual_seed(7)
    edges = np.array(edges, dtype=np.int64)
    n = int(edges[-1])
    # every range's first and last position, and random ones
    ends = torch.tensor(sorted({int(e) for e in edges[:-1]} | {int(e) - 1 for e in edges[1:]}))
    idx = torch.cat([ends[ends < n], torch.randperm(n, generator=gen)[:900]]).unique()
    idx = idx[torch.randperm(idx.numel(), generator=gen)]
    val = torch.randn(idx.numel(), generator=gen)
    gidx, gval, starts = cpu.group(idx, val, edges)
    assert starts[0] == 0 and starts[-1] == idx.numel()
    for j in range(len(edges) - 1):
        inside = (idx >= int(edges[j])) & (idx < int(edges[j + 1]))
        a, e = starts[j], starts[j + 1]
        assert e - a == int(inside.sum())
        assert torch.equal(gidx[a:e] + int(edges[j]), idx[inside])  # order kept
        assert torch.equal(gval[a:e], val[inside])


@pytest.mark.parametrize("sparsifier", ["topk", "gaussiank", "threshold", "adaptive", "sbc",
                                        "randomk"])
def test_pieces_give_the_bits_of_the_copy(with_a_pass, one_thread, sparsifier):
    kw = dict(scope="model", sparsifier=sparsifier, hidden=3000)  # long enough to sample
    if sparsifier == "threshold":
        kw["threshold"] = 1e-3
    if sparsifier == "adaptive":
        kw["total_steps"] = 8
    model, opt, _ = _run(8, **kw)
    ref_model, ref_opt, _ = with_a_pass(8, **kw)
    reads = opt.communication_stats()["totals"]["gradient_reads"]
    if sparsifier == "randomk":  # no fused form: the copy, made on demand
        assert reads == {"in_pieces": 0, "copied": 8}
    else:
        assert reads == {"in_pieces": 8, "copied": 0}
    assert ref_opt.communication_stats()["totals"]["gradient_reads"]["in_pieces"] == 0
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))


def test_pieces_with_a_nan_from_another_rank(with_a_pass, one_thread):
    kw = dict(nan_at=[4], nonfinite="propagate", scope="model", hidden=3000)
    model, opt, history = _run(6, **kw)
    before, after = history[4]
    assert all(torch.equal(before[k], after[k]) for k in before)
    ref_model, ref_opt, _ = with_a_pass(6, **kw)
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))
    assert opt.communication_stats()["totals"]["gradient_reads"]["in_pieces"] == 6


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("sparsifier", ["topk", "gaussiank", "threshold", "sbc", "randomk"])
@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_weight_change_formed_in_the_scan_gives_the_bits_written_first(with_a_pass,
                                                                       one_thread, scope,
                                                                       sparsifier):
    """Exchanged updates: the uplink scan forms ``params - anchor`` where it reads them (the
    change is never written by itself), with the bits of the change written first and a
    commit pass; a method without a fused form gets the change written on demand."""
    kw = dict(adam=True, scope=scope, sparsifier=sparsifier, hidden=3000)
    if sparsifier == "threshold":
        kw["threshold"] = 1e-4
    model, opt, _ = _run(8, **kw)
    ref_model, ref_opt, _ = with_a_pass(8, **kw)
    buckets = len(opt.engine_state())
    reads = opt.communication_stats()["totals"]["weight_change_reads"]
    assert reads["in_scan"] + reads["written"] == 8 * buckets
    if sparsifier == "randomk":
        assert reads["in_scan"] == 0
    else:  # (Top-K and SBC select a vector too short to sample without a scan)
        assert reads["in_scan"] >= 8 * (2 if scope == "tensor" else 1)
    assert ref_opt.communication_stats()["totals"]["weight_change_reads"]["in_scan"] == 0
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))


class _ScanThenGiveUp(hvd_sparse.TopK):
    """Top-K whose fused form scans (writing acc, and with exchanged updates putting the
    parameters back at the anchor), then hands the bucket to the plain path."""

    name = "scan-then-give-up"

    def fused(self, ops, grad, residual, density, ctx):
        ops.scan(grad, residual, 1.0, 1.0)
        return None


def test_a_method_giving_up_after_its_scan_sends_the_same_bits(with_a_pass, one_thread):
    """Exchanged updates: after the scan the parameters are back at the anchor, so the plain
    path cannot read the weight change again; it reads acc with the residual folded in, and
    every bit (parameters, residuals) is the one of the change written first."""
    kw = dict(adam=True, scope="model", sparsifier=_ScanThenGiveUp(), hidden=3000)
    model, opt, _ = _run(5, **kw)
    ref_model, ref_opt, _ = with_a_pass(5, **kw)
    assert opt.communication_stats()["totals"]["weight_change_reads"]["in_scan"] == 5
    assert _same(_bits(model, opt), _bits(ref_model, ref_opt))


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_unidirectional_weight_changes_land_in_the_anchor(scope, with_a_pass, one_thread,
                                                          monkeypatch):
    """Exchanged updates without the downlink selection: each payload (the mirrored peer's
    shares every position with this rank's) is added into the anchor where it lands, O(P k),
    and the parameters move at those positions only: one loop per payload for a
    one-parameter bucket, an O(k) write per piece for several, or one copy from the anchor
    where the scan did not put them back at it. The three give the same bits, the parameters
    stand exactly at the new anchor, and they match the full-length path (the payloads summed
    in a zeroed buffer, then added to the anchor) up to the order of the float32 additions."""
    from hvd_sparse.engine import pipeline, updates
    from hvd_sparse.optimizer import STATE_KEY

    twins, full_writes = [], []
    real_twin, real_full = cpu.scatter_add_twin, pipeline.Engine._write_delta
    monkeypatch.setattr(cpu, "scatter_add_twin",
                        lambda *a: (twins.append(1), real_twin(*a))[1])
    monkeypatch.setattr(pipeline.Engine, "_write_delta",
                        lambda self, b, out: (full_writes.append(b.numel),
                                              real_full(self, b, out))[1])
    kw = dict(exchange="update", bidirectional=False, scope=scope, hidden=3000)
    model, opt, _ = _run(4, **kw)
    assert opt.communication_stats()["totals"]["weight_change_reads"]["in_scan"] > 0
    assert (len(twins) > 0) == (scope == "tensor")
    assert all(n < 100 for n in full_writes)  # only the 9 biases of the last layer: 2 x 1
    # received entries are too many for them (SPARSE_DELTA_SHARE)
    copied_model, copied_opt, _ = with_a_pass(4, **kw)  # acc by a pass: not at the anchor
    assert _same(_bits(model, opt), _bits(copied_model, copied_opt))
    anchors = torch.cat(list(opt.state_dict()[STATE_KEY]["anchors"].values()))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(params.sort().values, anchors.sort().values)
    monkeypatch.setattr(updates, "SPARSE_DELTA_SHARE", 10 ** 12)  # always the full length
    full_writes.clear()
    full_model, _, _ = _run(4, **kw)
    assert max(full_writes) >= 12000
    for p, q in zip(model.parameters(), full_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert not torch.equal(p, torch.zeros_like(p))
