"""Single-process properties of the building blocks, each against a numpy reference."""
import warnings

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse import aggregation, buckets, wire
from hvd_sparse.feedback import Residual
from hvd_sparse.transport import LocalTransport
from hvd_sparse.sparsifiers import (SelectionContext, TopK, k_for_density, make_sparsifier,
                                    topk_indices)


def topk_reference(x, k):
    """numpy: largest magnitudes first, lowest index first among equals; sorted positions."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    return np.sort(order[:k])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (4096, 41), (777, 776)])
def test_topk_matches_numpy_reference(seed, n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    got = topk_indices(x, k).numpy()
    assert np.array_equal(got, topk_reference(x.numpy(), k))


def test_topk_ties_break_by_lowest_index():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 2.0, 0.5, 2.0])
    # |3| twice, then three 2s at 2, 4, 5, 7 of which the lowest two are kept
    assert topk_indices(x, 4).tolist() == [1, 2, 3, 4]
    assert topk_indices(torch.ones(10), 3).tolist() == [0, 1, 2]
    q = torch.zeros(100)
    q[[5, 50, 95]] = torch.tensor([-1.0, 1.0, -1.0])
    assert topk_indices(q, 2).tolist() == [5, 50]


def test_topk_edge_counts():
    x = torch.randn(20)
    assert topk_indices(x, 0).numel() == 0
    assert topk_indices(x, 25).tolist() == list(range(20))
    assert k_for_density(1000, 0.01) == 10
    assert k_for_density(10, 0.01) == 1
    assert k_for_density(0, 0.5) == 0
    assert TopK().select(x, 0.25, SelectionContext("b")).numel() == 5
    with pytest.raises(ValueError, match="not known"):
        make_sparsifier("bogus")


@pytest.mark.parametrize("spelling, cls", [
    ("top_k", "TopK"), ("Top-K", "TopK"), ("gaussian_k", "GaussianK"),
    ("hard_threshold", "HardThreshold"), ("adaptive_topk", "AdaptiveTopK"),
    ("sparse_binary", "SparseBinary"), ("SBC", "SparseBinary"), ("random_k", "RandomK")])
def test_sparsifier_names_as_papers_spell_them(spelling, cls):
    options = {"threshold": 0.1} if cls == "HardThreshold" else {}
    assert type(make_sparsifier(spelling, **options)).__name__ == cls


def test_sparsifier_options_of_another_method_are_named_as_such():
    with pytest.raises(TypeError, match=r"takes no option threshold= \(threshold= is for "
                                        r"sparsifier='threshold'\)"):
        make_sparsifier("topk", threshold=1e-3)
    with pytest.raises(TypeError, match="needs threshold=.*threshold_for_k"):
        make_sparsifier("hard_threshold")
    with pytest.raises(TypeError, match="gamma= is for sparsifier='adaptive'"):
        make_sparsifier("sbc", gamma=2.0)
    m = torch.nn.Linear(3000, 2)  # through the optimizer's keywords too; a scope by alias
    with pytest.raises(TypeError, match="takes no option threshold="):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters(), threshold=0.1,
                                        transport="local")
    from hvd_sparse.buckets import resolve_scope
    assert resolve_scope("auto", 0.001, "top_k") == "model"


@pytest.mark.parametrize("dtype,wire_dtype", [(torch.float32, torch.float32),
                                              (torch.float32, torch.float16),
                                              (torch.float32, torch.bfloat16),
                                              (torch.float64, torch.float64)])
def test_error_feedback_conserves_mass_exactly(dtype, wire_dtype):
    g = torch.Generator().manual_seed(0)
    res = Residual(5000, dtype)
    for step in range(5):
        grad = torch.randn(5000, generator=g, dtype=dtype) * 10 ** (step - 2)
        before = grad + (res.buffer if res.buffer is not None else 0)
        acc = res.accumulate(grad)
        assert torch.equal(acc, before)
        idx = topk_indices(acc, 50)
        sent = acc[idx].to(wire_dtype).to(dtype)  # what the wire carries
        res.settle(idx, sent)
        rebuilt = res.buffer.clone()
        rebuilt[idx] += sent
        assert torch.equal(rebuilt, before), "sent + residual must equal acc bit for bit"
        if wire_dtype == dtype:
            assert torch.all(res.buffer[idx] == 0)


@pytest.mark.parametrize("numel,vdtype", [(100, torch.float32), (70000, torch.float16),
                                          (5, torch.bfloat16), (1000, torch.float64)])
@pytest.mark.parametrize("count", [0, 1, 3, 64])
def test_payload_round_trips(numel, vdtype, count):
    g = torch.Generator().manual_seed(count)
    count = min(count, numel)
    idx = torch.sort(torch.randperm(numel, generator=g)[:count]).values
    vals = torch.randn(count, generator=g).to(vdtype)
    idt = wire.index_dtype_for(numel)
    tag = wire.fingerprint("layer.weight", numel)
    buf = wire.encode(idx, vals, index_dtype=idt, tag=tag)
    assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0
    assert buf.numel() == wire.payload_nbytes(count, idt, vdtype)
    both = torch.cat([buf, buf])  # what an allgather of two ranks returns
    out = wire.decode_all(both, 2, tag=tag, numel=numel, bucket="layer.weight")
    for p in out:
        assert torch.equal(p.indices, idx)
        assert p.values.dtype == vdtype and torch.equal(p.values, vals)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("coding,constant", [("plain", False), ("golomb", False),
                                             ("golomb", True)])
def test_payloads_decode_where_they_lie(device, coding, constant):
    """A gathered buffer on a device is decoded there (headers read by the host), plain and
    Golomb-coded positions alike, with the validation of every position."""
    numel = 100_000
    g = torch.Generator().manual_seed(3)
    tag = wire.fingerprint("w", numel)
    parts, want = [], []
    for count in (500, 0, 37):
        idx = torch.sort(torch.randperm(numel, generator=g)[:count]).values.to(device)
        vals = torch.randn(count, generator=g).to(device)
        parts.append(wire.encode(idx, vals, index_dtype=torch.int32, tag=tag, numel=numel,
                                 index_coding=coding, constant=constant))
        want.append((idx, vals[:1].expand(count) if constant else vals))
    buf = torch.cat(parts)
    assert buf.device.type == device
    out = wire.decode_all(buf, 3, tag=tag, numel=numel, bucket="w")
    for p, (idx, vals) in zip(out, want):
        assert p.indices.device.type == device
        assert torch.equal(p.indices, idx) and torch.equal(p.values, vals)
    bad = wire.encode(torch.tensor([3, 2], device=device), torch.ones(2, device=device),
                      index_dtype=torch.int32, tag=tag)
    with pytest.raises(wire.PayloadError, match="unsorted"):
        wire.decode_all(bad, 1, tag=tag, numel=numel, bucket="w")


@pytest.mark.parametrize("coding", ["plain", "golomb"])
def test_own_payload_takes_the_positions_this_rank_sent(coding):
    """decode_all with ``own``: that rank's positions are the ones given (the same tensor, not
    decoded), the others decoded as usual, and a count that disagrees is a PayloadError."""
    numel, tag = 50_000, wire.fingerprint("w", 50_000)
    g = torch.Generator().manual_seed(5)
    sent = []
    for count in (300, 41):
        idx = torch.sort(torch.randperm(numel, generator=g)[:count]).values
        sent.append((idx, torch.randn(count, generator=g)))
    buf = torch.cat([wire.encode(i, v, index_dtype=torch.int32, tag=tag, numel=numel,
                                 index_coding=coding) for i, v in sent])
    mine = sent[1][0].clone()
    out = wire.decode_all(buf, 2, tag=tag, numel=numel, bucket="w", own=(1, mine))
    assert out[1].indices is mine and torch.equal(out[1].values, sent[1][1])
    assert torch.equal(out[0].indices, sent[0][0]) and torch.equal(out[0].values, sent[0][1])
    with pytest.raises(wire.PayloadError, match="rank 1.*41 entries where this rank sent 40"):
        wire.decode_all(buf, 2, tag=tag, numel=numel, bucket="w", own=(1, mine[:40]))
    # still checked: a method that broke the contract fails on its own rank as on the others
    bad = sent[1][0].flip(0).clone()
    buf = torch.cat([wire.encode(sent[0][0], sent[0][1], index_dtype=torch.int32, tag=tag,
                                 numel=numel),
                     wire.encode(bad, sent[1][1], index_dtype=torch.int32, tag=tag,
                                 numel=numel)])
    with pytest.raises(wire.PayloadError, match="rank 1.*unsorted"):
        wire.decode_all(buf, 2, tag=tag, numel=numel, bucket="w", own=(1, bad))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_golomb_stream_that_never_terminates_is_a_payload_error(device):
    """All-ones bytes are one unfinished unary quotient: decoded on the host or on the device,
    the payload is refused, naming the rank and the bucket."""
    numel = 10_000
    tag = wire.fingerprint("g", numel)
    idx = torch.tensor([3, 900, 4000], device=device)
    buf = wire.encode(idx, torch.ones(3, device=device), index_dtype=torch.int32, tag=tag,
                      numel=numel, index_coding="golomb")
    stream = wire.HEADER_BYTES + wire.GOLOMB_EXT.size
    stream_bytes = wire.GOLOMB_EXT.unpack(
        bytes(buf[wire.HEADER_BYTES:stream].cpu().tolist()))[0]
    buf[stream:stream + stream_bytes] = 0xFF
    with pytest.raises(wire.PayloadError, match="rank 0.*'g'.*Golomb-Rice"):
        wire.decode_all(buf, 1, tag=tag, numel=numel, bucket="g")


def test_payload_index_width_switches_to_int64():
    assert wire.index_dtype_for(2**31) == torch.int32  # last index 2**31 - 1 still fits
    assert wire.index_dtype_for(2**31 + 1) == torch.int64
    idx = torch.tensor([0, 5, 2**31 + 7])
    buf = wire.encode(idx, torch.ones(3), index_dtype=torch.int64, tag=1)
    (p,) = wire.decode_all(buf, 1, tag=1, numel=2**32, bucket="big")
    assert p.indices.tolist() == idx.tolist()


def test_payload_mismatch_is_reported():
    a = wire.encode(torch.tensor([1]), torch.ones(1), index_dtype=torch.int32,
                    tag=wire.fingerprint("a", 10))
    b = wire.encode(torch.tensor([1]), torch.ones(1), index_dtype=torch.int32,
                    tag=wire.fingerprint("b", 10))
    with pytest.raises(wire.PayloadError, match="different bucket"):
        wire.decode_all(torch.cat([a, b]), 2, tag=wire.fingerprint("a", 10), numel=10, bucket="a")
    with pytest.raises(wire.PayloadError, match="world size"):
        wire.decode_all(torch.cat([a, a]), 1, tag=wire.fingerprint("a", 10), numel=10, bucket="a")
    with pytest.raises(wire.PayloadError, match="outside bucket"):
        wire.decode_all(a, 1, tag=wire.fingerprint("a", 10), numel=1, bucket="a")


def test_aggregation_is_independent_of_arrival_order():
    g = torch.Generator().manual_seed(3)
    n, ranks = 1000, 5
    payloads = {}
    for r in range(ranks):
        idx = torch.sort(torch.randperm(n, generator=g)[:200]).values
        payloads[r] = wire.Payload(idx, torch.randn(200, generator=g) * 10 ** r, 0)
    ref = aggregation.aggregate([payloads[r] for r in range(ranks)], n, torch.float32, "cpu")
    for perm in ([4, 2, 0, 3, 1], [1, 0, 2, 3, 4], [3, 4, 1, 2, 0]):
        arrived = {r: payloads[r] for r in perm}  # dict in arrival order
        assert torch.equal(aggregation.aggregate(arrived, n, torch.float32, "cpu"), ref)
    dense64 = np.zeros(n)
    for r in range(ranks):
        np.add.at(dense64, payloads[r].indices.numpy(), payloads[r].values.double().numpy())
    assert np.allclose(ref.double().numpy(), dense64, rtol=1e-5, atol=1e-3)


def test_bucket_plans_are_deterministic_and_complete():
    m = torch.nn.Sequential(torch.nn.Linear(10, 200), torch.nn.Linear(200, 30),
                            torch.nn.Linear(30, 2))
    named = list(m.named_parameters())
    for scope in buckets.SCOPES:
        plan = buckets.plan_buckets(named, scope=scope, bucket_cap_mb=0.01, min_sparse_numel=100)
        again = buckets.plan_buckets(named, scope=scope, bucket_cap_mb=0.01, min_sparse_numel=100)
        assert [(b.name, b.numel, b.tag) for b in plan] == [(b.name, b.numel, b.tag) for b in again]
        covered = sorted(n for b in plan for n in b.names)
        assert covered == sorted(n for n, _ in named)
        # under every scope the tensors below min_sparse_numel travel dense, together
        assert all(b.sparse == (b.numel >= 100 and all(p.numel() >= 100 for p in b.params))
                   for b in plan)
    # 0.weight and 1.weight alone (or together); the four tensors under 1,024 entries as one
    # dense bucket
    assert len(buckets.plan_buckets(named, scope="tensor")) == 3
    model = buckets.plan_buckets(named, scope="model")
    assert [(b.names, b.sparse) for b in model] == [
        (["0.bias", "1.bias", "2.weight", "2.bias"], False), (["0.weight", "1.weight"], True)]
    explicit = buckets.plan_buckets(named, groups=[[m[0].weight, m[0].bias]])
    assert explicit[0].names == ["0.weight", "0.bias"] and len(explicit) == 5
    assert len(buckets.plan_buckets(named, groups=2)) == 2


def test_small_tensors_travel_as_one_dense_bucket_per_dtype():
    """The tensors below min_sparse_numel form one dense bucket per dtype, whatever their
    total, first in the list (launched last), under every scope."""
    m = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.LayerNorm(30),
                            torch.nn.Linear(30, 20))
    extra = torch.nn.Parameter(torch.zeros(7, dtype=torch.float64))
    named = list(m.named_parameters()) + [("extra", extra)]
    plan = buckets.plan_buckets(named, scope="tensor", min_sparse_numel=1000)
    assert [b.names for b in plan] == [
        ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"], ["extra"], ["0.weight"]]
    assert plan[0].numel == 30 + 30 + 30 + 600 + 20 and not plan[0].sparse
    assert plan[2].sparse and not plan[1].sparse
    for scope in ("model", "bucket"):  # the large tensors alone in the sparse buckets
        plan = buckets.plan_buckets(named, scope=scope, min_sparse_numel=1000)
        assert [(b.names, b.sparse) for b in plan] == [
            (["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"], False), (["extra"], False),
            (["0.weight"], True)]
    # with a threshold below the packed total, still dense
    plan = buckets.plan_buckets(named, scope="tensor", min_sparse_numel=650)
    assert plan[0].names[0] == "0.bias" and plan[0].numel > 650 and not plan[0].sparse


def test_sharded_regions_cover_the_bucket_in_rank_order():
    from hvd_sparse.engine import sharded

    for numel, size in [(10, 3), (2, 4), (0, 2), (1000, 7)]:
        b = sharded.region_bounds(numel, size)
        assert len(b) == size + 1 and b[0] == 0 and b[-1] == numel
        lengths = [hi - lo for lo, hi in zip(b[:-1], b[1:])]
        assert all(x >= 0 for x in lengths) and max(lengths) - min(lengths) <= 1
    idx = torch.tensor([0, 3, 4, 9])
    assert sharded.cut_points(idx, sharded.region_bounds(10, 3)) == [0, 2, 3, 4]  # 0-4,4-7,7-10
    buf, splits = sharded.encode_parts(idx, torch.ones(4), sharded.region_bounds(10, 3),
                                       constant=False, index_dtype=torch.int32, tag=5, numel=10)
    assert sum(splits) == buf.numel() and len(splits) == 3
    parts = [wire.decode_all(part, 1, tag=5, numel=10, bucket="b")[0]
             for part in torch.split(buf, splits)]
    assert [p.indices.tolist() for p in parts] == [[0, 3], [4], [9]]


def test_sharded_cost_model_and_option():
    from hvd_sparse import costmodel
    from hvd_sparse.engine.config import COLLECTIVES

    link = costmodel.Link(1e-4, 1e8, 1e-4, 1e8)
    payload = 1e6
    for p in (4, 16, 256):  # the allgather brings P payloads, the sharded exchange about two
        gather = costmodel.sparse_time(0.0, p * payload, link)
        shard = costmodel.sharded_time(0.0, payload, p, link)
        assert shard < gather
    # two latencies: a tiny bucket at 2 ranks is cheaper by allgather
    assert costmodel.sharded_time(0.0, 100, 2, link) > costmodel.sparse_time(0.0, 200, link)
    # in bytes gathered per second an all-to-all of a payload costs the whole payload: with
    # a downlink selection as dense as the uplink, two payloads at any rank count; without
    # one (owners send their regions' whole sums, up to P payloads in all) it is dearer
    # than the allgather of P payloads at every rank count
    for p in (2, 4, 16):
        assert costmodel.sharded_time(0.0, payload, p, link) == \
            pytest.approx(2e-4 + 2 * payload / 1e8)
        assert costmodel.sharded_time(0.0, payload, p, link, downlink_ratio=p) > \
            costmodel.sparse_time(0.0, p * payload, link)
    # the global rule's histograms: two more latencies and their bytes
    plain = costmodel.sharded_time(0.0, payload, 4, link)
    assert costmodel.sharded_time(0.0, payload, 4, link, histogram_bytes=32768) == \
        pytest.approx(plain + 2e-4 + 32768 / 1e8)
    assert COLLECTIVES == ("allgather", "sharded", "auto")
    import hvd_sparse

    p = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError, match="collective"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                        collective="ring", transport="local")


def test_global_threshold_counts_close_to_k():
    """Two rounds of summed magnitude histograms (the coarse one names the bin of the k-th
    magnitude, the fine one splits it) give a threshold whose count is within one fine bin of
    k, from the numba and the torch histograms alike; k past the non-zeros selects them all."""
    from hvd_sparse.engine import sharded
    from hvd_sparse.kernels import cpu, reference

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    x[::3] = 0.5  # a third of the entries share one magnitude: one coarse bin holds them
    halves = [x[:100_000], x[100_000:]]  # two owners' regions
    backends = [reference] + ([cpu] if cpu.available() else [])

    def threshold(ops, k):
        coarse = sum(ops.magnitude_histogram(h, sharded.HIST_SHIFT, sharded.BINS)
                     for h in halves)
        found = sharded.coarse_bin(coarse, k)
        if found is None:
            return sharded.TINY
        b, above = found
        fine = sum(ops.magnitude_histogram(h, sharded.FINE_SHIFT, sharded.FINE_BINS,
                                           sharded.HIST_SHIFT, b) for h in halves)
        return sharded.fine_threshold(b, above, fine, k)

    mags = x.abs()
    for k in (10, 2_000, 50_000, 120_000):
        ts = [threshold(ops, k) for ops in backends]
        assert len(set(ts)) == 1
        count = int((mags >= ts[0]).sum())
        step = ts[0] * 2.0 ** -13  # one fine bin around the threshold
        near = int(((mags >= ts[0] - step) & (mags < ts[0] + step)).sum())
        assert abs(count - k) <= max(near, 1), (k, count, near)
    assert threshold(reference, 10**6) == sharded.TINY


def test_allgather_serves_small_topk_buckets_under_the_global_rule():
    """At two ranks the allgather never receives more than the sharded exchange; from three
    ranks on, large buckets shard (the histograms are cheap beside their pairs) and small ones
    do not; the crossover moves down as the rank count grows."""
    from hvd_sparse.engine import sharded

    pair = 8
    for k in (10, 1_000, 100_000, 10_000_000):
        assert sharded.allgather_is_cheaper(k, k, 2, pair)
    for p in (3, 4, 64, 1024):
        assert sharded.allgather_is_cheaper(5, 5, p, pair)
        assert not sharded.allgather_is_cheaper(100_000, 100_000, p, pair)

    def crossover(p):
        k = 1
        while sharded.allgather_is_cheaper(k, k, p, pair):
            k += 1
        return k

    assert crossover(4) > crossover(16) > crossover(1024) >= 1
    # the histograms: two of 2048 float64 counts each, through a ring allreduce
    assert sharded.histogram_bytes(2) == 2 * (1 / 2) * 4096 * 8


def test_whole_from_regions_keeps_survivors_and_zeros_the_departed():
    """Elastic reset: regions held by survivors of a 3-rank world, region 1 twice (a rank
    renumbered and a copy), region 2's owner gone."""
    from hvd_sparse.engine import sharded

    full = torch.arange(1.0, 11.0)
    bounds = sharded.region_bounds(10, 3)
    piece = [(bounds[r], bounds[r + 1], full[bounds[r]:bounds[r + 1]].clone()) for r in range(3)]
    whole, covered = sharded.whole_from_regions(10, [piece[1], piece[0], piece[1]], torch.float32)
    assert covered == bounds[2]
    assert torch.equal(whole[:bounds[2]], full[:bounds[2]])
    assert not whole[bounds[2]:].any()
    whole, covered = sharded.whole_from_regions(10, piece, torch.float32)
    assert covered == 10 and torch.equal(whole, full)


def test_balanced_bounds_follow_the_load_and_bound_the_length():
    """Uniform load keeps equal regions; load in the first tenth moves the first bounds into
    it, shares the load within a bin of equal, and no region passes 1 / COLD_SHARE times the
    equal length; the loads per region are counted from the same bins."""
    from hvd_sparse.engine import sharded

    n = 1_000_000
    flat = torch.ones(sharded.LOAD_BINS, dtype=torch.float64)
    assert sharded.balanced_bounds(flat, n, 4) == sharded.region_bounds(n, 4)
    idx = torch.randint(0, n // 10, (50_000,), generator=torch.Generator().manual_seed(0))
    counts = sharded.load_counts(idx, n)
    assert counts.sum() == 50_000 and counts[sharded.LOAD_BINS // 10 + 1:].sum() == 0
    equal = sharded.region_bounds(n, 4)
    before = sharded.region_loads(counts, equal, n)
    assert before[0] == 50_000 and before[1:].sum() == 0
    for p in (2, 4, 8):
        bounds = sharded.balanced_bounds(counts, n, p)
        assert bounds[0] == 0 and bounds[-1] == n and list(bounds) == sorted(bounds)
        assert 0 < bounds[1] < n // 10
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        assert max(lengths) <= n / p / sharded.COLD_SHARE + n / sharded.LOAD_BINS
        loads = sharded.region_loads(counts, bounds, n)
        assert loads.sum() == 50_000
        if p == 2:  # the hot tenth is split between the two owners
            assert loads.min() > 0.25 * 50_000
    # fewer entries than bins or ranks: bounds stay in range and ordered
    tiny = sharded.balanced_bounds(sharded.load_counts(torch.tensor([0, 0, 1]), 3), 3, 4)
    assert tiny[0] == 0 and tiny[-1] == 3 and list(tiny) == sorted(tiny)


def test_merge_rank_states_refuses_what_it_cannot_merge():
    """One state dict per rank of one job, or a clear error naming what is wrong."""
    import hvd_sparse

    def state(rank, size, **extra):
        return {"state": {}, "param_groups": [],
                "hvd_sparse": dict({"rank": rank, "world_size": size, "buckets": {}}, **extra)}

    with pytest.raises(ValueError, match="every rank"):
        hvd_sparse.merge_rank_states([])
    with pytest.raises(ValueError, match="one state dict per rank"):
        hvd_sparse.merge_rank_states([state(0, 3), state(2, 3)])
    with pytest.raises(ValueError, match="one state dict per rank"):
        hvd_sparse.merge_rank_states([state(0, 2), state(1, 3)])
    with pytest.raises(ValueError, match="hvd_sparse optimizer state"):
        hvd_sparse.merge_rank_states([{"state": {}}])
    merged = hvd_sparse.merge_rank_states([state(1, 2), state(0, 2)])
    assert merged["hvd_sparse"]["merged"] and merged["hvd_sparse"]["rank"] == -1
    with pytest.raises(ValueError, match="merged already"):
        hvd_sparse.merge_rank_states([merged])
    # bidirectional=False: the unsent gradients are carried the same way (the engine adds them
    # to its first aggregate after loading), with no warning
    uni = [state(r, 2, bidirectional=False, average=True) for r in range(2)]
    for r, s in enumerate(uni):
        s["hvd_sparse"]["buckets"] = {"w": {"numel": 4, "downlink": None, "shard": None,
                                            "uplink": torch.full((4,), float(r + 1)),
                                            "velocity": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = hvd_sparse.merge_rank_states(uni)
    assert merged["hvd_sparse"]["buckets"]["w"]["uplink"] is None
    assert torch.equal(merged["hvd_sparse"]["buckets"]["w"]["downlink"], torch.full((4,), 1.5))
    # bidirectional: the uplinks are folded in, averaged, in the residual's own dtype
    bi = [state(r, 2, bidirectional=True, average=True) for r in range(2)]
    for r, s in enumerate(bi):
        s["hvd_sparse"]["buckets"] = {"w": {
            "numel": 4, "downlink": None, "uplink": torch.full((4,), float(r + 1),
                                                               dtype=torch.float64),
            "velocity": None,
            "shard": {"layout": [2, r, 2 * r, 2 * r + 2], "residual": None}}}
    whole = hvd_sparse.merge_rank_states(bi)["hvd_sparse"]["buckets"]["w"]["downlink"]
    assert whole.dtype == torch.float64 and torch.equal(whole, torch.full((4,), 1.5,
                                                                          dtype=torch.float64))


def test_one_rank_sharded_equals_the_allgather_result():
    """A world of one: every collective gives the same parameters bit for bit (one region
    covers the bucket; its owner is the only rank)."""
    import hvd_sparse

    def run(**kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), density=0.05, min_sparse_numel=0,
            cost_model="off", transport="local", **kw)
        gen = torch.Generator().manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 30, generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), x[:, :3].argmax(1)).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    want = run(collective="allgather")
    for kw in ({"collective": "sharded"}, {"collective": "sharded", "sharded_selection": "region"},
               {"collective": "auto"}, {"collective": "sharded", "bidirectional": False}):
        got = run(**kw)
        if kw.get("bidirectional") is False:
            want_uni = run(collective="allgather", bidirectional=False)
            assert torch.equal(got, want_uni), kw
        else:
            assert torch.equal(got, want), kw


class _RecordingPeer(LocalTransport):
    """Two ranks whose other rank sends this rank's bytes, noting the order buckets start in."""

    def __init__(self, ordered):
        self.ordered = ordered
        self.started = []

    def size(self):
        return 2

    def allgather_async(self, payload, name):
        if name.startswith("hvd_sparse.") and name.count(".") >= 2 \
                and name.split(".")[1].isdigit():
            self.started.append(name.split(".", 2)[2])
        return torch.cat([payload, payload])

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor

    def wait(self, handle):
        return handle


@pytest.mark.usefixtures("one_bucket_per_tensor")
@pytest.mark.parametrize("ordered", [False, True], ids=["by-name", "by-order"])
def test_buckets_start_as_they_complete_or_in_the_launch_order(ordered):
    """Gradients arrive last layer first; handing the wrapped optimizer the parameters last
    layer first makes the launch order (the reverse of the buckets') the first layer first. A
    transport matched by name starts each bucket when it completes; one matched by order (MPI)
    waits for the head of the launch order, then starts every complete bucket behind it, in
    that order."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))
    transport = _RecordingPeer(ordered)
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(list(reversed(list(m.parameters()))), lr=0.1),
        named_parameters=m.named_parameters(), density=0.1, min_sparse_numel=0,
        cost_model="off", collective="allgather", check_config=False, transport=transport)
    launch_order = list(reversed(list(opt.engine_state())))
    assert launch_order[0].startswith("0.") and launch_order[-1].startswith("1.")
    for _ in range(2):
        transport.started.clear()
        opt.zero_grad()
        m(torch.randn(4, 30)).pow(2).sum().backward()
        opt.step()
        if ordered:
            assert transport.started == launch_order
        else:  # as autograd finished them: the last layer first
            assert set(transport.started) == set(launch_order)
            assert transport.started.index("1.weight") < transport.started.index("0.weight")


@pytest.mark.parametrize("exchange", ["gradient", "update"])
def test_unidirectional_engine_applies_a_merged_downlink_residual_once(exchange):
    """A job without the downlink selection, resumed from ``merge_rank_states`` on another rank
    count: the ranks' unsent mass, carried as a downlink residual, joins the first aggregate
    whole (with zero gradients the parameters move by exactly that much) and never again."""
    import copy

    from hvd_sparse.optimizer import STATE_KEY

    def build():
        torch.manual_seed(0)
        m = torch.nn.Linear(50, 40, bias=False)
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=1.0), named_parameters=m.named_parameters(),
            density=0.05, bidirectional=False, exchange=exchange, cost_model="off",
            min_sparse_numel=0, transport="local", check_config=False)
        return m, opt

    def zero_step(m, opt):
        opt.zero_grad()
        (0.0 * m(torch.ones(1, 50)).sum()).backward()
        opt.step()

    m, opt = build()
    zero_step(m, opt)
    sd = opt.state_dict()
    (name,) = sd[STATE_KEY]["buckets"]
    states = []
    for r in range(2):  # the old job: two ranks, each with unsent mass of its own
        s = copy.deepcopy(sd)
        s[STATE_KEY].update(rank=r, world_size=2)
        s[STATE_KEY]["buckets"][name]["uplink"] = torch.linspace(-1, 1, 2000) * (r + 1)
        states.append(s)
    merged = hvd_sparse.merge_rank_states(states)
    pending = torch.linspace(-1, 1, 2000) * 1.5  # (1 + 2) / 2 ranks, op=Average
    m2, opt2 = build()
    opt2.load_state_dict(merged)
    before = m2.weight.detach().clone().reshape(-1)
    zero_step(m2, opt2)
    moved = m2.weight.detach().reshape(-1) - before  # a weight change, or (SGD, lr 1)
    torch.testing.assert_close(moved, pending if exchange == "update" else -pending,  # minus
                               rtol=0, atol=1e-6)  # the averaged gradient
    after = m2.weight.detach().clone()
    zero_step(m2, opt2)
    assert torch.equal(m2.weight.detach(), after)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("stacked", [None, True, False])
def test_finiteness_of_many_tensors_read_at_once_equals_one_by_one(device, stacked):
    """The per-parameter NaN/Inf check of exchanged updates reads every gradient's verdict in
    one host read on a GPU; each verdict must equal the tensor's own check, whatever the
    dtype (half precision summed wide: 70,000 ones are finite) and wherever the bad entry."""
    from hvd_sparse.engine.flat import all_finite, finite_each

    g = torch.Generator().manual_seed(3)
    tensors = []
    for i, dtype in enumerate([torch.float32, torch.float16, torch.bfloat16, torch.float64] * 3):
        t = torch.randn(50 + 7 * i, generator=g).to(dtype)
        if i % 3 == 1:
            t[i % t.numel()] = float("nan") if i % 2 else float("inf")
        tensors.append(t.to(device))
    tensors.append(torch.ones(70_000, dtype=torch.float16, device=device))
    tensors.append(torch.full((3,), -float("inf"), device=device))
    # huge entries whose signs cancel: finite (a sum of magnitudes would overflow)
    tensors.append(torch.tensor([3e38, -3e38], device=device))
    tensors.append(torch.tensor([1e308, -1e308], dtype=torch.float64, device=device))
    tensors.append(torch.tensor([3e38, -3e38], dtype=torch.bfloat16, device=device))
    want = [all_finite(t) for t in tensors]
    assert want.count(False) == 5 and all(want[-3:])
    assert finite_each(tensors, stacked=stacked) == want
    assert finite_each([], stacked=stacked) == []
