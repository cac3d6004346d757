"""Sharded-exchange scenarios (run by tests/test_sharded.py on 2-4 ranks): replicas stay bitwise
identical for every sparsifier, density 1.0 is the dense average, the unidirectional sharded
result equals the allgather one bit for bit, exact resume from per-rank state dicts, uneven
regions, a non-finite step, and the traffic per rank. Each rank writes OUTDIR/rank<r>.json."""
import copy
import os
import sys
import warnings

import torch
import torch.nn.functional as F

BACKEND = os.environ.get("HVD_SPARSE_TEST_BACKEND", "horovod")
if BACKEND == "mpi":
    sys.modules["horovod"] = None  # the mpi4py path never needs Horovod
    import hvd_sparse.mpi as hvd
else:
    import hvd_sparse as hvd

import scenario_runner as runner  # noqa: E402

torch.set_num_threads(1)
STEPS = int(os.environ.get("HVD_SPARSE_SHARDED_STEPS", "200"))


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.Tanh(), torch.nn.Linear(48, 5))


TEACHER = torch.randn(20, 5, generator=torch.Generator().manual_seed(99))


def batch(i):
    """Fresh inputs each step and rank, labelled by one fixed linear teacher (learnable)."""
    g = torch.Generator().manual_seed(i * 31 + hvd.rank())
    x = torch.randn(16, 20, generator=g)
    return x, (x @ TEACHER).argmax(1)


def make(m, **kw):
    kw.setdefault("density", 0.05)
    kw.setdefault("min_sparse_numel", 0)
    kw.setdefault("cost_model", "off")
    kw.setdefault("collective", "sharded")
    # the per-region rule, so that Top-K on this small model is sharded too (the default
    # global rule sends buckets this small by allgather: small_topk_gathered)
    kw.setdefault("sharded_selection", "region")
    kw.setdefault("exchange", "gradient")  # the residuals these scenarios follow are gradients'
    base = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(), **kw)


def train(m, opt, steps, start=0, poison_at=None):
    losses = []
    for i in range(start, start + steps):
        x, y = batch(i)
        if poison_at == i and hvd.rank() == hvd.size() - 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def same(obj):
    return runner.same_everywhere(hvd, obj)


METHODS = {"topk": {}, "gaussiank": {}, "sbc": {}, "adaptive": {"total_steps": 40},
           "threshold": {"threshold": 2e-3}, "randomk": {}}


def replicas(res):
    """Every sparsifier: bitwise-identical replicas (topk for STEPS steps), training moves."""
    for name, extra in METHODS.items():
        m = model()
        opt = make(m, sparsifier=name, **extra)
        steps = STEPS if name == "topk" else 30
        losses = train(m, opt, steps)
        view = opt.engine_state()
        res[f"replicas_{name}_equal"] = same(params(m))
        res[f"replicas_{name}_finite"] = bool(torch.isfinite(params(m)).all())
        res[f"replicas_{name}_loss_fell"] = sum(losses[-10:]) < sum(losses[:10])
        res[f"replicas_{name}_collective"] = sorted({v.collective for v in view.values()
                                                     if v.sparse})
        res[f"replicas_{name}_shards"] = [v.shard is not None and v.downlink is None
                                          for v in view.values() if v.sparse]


def dense_average(res):
    """density 1.0: p.grad after synchronize() is the average of the ranks' gradients."""
    m = model()
    opt = make(m, density=1.0)
    x, y = batch(0)
    # this rank's own gradient, by autograd.grad (no hooks fire): read from p.grad after
    # backward it raced the in-place allreduce the hooks had started (a loaded machine saw
    # it half averaged)
    local = [g.detach().clone() for g in torch.autograd.grad(
        F.cross_entropy(m(x), y), list(m.parameters()))]
    everyone = hvd.allgather_object(local)
    want = [sum(g[i] for g in everyone) / hvd.size() for i in range(len(local))]
    F.cross_entropy(m(x), y).backward()
    opt.synchronize()
    res["dense_average_maxdiff"] = max(float((p.grad - w).abs().max())
                                       for p, w in zip(m.parameters(), want))
    with opt.skip_synchronize():
        opt.step()


def unidirectional_equals_allgather(res):
    """Without a downlink selection an owner's region sum is the allgather's sum, same order:
    the two collectives give the same parameters bit for bit."""
    out = {}
    for collective in ("allgather", "sharded"):
        m = model()
        opt = make(m, bidirectional=False, collective=collective)
        train(m, opt, 25)
        out[collective] = params(m)
        res[f"unidirectional_{collective}_received"] = \
            opt.communication_stats()["totals"]["bytes_received"]
    res["unidirectional_equal"] = bool(torch.equal(out["allgather"], out["sharded"]))


def resume(res):
    """Each rank saves its own state dict; resuming from it continues exactly."""
    m = model()
    opt = make(m)
    train(m, opt, 12)
    saved_model = copy.deepcopy(m.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(m, opt, 8, start=12)
    want = params(m)
    m2 = model(seed=5)
    m2.load_state_dict(saved_model)
    opt2 = make(m2)
    opt2.load_state_dict(saved_opt)
    train(m2, opt2, 8, start=12)
    res["resume_exact"] = bool(torch.equal(want, params(m2)))
    res["resume_shards_saved"] = all(v["shard"] is not None for v in
                                     saved_opt["hvd_sparse"]["buckets"].values())


def uneven(res):
    """A bucket shorter than the rank count (some regions empty) and a gradient that lives
    in one region only."""
    torch.manual_seed(1)
    tiny = torch.nn.Parameter(torch.randn(max(1, hvd.size() - 1)))
    skew = torch.nn.Parameter(torch.zeros(1000))
    base = torch.optim.SGD([tiny, skew], lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=[("tiny", tiny), ("skew", skew)],
                                   density=0.5, min_sparse_numel=0, cost_model="off",
                                   collective="sharded", sharded_selection="region")
    for i in range(6):
        opt.zero_grad()
        g = torch.Generator().manual_seed(i + 10 * hvd.rank())
        tiny.grad = torch.randn(tiny.shape, generator=g)
        grad = torch.zeros(1000)
        grad[:40] = torch.randn(40, generator=g)  # all in the first region
        skew.grad = grad
        opt.step()
    res["uneven_equal"] = same([tiny.detach(), skew.detach()])
    res["uneven_moved"] = bool(skew.detach()[:40].abs().sum() > 0)
    res["uneven_rest_zero"] = bool((skew.detach()[40:] == 0).all())


def nonfinite(res):
    """A NaN on the last rank at step 3: every rank sees it (default policy hands NaN to
    p.grad; the SGD step then writes NaN, so train() with poison uses 'skip' here)."""
    m = model()
    opt = make(m, nonfinite="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(m, opt, 8, poison_at=3)
    stats = opt.communication_stats()
    res["nonfinite_steps"] = stats["nonfinite_steps"]
    res["nonfinite_skipped"] = stats["skipped_steps"]
    res["nonfinite_equal"] = same(params(m))
    res["nonfinite_finite"] = bool(torch.isfinite(params(m)).all())


def traffic(res):
    """Bytes per rank per step, sharded against allgather, same model and density."""
    for collective in ("allgather", "sharded"):
        m = model()
        opt = make(m, density=0.05, collective=collective)
        train(m, opt, 5)
        t = opt.communication_stats()["totals"]
        res[f"traffic_{collective}"] = {"received": t["bytes_received"] / 5,
                                        "sent": t["bytes_sent"] / 5,
                                        "selected": t["selected"] / 5,
                                        "downlink_selected": t.get("downlink_selected", 0) / 5}


def auto(res):
    """collective="auto": the time cost model picks a collective per bucket, the same on
    every rank; a bucket's downlink residual survives a switch either way unchanged."""
    m = model()
    opt = make(m, collective="auto", cost_model="time", calibration_steps=2)
    train(m, opt, 10)
    report = opt.communication_stats()["cost_model"]["buckets"]
    res["auto_choices"] = {k: v.get("collective") for k, v in report.items()}
    res["auto_same_choices"] = same(sorted(res["auto_choices"].items()))
    res["auto_equal"] = same(params(m))
    m = model()
    opt = make(m, collective="auto", cost_model="off")  # every bucket stays sparse
    train(m, opt, 4)
    engine = opt._hs_engine
    kept = []
    for b in engine.buckets:
        if not b.sparse:
            continue
        engine._set_collective(b, "allgather")
        full = engine.view()[b.name].downlink
        engine._set_collective(b, "sharded")
        region = engine.view()[b.name].shard
        engine._set_collective(b, "allgather")
        lo, hi = engine._region(b)
        kept.append(full is not None and (bool(full.any()) or b.numel < 100)
                    and torch.equal(full, engine.view()[b.name].downlink)
                    and torch.equal(full[lo:hi], region))
    res["auto_switch_keeps_residual"] = kept
    train(m, opt, 3, start=10)
    res["auto_equal_after_switch"] = same(params(m))


def selection_rules(res):
    """A gradient whose mass lies in the first region only (a bucket large enough for the
    global rule): the global rule spends the whole downlink budget there; the region rule
    caps it at the region's share."""
    n, hot = 2_000_000, 50_000
    for rule in ("global", "region"):
        skew = torch.nn.Parameter(torch.zeros(n))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([skew], lr=0.1),
                                       named_parameters=[("skew", skew)], density=0.01,
                                       min_sparse_numel=0, cost_model="off",
                                       collective="sharded", sharded_selection=rule)
        g = torch.Generator().manual_seed(7 + hvd.rank())
        grad = torch.zeros(n)
        grad[:hot] = torch.randn(hot, generator=g)
        skew.grad = grad
        opt.synchronize()
        got = torch.nonzero(skew.grad).squeeze(1)
        res[f"rule_{rule}_selected"] = got.numel()
        res[f"rule_{rule}_in_first_region"] = bool((got < n // hvd.size()).all())
        acc = torch.stack(hvd.allgather_object(grad)).mean(0)
        top = torch.topk(acc.abs(), int(0.01 * n)).indices
        res[f"rule_{rule}_overlap"] = float(torch.isin(top, got).float().mean())
        with opt.skip_synchronize():
            opt.step()
        res[f"rule_{rule}_equal"] = same(skew.detach())


def small_topk_gathered(res):
    """Under the default global rule, Top-K buckets too small for the histograms to pay go by
    allgather (exact global Top-K): the run equals collective="allgather" bit for bit."""
    out = {}
    for collective in ("allgather", "sharded"):
        m = model()
        opt = make(m, collective=collective, sharded_selection="global")
        train(m, opt, 15)
        out[collective] = params(m)
        res[f"small_{collective}_collectives"] = sorted(
            {v.collective for v in opt.engine_state().values() if v.sparse})
    res["small_gathered_equal"] = bool(torch.equal(out["allgather"], out["sharded"]))


def rebalance(res):
    """All the load in the first tenth of a bucket: after ``rebalance_every`` steps the bounds
    move there, the same on every rank; the parameters equal those of a run with fixed
    regions bit for bit (the residuals move with the bounds, nothing is lost); a resume from
    per-rank state dicts after the move is exact. Top-K under the global rule (sharded from
    3 ranks on, at this size) and the hard threshold (sharded at any rank count)."""
    n = 200_000

    def run(method, every, steps, state=None, save_at=None):
        w = torch.nn.Parameter(torch.zeros(n))
        extra = {"threshold": 1.5} if method == "threshold" else {}
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), named_parameters=[("w", w)],
                                       density=0.05, sparsifier=method, min_sparse_numel=0,
                                       cost_model="off", collective="sharded",
                                       rebalance_every=every, **extra)
        start, saved = 0, None
        if state is not None:
            start = state[0]
            with torch.no_grad():
                w.copy_(state[1])
            opt.load_state_dict(state[2])
        for i in range(start, steps):
            if i == save_at:
                saved = (i, w.detach().clone(), copy.deepcopy(opt.state_dict()))
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * i + hvd.rank())
            grad = torch.randn(n, generator=g) * 0.01
            grad[:n // 10] += torch.randn(n // 10, generator=g)
            w.grad = grad
            opt.step()
        view = next(iter(opt.engine_state().values()))
        return w.detach().clone(), view, saved

    for method in ("threshold", "topk"):
        moved, view, saved = run(method, 5, 12, save_at=8)
        fixed, fixed_view, _ = run(method, 0, 12)
        resumed, _, _ = run(method, 5, 12, state=saved)
        equal = sharded_bounds = None
        if view.collective == "sharded":
            from hvd_sparse.engine import sharded as shard_mod
            sharded_bounds = list(view.bounds)
            equal = list(shard_mod.region_bounds(n, hvd.size()))
        res[f"rebalance_{method}_collective"] = view.collective
        res[f"rebalance_{method}_bounds"] = sharded_bounds
        res[f"rebalance_{method}_equal_bounds"] = equal
        res[f"rebalance_{method}_fixed_bounds"] = None if fixed_view.bounds is None \
            else list(fixed_view.bounds)
        res[f"rebalance_{method}_same_bounds"] = same(sharded_bounds)
        res[f"rebalance_{method}_replicas"] = same(moved)
        res[f"rebalance_{method}_equals_fixed"] = bool(torch.equal(moved, fixed))
        res[f"rebalance_{method}_resume_exact"] = bool(torch.equal(moved, resumed))


def restored(saved, seed):
    """A fresh model and optimizer loaded from ``(model state, optimizer state)``, and the
    warnings the optimizer's load gave."""
    m = model(seed=seed)
    m.load_state_dict(saved[0])
    opt = make(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(saved[1])
    return m, opt, [str(w.message) for w in caught]


def rank0_checkpoint(res):
    """The usual Horovod resume, rank 0's file loaded everywhere: rank 0 restores its region
    residuals, the others start theirs from zero with a warning; replicas stay identical."""
    m = model()
    opt = make(m)
    train(m, opt, 6)
    saved = hvd.allgather_object((copy.deepcopy(m.state_dict()), opt.state_dict()))[0]
    m2, opt2, said = restored(saved, seed=3)
    res["rank0_ckpt_warned"] = any("cannot be re-sharded" in w for w in said)
    shards = [v.shard for v in opt2.engine_state().values() if v.sparse]
    mine = [v.shard for v in opt.engine_state().values() if v.sparse]
    res["rank0_ckpt_own_restored"] = all(a is not None and torch.equal(a, b)
                                         for a, b in zip(shards, mine))
    train(m2, opt2, 4, start=6)
    res["rank0_ckpt_equal"] = same(params(m2))


def consolidated_checkpoint(res):
    """Rank 0 alone saves, after consolidate_state_dict() on every rank: its state dict holds
    every owner's region (the whole downlink residual, no warning), resumes each rank exactly
    from its own, and loaded on every rank loses no region. Without consolidating, rank 0's
    state_dict() warns."""
    def saving(call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = call()
        return out, any(issubclass(w.category, hvd.ShardedStateWarning) for w in caught)

    m = model()
    opt = make(m)
    train(m, opt, 6)
    _, res["consolidated_partial_warned"] = saving(opt.state_dict)
    mine = {n: v.shard for n, v in opt.engine_state().items() if v.sparse}
    everyone = hvd.allgather_object(mine)
    want = {n: torch.cat([everyone[r][n] for r in range(hvd.size())]) for n in mine}
    opt.consolidate_state_dict()
    whole, res["consolidated_warned"] = saving(opt.state_dict)
    got = whole["hvd_sparse"]["buckets"]
    res["consolidated_whole"] = all(got[n]["shard"] is None and torch.equal(got[n]["downlink"], w)
                                    for n, w in want.items())
    res["consolidated_has_mass"] = any(bool(w.any()) for w in want.values())
    snapshot = copy.deepcopy((m.state_dict(), whole))
    train(m, opt, 4, start=6)
    straight = params(m)
    m2, opt2, _ = restored(snapshot, seed=3)
    train(m2, opt2, 4, start=6)
    res["consolidated_resume_exact"] = bool(torch.equal(params(m2), straight))
    first = hvd.allgather_object(snapshot)[0]  # rank 0's file, loaded everywhere
    m3, opt3, said = restored(first, seed=4)
    res["consolidated_load_dropped"] = any("re-sharded" in w for w in said)
    view = opt3.engine_state()
    res["consolidated_regions_kept"] = all(torch.equal(view[n].downlink, w)
                                           for n, w in want.items())
    train(m3, opt3, 4, start=6)
    res["consolidated_everywhere_equal"] = same(params(m3))


SCENARIOS = [replicas, dense_average, unidirectional_equals_allgather, resume, uneven, nonfinite,
             traffic, auto, selection_rules, small_topk_gathered, rebalance, rank0_checkpoint,
             consolidated_checkpoint]

if __name__ == "__main__":
    runner.run_scenarios(hvd, SCENARIOS)
