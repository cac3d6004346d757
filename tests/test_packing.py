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
    if optimizer == "sgd":  # its gradients, unless a case asks for its updates
        options.setdefault("exchange", "gradient")
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
    ("adamw", {"sparsifier": "threshold", "threshold": 1e-3}),
    ("sgd", {"exchange": "update"})],
    ids=["gradients", "uplink-only", "updates", "momentum-correction", "fp16-wire",
         "threshold", "threshold-updates", "sgd-updates"])
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


class _InPlacePeer(_EchoPeer):
    """Reduces in place, as Horovod's ``allreduce_async_`` does, and keeps what it reduced."""

    def __init__(self):
        super().__init__()
        self.reduced = []

    def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
        self.reduced.append(tensor)
        return tensor.mul_(prescale * postscale)


@pytest.mark.parametrize("pack", [buckets.PACK_BELOW, 0], ids=["shared", "alone"])
def test_a_dense_bucket_of_many_tensors_writes_every_gradient_in_its_layout(pack,
                                                                            monkeypatch):
    """A bucket that goes dense (here the dense warm-up) is one allreduce of its tensors
    copied together, then copied back: a missing gradient reads as zeros, a transposed or
    channels_last one keeps its logical order, a contiguous one is written in place (the
    tensor user code holds)."""
    monkeypatch.setenv("HVD_SPARSE_PACK_BELOW", str(pack))
    torch.manual_seed(0)
    named = [("a", torch.nn.Parameter(torch.randn(40, 50))),
             ("b", torch.nn.Parameter(torch.randn(3000))),
             ("c", torch.nn.Parameter(torch.randn(8, 6, 5, 7))),
             ("d", torch.nn.Parameter(torch.randn(60, 70))),
             ("e", torch.nn.Parameter(torch.randn(2000)))]
    peer = _InPlacePeer()
    opt = hvd_sparse.DistributedOptimizer(
        torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
        dense_warmup_steps=5, cost_model="off", check_config=False, transport=peer)
    if pack:
        assert len(opt.engine_state()) < len(named)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        opt.zero_grad()
        a, b, c, d, e = (p for _, p in named)
        a.grad = torch.randn(40, 50, generator=gen)
        c.grad = torch.randn(8, 6, 5, 7, generator=gen)
        if step == 0:  # (then plain ones: the bucket's gradients copied in one call)
            a.grad = torch.randn(50, 40, generator=gen).t()  # transposed
            c.grad = c.grad.contiguous(memory_format=torch.channels_last)
        d.grad = torch.randn(60, 70, generator=gen)
        if step != 1:
            e.grad = torch.randn(2000, generator=gen)  # none at step 1: zeros
        expected = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                    for n, p in named if n != "b"}
        held = d.grad
        peer.reduced.clear()
        opt.synchronize()
        assert b.grad is None or not b.grad.any()
        for n, p in named:
            if n != "b":
                assert torch.equal(p.grad, expected[n]), (n, step)
        assert d.grad is held  # written in place
        # the echoing peer doubles nothing: everything was reduced once, as one vector per
        # bucket
        assert sum(t.numel() for t in peer.reduced) == sum(p.numel() for _, p in named)
        with opt.skip_synchronize():
            opt.step()


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


class _Ranks(_EchoPeer):
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def allgather_async(self, payload, name):
        return torch.cat([payload] * self._size)


def test_no_sharing_where_a_bucket_is_judged_whole_or_may_be_sharded(monkeypatch):
    """``local_clip_norm`` takes one norm per bucket (shared tensors would be clipped by
    their joint norm), and from 4 ranks the exchange may shard a tensor's bucket, which a
    shared Top-K bucket with a downlink selection cannot be (a review of the session's
    diff): there the tensors that the byte rule would shard keep their own buckets."""
    monkeypatch.delenv("HVD_SPARSE_PACK_BELOW", raising=False)
    sizes = [3000, 5000, 2500]
    _, opt = _train(sizes, steps=2, monkeypatch=monkeypatch, local_clip_norm=1.0)
    assert len(opt.engine_state()) == 3

    def buckets_at(ranks, sizes, **options):
        named = [(f"t{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
        opt = hvd_sparse.DistributedOptimizer(
            torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
            density=0.02, cost_model="off", check_config=False, transport=_Ranks(ranks),
            **options)
        return sorted(len(b.parameters) for b in opt.engine_state().values())

    # short tensors that the byte rule gathers anyway share at 4 ranks, under "auto" too
    assert buckets_at(4, sizes) == [3]
    # at 16 ranks a 60k-entry tensor's own bucket would be sharded: it keeps it
    assert buckets_at(16, [60000, 3000, 5000]) == [1, 2]
    assert buckets_at(16, [60000, 3000, 5000], collective="allgather") == [3]
    # the region rule may shard any of them; without a downlink selection a shared bucket
    # is sharded as well as a tensor's own
    assert buckets_at(4, sizes, sharded_selection="region") == [1, 1, 1]
    assert buckets_at(16, [60000, 3000, 5000], bidirectional=False) == [3]


@pytest.mark.parametrize("threads", [1, 2])
def test_subnormals_rank_alike_whatever_the_threads_flush(threads):
    """A tensor with fewer normal entries than its k, holding subnormals, ranked whole: by
    the bits of |v| (as one bucket per tensor ranks them), so a thread that flushes
    subnormals to zero picks what every other thread picks (a review found the float
    comparison picking zeros there instead)."""
    from hvd_sparse.kernels import cpu
    from hvd_sparse.sparsifiers import TopK
    from hvd_sparse.sparsifiers.base import SelectionContext

    if not cpu.available():
        pytest.skip("numba is not installed")
    gen = torch.Generator().manual_seed(3)
    segments = ((0, 20000), (20000, 26000))
    r = torch.zeros(26000)
    for lo, hi in segments:
        pos = lo + torch.randperm(hi - lo, generator=gen)[:400]
        r[pos] = torch.rand(400, generator=gen) * 1e-39  # subnormal
        r[lo + 7] = 1.0
    ctx = SelectionContext("b", segments=segments, layer_floor=1.0)
    before_threads, before_ftz = torch.get_num_threads(), None
    torch.set_num_threads(threads)
    try:
        plain = TopK().fused(cpu, None, r.clone(), 0.001, ctx).idx
        before_ftz = torch.set_flush_denormal(True)
        flushed = TopK().fused(cpu, None, r.clone(), 0.001, ctx).idx
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before_threads)
    assert before_ftz is not None
    assert torch.equal(flushed, plain)
    # the largest subnormals were chosen, not zeros by lowest index
    assert bool((r[plain] != 0).all())


def test_a_malformed_pack_setting_is_refused_clearly(monkeypatch):
    monkeypatch.setenv("HVD_SPARSE_PACK_BELOW", "lots")
    with pytest.raises(ValueError, match="HVD_SPARSE_PACK_BELOW must be a whole number"):
        _train([3000, 4000], steps=1)


def _resume(sizes, first_pack, then_pack, optimizer, monkeypatch, steps=(3, 3), **options):
    """Train ``steps[0]`` steps with one grouping, save, resume with the other for
    ``steps[1]`` more; returns the parameters and whether the load warned."""
    import copy
    import warnings

    def make(pack, params):
        monkeypatch.setenv("HVD_SPARSE_PACK_BELOW", str(pack))
        named = [(f"t{i}", p) for i, p in enumerate(params)]
        base = torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd" \
            else torch.optim.AdamW(params, lr=1e-2)
        extra = {"exchange": "gradient"} if optimizer == "sgd" else {}
        return hvd_sparse.DistributedOptimizer(base, named_parameters=named, density=0.02,
                                               cost_model="off", check_config=False,
                                               transport=_EchoPeer(), **extra, **options)

    def run(opt, params, gen, n):
        for _ in range(n):
            opt.zero_grad()
            for i, p in enumerate(params):
                p.grad = torch.randn(p.numel(), generator=gen) * 10.0 ** (i % 4 - 2)
            opt.step()

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n) * 0.1) for n in sizes]
    gen = torch.Generator().manual_seed(1)
    opt = make(first_pack, params)
    run(opt, params, gen, steps[0])
    saved_params = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    gen_state = gen.get_state()
    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = make(then_pack, resumed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt2.load_state_dict(state)
    gen2 = torch.Generator()
    gen2.set_state(gen_state)
    run(opt2, resumed, gen2, steps[1])
    return resumed, [str(w.message) for w in seen if "unsent mass" in str(w.message)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("first,then", [(0, buckets.PACK_BELOW), (buckets.PACK_BELOW, 0)],
                         ids=["one-per-tensor-to-shared", "shared-to-one-per-tensor"])
def test_a_checkpoint_resumes_where_the_tensors_are_grouped_otherwise(
        optimizer, first, then, monkeypatch):
    """A checkpoint of one bucket per tensor (every checkpoint before this session) resumed
    where short tensors share buckets, and the reverse: the residuals (and anchors, under
    exchanged updates) move parameter by parameter, so the run ends where one without the
    regrouping ends, bit for bit, and no mass is reported dropped."""
    sizes = [3000, 20000, 5000, 150000, 17000]
    straight, warned = _resume(sizes, first, first, optimizer, monkeypatch)
    assert not warned
    regrouped, warned = _resume(sizes, first, then, optimizer, monkeypatch)
    assert not warned
    for a, b in zip(straight, regrouped):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved_frozen", [True, False], ids=["unfrozen-at-resume",
                                                             "frozen-at-resume"])
def test_a_layer_frozen_or_unfrozen_at_resume_keeps_the_other_layers_mass(saved_frozen):
    """Short tensors share a bucket; one of them is trainable on one side of a checkpoint
    only (fine-tuning that unfreezes a layer at a resume, or freezes one). The other tensors'
    unsent mass moves into the new bucket, the new tensor's starts from zero; only a frozen
    tensor's own mass is reported dropped, by name (the whole bucket's was dropped, and the
    warning blamed the settings)."""
    import copy
    import warnings

    sizes = [3000, 2000, 5000, 1500]

    def make(params, frozen):
        for i, p in enumerate(params):
            p.requires_grad_(not (frozen and i == 2))
        named = [(f"t{i}", p) for i, p in enumerate(params)]
        return hvd_sparse.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.1), named_parameters=named, density=0.02,
            cost_model="off", check_config=False, transport=_EchoPeer(), exchange="gradient")

    def residuals(opt):
        (state,) = opt.engine_state().values()
        out, off = {}, 0
        for name in state.parameters:
            n = sizes[int(name[1:])]
            out[name] = state.uplink[off:off + n]
            off += n
        return out

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = make(params, saved_frozen)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        for p in params:
            if p.requires_grad:
                p.grad = torch.randn(p.numel(), generator=gen)
        opt.step()
    before = residuals(opt)
    assert all(float(r.abs().sum()) > 0 for r in before.values())
    state = copy.deepcopy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(resumed, not saved_frozen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt2.load_state_dict(state)
    warned = [str(w.message) for w in seen if "unsent mass" in str(w.message)]
    after = residuals(opt2)
    for name in set(before) & set(after):
        assert torch.equal(before[name], after[name]), name
    if saved_frozen:  # t2 joins, from zero
        assert set(after) == set(before) | {"t2"}
        assert float(after["t2"].abs().sum()) == 0
        assert not warned
    else:  # t2's mass alone is dropped, and said so
        assert set(after) == set(before) - {"t2"}
        assert len(warned) == 1 and "(t2)" in warned[0]
