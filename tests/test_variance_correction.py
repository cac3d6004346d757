"""The full batch's second moment for Adam-family optimizers whose updates are exchanged
(hvd_sparse.variance_correction): the step against a hand-written reference, the estimate
against a known noise, the wrapped optimizer's own state left as it was, and the option's
resolution. Multi-rank behaviour (identical replicas, exact resume) is in test_dropin.py."""
import copy

import pytest
import torch

import hvd_sparse
from hvd_sparse.variance_correction import VarianceCorrection

from conftest import echo_transport


def _grads(steps, shape=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    return [mean + 2.0 * torch.randn(shape, generator=g, dtype=torch.float64)
            for _ in range(steps)]


def _reference(p0, grads, world, lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.0,
               decoupled=True, maximize=False):
    """Adam(W) written out, stepping on the corrected second moment."""
    b1, b2 = betas
    p = p0.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    d = torch.zeros_like(p)
    n, last = 0, None
    for t, g in enumerate(grads, 1):
        if maximize:
            g = -g
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        if last is not None:
            d = b2 * d + (1 - b2) * (g - last) ** 2 / 2
            n += 1
        last = g
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vhat = v / (1 - b2 ** t)
        if n and t > 1:
            floor = (1 - b2) * g * g / (1 - b2 ** t)
            vhat = torch.maximum(torch.maximum(vhat - (1 - 1 / world) * d / (1 - b2 ** n),
                                               vhat / world), floor)
        p = p - lr * (m / (1 - b1 ** t)) / (vhat.sqrt() + eps)
    return p, v


def _run(make, grads, world, p0):
    p = torch.nn.Parameter(p0.clone())
    opt = make([p])
    corr = VarianceCorrection()
    for g in grads:
        p.grad = g.clone()
        corr.before(opt, world)
        opt.step()
        corr.after()
    return p.detach(), opt.state[p]["exp_avg_sq"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["adamw", "adam_l2", "adam_plain", "adam_l2_maximize"])
def test_the_step_uses_the_corrected_second_moment_and_keeps_adams_own(world, kind, fused,
                                                                     monkeypatch):
    """Both forms: numba's one pass (where it applies: no coupled decay, no maximize) and
    torch's."""
    from hvd_sparse import variance_correction

    if not fused:
        monkeypatch.setattr(variance_correction, "HAVE_NUMBA", False)
    elif not variance_correction.HAVE_NUMBA:
        pytest.skip("numba is not installed (the optional 'fast' extra)")
    grads = _grads(40)
    p0 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if kind == "adamw":
        make, ref = (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)), \
            dict(wd=0.1, decoupled=True)
    elif kind == "adam_l2":  # Adam squares the gradient plus the decay term
        make, ref = (lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.05)), \
            dict(wd=0.05, decoupled=False)
    elif kind == "adam_l2_maximize":  # the gradient negated before the decay term
        make, ref = (lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.05,
                                                 maximize=True)), \
            dict(wd=0.05, decoupled=False, maximize=True)
    else:
        make, ref = (lambda ps: torch.optim.Adam(ps, lr=0.01)), {}
    got, v = _run(make, grads, world, p0)
    want, want_v = _reference(p0, grads, world, **ref)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    # Adam's state holds the rank's own second moment, as without the correction (to rounding)
    assert torch.allclose(v, want_v, rtol=1e-9, atol=0)
    plain, _ = _run(make, grads, 1, p0)  # one rank: nothing to correct
    assert not torch.allclose(got, plain, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by "
                    "benchmarks/gpu_check.sh on a GPU machine)")
@pytest.mark.parametrize("kind", ["adamw", "adam_l2"])
def test_the_multi_tensor_form_on_cuda_matches_the_reference(kind):
    """On a GPU the torch form (multi-tensor ops) steps as the written-out reference does."""
    grads = _grads(30)
    p0 = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    make, ref = ((lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
                 dict(wd=0.1)) if kind == "adamw" else \
        ((lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.05)),
         dict(wd=0.05, decoupled=False))
    got, _ = _run(make, [g.cuda() for g in grads], 2, p0.cuda())
    want, _ = _reference(p0, grads, 2, **ref)
    assert torch.allclose(got.cpu(), want, rtol=1e-10, atol=1e-12)


def test_one_rank_is_adam_bit_for_bit():
    grads = [g.float() for g in _grads(20)]
    p0 = torch.randn(5, 3)
    got, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=0.01), grads, 1, p0)
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert torch.equal(got, p.detach())


@pytest.mark.parametrize("world", [2, 4])
def test_the_estimate_is_the_full_batchs_second_moment(world):
    """Gradients of a rank: mean 0.5 plus noise of variance 1. The full batch (P ranks) has
    noise of variance 1/P: its second moment is 0.25 + 1/P, the rank's own 1.25."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(2000, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.0, betas=(0.9, 0.999))
    corr = VarianceCorrection()
    seen = []
    for t in range(3000):
        p.grad = 0.5 + torch.randn(2000, dtype=torch.float64)
        corr.before(opt, world)
        opt.step()
        if t == 2999:
            seen.append(opt.state[p]["exp_avg_sq"].clone() / (1 - 0.999 ** 3000))
        corr.after()
    own = opt.state[p]["exp_avg_sq"] / (1 - 0.999 ** 3000)
    assert abs(float(own.mean()) - 1.25) < 0.03
    assert abs(float(seen[0].mean()) - (0.25 + 1 / world)) < 0.03


def test_the_rank_keeps_its_own_second_moment_for_the_gradient_the_step_used():
    """A step pre-hook that clips the gradient after the correction was put in: Adam's
    state afterwards is the rank's own for the clipped gradient, as without the correction;
    a step that raises gives the state back as it was."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(50, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.01)
    corr = VarianceCorrection()
    for t in range(20):
        p.grad = torch.randn(50, generator=g, dtype=torch.float64)
        v0 = opt.state[p]["exp_avg_sq"].clone() if p in opt.state else None
        corr.before(opt, 2)
        p.grad.clamp_(-0.5, 0.5)  # (a pre-hook's clip)
        opt.step()
        corr.after()
        if v0 is not None:
            want = 0.999 * v0 + 0.001 * p.grad * p.grad
            assert torch.allclose(opt.state[p]["exp_avg_sq"], want, rtol=1e-12, atol=1e-18)
    v0 = opt.state[p]["exp_avg_sq"].clone()
    p.grad = torch.randn(50, generator=g, dtype=torch.float64)
    corr.before(opt, 2)
    assert not torch.equal(opt.state[p]["exp_avg_sq"], v0)  # (the corrected one is in)
    corr.after(stepped=False)
    assert torch.allclose(opt.state[p]["exp_avg_sq"], v0, rtol=1e-12, atol=1e-18)


def test_a_stand_in_zero_gradient_is_no_sample_of_the_noise():
    """A parameter without a gradient this step gets zeros from the facade: skipped, the
    estimate keeps counting real gradients only."""
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.Adam([p], lr=0.01)
    corr = VarianceCorrection()
    for t in range(6):
        p.grad = torch.zeros(10) if t % 2 else torch.ones(10)
        corr.before(opt, 2, skip={p} if t % 2 else frozenset())
        opt.step()
        corr.after()
    assert corr.count == {0: 2}  # three real gradients, two differences
    assert float(corr.noise[0].abs().max()) == 0.0  # (equal real gradients: no noise)


def test_half_precision_parameters_with_large_gradients_stay_finite():
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    opt = torch.optim.Adam([p], lr=1e-3, eps=1e-4)
    corr = VarianceCorrection()
    g = torch.Generator().manual_seed(0)
    for t in range(10):
        p.grad = (torch.randn(64, generator=g) * 1000).half()
        corr.before(opt, 4)
        opt.step()
        corr.after()
    assert torch.isfinite(p).all() and torch.isfinite(opt.state[p]["exp_avg_sq"]).all()


def test_amsgrad_and_a_pre_hook_that_shrinks_gradients_stay_finite():
    """The corrected moment is put in as the pre-image of Adam's update: a gradient changed
    after it (a step pre-hook clipping it) must not make the second moment negative."""
    p = torch.nn.Parameter(torch.zeros(100))
    opt = torch.optim.Adam([p], lr=0.01, amsgrad=True)
    corr = VarianceCorrection()
    g = torch.Generator().manual_seed(0)
    for t in range(50):
        p.grad = torch.randn(100, generator=g) * (100.0 if t % 7 == 0 else 1.0)
        corr.before(opt, 4)
        p.grad.mul_(0.01)  # what a pre-hook clipping it would do
        opt.step()
        corr.after()
    assert torch.isfinite(p).all()
    assert (opt.state[p]["exp_avg_sq"] >= 0).all()


_Echo = echo_transport()  # two ranks holding the same gradients: each averaged update
# is the rank's own


def _wrapped(m, base, **kw):
    return hvd_sparse.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                           transport=_Echo(), min_sparse_numel=0,
                                           cost_model="off", check_config=False, **kw)


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def test_the_wrapped_adamw_steps_on_the_corrected_moment():
    """AdamW wrapped (its updates exchanged, dense here) on two echoing ranks steps exactly as
    AdamW with the correction for two ranks; with it turned off, as AdamW itself. Its state
    saved and loaded by the same rank resumes bit for bit."""
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 2)
    twin, plain_net = copy.deepcopy(net), copy.deepcopy(net)
    opt = _wrapped(net, torch.optim.AdamW(net.parameters(), lr=0.05), density=1.0,
                   exchange="update")
    assert opt.communication_stats()["variance_correction"] is True
    plain = _wrapped(plain_net, torch.optim.AdamW(plain_net.parameters(), lr=0.05),
                     density=1.0, exchange="update", variance_correction=False)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.05)
    corr = VarianceCorrection()
    batches = _batches(12)
    for i, (x, y) in enumerate(batches):
        for n, o in ((net, opt), (plain_net, plain), (twin, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(n(x), y).backward()
        opt.step()
        plain.step()
        corr.before(ref, 2)
        ref.step()
        corr.after()
        if i == 5:
            saved = (copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict()))
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(a, b, rtol=1e-4)
               for a, b in zip(net.parameters(), plain_net.parameters()))
    assert saved[1]["hvd_sparse"]["variance"]["count"] == {0: 5, 1: 5}
    end = [p.detach().clone() for p in net.parameters()]
    net.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for x, y in batches[6:]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), end))


def test_where_the_correction_applies():
    def resolved(make, **kw):
        m = torch.nn.Linear(6, 2)
        return _wrapped(m, make(m.parameters()), density=0.1, **kw) \
            .communication_stats()["variance_correction"]

    class MyAdam(torch.optim.Adam):
        pass

    for make in (lambda p: torch.optim.Adam(p), lambda p: torch.optim.AdamW(p),
                 lambda p: torch.optim.NAdam(p), lambda p: torch.optim.RAdam(p),
                 lambda p: MyAdam(p)):
        assert resolved(make) is True  # the library's choice: their updates, corrected
        assert resolved(make, variance_correction=False) is False
        assert resolved(make, exchange="gradient") is False  # (the averaged gradient)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    assert resolved(sgd) is False  # no second moment
    assert resolved(lambda p: torch.optim.RMSprop(p)) is False  # (another update rule)
    assert resolved(lambda p: torch.optim.Adamax(p)) is False
    with pytest.raises(ValueError, match="Adam, AdamW, NAdam or RAdam"):
        resolved(sgd, variance_correction=True)
    with pytest.raises(ValueError, match="weight updates are exchanged"):
        resolved(lambda p: torch.optim.Adam(p), exchange="gradient", variance_correction=True)
    with pytest.raises(TypeError, match="variance_correction"):
        resolved(lambda p: torch.optim.Adam(p), variance_correction="yes")
