"""``momentum_masking``: with exchanged weight updates, each rank's SGD momentum buffer is
zeroed (or, at a strength below 1, scaled down) exactly where that rank sent (DGC's momentum
factor masking), nowhere else, in one-tensor and several-tensor buckets; clear errors where it
cannot apply."""
import pytest
import torch

import hvd_sparse
from hvd_sparse.sparsifiers.base import k_for_density
from hvd_sparse.transport import LocalTransport


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(30, 200), torch.nn.ReLU(),
                               torch.nn.Linear(200, 7))


def _step(masking, scope, steps=3):
    """(model, wrapped optimizer, momentum buffers after the last local step's SGD but before
    its exchange, those after it) for ``steps`` steps."""
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd_sparse.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), density=0.02, exchange="update",
        bidirectional=False, scope=scope, min_sparse_numel=100, cost_model="off",
        check_config=False, momentum_masking=masking, transport=LocalTransport())
    gen = torch.Generator().manual_seed(1)
    before = None
    for step in range(steps):
        x, y = torch.randn(16, 30, generator=gen), torch.randint(0, 7, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step == steps - 1:  # what plain SGD makes of this step's momentum
            before = _plain_momentum(model, base)
        opt.step()
    after = [base.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return model, opt, before, after


def _plain_momentum(model, base):
    out = []
    for p in model.parameters():
        buf = base.state[p]["momentum_buffer"]
        out.append(buf * 0.9 + p.grad)
    return out


@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_momentum_is_zeroed_exactly_where_this_rank_sent(scope):
    model, _, before, after = _step(True, scope)
    sizes = [p.numel() for p in model.parameters()]
    sparse = [n >= 100 for n in sizes]  # the 7-entry bias goes dense (min_sparse_numel)
    zeroed = 0
    for b, a, is_sparse in zip(before, after, sparse):
        kept = a == b
        gone = (a == 0) & (b != 0)
        assert bool((kept | gone).all()), "the buffer changed other than by zeroing"
        if not is_sparse:
            assert not bool(gone.any()), "a dense tensor's momentum was masked"
        zeroed += int(gone.sum())
    # every entry this rank sent had a non-zero momentum (a random model's gradients), so
    # the zeroed ones are exactly the k of each sparse bucket
    buckets = [n for n, s in zip(sizes, sparse) if s] if scope == "tensor" \
        else [sum(n for n, s in zip(sizes, sparse) if s)]
    assert zeroed == sum(k_for_density(n, 0.02) for n in buckets)


def test_without_masking_the_momentum_is_plain_sgds():
    _, _, before, after = _step(False, "tensor")
    for b, a in zip(before, after):
        assert torch.allclose(a, b)


def test_masking_changes_training_and_keeps_it_finite():
    m1, *_ = _step(True, "tensor", steps=6)
    m2, *_ = _step(False, "tensor", steps=6)
    differ = any(not torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    assert differ
    assert all(bool(torch.isfinite(p).all()) for p in m1.parameters())


def _build(momentum=0.9, **kwargs):
    model = _model()
    return hvd_sparse.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
        named_parameters=model.named_parameters(), transport=LocalTransport(), **kwargs)


def test_masking_is_refused_where_gradients_are_exchanged():
    with pytest.raises(ValueError, match="momentum_masking"):
        _build(exchange="gradient", momentum_masking=True)


def test_masking_is_refused_without_momentum():
    with pytest.raises(ValueError, match="momentum"):
        _build(momentum=0.0, exchange="update", momentum_masking=True)


@pytest.mark.parametrize("strength", [0.5, 0.25])
def test_a_partial_strength_scales_the_momentum_exactly_where_this_rank_sent(strength):
    """``momentum_masking=s`` leaves ``(1 - s)`` of the momentum where this rank sent (k
    positions per sparse bucket) and every other entry as plain SGD made it."""
    model, _, before, after = _step(strength, "tensor")
    scaled = 0
    for b, a in zip(before, after):
        kept = a == b
        damped = (a == b * (1.0 - strength)) & (b != 0)
        assert bool((kept | damped).all()), "the buffer changed other than by the masking"
        scaled += int(damped.sum())
    sizes = [p.numel() for p in model.parameters() if p.numel() >= 100]
    assert scaled == sum(k_for_density(n, 0.02) for n in sizes)


def test_masking_takes_a_bool_or_a_share():
    with pytest.raises(TypeError, match="momentum_masking"):
        _build(exchange="update", momentum_masking="yes")
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="momentum_masking"):
            _build(exchange="update", momentum_masking=bad)
    from hvd_sparse.engine.config import masking_strength
    assert [masking_strength(v) for v in (True, False, 0, 1, 0.5)] == [1.0, 0.0, 0.0, 1.0, 0.5]


def test_cooldown_with_updates_warns_for_adaptive_optimizers_only():
    """The cool-down undid an AdamW run's training at 0.1%; SGD's updates gained from it."""
    import warnings

    model = _model()
    with pytest.warns(UserWarning, match="adaptive optimizer"):
        hvd_sparse.DistributedOptimizer(
            torch.optim.AdamW(model.parameters()), named_parameters=model.named_parameters(),
            transport=LocalTransport(), total_steps=100, density_cooldown_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for masking in (False, True):
            _build(exchange="update", total_steps=100, density_cooldown_steps=10,
                   momentum_masking=masking)
