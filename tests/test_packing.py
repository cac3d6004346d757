"""Short tensors sharing buckets under scope "tensor" (``buckets._pack_layerwise``): one
Top-K per tensor still, so the same bits as one bucket per tensor, at a fraction of the
per-bucket cost. Single process, with a peer that sends back this rank's own payload (the
downlink then selects from a real aggregate)."""
import pytest
import torch

import hvd_sparse
from hvd_sparse import buckets
from hvd_sparse.transport import Transport


class _EchoPeer(Transport):
    """Two ranks, the other one sending what this one sends."""

    def size(self):
        return 2

    def rank(self):
        return 0

    def allgather_async(self, payload, name):
        return torch.cat([payload, payload])

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        return tensor * prescale * postscale

    def wait(self, handle):
        return handle


def _named(sizes, dtype=torch.float32):
    return [(f"t{i}", torch.nn.Parameter(torch.zeros(n, dtype=dtype))) for i, n in
            enumerate(sizes)]


def test_runs_of_short_tensors_share_buckets_and_long_ones_stay_alone():
    named = _named([5000, 3000, 200000, 7000, 9000, 10])
    plan = buckets.plan_buckets(named, scope="tensor", pack=buckets.PACK_BELOW)
    sparse = [(b.names, b.layerwise) for b in plan if b.sparse]
    assert sparse == [(["t0", "t1"], True), (["t2"], False), (["t3", "t4"], True)]
    # the tensor below min_sparse_numel goes dense, as without packing
    assert [b.names for b in plan if not b.sparse] == [["t5"]]
    # pack=0: one bucket per tensor
    plan = buckets.plan_buckets(named, scope="tensor", pack=0)
    assert [b.names for b in plan if b.sparse] == [["t0"], ["t1"], ["t2"], ["t3"], ["t4"]]
    assert not any(b.layerwise for b in plan)


def test_packs_are_capped_and_never_cut_a_tensor():
    named = _named([100000] * 25)
    plan = buckets.plan_buckets(named, scope="tensor", pack=buckets.PACK_BELOW)
    assert all(b.numel <= buckets.PACK_NUMEL for b in plan)
    assert sum(len(b.params) for b in plan) == 25 and len(plan) < 25
    assert all(b.slices == [(0, 100000)] * len(b.params) for b in plan)
    # a smaller max_bucket_numel caps the packs too; a tensor above it is not packed
    plan = buckets.plan_buckets(named[:6] + _named([300000]), scope="tensor",
                                pack=buckets.PACK_BELOW, max_bucket_numel=250000)
    assert [len(b.params) for b in plan] == [2, 2, 2, 1, 1]
    assert all(b.numel <= 250000 for b in plan)


def test_only_float32_cpu_tensors_are_packed_and_only_under_scope_tensor():
    named = _named([4000, 4000]) + _named([4000, 4000], torch.float64)
    plan = buckets.plan_buckets(named, scope="tensor", pack=buckets.PACK_BELOW)
    assert [len(b.params) for b in plan] == [2, 1, 1]
    plan = buckets.plan_buckets(_named([4000, 4000]), scope="bucket", pack=buckets.PACK_BELOW)
    assert [b.layerwise for b in plan] == [False]


def _train(sizes, steps=6, pack=None, optimizer="sgd", monkeypatch=None, **options):
    if pack is not None:
        monkeypatch.setenv("HVD_SPARSE_PACK_BELOW", str(pack))
    torch.manual_seed(0)
    named = [(f"t{i}", torch.nn.Parameter(torch.randn(n) * 0.1)) for i, n in enumerate(sizes)]
    params = [p for _, p in named]
    base = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd" \
        else torch.optim.AdamW(params, lr=1e-2)
    opt = hvd_sparse.DistributedOptimizer(base, named_parameters=named, density=0.02,
                                          cost_model="off", check_config=False,
                                          transport=_EchoPeer(), **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for i, p in enumerate(params):  # tensors of very different scales
            p.grad = torch.randn(p.numel(), generator=gen) * 10.0 ** (i % 4 - 2)
        opt.step()
    return params, opt


@pytest.mark.parametrize("optimizer,options", [
    ("sgd", {}), ("sgd", {"bidirectional": False}), ("adamw", {}),
    ("sgd", {"momentum_correction": 0.9}), ("sgd", {"value_dtype": torch.float16}),
    ("sgd", {"sparsifier": "threshold", "threshold": 0.02}),
    ("adamw", {"sparsifier": "threshold", "threshold": 1e-3})],
    ids=["gradients", "uplink-only", "updates", "momentum-correction", "fp16-wire",
         "threshold", "threshold-updates"])
def test_packed_buckets_train_to_the_same_bits_as_one_bucket_per_tensor(
        optimizer, options, monkeypatch):
    sizes = [3000, 20000, 5000, 150000, 17000, 40000, 2500]
    packed, opt = _train(sizes, pack=buckets.PACK_BELOW, optimizer=optimizer,
                         monkeypatch=monkeypatch, **options)
    state = opt.engine_state()
    assert len(state) < len(sizes)  # some tensors did share
    alone, alone_opt = _train(sizes, pack=0, optimizer=optimizer, monkeypatch=monkeypatch,
                              **options)
    assert len(alone_opt.engine_state()) == len(sizes)
    for a, b in zip(packed, alone):
        assert torch.equal(a, b)
    # each tensor sent its own k, so the totals are the same
    assert opt.communication_stats()["totals"]["selected"] == \
        alone_opt.communication_stats()["totals"]["selected"]


def test_the_default_shares_for_topk_and_threshold_only_and_not_when_sharded(monkeypatch):
    monkeypatch.delenv("HVD_SPARSE_PACK_BELOW", raising=False)
    sizes = [3000, 5000, 7000]
    _, opt = _train(sizes, steps=1, monkeypatch=monkeypatch)
    assert len(opt.engine_state()) == 1
    for method in ("gaussiank", "sbc", "randomk", "adaptive"):
        extra = {"total_steps": 10} if method == "adaptive" else {}
        _, opt = _train(sizes, steps=1, monkeypatch=monkeypatch, sparsifier=method, **extra)
        assert len(opt.engine_state()) == 3, method
    # the hard threshold chooses each entry by itself: shared, without a floor
    _, opt = _train(sizes, steps=1, monkeypatch=monkeypatch, sparsifier="threshold",
                    threshold=0.01)
    assert len(opt.engine_state()) == 1
    _, opt = _train(sizes, steps=1, monkeypatch=monkeypatch, collective="sharded")
    assert len(opt.engine_state()) == 3
