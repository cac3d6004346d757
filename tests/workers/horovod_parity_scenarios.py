"""What Horovod's own optimizer tests exercise, with hvd_sparse's optimizer and default options
(run by tests/test_horovod_parity.py): broadcast of optimizer state for every torch optimizer
(rank 0 loaded, the others fresh), hyper-parameters that differ per rank, frozen and integer
parameters, a parameter without a gradient on one rank, synchronize / skip_synchronize with
clipping, and the step-after-synchronize warning. Written here from the behaviour Horovod
documents; each rank writes OUTDIR/rank<r>.json."""
import copy
import warnings

import torch
import torch.nn.functional as F

import hvd_sparse as hvd

import scenario_runner as runner  # noqa: E402

torch.set_num_threads(1)


def optimizer_classes():
    skip = {"LBFGS", "SparseAdam", "Muon"}  # LBFGS: Horovod refuses it; the others need
    return sorted((c for c in torch.optim.Optimizer.__subclasses__()  # sparse or 2-D only
                   if c.__module__.startswith("torch.optim") and c.__name__ not in skip),
                  key=lambda c: c.__name__)


def options(cls, **wanted):
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in wanted.items() if k in accepted}


def net():
    return torch.nn.Sequential(torch.nn.Linear(100, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))


def train_step(m, opt):
    x, y = torch.randn(16, 100), torch.randn(16, 10)
    opt.zero_grad()
    F.mse_loss(m(x), y).backward()
    opt.step()


def same_everywhere(obj) -> bool:
    return runner.same_everywhere(hvd, obj)


def scenario_broadcast_state_every_optimizer(res):
    out = {}
    for cls in optimizer_classes():
        torch.manual_seed(hvd.rank())  # models differ by rank until the broadcast
        m = net()
        opt = hvd.DistributedOptimizer(cls(m.parameters(), **options(cls, lr=0.01, momentum=0.9)),
                                       named_parameters=m.named_parameters())
        train_step(m, opt)
        saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
        m2 = net()
        opt2 = hvd.DistributedOptimizer(cls(m2.parameters(), **options(cls, lr=0.01,
                                                                      momentum=0.9)),
                                        named_parameters=m2.named_parameters())
        if hvd.rank() == 0:
            m2.load_state_dict(saved["model"])
            opt2.load_state_dict(saved["opt"])
        expected = hvd.broadcast_object(len(opt2.state_dict()["state"]), root_rank=0)
        hvd.broadcast_parameters(m2.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt2, root_rank=0)
        sd = opt2.state_dict()
        sd.pop("hvd_sparse")
        types = {k: {n: type(v).__name__ for n, v in st.items()} for k, st in sd["state"].items()}
        out[cls.__name__] = {"count": len(sd["state"]), "expected": expected,
                             "equal": same_everywhere(sd), "types_equal": same_everywhere(types)}
        train_step(m2, opt2)  # and it trains on
        out[cls.__name__]["trains_equal"] = same_everywhere(list(m2.parameters()))
    res["broadcast_state"] = out


def scenario_broadcast_options(res):
    """Hyper-parameters that differ by rank become rank 0's, with their Python types."""
    rank0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999),
                 etas=(0.8, 2.4), step_sizes=(1e-5, 100))
    other = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9),
                 etas=(0.25, 1.75), step_sizes=(1e-7, 5))
    out = {}
    for cls in optimizer_classes():
        mine = options(cls, **(rank0 if hvd.rank() == 0 else other))
        m = net()
        try:
            base = cls(m.parameters(), **mine)
        except (ValueError, TypeError):
            continue  # a combination this optimizer refuses (as in Horovod's test)
        opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
        train_step(m, opt)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        want = options(cls, **rank0)
        got = {k: opt.param_groups[0][k] for k in want}
        out[cls.__name__] = {"values_equal": got == want,
                             "types_equal": {k: type(v).__name__ for k, v in got.items()} ==
                             {k: type(v).__name__ for k, v in want.items()}}
        train_step(m, opt)
    res["broadcast_options"] = out


def scenario_stateless_optimizer_options(res):
    """An optimizer without state (SGD without momentum) takes rank 0's hyper-parameters too,
    fresh or after a step, and the replicas then train alike. (Horovod's own broadcast stops
    before the options when there is no state to send.)"""
    out = {}
    for when in ("fresh", "after_a_step"):
        torch.manual_seed(0)
        m = net()
        lr, wd = (0.1, 0.0) if hvd.rank() == 0 else (0.3, 0.01)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=lr, weight_decay=wd),
                                       named_parameters=m.named_parameters())
        if when == "after_a_step":
            train_step(m, opt)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        got = (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])
        for _ in range(3):
            train_step(m, opt)
        out[when] = {"options": list(got), "stateless": len(opt.state) == 0,
                     "replicas_equal": same_everywhere([p.detach() for p in m.parameters()])}
    res["stateless_options"] = out


def scenario_elastic_sync_of_a_fresh_rank(res):
    """An elastic reset: rank 0 keeps the model and optimizer it trained, rank 1 holds what a
    new worker would (its own weights and learning rate, no optimizer state), then
    ``TorchState.sync()``. With
    weight decay, Horovod's own sync gave the fresh rank an initialising step on zero gradients
    after the weights were broadcast, which moved them; an optimizer without state kept the
    fresh rank's learning rate. Replicas must be equal after the sync and after training on."""
    out = {}
    for name, kw in (("momentum_and_decay", dict(momentum=0.9, weight_decay=0.1)),
                     ("without_state", {})):
        torch.manual_seed(0)
        m = net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, **kw),
                                       named_parameters=m.named_parameters())
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        for _ in range(2):
            train_step(m, opt)
        if hvd.rank() == 1:  # as a new worker: weights, learning rate and no state of its own
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(1.0)
            opt.state.clear()
            opt.param_groups[0]["lr"] = 0.5
        state = hvd.elastic.TorchState(model=m, optimizer=opt)
        state.sync()
        synced = same_everywhere([p.detach() for p in m.parameters()])
        lrs = hvd.allgather_object(opt.param_groups[0]["lr"])
        for _ in range(3):
            train_step(m, opt)
        out[name] = {"params_equal_after_sync": synced, "lr": lrs,
                     "replicas_equal": same_everywhere([p.detach() for p in m.parameters()])}
    res["elastic_fresh_rank"] = out


def scenario_frozen_and_integer_parameters(res):
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
    m.b = torch.nn.Parameter(torch.rand(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.001, weight_decay=1e-6,
                                                   momentum=0.9, nesterov=True),
                                   named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    res["no_grad_a_grad_is_none"] = opt.param_groups[0]["params"][0].grad is None
    res["no_grad_b_grad_equal"] = grad is not None and same_everywhere(grad)


def scenario_missing_gradient_on_one_rank(res):
    torch.manual_seed(0)
    fc1, fc2, fc3 = torch.nn.Linear(100, 10), torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
    params = [("fc1." + n, p) for n, p in fc1.named_parameters()] + \
        [("fc2." + n, p) for n, p in fc2.named_parameters()] + \
        [("fc3." + n, p) for n, p in fc3.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params)
    for _ in range(3):
        x, y = torch.randn(8, 100), torch.randn(8, 10)
        h = fc2(F.relu(fc1(x)))
        out = h if hvd.rank() == 0 else fc3(F.relu(h))  # fc3 has no gradient on rank 0
        opt.zero_grad()
        F.mse_loss(out, y).backward()
        opt.step()
    res["force_allreduce_equal"] = same_everywhere([p for _, p in params])


def scenario_synchronize_clip_and_warning(res):
    torch.manual_seed(0)
    m = torch.nn.Linear(1, 1)
    with torch.no_grad():
        m.weight.fill_(0.5)
        m.bias.fill_(0.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    x, y = torch.ones(1, 1), torch.ones(1, 1)
    opt.zero_grad()
    F.mse_loss(m(x), y).backward()
    opt.synchronize()
    prior = m.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    res["clip_reduced"] = abs(m.weight.grad.item()) < abs(prior)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    F.mse_loss(m(torch.zeros(1, 1)), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        opt.step()
    res["step_warnings"] = [str(w.message) for w in ws]


def scenario_gradients_written_through_data(res):
    """An fp32 master copy whose gradients are filled from a working model with
    ``m.grad.data.copy_(...)`` (apex's and fairseq's pattern): no backward hook fires on the
    masters and ``.data`` writes leave ``_version`` alone, yet every step is a new gradient,
    exchanged as Horovod's synchronize() exchanges every parameter every step."""
    out = {}
    for density in (1.0, 0.05):
        torch.manual_seed(0)
        work = net()
        master = [torch.nn.Parameter(p.detach().clone()) for p in work.parameters()]
        start = [p.detach().clone() for p in master]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(master, lr=0.1),
            named_parameters=[(f"master.{i}", p) for i, p in enumerate(master)],
            density=density, cost_model="off")
        torch.manual_seed(1 + hvd.rank())  # each rank its own batches
        for step in range(4):
            x, y = torch.randn(16, 100), torch.randn(16, 10)
            work.zero_grad()
            F.mse_loss(work(x), y).backward()
            for m, w in zip(master, work.parameters()):
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                m.grad.data.copy_(w.grad.data)
            opt.step()
            with torch.no_grad():
                for m, w in zip(master, work.parameters()):
                    w.copy_(m)
        out[str(density)] = {"same": same_everywhere(master),
                             "moved": any(not torch.equal(m, s0) for m, s0 in zip(master, start))}
    res["data_written_grads"] = out


def scenario_rank_skips_backward(res):
    """One rank has no batch at step 2: it skips backward but calls ``step()`` (to stay in
    step), with its gradients zeroed through ``.data`` (torch's own ``zero_grad`` before 1.7),
    not zeroed at all, or by ``zero_grad()``; and a master copy whose gradient is written as
    zeros on one rank. Horovod allreduces what each rank holds every step; a rank deciding
    alone that it had nothing new skipped the collective and the others waited or paired their
    next step with it. At density 1 the result is Horovod's, bit for bit."""
    import horovod.torch as real

    def run(kind, wrap):
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 32)
        opt = wrap(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters())
        torch.manual_seed(1 + hvd.rank())
        for step in range(4):
            x = torch.randn(4, 64)
            if kind == "data_zero":
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.data.zero_()
            elif kind == "zero_grad":
                opt.zero_grad()
            if kind == "master_zeros":
                for p in m.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.data.copy_(torch.zeros_like(p) if step == 0 or hvd.rank() == 0
                                      else torch.ones_like(p))
            elif not (step == 2 and hvd.rank() == 0):
                m(x).pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    out = {}
    for kind in ("data_zero", "none", "zero_grad", "master_zeros"):
        got = {}
        for density in (1.0, 0.05):
            params = run(kind, lambda o, n: hvd.DistributedOptimizer(
                o, named_parameters=n, density=density, cost_model="off"))
            got[str(density)] = {"same": same_everywhere(params)}
            if density == 1.0:
                ref = run(kind, lambda o, n: real.DistributedOptimizer(o, named_parameters=n))
                got["1.0"]["horovod"] = all(torch.equal(a, b) for a, b in zip(params, ref))
        out[kind] = got
    res["rank_skips_backward"] = out


def sparse_job(opt_cls, **kw):
    """A fresh model (seed 0) and its optimizer at density 0.05, the cost model off (every
    large bucket sparse); then each rank its own batches."""
    torch.manual_seed(0)
    m = net()
    opt = hvd.DistributedOptimizer(opt_cls(m.parameters(), lr=kw.pop("lr", 0.1)),
                                   named_parameters=m.named_parameters(), density=0.05,
                                   cost_model="off", **kw)
    torch.manual_seed(1 + hvd.rank())
    return m, opt


def scenario_frozen_after_wrapping(res):
    """A layer frozen after the optimizer was wrapped (fine-tuning's second stage), plain SGD:
    under Horovod its zero gradient leaves it where it is; error feedback's held mass must not
    move it either."""
    m, opt = sparse_job(torch.optim.SGD)
    train_step(m, opt)
    m[0].weight.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    trained = m[2].weight.detach().clone()
    for _ in range(5):
        train_step(m, opt)
    res["frozen_after_wrapping"] = {"still": torch.equal(m[0].weight, frozen),
                                    "others_moved": not torch.equal(m[2].weight, trained),
                                    "same": same_everywhere(list(m.parameters()))}


def scenario_join(res):
    """``hvd.join()`` on every rank after a step: refused with a clear error while a bucket
    goes sparse (Horovod's allgather cannot serve a joined rank: its background loop failed or
    hung), Horovod's own join where everything is allreduced."""
    import gc

    out = {}
    # at density 1 the byte cost model sends every bucket dense (allreduce)
    # in a dense warm-up every bucket is allreduced, but sparse after it: refused too (the
    # other ranks' allgathers failed when the warm-up ended)
    for key, density, cost_model, warm in (("0.05", 0.05, "off", 0), ("1.0", 1.0, "bytes", 0),
                                           ("0.05-dense-warmup", 0.05, "off", 4)):
        torch.manual_seed(0)
        m = net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(), density=density,
                                       cost_model=cost_model, dense_warmup_steps=warm)
        train_step(m, opt)
        try:
            out[key] = {"returned": hvd.join()}
        except RuntimeError as e:
            out[key] = {"error": str(e)}
        del m, opt
        gc.collect()
    # uneven data with a model of small tensors only (every bucket Horovod's allreduce): rank 0
    # takes three steps, the others none, then every rank joins. Horovod's own optimizer and
    # hvd_sparse's must end alike; hvd_sparse's first-exchange and calibration allgathers
    # crashed the job here
    import horovod.torch as horovod

    # (and a layer of 1,536 entries at density 1: every gradient sent whole, Horovod's
    # allreduce from the first step, where the cost model's calibration refused the join)
    for name, wrap, width in (
            ("horovod", horovod.DistributedOptimizer, 8),
            ("hvd_sparse", hvd.DistributedOptimizer, 8),
            ("horovod-wide", horovod.DistributedOptimizer, 96),
            ("hvd_sparse-wide", lambda o, **kw: hvd.DistributedOptimizer(o, density=1.0, **kw),
             96),
            # exchanged updates, one step on every rank first (the first exchange's agreement
            # is an allgather): the finiteness vote of each later step is an allreduce (an
            # allgather there stopped the job: Horovod's join serves allreduces only)
            ("hvd_sparse-update",
             lambda o, **kw: hvd.DistributedOptimizer(o, exchange="update", **kw), 8)):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
        opt = wrap(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
        torch.manual_seed(7 + hvd.rank())
        together = 1 if name.endswith("-update") else 0
        for _ in range(3 if hvd.rank() == 0 else together):
            opt.zero_grad()
            F.mse_loss(m(torch.randn(8, 16)), torch.randn(8, 4)).backward()
            opt.step()
        try:
            out[f"uneven-small-{name}"] = {"returned": hvd.join(),
                                           "params": [p.tolist() for p in m.parameters()]}
            if name.startswith("hvd_sparse"):  # the counters of the rank that stepped longest
                out[f"uneven-small-{name}"]["steps"] = opt.state_dict()["hvd_sparse"]["steps"]
            # and the next epoch, every rank stepping (a rank that had joined before its first
            # step made the all-dense pairing check alone there, and the job stalled)
            for _ in range(2):
                opt.zero_grad()
                F.mse_loss(m(torch.randn(8, 16)), torch.randn(8, 4)).backward()
                opt.step()
            out[f"uneven-small-{name}"]["then"] = [p.tolist() for p in m.parameters()]
        except RuntimeError as e:
            out[f"uneven-small-{name}"] = {"error": str(e)}
        del m, opt
        gc.collect()
    res["join"] = out


def scenario_reload_weights_with_updates(res):
    """Rank 0 reloads earlier weights into the model mid-run and broadcasts them (AdamW,
    updates exchanged): the next step starts from them on every rank, as under Horovod (the
    reload was taken for part of the update and mostly undone), and the replicas agree."""
    m, opt = sparse_job(torch.optim.AdamW, lr=0.01)
    for _ in range(3):
        train_step(m, opt)
    earlier = copy.deepcopy(m.state_dict())
    for _ in range(10):
        train_step(m, opt)
    flat = lambda tensors: torch.cat([t.detach().reshape(-1) for t in tensors])
    before = flat(m.parameters())
    if hvd.rank() == 0:
        m.load_state_dict(earlier)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    train_step(m, opt)
    now, start = flat(m.parameters()), flat(earlier.values())
    res["reload_with_updates"] = {
        "stands": float((now - start).norm()) < 0.5 * float((now - before).norm()),
        "same": same_everywhere(list(m.parameters()))}


def scenario_per_rank_update_state_resumed_with_gradients(res):
    """Updates exchanged (SGD with momentum, Adam: each rank's optimizer state its own), one
    state dict per rank saved, each resumed into an optimizer that exchanges gradients, dense
    (finishing at density=1.0) or sparse: the replicas stay identical (they drifted apart from
    the first step, the momentum or moments taken as they were on each rank)."""
    out = {}
    for cls, kw in ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adam, {})):
        for again in ({"density": 1.0}, {"exchange": "gradient"},
                      {"density": 1.0, "check_config": False}):
            torch.manual_seed(0)
            m = net()
            opt = hvd.DistributedOptimizer(cls(m.parameters(), lr=0.01, **kw),
                                           named_parameters=m.named_parameters(),
                                           density=0.05, cost_model="off")
            torch.manual_seed(1 + hvd.rank())
            for _ in range(3):
                train_step(m, opt)
            mine = copy.deepcopy(opt.state_dict())
            del opt  # (its hooks go with it)
            opt2 = hvd.DistributedOptimizer(cls(m.parameters(), lr=0.01, **kw),
                                            named_parameters=m.named_parameters(),
                                            cost_model="off", **{"density": 0.05, **again})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the update residuals are dropped, said)
                opt2.load_state_dict(mine)
            for _ in range(2):
                train_step(m, opt2)
            out[f"{cls.__name__}_{'_'.join(map(str, again.values()))}"] = \
                same_everywhere(list(m.parameters()))
    res["per_rank_update_state_resumed"] = out


SCENARIOS = [scenario_broadcast_state_every_optimizer, scenario_broadcast_options,
             scenario_stateless_optimizer_options, scenario_elastic_sync_of_a_fresh_rank,
             scenario_frozen_and_integer_parameters, scenario_missing_gradient_on_one_rank,
             scenario_synchronize_clip_and_warning, scenario_gradients_written_through_data,
             scenario_rank_skips_backward, scenario_frozen_after_wrapping, scenario_join,
             scenario_reload_weights_with_updates,
             scenario_per_rank_update_state_resumed_with_gradients]


if __name__ == "__main__":
    runner.run_scenarios(hvd, SCENARIOS)
