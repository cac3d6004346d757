"""The downlink watch (hvd_sparse.kernels.watch) selects exactly what a scan of the residual
selects: same positions, same values, same residual afterwards, ties included, whatever
happened to the residual in between."""
import numpy as np
import pytest
import torch

from hvd_sparse.kernels import cpu, select
from hvd_sparse.kernels.watch import ResidualWatch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")


def payloads(rng, n, k, ranks, ties):
    out = []
    for _ in range(ranks):
        count = k if rng.random() > 0.1 else int(rng.integers(0, k + 1))
        idx = np.sort(rng.choice(n, count, replace=False))
        vals = rng.standard_normal(count).astype(np.float32)
        if ties:  # many equal magnitudes, exact zeros among them
            vals = np.round(vals * 2) / 2
        out.append((torch.from_numpy(idx), torch.from_numpy(vals)))
    return out


def step_both(rng, scanned, watched, watch, n, k, ranks, ties, method, fresh=False):
    """One downlink step on two copies of a residual: plain scan against the watch."""
    watch.begin(watched, fresh)
    for idx, vals in payloads(rng, n, k, ranks, ties):
        if method == "sbc" and ties:  # as SBC's ranks send: one mean of either sign
            vals = torch.full_like(vals, float(rng.choice([-1.0, 1.0]) * rng.random()))
        cpu.scatter_add(scanned, idx, vals, 0.5)
        if idx.numel():
            watch.scatter(cpu, watched, idx, vals, 0.5)
    if method == "topk":
        kk = k if rng.random() > 0.2 else int(rng.integers(1, 3 * k))
        a = select.topk(cpu, None, scanned, kk)
        b = select.topk(cpu, None, watched, kk, watch=watch)
    elif method == "gaussiank":
        a = select.gaussiank(cpu, None, scanned, k, k // 2, 2 * k, 3)
        b = select.gaussiank(cpu, None, watched, k, k // 2, 2 * k, 3, watch=watch)
        assert (a.passes, a.fallback) == (b.passes, b.fallback)
    elif method == "sbc":
        a = select.sbc(cpu, None, scanned, k)
        b = select.sbc(cpu, None, watched, k, watch=watch)
        if a is None:  # too short for the fused path: both take the plain one
            assert b is None
            watch.end(watched)
            return
    else:
        a = select.threshold(cpu, None, scanned, 0.6)
        b = select.threshold(cpu, None, watched, 0.6, watch=watch)
    order = torch.argsort(b.idx)
    assert torch.equal(a.idx, b.idx[order])
    assert torch.equal(a.values, b.values[order])
    assert torch.equal(a.acc_values, b.acc_values[order])
    select.commit(cpu, None, scanned, a, a.values)
    select.commit(cpu, None, watched, b, b.values)
    watch.end(watched)
    assert torch.equal(scanned, watched)
    if watch.idx is not None:  # what the list promises: every entry outside is below its bound
        outside = np.ones(n, dtype=bool)
        outside[watch.idx] = False
        w = watched.numpy()[outside]
        assert (w < watch.bound).all() and (w > -watch.bound_neg).all()


@pytest.mark.parametrize("method", ["topk", "threshold", "gaussiank", "sbc"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n,k,ranks", [(100_000, 1000, 2), (100_000, 500, 4), (5000, 50, 3),
                                       (20_000, 200, 1)])
def test_watch_selects_what_a_scan_selects(method, ties, n, k, ranks):
    rng = np.random.default_rng(n + k + ranks)
    scanned, watched = torch.zeros(n), torch.zeros(n)
    watch = ResidualWatch()
    for s in range(40):
        step_both(rng, scanned, watched, watch, n, k, ranks, ties, method, fresh=s == 0)
    if ranks > 1 and not ties and method != "gaussiank" and select.sbc_fits(n, k):
        # the check is not vacuous: most steps were served from the watched positions
        assert watch.incremental > 30
    if method == "gaussiank" and ranks > 1:
        assert watch.incremental > 0


def test_watch_notices_writes_between_steps():
    """An in-place torch write (a load, a rescale) makes the list untrusted: the next step
    scans, and a large value planted outside the list is found."""
    rng = np.random.default_rng(0)
    n, k = 50_000, 200
    scanned, watched = torch.zeros(n), torch.zeros(n)
    watch = ResidualWatch()
    for s in range(5):
        step_both(rng, scanned, watched, watch, n, k, 2, False, "topk", fresh=s == 0)
    listed = set(watch.idx.tolist())
    outside = next(i for i in range(n) if i not in listed)
    for r in (scanned, watched):
        r[outside] = 1e6  # a torch write: bumps the version
        r.mul_(0.5)
    before = watch.scanned
    step_both(rng, scanned, watched, watch, n, k, 2, False, "topk")
    assert watch.scanned == before + 1
    assert scanned[outside] == 0  # it was selected
    # another tensor of the same length is not the one the list describes
    other = watched.clone()
    watch.begin(other, False)
    assert watch.idx is None


def test_watch_reports_nonfinite_and_forgets_the_list():
    n, k = 20_000, 100
    r = torch.zeros(n)
    watch = ResidualWatch()
    watch.begin(r, True)
    watch.scatter(cpu, r, torch.tensor([3, 70]), torch.tensor([1.0, float("nan")]), 1.0)
    sel = select.topk(cpu, None, r, k, watch=watch)
    assert sel.nonfinite and sel.idx.numel() == 0
    watch.end(r)
    assert watch.idx is None


def test_unused_watch_is_dropped():
    """A method that did not use the watch (a plain scan here) leaves the list untrusted
    afterwards."""
    n = 10_000
    r = torch.zeros(n)
    watch = ResidualWatch()
    watch.begin(r, True)
    watch.scatter(cpu, r, torch.arange(0, n, 7), torch.randn(len(range(0, n, 7))), 1.0)
    select.topk(cpu, None, r, 50)
    watch.end(r)
    assert watch.idx is None


def test_many_payloads_prefer_the_scan():
    """Past n / SCAN_RATIO candidates the scan serves and no list is kept."""
    rng = np.random.default_rng(1)
    n, k, ranks = 10_000, 200, 8  # 1,600 touched positions: more than n / 10
    scanned, watched = torch.zeros(n), torch.zeros(n)
    watch = ResidualWatch()
    for s in range(5):
        step_both(rng, scanned, watched, watch, n, k, ranks, False, "topk", fresh=s == 0)
    assert watch.incremental == 0 and watch.idx is None


def test_helpers():
    mark = cpu.position_marks(200)
    lists = [(np.array([5, 9, 150], dtype=np.int64), np.array([3, -4, 0.5], dtype=np.float32)),
             (np.array([9, 20], dtype=np.int64), np.array([1, 2], dtype=np.float32))]
    idx, val = cpu.candidates(lists, 1.0, mark)  # newest first: 9 keeps -4
    assert sorted(zip(idx.tolist(), val.tolist())) == [(5, 3.0), (9, -4.0), (20, 2.0)]
    assert not mark.any()
    sel, sval, rest, rval = cpu.pick_unordered(np.array([4, 1, 7, 2], dtype=np.int64),
                                               np.array([2, -2, 5, 2], dtype=np.float32), 2)
    assert sel.tolist() == [1, 7] and sval.tolist() == [-2, 5]  # ties by lowest index
    assert rest.tolist() == [4, 2] and rval.tolist() == [2, 2]


@pytest.mark.parametrize("m", [3000, 3 * cpu.SHORT_LIST])  # both ways of ranking
@pytest.mark.parametrize("values", ["normal", "few distinct"])
def test_the_unordered_pick_is_a_sort_by_magnitude_then_index(m, values):
    rng = np.random.default_rng(m)
    v = rng.standard_normal(m).astype(np.float32) if values == "normal" else \
        rng.choice(np.array([1, -1, 2, 0.5, -2, 0, -0.0, 1e-40], dtype=np.float32), m)
    idx = rng.permutation(7 * m)[:m].astype(np.int64)
    mag = np.abs(v).view(np.uint32).astype(np.int64)  # as the kernels compare magnitudes
    order = np.lexsort((idx, -mag))
    for k in (0, 1, m // 3, m - 1, m):
        sel, sval, rest, rval = cpu.pick_unordered(idx, v, k)
        chosen = np.zeros(m, dtype=bool)
        chosen[order[:k]] = True
        assert sel.tolist() == idx[chosen].tolist() and rest.tolist() == idx[~chosen].tolist()
        assert np.array_equal(sval.view(np.uint32), v[chosen].view(np.uint32))
        assert np.array_equal(rval.view(np.uint32), v[~chosen].view(np.uint32))


@pytest.mark.parametrize("k,bound", [(3, 0.1), (3, 4.5), (1, 0.0)])
def test_largest_trims_to_the_kth_magnitude_keeping_ties(k, bound):
    idx = np.array([10, 3, 8, 1, 6, 4], dtype=np.int64)
    val = np.array([2, -5, 3, -3, 1, 7], dtype=np.float32)
    kept, kval, cut = cpu.largest(idx, val, k, bound)
    kth = np.sort(np.abs(val))[::-1][k - 1]
    want = max(np.float32(kth), np.float32(bound))
    assert cut == want
    mask = np.abs(val) >= want  # everything at or above the cut, ties included, in order
    assert kept.tolist() == idx[mask].tolist() and kval.tolist() == val[mask].tolist()


def test_watch_does_not_keep_a_released_residual_alive():
    """A bucket that goes dense drops its downlink residual; the watch must not hold it."""
    import gc
    import weakref

    r = torch.zeros(100_000)
    watch = ResidualWatch()
    watch.begin(r, True)
    watch.scatter(cpu, r, torch.arange(0, 100_000, 50), torch.randn(2000), 1.0)
    sel = select.topk(cpu, None, r, 100, watch=watch)
    select.commit(cpu, None, r, sel, sel.values)
    watch.end(r)
    assert watch.idx is not None  # the list is kept for the next step
    ref = weakref.ref(r)
    del r, sel
    gc.collect()
    assert ref() is None
