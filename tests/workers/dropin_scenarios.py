"""Drop-in scenarios (run by tests/test_dropin.py): the patterns a Horovod user already has -
resume from rank 0's checkpoint with broadcast_optimizer_state, GradScaler through an overflow,
non-finite gradients under every policy and sparsifier, sparse embeddings. Each rank writes
OUTDIR/rank<r>.json; a hang shows up as the launcher's timeout."""
import copy
import os
import sys
import time
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
from hvd_sparse.safety import NonFiniteGradientError  # noqa: E402

torch.set_num_threads(1)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def batch(i):
    g = torch.Generator().manual_seed(i * 31 + hvd.rank())
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def step(m, opt, i, poison=None):
    x, y = batch(i)
    if poison is not None:  # reaches the gradients during backward, before any exchange
        x[0, 0] = poison
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    return opt.step()


# the sharded exchange (which "auto" picks from 4 ranks on) for every bucket, when asked
SHARDED = {"collective": "sharded", "sharded_selection": "region"} \
    if os.environ.get("HVD_SPARSE_TEST_COLLECTIVE") == "sharded" else {}


def make(m, base=None, **kw):
    kw.setdefault("density", 0.1)
    kw.setdefault("min_sparse_numel", 0)
    kw.setdefault("cost_model", "off")
    if base is None:  # SGD's gradients (the path these scenarios follow), not its updates
        kw.setdefault("exchange", "gradient")
    for key, value in SHARDED.items():
        kw.setdefault(key, value)
    base = base or torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(), **kw)


def same_everywhere(obj) -> bool:
    return runner.same_everywhere(hvd, obj)


def params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def uplinks(opt):
    return [v.uplink for v in opt.engine_state().values() if v.sparse]


def downlinks(opt):
    return [v.downlink for v in opt.engine_state().values() if v.sparse]


def broadcast_state(opt, how):
    if how == "horovod":  # Horovod's own function, untouched
        import horovod.torch as real

        real.broadcast_optimizer_state(opt, root_rank=0)
    else:  # hvd_sparse's (Horovod-backed or mpi4py)
        hvd.broadcast_optimizer_state(opt, root_rank=0)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    # weight decay: Horovod's broadcast initialises the fresh ranks' state by a step on zero
    # gradients, which moves their weights (Horovod's own function keeps that: hvd_sparse's only)
    "sgd_decay": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}
DECAYING = ("sgd_decay", "adamw")


def scenario_resume_from_rank0(res):
    """Rank 0 loads a checkpoint, the others start fresh, then broadcast_optimizer_state."""
    hows = ["mpi"] if BACKEND == "mpi" else ["horovod", "hvd_sparse"]
    for how in hows:
        for oname, build in OPTIMIZERS.items():
            if how == "horovod" and oname in DECAYING:
                continue
            key = f"resume_{how}_{oname}"
            m = model()
            opt = make(m, build(m.parameters()), sparsifier="adaptive")
            for i in range(6):
                step(m, opt, i)
            res["collectives"] = sorted({v.collective for v in opt.engine_state().values()
                                         if v.sparse})
            if SHARDED:  # what the documentation asks before rank 0 alone saves
                opt.consolidate_state_dict()
            ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
            saved = ckpt["opt"]["hvd_sparse"]
            m2 = model(seed=100 + hvd.rank())  # the fresh ranks differ until the broadcast
            opt2 = make(m2, build(m2.parameters()), sparsifier="adaptive")
            if hvd.rank() == 0:
                m2.load_state_dict(ckpt["model"])
                opt2.load_state_dict(ckpt["opt"])
            hvd.broadcast_parameters(m2.state_dict(), root_rank=0)
            broadcast_state(opt2, how)
            res[f"{key}_params_equal_at_once"] = same_everywhere(params(m2))
            base = opt2.state_dict()
            base.pop("hvd_sparse")
            res[f"{key}_base_state_equal"] = same_everywhere(base)
            res[f"{key}_base_state_nonempty"] = len(base["state"]) > 0
            step(m2, opt2, 6)
            sd = opt2.state_dict()["hvd_sparse"]
            res[f"{key}_steps"] = [saved["steps"], sd["steps"]]
            res[f"{key}_params_equal"] = same_everywhere(params(m2))
            res[f"{key}_downlink_equal"] = same_everywhere(downlinks(opt2))
            res[f"{key}_sparsifier_equal"] = same_everywhere(sd["sparsifier"])
            res[f"{key}_sparsifier_kept"] = sd["sparsifier"]["buckets"]["0.weight"]["steps"] == \
                saved["sparsifier"]["buckets"]["0.weight"]["steps"] + 1
            for i in range(7, 10):
                step(m2, opt2, i)
            res[f"{key}_then_equal"] = same_everywhere(params(m2))


def scenario_fresh_state_broadcast(res):
    """broadcast_optimizer_state on a fresh AdamW (weight decay): Horovod's creates the state
    by one step on zero gradients (step count 1, zero moments), and the front ends without
    Horovod left it empty, so their runs drifted from Horovod's from the second step (a peer's
    probe); the weights stay where they were broadcast."""
    m = model()
    opt = make(m, torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1))
    before = params(m).clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    st = opt.state[next(m.parameters())]
    res["fresh_state"] = [float(st["step"]), float(st["exp_avg"].abs().sum())] if st else None
    res["fresh_params_kept"] = bool(torch.equal(params(m), before))


def scenario_broadcast_mid_run(res):
    """hvd_sparse's broadcast_optimizer_state in the middle of a run: rank 0 reloads an old
    state, every rank calls the broadcast, replicas are equal again."""
    if BACKEND != "mpi":
        import horovod.torch as real
    m = model()
    opt = make(m)
    for i in range(4):
        step(m, opt, i)
    old = copy.deepcopy(opt.state_dict())
    old_model = copy.deepcopy(m.state_dict())
    for i in range(4, 8):
        step(m, opt, i)
    if hvd.rank() == 0:
        opt.load_state_dict(old)
        m.load_state_dict(old_model)
    (real if BACKEND != "mpi" else hvd).broadcast_parameters(m.state_dict(), root_rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    # the state dict a broadcast reads is not a checkpoint: no advice to consolidate
    res["midrun_broadcast_warned"] = any(issubclass(w.category, hvd.ShardedStateWarning)
                                         for w in caught)
    step(m, opt, 8)
    res["midrun_steps"] = opt.state_dict()["hvd_sparse"]["steps"]
    res["midrun_params_equal"] = same_everywhere(params(m))
    res["midrun_downlink_equal"] = same_everywhere(downlinks(opt))


def scenario_gradscaler(res):
    """torch.amp.GradScaler through an overflow on one rank, with the default policy and
    Horovod's AMP pattern (synchronize, unscale_, skip_synchronize)."""
    m = model()
    amp_run(res, "amp", make(m), m)  # default nonfinite
    m = model()
    amp_run(res, "amp_update",
            make(m, torch.optim.AdamW(m.parameters(), lr=1e-2), exchange="update"), m)
    # a fused optimizer: the scaler calls step() with found_inf set, so the step must be a
    # no-op on every rank (no local step, no exchange of the residuals either)
    m = model()
    amp_run(res, "amp_update_fused",
            make(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                 exchange="update"), m)
    # and under torch's recipe, where the fused step unscales inside (the scale handed to it):
    # the full batch's second moment is estimated from the unscaled gradients
    m = model()
    amp_run(res, "amp_update_fused_torch",
            make(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                 exchange="update"), m, recipe="torch")
    # torch's own recipes, no synchronize() first: the scaler's unscale finishes the exchange
    m = model()
    amp_run(res, "amp_torch", make(m), m, recipe="torch")
    m = model()
    amp_run(res, "amp_torch_clip", make(m), m, recipe="torch_clip")
    m = model()
    amp_run(res, "amp_horovod_clip", make(m), m, recipe="horovod_clip")
    # a fused optimizer with gradients exchanged: the scaler's Inf check (it does not unscale
    # but hands the scale and found_inf to the step) reads the exchanged gradient too
    m = model()
    amp_run(res, "amp_torch_fused",
            make(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                 exchange="gradient"), m, recipe="torch")
    # SGD with momentum under the library's choice (its updates), both recipes
    for prefix, recipe in (("amp_sgd_updates", "horovod"), ("amp_sgd_updates_torch", "torch")):
        m = model()
        opt = make(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        res[f"{prefix}_exchange"] = opt.communication_stats()["exchange"]
        amp_run(res, prefix, opt, m, recipe=recipe)


def scenario_bfloat16_broadcasts(res):
    """A bfloat16 model through the start-of-training broadcasts (Horovod's own refuses
    bfloat16 tensors): parameters and momentum buffers become rank 0's on every rank."""
    m = model().to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(hvd.rank())  # each rank starts elsewhere
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    res["bf16_params_equal"] = same_everywhere(params(m).float())
    opt = make(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))

    def bf16_step(i):
        x, y = batch(i)
        opt.zero_grad()
        F.cross_entropy(m(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()

    for i in range(2):
        bf16_step(i)
    with torch.no_grad():
        for st in opt.state.values():
            st["momentum_buffer"].mul_(1 + hvd.rank())  # the ranks' momenta differ
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    res["bf16_momentum_equal"] = same_everywhere(torch.cat(
        [st["momentum_buffer"].float().reshape(-1) for st in opt.state.values()]))
    res["bf16_momentum_dtype"] = sorted({str(st["momentum_buffer"].dtype)
                                         for st in opt.state.values()})
    bf16_step(2)
    res["bf16_then_equal"] = same_everywhere(params(m).float())


def scenario_update_nonfinite(res):
    """Exchanged updates (Adam), an Inf on rank 1 at step 2, under "skip" and "propagate",
    in a plain loop (backward, step) and with synchronize() first: no rank steps or
    exchanges then (weights, Adam's step count and the exchange counter stand still on every
    rank), and training goes on with identical replicas."""
    for policy in ("skip", "propagate"):
        for recipe in ("plain", "synchronize"):
            m = model()
            opt = make(m, torch.optim.Adam(m.parameters(), lr=1e-2), exchange="update",
                       nonfinite=policy)
            key = f"upd_nf_{policy}_{recipe}"
            moved, counts = [], []
            for i in range(5):
                x, y = batch(i)
                if i == 2 and hvd.rank() == 1:
                    x[0, 0] = float("inf")
                before = params(m).clone()
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if recipe == "synchronize":
                        opt.synchronize()
                        with opt.skip_synchronize():
                            opt.step()
                    else:
                        opt.step()
                moved.append(not torch.equal(before, params(m)))
                counts.append(max(float(s["step"]) for s in opt.state.values()))
            res[f"{key}_moved"] = moved
            res[f"{key}_adam_steps"] = counts
            res[f"{key}_exchanges"] = opt.state_dict()["hvd_sparse"]["steps"]
            res[f"{key}_equal"] = same_everywhere(params(m))
            res[f"{key}_finite"] = bool(torch.isfinite(params(m)).all())


def amp_run(res, prefix, opt, m, recipe="horovod"):
    """``recipe``: Horovod's AMP pattern (synchronize, unscale_, skip_synchronize), with
    clipping after the unscale (``horovod_clip``), or torch's own: ``scaler.step`` alone
    (``torch``), or ``scaler.unscale_``, clipping, ``scaler.step`` (``torch_clip``)."""
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    scales, nonfinite_grads, stepped = [], [], []
    for i in range(8):
        x, y = batch(i)
        if i == 3 and hvd.rank() == 1:
            x[0, 0] = float("inf")
        before = params(m).clone()
        ups = [u.clone() for u in uplinks(opt) if u is not None]
        downs = [d.clone() for d in downlinks(opt) if d is not None]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        if recipe.startswith("horovod"):
            opt.synchronize()
            nonfinite_grads.append(any(not bool(torch.isfinite(p.grad).all())
                                       for p in m.parameters()))
            scaler.unscale_(opt)
            if recipe.endswith("_clip"):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            if recipe.endswith("_clip"):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                scaler.step(opt)
            res.setdefault(f"{prefix}_warnings", []).extend(str(w.message) for w in seen)
            nonfinite_grads.append(any(not bool(torch.isfinite(p.grad).all())
                                       for p in m.parameters()))
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(not torch.equal(before, params(m)))
        if i == 3:
            res[f"{prefix}_uplink_untouched"] = all(
                torch.equal(a, b) for a, b in zip(ups, [u for u in uplinks(opt) if u is not None]))
            res[f"{prefix}_downlink_untouched"] = all(
                torch.equal(a, b) for a, b in zip(downs, [d for d in downlinks(opt)
                                                          if d is not None]))
            res[f"{prefix}_residuals_finite"] = all(
                bool(torch.isfinite(u).all()) for u in uplinks(opt) + downlinks(opt)
                if u is not None)
    res[f"{prefix}_scales"] = scales
    res[f"{prefix}_nonfinite_grads"] = nonfinite_grads
    res[f"{prefix}_stepped"] = stepped
    res[f"{prefix}_params_equal"] = same_everywhere(params(m))
    res[f"{prefix}_params_finite"] = bool(torch.isfinite(params(m)).all())
    res[f"{prefix}_params"] = params(m).tolist()
    res[f"{prefix}_stats_nonfinite"] = opt.communication_stats()["nonfinite_steps"]


def scenario_nonfinite_policies(res):
    """NaN on rank 1 at step 3 under each policy and several sparsifiers: the same outcome on
    every rank, residuals and sparsifier state as before the step, training goes on."""
    cases = {
        "adaptive_skip": dict(sparsifier="adaptive", nonfinite="skip", cost_model="bytes"),
        "sbc_skip": dict(sparsifier="sbc", nonfinite="skip"),
        "sbc_raise": dict(sparsifier="sbc", nonfinite="raise"),
        "gaussiank_propagate": dict(sparsifier="gaussiank"),
        "momentum_propagate": dict(momentum_correction=0.9),
    }
    for name, kw in cases.items():
        m = model()
        base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0 if "momentum" in name
                               else 0.9)
        opt = make(m, base, **kw)
        for i in range(3):
            step(m, opt, i)
        ups = [u.clone() if u is not None else None for u in uplinks(opt)]
        sp = copy.deepcopy(opt.state_dict()["hvd_sparse"]["sparsifier"])
        try:
            step(m, opt, 3, poison=float("nan") if hvd.rank() == 1 else None)
            res[f"nf_{name}_error"] = None
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            res[f"nf_{name}_error"] = f"{type(e).__name__}: {e}"
        res[f"nf_{name}_uplink_rolled_back"] = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(ups, uplinks(opt)))
        res[f"nf_{name}_sparsifier_rolled_back"] = \
            opt.state_dict()["hvd_sparse"]["sparsifier"] == sp
        for i in range(4, 9):
            step(m, opt, i)
        res[f"nf_{name}_then_equal"] = same_everywhere(params(m)) and \
            same_everywhere(opt.state_dict()["hvd_sparse"]["sparsifier"])
        res[f"nf_{name}_finite"] = bool(torch.isfinite(params(m)).all())


def scenario_dense_bucket_skip(res):
    """A bucket the cost model sent dense after sparse steps flushes its residual; a NaN that
    step must give the residual back (skip), on every rank."""
    m = model()
    opt = make(m, nonfinite="skip", cost_model="time", calibration_steps=1000)
    for i in range(4):
        step(m, opt, i)
    sd = opt.state_dict()
    for entry in sd["hvd_sparse"]["buckets"].values():
        entry["mode"] = "dense"
    opt.load_state_dict(sd)  # as if the cost model had chosen dense
    ups = [u.clone() for u in uplinks(opt)]
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore")
        step(m, opt, 4, poison=float("nan") if hvd.rank() == 1 else None)
    res["dense_skip_uplink_kept"] = all(u is not None and torch.equal(a, u)
                                        for a, u in zip(ups, uplinks(opt)))
    step(m, opt, 5)
    res["dense_skip_flushed_after"] = all(u is None for u in uplinks(opt))
    res["dense_skip_equal"] = same_everywhere(params(m))


def scenario_local_steps_nan(res):
    """Communication delay with a NaN local step on one rank: never applied, weights recover."""
    m = model()
    opt = make(m, local_steps=2, nonfinite="skip")
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    for i in range(8):
        step(m, opt, i, poison=float("nan") if (i == 3 and hvd.rank() == 1) else None)
    res["local_nan_finite"] = bool(torch.isfinite(params(m)).all())
    res["local_nan_equal"] = same_everywhere(params(m))
    # under "raise", beside dense buckets (the biases, below min_sparse_numel): the flag went
    # as a sparse payload where the others started a dense collective (a Horovod type
    # mismatch at 3 ranks), and after the error each rank kept its own local steps, which the
    # next round took for an outside change (replicas parted for good)
    m = model()
    opt = make(m, local_steps=3, nonfinite="raise", min_sparse_numel=100)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    raised = []
    for i in range(9):
        try:
            step(m, opt, i, poison=float("nan") if (i == 3 and hvd.rank() == 1) else None)
        except NonFiniteGradientError:
            raised.append(i)
        if i == 5:  # just after the refused exchange: back at the last exchange's weights
            res["local_nan_raise_restored"] = same_everywhere(params(m))
    res["local_nan_raise_steps"] = raised
    res["local_nan_raise_finite"] = bool(torch.isfinite(params(m)).all())
    res["local_nan_raise_equal"] = same_everywhere(params(m))


class EmbedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, idx, poison=None):
        e = self.emb(idx).mean(1)
        if poison is not None:
            e = e * poison
        return self.out(e)


def scenario_sparse_embedding(res):
    """Sparse-gradient parameters: alone and in a bucket with dense ones (scope="model"),
    with a NaN on one rank under each policy."""
    for scope in ("tensor", "model"):
        for policy in ("propagate", "skip", "raise"):
            key = f"emb_{scope}_{policy}"
            net = EmbedNet()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                           named_parameters=net.named_parameters(),
                                           density=0.2, min_sparse_numel=0, scope=scope,
                                           cost_model="off", nonfinite=policy)
            errors = []
            for i in range(6):
                g = torch.Generator().manual_seed(i * 7 + hvd.rank())
                idx = torch.randint(0, 50, (4, 3), generator=g)
                y = torch.randint(0, 4, (4,), generator=g)
                poison = float("nan") if (i == 2 and hvd.rank() == 1) else None
                opt.zero_grad()
                F.cross_entropy(net(idx, poison), y).backward()
                try:
                    with __import__("warnings").catch_warnings():
                        __import__("warnings").simplefilter("ignore")
                        opt.step()
                except Exception as e:  # noqa: BLE001
                    errors.append(type(e).__name__)
            res[f"{key}_errors"] = errors
            if policy == "propagate":  # NaN reached the weights, as with dense Horovod
                res[f"{key}_finite_flags"] = hvd.allgather_object(
                    bool(torch.isfinite(params(net)).all()))
            else:
                res[f"{key}_finite"] = bool(torch.isfinite(params(net)).all())
                res[f"{key}_equal"] = same_everywhere(params(net))


def scenario_sparse_embedding_unused_on_one_rank(res):
    """A sparse embedding that one rank leaves out of some steps (a dynamic graph): its
    gradient, missing there, came back dense on that rank and sparse on the others, and
    Adagrad (sparse-aware) stepped the replicas apart; SparseAdam refused the dense one."""
    for oname, density in (("adagrad", 1.0), ("adagrad", 0.2), ("sgd", 0.2)):
        key = f"emb_unused_{oname}_{density}"
        net = EmbedNet()
        base = torch.optim.Adagrad(net.parameters(), lr=0.1) if oname == "adagrad" else \
            torch.optim.SGD(net.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(base, named_parameters=net.named_parameters(),
                                       density=density, min_sparse_numel=0, cost_model="off",
                                       exchange="gradient")
        layouts = []
        for i in range(6):
            g = torch.Generator().manual_seed(i * 7 + hvd.rank())
            idx = torch.randint(0, 50, (4, 3), generator=g)
            y = torch.randint(0, 4, (4,), generator=g)
            opt.zero_grad()
            if hvd.rank() == 1 and i % 2:  # the embedding left out on this rank
                out = net.out(torch.zeros(4, 8))
            else:
                out = net(idx)
            F.cross_entropy(out, y).backward()
            opt.synchronize()
            layouts.append(bool(net.emb.weight.grad.is_sparse))
            with opt.skip_synchronize():
                opt.step()
        res[f"{key}_layouts_equal"] = same_everywhere(layouts)
        res[f"{key}_sparse"] = layouts
        res[f"{key}_equal"] = same_everywhere(params(net))
    # SparseAdam, whose updates are exchanged: the rank that left the embedding out was
    # handed dense zeros to step on, which SparseAdam refuses
    net = EmbedNet()
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(net.emb.parameters()), lr=0.01),
                                   named_parameters=net.emb.named_parameters(), density=0.2,
                                   min_sparse_numel=0, cost_model="off")
    errors = []
    for i in range(6):
        g = torch.Generator().manual_seed(i * 7 + hvd.rank())
        idx = torch.randint(0, 50, (4, 3), generator=g)
        opt.zero_grad()
        out = net.out(torch.zeros(4, 8)) if hvd.rank() == 1 and i % 2 else net(idx)
        out.sum().backward()
        try:
            opt.step()
        except RuntimeError as e:
            errors.append(str(e)[:80])
    res["emb_unused_sparseadam_errors"] = errors
    res["emb_unused_sparseadam_equal"] = same_everywhere(net.emb.weight.detach())


def horovod_step(m, base, i):
    """Horovod's step at batch ``i``: ``base`` on the gradient averaged over the ranks."""
    x, y = batch(i)
    base.zero_grad()
    F.cross_entropy(m(x), y).backward()
    for j, p in enumerate(m.parameters()):
        p.grad = hvd.allreduce(p.grad, name=f"twin.{j}")
    base.step()


def horovods_step_apart(m, opt, make_base, i):
    """Step ``opt`` at batch ``i`` beside a twin of ``m`` stepped as Horovod would (the wrapped
    optimizer's class, ``opt``'s state, on the allreduced gradient): the largest difference."""
    twin = copy.deepcopy(m)
    twin_opt = make_base(twin.parameters())
    sd = copy.deepcopy(opt.state_dict())
    sd.pop("hvd_sparse")
    twin_opt.load_state_dict(sd)
    step(m, opt, i)
    horovod_step(twin, twin_opt, i)
    return max(float((a - b).detach().abs().max())
               for a, b in zip(m.parameters(), twin.parameters()))


def scenario_sgd_momentum_all_dense_keeps_its_updates(res):
    """SGD with momentum: exchange="auto" exchanges its updates, each rank's velocity its own;
    when every bucket goes dense it keeps them (no switch to Horovod's step: the averaged
    updates are that step up to rounding, SGD being linear), so the choice stays the same on
    every rank whatever each one loaded or when it joined. The step then matches a Horovod
    SGD run from the same start to rounding. Pricing forced as below."""
    from hvd_sparse import costmodel
    real_price = costmodel.dense_time
    costmodel.dense_time = lambda *a, **k: 0.0
    try:
        m = model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=m.named_parameters(), density=0.1, min_sparse_numel=0,
            cost_model="time", calibration_steps=2)
        kinds, modes = [], []
        twin = twin_opt = None
        for i in range(7):
            if i == 3:  # every bucket dense by now: Horovod's run from here, on the mean of
                # the ranks' velocities (what theirs average to) and the same weights
                twin = copy.deepcopy(m)
                twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9,
                                           nesterov=True)
                sd = copy.deepcopy(opt.state_dict())
                sd.pop("hvd_sparse")
                twin_opt.load_state_dict(sd)
                for j, p in enumerate(twin.parameters()):
                    buf = twin_opt.state[p]["momentum_buffer"]
                    buf.copy_(hvd.allreduce(buf, name=f"sgd.velocity.{j}"))
            step(m, opt, i)
            kinds.append(opt.communication_stats()["exchange"])
            modes.append(sorted({v.mode for v in opt.engine_state().values() if v.sparse}))
            if twin is not None:
                horovod_step(twin, twin_opt, i)
        res["sgd_dense_kinds"] = kinds
        res["sgd_dense_modes"] = modes
        res["sgd_dense_params_equal"] = same_everywhere(params(m))
        res["sgd_dense_twin_apart"] = max(float((a - b).detach().abs().max())
                                          for a, b in zip(m.parameters(), twin.parameters()))
    finally:
        costmodel.dense_time = real_price


def scenario_adam_all_dense_takes_horovods_step(res):
    """exchange="auto" picks updates for Adam; when the time cost model then sends every
    bucket dense (a fast link), each rank's own Adam step, averaged, trained worse than
    Horovod's step on the averaged gradient (a peer's probe). From that calibration on,
    gradients are exchanged, the Adam state averaged first so that it is the same everywhere.
    The pricing is forced here (every dense exchange priced free), so the choice does not
    depend on this machine's timings."""
    from hvd_sparse import costmodel

    real = costmodel.dense_time
    costmodel.dense_time = lambda *a, **k: 0.0
    try:
        m = model()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                       named_parameters=m.named_parameters(), density=0.1,
                                       min_sparse_numel=0, cost_model="time",
                                       calibration_steps=2)
        kinds = []
        for i in range(5):
            step(m, opt, i)
            kinds.append(opt.communication_stats()["exchange"])
        res["adam_dense_kinds"] = kinds
        states = [t for p in m.parameters() for _, t in sorted(opt.state[p].items())
                  if torch.is_tensor(t)]
        res["adam_dense_state_equal"] = same_everywhere(states)
        res["adam_dense_params_equal"] = same_everywhere(params(m))
        # the next step is Adam on the averaged gradient, as under Horovod
        res["adam_dense_horovods_step"] = horovods_step_apart(
            m, opt, lambda ps: torch.optim.Adam(ps, lr=0.01), 5)
        res["adam_dense_then_equal"] = same_everywhere(params(m))
        # a layer frozen before the switch stays where it was (the release of what error
        # feedback held moved it), and a later calibration that finds the link slow keeps
        # Horovod's step (it sent Adam sparse gradients)
        m = model()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                       named_parameters=m.named_parameters(), density=0.1,
                                       min_sparse_numel=0, cost_model="time",
                                       calibration_steps=2, recalibrate_every=2)
        step(m, opt, 0)
        m[0].weight.requires_grad_(False)
        frozen = m[0].weight.detach().clone()
        for i in (1, 2):  # (after the switch Adam's momentum moves it, as under Horovod)
            step(m, opt, i)
            if opt.communication_stats()["exchange"] == "gradient":
                break
        res["adam_dense_frozen_kept"] = bool(torch.equal(m[0].weight.detach(), frozen))
        costmodel.dense_time = lambda *a, **k: 1e3  # the link got slow
        for i in range(3, 9):
            step(m, opt, i)
        stats = opt.communication_stats()
        res["adam_dense_after_recalibration"] = [
            stats["exchange"], sorted({v["mode"] for v in stats["cost_model"]["buckets"].values()})]
    finally:
        costmodel.dense_time = real


def scenario_adam_switch_resumed_on_rank0(res):
    """Horovod's resume recipe after Adam's switch to Horovod's step: rank 0 alone loads a
    checkpoint saved after the switch, the other ranks start fresh (exchanging updates, the
    library's choice), then broadcast_optimizer_state. The switch is replicated state: every
    rank takes rank 0's (it was a rank's own, and the fresh ranks' updates met rank 0's
    gradients in a configuration mismatch). The reverse too: rank 0 loads a state saved before
    any switch while the others had switched. Pricing forced (dense free), as above."""
    from hvd_sparse import costmodel

    real = costmodel.dense_time
    hows = ["mpi"] if BACKEND == "mpi" else ["horovod", "hvd_sparse"]
    try:
        for how in hows:
            for case in ("switched", "unswitched"):
                if how == "horovod" and case == "unswitched":
                    continue  # (a broadcast mid-run needs hvd_sparse's: Horovod's own tells
                    # the engine nothing, and the others' agreement is not due)
                key = f"switch_resume_{how}_{case}"
                costmodel.dense_time = lambda *a, **k: 0.0
                m = model()
                opt = hvd.DistributedOptimizer(
                    torch.optim.Adam(m.parameters(), lr=0.01),
                    named_parameters=m.named_parameters(), density=0.1, min_sparse_numel=0,
                    cost_model="time", calibration_steps=2)
                if case == "unswitched":  # saved before the calibration
                    step(m, opt, 0)
                    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
                for i in range(1, 5):
                    step(m, opt, i)
                if case == "switched":
                    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
                    m2 = model(seed=100 + hvd.rank())
                    opt2 = hvd.DistributedOptimizer(
                        torch.optim.Adam(m2.parameters(), lr=0.01),
                        named_parameters=m2.named_parameters(), density=0.1,
                        min_sparse_numel=0, cost_model="time", calibration_steps=2)
                else:  # the others go on from where they are: switched
                    m2, opt2 = m, opt
                before = opt2.communication_stats()["exchange"]
                costmodel.dense_time = lambda *a, **k: 1e3  # from now on a slow link: only
                # the switch (dense_only) keeps Horovod's step
                if hvd.rank() == 0:
                    m2.load_state_dict(ckpt["model"])
                    opt2.load_state_dict(ckpt["opt"])
                hvd.broadcast_parameters(m2.state_dict(), root_rank=0)
                broadcast_state(opt2, how)
                kinds, error = [before], None
                try:
                    for i in range(5, 9):
                        step(m2, opt2, i)
                        kinds.append(opt2.communication_stats()["exchange"])
                except Exception as exc:  # noqa: BLE001 - the type is what is checked
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
                res[f"{key}_error"] = error
                res[f"{key}_kinds"] = kinds
                if error is None:
                    res[f"{key}_params_equal"] = same_everywhere(params(m2))
                    if case == "switched":  # Horovod's step, as rank 0's was, on its state
                        base = opt2.state_dict()
                        base.pop("hvd_sparse")
                        res[f"{key}_state_equal"] = same_everywhere(base)
                        res[f"{key}_horovods_step"] = horovods_step_apart(
                            m2, opt2, lambda ps: torch.optim.Adam(ps, lr=0.01), 9)
    finally:
        costmodel.dense_time = real


def scenario_switchable_beside_explicit_updates(res):
    """Rank 0 lets the library choose Adam's exchange (updates, with the all-dense switch
    agreed as replicated state), the others name exchange="update": a configuration
    mismatch, said on every rank at the first exchange, also under Horovod's AMP pattern,
    whose synchronize() comes first (the explicit ranks' Inf vote met the others'
    agreement there, and the job hung)."""
    m = model()
    kw = {} if hvd.rank() == 0 else {"exchange": "update"}
    opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                   named_parameters=m.named_parameters(), density=0.1,
                                   min_sparse_numel=0, cost_model="off", **kw)
    error = None
    try:
        x, y = batch(0)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        error = type(exc).__name__
    res["switchable_beside_explicit_error"] = error


def scenario_update_exchange(res):
    """exchange="update" with AdamW: replicas stay bitwise identical, optimizer state per rank."""
    m = model()
    opt = make(m, torch.optim.AdamW(m.parameters(), lr=1e-2), exchange="update")
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    for i in range(12):
        step(m, opt, i)
    res["update_params_equal"] = same_everywhere(params(m))
    res["update_moved"] = float((params(m) - params(model())).abs().max())
    state = opt.state_dict()["state"][0]["exp_avg"]
    res["update_adam_state_per_rank"] = not same_everywhere(state)
    # the full batch's second moment (the default for AdamW's updates): each rank's state
    # saved and loaded by itself resumes bit for bit, replicas stay identical, and the steps
    # differ from AdamW's on each rank's own second moment
    res["update_variance_correction"] = opt.communication_stats()["variance_correction"]
    ends = {}
    for corrected in (True, False):
        m = model()
        opt = make(m, torch.optim.AdamW(m.parameters(), lr=1e-2), exchange="update",
                   variance_correction=corrected)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        for i in range(6):
            step(m, opt, i)
        saved = copy.deepcopy((m.state_dict(), opt.state_dict()))
        for i in range(6, 10):
            step(m, opt, i)
        ends[corrected] = params(m)
        if corrected:
            m.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            for i in range(6, 10):
                step(m, opt, i)
            res["update_corrected_resume_exact"] = bool(torch.equal(params(m), ends[True]))
            res["update_corrected_equal"] = same_everywhere(params(m))
            res["update_corrected_counts"] = sorted(
                saved[1]["hvd_sparse"]["variance"]["count"].values())
    res["update_corrected_differs"] = float((ends[True] - ends[False]).abs().max())


def scenario_gradient_hooks_after_wrapping(res):
    """A per-parameter gradient hook registered after wrapping (a clip, a layout change of
    ``p.grad``) is part of what is exchanged, as under Horovod, whose hook runs after every
    post-accumulate-grad hook: the result equals the same hook registered before wrapping,
    bit for bit, on every rank. Ours used to run first: a sparse bucket read the gradient
    unclipped, and a dense one was allreduced in place while the hook still wrote to it."""
    def clip(p):
        p.grad.clamp_(-0.02, 0.02)

    def relayout(p):  # the same values in column-major storage
        if p.grad.dim() == 2:
            p.grad = p.grad.t().contiguous().t()

    for name, hook in (("clip", clip), ("relayout", relayout)):
        for density in (1.0, 0.1):
            ends = {}
            for when in ("before", "after"):
                m = model()
                if when == "before":
                    handles = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters()]
                opt = make(m, density=density)
                if when == "after":
                    handles = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters()]
                for i in range(5):
                    step(m, opt, i)
                for h in handles:
                    h.remove()
                ends[when] = params(m)
            key = f"late_hook_{name}_{density:g}"
            res[key + "_equal"] = bool(torch.equal(ends["before"], ends["after"]))
            res[key + "_replicas"] = same_everywhere(ends["after"])


def scenario_step_hooks(res):
    """Step pre- and post-hooks (the optimizer's own and torch's global ones) fire once per
    step; the post-hooks see the exchanged parameters, identical on every rank, also where
    weight updates are exchanged (an EMA kept in a post-hook, as timm's is)."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    for exchange in ("update", "gradient"):
        m = model()
        opt = make(m, torch.optim.AdamW(m.parameters(), lr=1e-2), exchange=exchange)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        calls, seen = [], []
        opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
        opt.register_step_post_hook(lambda o, a, k: (calls.append("post"),
                                                     seen.append(params(m).clone())))
        handles = [register_optimizer_step_pre_hook(
                       lambda o, a, k: calls.append("global pre") if o is opt else None),
                   register_optimizer_step_post_hook(
                       lambda o, a, k: calls.append("global post") if o is opt else None)]
        try:
            for i in range(6):
                step(m, opt, i)
        finally:
            for h in handles:
                h.remove()
        res[f"hooks_{exchange}_calls"] = calls
        res[f"hooks_{exchange}_post_saw_replicas"] = same_everywhere(torch.stack(seen))
        res[f"hooks_{exchange}_post_saw_result"] = bool(torch.equal(seen[-1], params(m)))


def _elementwise_step(ws, i, opt):
    """A loss whose gradient is exact whatever the parameters' memory layout:
    ``c + 0.01 w`` for each parameter, ``c`` this rank's and step's multiples of 1/8."""
    g = torch.Generator().manual_seed(100 * i + hvd.rank())
    opt.zero_grad()
    loss = sum((w * (torch.randint(-8, 9, w.shape, generator=g) / 8).to(w.dtype)).sum()
               + 0.005 * (w * w).sum() for w in ws)
    loss.backward()
    return loss


def scenario_memory_layouts(res):
    """A transposed and a channels_last parameter (non-contiguous storage, as
    ``model.to(memory_format=torch.channels_last)`` makes) train exactly as the same values in
    row-major storage, for gradients (SGD) and updates (AdamW), and keep their layout; also
    with updates clipped locally (``local_clip_norm``), and with gradients a user put in
    ``p.grad`` after backward in the parameter's layout (overwritten by the exchange)."""
    torch.manual_seed(5)
    values = [torch.randn(48, 64), torch.randn(16, 8, 3, 3)]
    for name, base, extra in (
            ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),
            ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2), {}),
            ("adamw_clip", lambda ps: torch.optim.AdamW(ps, lr=1e-2), {"local_clip_norm": 0.5}),
            ("sgd_regrad", lambda ps: torch.optim.SGD(ps, lr=0.1), {})):
        runs = {}
        for layout in ("rowmajor", "strided"):
            if layout == "rowmajor":
                ws = [torch.nn.Parameter(v.clone()) for v in values]
            else:
                ws = [torch.nn.Parameter(values[0].t().contiguous().t()),
                      torch.nn.Parameter(values[1].contiguous(
                          memory_format=torch.channels_last))]
            strides = [w.stride() for w in ws]
            opt = make(torch.nn.ParameterList(ws), base(ws), density=0.05, **extra)
            for i in range(4):
                _elementwise_step(ws, i, opt)
                if name == "sgd_regrad":  # a copy in the parameter's own layout
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        for w in ws:
                            w.grad = torch.empty_like(w).copy_(w.grad)
                opt.step()
            runs[layout] = torch.cat([w.detach().reshape(-1) for w in ws])
            res[f"layout_{name}_{layout}_kept"] = [w.stride() for w in ws] == strides
        res[f"layout_{name}_equal"] = bool(torch.equal(runs["rowmajor"], runs["strided"]))
        res[f"layout_{name}_replicas"] = same_everywhere(runs["strided"])
        res[f"layout_{name}_moved"] = float((runs["strided"] - torch.cat(
            [v.reshape(-1) for v in values])).abs().max())
    # the first line of a channels_last script: broadcast_parameters of its state_dict (Horovod's
    # own refuses non-contiguous tensors), by dict, list and generator
    for how in ("dict", "list", "generator"):
        torch.manual_seed(hvd.rank())  # different weights per rank until the broadcast
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1)).to(
            memory_format=torch.channels_last)
        strides = [p.stride() for p in net.parameters()]
        src = {"dict": lambda: net.state_dict(), "list": lambda: list(net.named_parameters()),
               "generator": lambda: net.named_parameters()}[how]()
        hvd.broadcast_parameters(src, root_rank=1)
        torch.manual_seed(1)
        want = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1))
        res[f"layout_broadcast_{how}_from_root"] = all(
            torch.equal(a.detach(), b.detach()) for a, b in zip(net.parameters(),
                                                                  want.parameters()))
        res[f"layout_broadcast_{how}_kept"] = [p.stride() for p in net.parameters()] == strides


def _strided_net(seed):
    """A channels_last convolution and a transposed linear weight (torch gives their Adam
    moments the same layouts), and the input for step ``i`` on this rank."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 5))
    net[0].to(memory_format=torch.channels_last)
    net[2].weight = torch.nn.Parameter(net[2].weight.detach().t().contiguous().t())

    def batch(i):
        g = torch.Generator().manual_seed(100 * i + hvd.rank())
        return torch.randn(6, 3, 4, 4, generator=g).contiguous(
            memory_format=torch.channels_last)
    return net, batch


def _adam_state(opt, net):
    return [t for p in net.parameters() for _, t in sorted(opt.state[p].items())
            if torch.is_tensor(t)]


def scenario_strided_adam_state(res):
    """Adam's moments in a parameter's non-row-major layout, where Horovod's collectives take
    row-major tensors only: ``broadcast_optimizer_state`` (every rank holding state, and the
    root alone, as at a resume) and the switch to Horovod's step once every bucket goes dense
    (which averages the moments) give the root's / the averaged state on every rank, layouts
    kept. Both failed with Horovod's 'Tensor is required to be contiguous'."""
    from hvd_sparse import costmodel

    for case in ("all", "root_only"):
        net, batch = _strided_net(hvd.rank())  # different weights and state on every rank
        opt = make(net, torch.optim.Adam(net.parameters(), lr=0.01), density=0.2)
        opt.zero_grad()
        net(batch(0)).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():  # each rank's own moments, in the parameters' layouts
            for t in _adam_state(opt, net):
                if t.dim():
                    t.add_(hvd.rank())
        if case == "root_only" and hvd.rank() != 0:
            opt.state.clear()  # as a job resumed on the root alone: the others fresh
        error = None
        try:
            hvd.broadcast_parameters(net.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: one rank's
            error = f"{type(exc).__name__}: {exc}"
        res[f"strided_bcast_{case}_error"] = error
        if error is None:
            state = _adam_state(opt, net)
            res[f"strided_bcast_{case}_equal"] = same_everywhere(state) and len(state) == 12
            res[f"strided_bcast_{case}_kept"] = all(
                t.stride() == p.stride() for p in net.parameters()
                for t in opt.state[p].values() if torch.is_tensor(t) and t.dim())
            for i in range(1, 3):
                opt.zero_grad()
                net(batch(i)).pow(2).mean().backward()
                opt.step()
            res[f"strided_bcast_{case}_trained_equal"] = same_everywhere(params(net))
    real = costmodel.dense_time
    costmodel.dense_time = lambda *a, **k: 0.0  # every dense exchange priced free
    try:
        net, batch = _strided_net(7)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=0.01),
                                       named_parameters=net.named_parameters(), density=0.1,
                                       min_sparse_numel=0, cost_model="time",
                                       calibration_steps=2)
        kinds, error = [], None
        try:
            for i in range(4):
                opt.zero_grad()
                net(batch(i)).pow(2).mean().backward()
                opt.step()
                kinds.append(opt.communication_stats()["exchange"])
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        res["strided_switch_error"] = error
        res["strided_switch_kinds"] = kinds
        if error is None:
            res["strided_switch_state_equal"] = same_everywhere(_adam_state(opt, net))
            res["strided_switch_params_equal"] = same_everywhere(params(net))
            res["strided_switch_layout_kept"] = \
                net[0].weight.is_contiguous(memory_format=torch.channels_last) \
                and not net[2].weight.is_contiguous()
    finally:
        costmodel.dense_time = real


def scenario_bfloat16_adam(res):
    """bfloat16 parameters under Adam and AdamW with the defaults (updates exchanged, the
    second moment's variance correction on): the correction's numba pass took a numpy view
    of the gradient first, which has no bfloat16, and the first step failed."""
    for name, build in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(),
                                  torch.nn.Linear(30, 4)).to(torch.bfloat16)
        start = params(net).clone()
        opt = make(net, build(net.parameters(), lr=1e-2), density=0.1)
        error = None
        try:
            for i in range(4):
                g = torch.Generator().manual_seed(10 * i + hvd.rank())
                opt.zero_grad()
                net(torch.randn(8, 20, generator=g).bfloat16()).float().pow(2).mean().backward()
                opt.step()
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        res[f"bf16_{name}_error"] = error
        if error is None:
            res[f"bf16_{name}_equal"] = same_everywhere(params(net))
            res[f"bf16_{name}_moved"] = float((params(net) - start).float().abs().max())
            res[f"bf16_{name}_corrected"] = opt._hs_engine.config.variance_correction


def scenario_bfloat16_dense_tensor(res):
    """bfloat16 gradients, which Horovod's allreduce refuses: a tensor sent dense is averaged
    in float32 (exactly the mean here) and the replicas stay identical."""
    torch.manual_seed(6)
    ws = [torch.nn.Parameter(torch.randn(40, 30).bfloat16()),
          torch.nn.Parameter(torch.randn(10).bfloat16())]
    opt = make(torch.nn.ParameterList(ws), torch.optim.SGD(ws, lr=0.1),
               min_sparse_numel=100)  # the second tensor goes dense
    twins = [w.detach().clone().requires_grad_() for w in ws]
    _elementwise_step(twins, 0, torch.optim.SGD(twins, lr=0))  # this rank's own gradient
    _elementwise_step(ws, 0, opt)
    opt.synchronize()
    local = hvd.allgather_object(twins[1].grad.float().tolist())
    expected = (torch.tensor(local).sum(0) / hvd.size()).bfloat16()
    res["bf16_dense_mean"] = bool(torch.equal(ws[1].grad, expected))
    res["bf16_ranks_differ"] = local[0] != local[-1]
    with opt.skip_synchronize():
        opt.step()
    for i in range(1, 4):
        _elementwise_step(ws, i, opt)
        opt.step()
    res["bf16_dtypes"] = [str(w.dtype) for w in ws]
    res["bf16_replicas"] = same_everywhere([w.detach() for w in ws])


def scenario_step_with_closure(res):
    """``step(closure)``, the pattern torch documents: the closure's gradients are exchanged
    (not recomputed locally after the exchange) and its loss returned; the same as backward
    then ``step()``."""
    for name, base, kw in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}),
                           ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                            {"exchange": "update"})):
        runs, losses = {}, {}
        for how in ("explicit", "closure"):
            m = model()
            opt = make(m, base(m.parameters()), **kw)
            got = []
            for i in range(4):
                x, y = batch(i)

                def closure():
                    opt.zero_grad()
                    loss = F.cross_entropy(m(x), y)
                    loss.backward()
                    return loss
                if how == "closure":
                    got.append(float(opt.step(closure)))
                else:
                    got.append(float(closure()))
                    opt.step()
            runs[how], losses[how] = params(m), got
        res[f"closure_{name}_equal"] = bool(torch.equal(runs["explicit"], runs["closure"]))
        res[f"closure_{name}_losses_equal"] = losses["explicit"] == losses["closure"]
        res[f"closure_{name}_replicas"] = same_everywhere(runs["closure"])


def scenario_checkpoint_loads_weights_only(res):
    """A checkpoint of the optimizer, saved after the cost model's calibration, loads with
    ``torch.load``'s default ``weights_only=True`` (torch >= 2.6) for every method, and the
    loaded optimizer goes on training."""
    import io

    cases = {"topk": {}, "gaussiank": dict(sparsifier="gaussiank"),
             "adaptive": dict(sparsifier="adaptive", total_steps=50),
             "threshold": dict(sparsifier="threshold", threshold=1e-3),
             "sbc": dict(sparsifier="sbc"), "randomk": dict(sparsifier="randomk"),
             "update": dict(exchange="update", index_coding="auto")}
    out = {}
    for name, kw in cases.items():
        m = model()
        opt = make(m, cost_model="time", calibration_steps=2, **kw)
        for i in range(4):
            step(m, opt, i)
        # the costs are replicated state (digested, sent through torch.load): plain numbers
        res[f"weights_only_{name}_costs_plain"] = all(
            type(v) in (float, str) for c in opt.communication_stats()["cost_model"][
                "buckets"].values() for k, v in c.items() if k != "mode")
        buf = io.BytesIO()
        torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, buf)
        buf.seek(0)
        try:
            saved = torch.load(buf)
            m2 = model()
            m2.load_state_dict(saved["model"])
            opt2 = make(m2, cost_model="time", calibration_steps=2, **kw)
            opt2.load_state_dict(saved["optimizer"])
            step(m2, opt2, 4)
            out[name] = "ok" if opt2.engine_state() is not None else "no state"
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            out[name] = f"{type(e).__name__}: {str(e)[-300:]}"
    res["weights_only_loads"] = out


def scenario_collective_helpers(res):
    """The tensor helpers training scripts call around the optimizer (metrics, seeds), the same
    under Horovod and the mpi4py front end."""
    r, n = hvd.rank(), hvd.size()
    x = torch.arange(4.0) + r
    res["helpers_broadcast"] = hvd.broadcast(x, root_rank=n - 1).tolist()
    res["helpers_broadcast_left_input"] = x.tolist() == (torch.arange(4.0) + r).tolist()
    y = torch.arange(4.0) + r
    hvd.broadcast_(y, root_rank=n - 1)
    res["helpers_broadcast_"] = y.tolist()
    z = torch.full((3,), float(r))
    hvd.allreduce_(z, op=hvd.Sum)
    res["helpers_allreduce_"] = z.tolist()
    res["helpers_allreduce"] = hvd.allreduce(torch.tensor([float(r)])).tolist()
    res["helpers_sizes"] = [hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
    if r == 0:  # lookups, not collectives: one rank alone may ask
        res["helpers_rank0_alone"] = [hvd.local_size(), hvd.cross_size(), hvd.local_rank()]
    res["helpers_allreduce_parameter"] = hvd.allreduce(
        torch.nn.Parameter(torch.full((2,), float(r)))).tolist()
    # Horovod's calls as its own tests make them: the deprecated average=, integer tensors,
    # gradients through the collectives, plain parameter lists, objects cloudpickle carries
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        res["helpers_average_false"] = hvd.allreduce(torch.tensor([float(r + 1)]),
                                                     average=False).tolist()
    ints = torch.tensor([r + 1, 7 * (r + 1)], dtype=torch.int32)
    res["helpers_int_sum"] = [hvd.allreduce(ints, op=hvd.Sum).tolist(),
                              str(hvd.allreduce(ints, op=hvd.Sum).dtype)]
    res["helpers_int_average"] = hvd.allreduce(ints.long()).tolist()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * torch.arange(3.0)).sum().backward()
    res["helpers_allreduce_grad"] = x.grad.tolist()
    x = torch.full((r + 1, 2), float(r), requires_grad=True)
    gathered = hvd.allgather(x)
    (gathered * (1 + torch.arange(gathered.shape[0], dtype=torch.float32)[:, None])).sum() \
        .backward()
    res["helpers_allgather_grad"] = [list(gathered.shape), x.grad.tolist()]
    x = torch.full((2,), float(r), requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * 3).sum().backward()
    res["helpers_broadcast_grad"] = x.grad.tolist()
    plain = [torch.full((2,), float(r)), torch.full((3,), 10.0 + r)]
    hvd.broadcast_parameters(plain, root_rank=n - 1)
    res["helpers_broadcast_parameter_list"] = [t.tolist() for t in plain]
    scale = 3 + r
    res["helpers_broadcast_lambda"] = hvd.broadcast_object(lambda v: v * scale,
                                                           root_rank=n - 1)(2)
    # Horovod's process_set keyword where it has one, and a root outside the job
    hvd.barrier(process_set=hvd.global_process_set)
    res["helpers_object_process_set"] = hvd.broadcast_object(
        r, n - 1, process_set=hvd.global_process_set)
    bad_root = {}
    for what, call in (("broadcast", lambda: hvd.broadcast(torch.ones(2), root_rank=n + 3)),
                       ("broadcast_object", lambda: hvd.broadcast_object(1, root_rank=n))):
        try:
            call()
            bad_root[what] = None
        except Exception as e:  # noqa: BLE001 - the type is the result
            bad_root[what] = type(e).__name__
    res["helpers_bad_root"] = bad_root
    hvd.barrier()  # still in step after the refusals
    m = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   m.named_parameters(), hvd.Compression.none, 1)
    res["helpers_positional_options"] = opt.backward_passes_per_step
    if BACKEND == "mpi":  # broadcasts in chunks (MPI's int counts end at 2 GiB): here of 5 bytes
        chunk, hvd.BROADCAST_CHUNK_BYTES = hvd.BROADCAST_CHUNK_BYTES, 5
        comm, calls = hvd._comm, []

        class Counting:  # the communicator, counting its Ibcast calls
            def __getattr__(self, name):
                return getattr(comm, name)

            def Ibcast(self, buf, root=0):
                calls.append(len(buf))
                return comm.Ibcast(buf, root=root)

        hvd._comm = Counting()
        try:
            t = torch.arange(37, dtype=torch.float32) * (r + 1)
            hvd.broadcast_(t, root_rank=n - 1)
            res["helpers_chunked_broadcast_"] = t.tolist()
            obj = {"rank": r, "state": torch.arange(11, dtype=torch.float64) * (r + 1)}
            got = hvd.broadcast_object(obj, root_rank=n - 1)
            res["helpers_chunked_broadcast_object"] = [got["rank"], got["state"].tolist()]
            got = hvd.allgather_object({"rank": r, "pad": "x" * (3 * r + 1)})
            res["helpers_chunked_allgather_object"] = [[g["rank"], len(g["pad"])] for g in got]
            res["helpers_chunked_broadcast_calls"] = calls
        finally:
            hvd.BROADCAST_CHUNK_BYTES, hvd._comm = chunk, comm
        # the transport's sums in pieces too (C int counts end at 2**31 - 1 elements)
        from hvd_sparse import transport as tr
        piece, tr.ALLREDUCE_CHUNK = tr.ALLREDUCE_CHUNK, 3
        try:
            t = torch.arange(10, dtype=torch.float32) * (r + 1)
            res["helpers_chunked_allreduce"] = hvd.allreduce(t, op=hvd.Sum).tolist()
            res["helpers_chunked_allreduce_avg"] = hvd.allreduce(t).tolist()
        finally:
            tr.ALLREDUCE_CHUNK = piece


def scenario_more_collectives(res):
    """Horovod's other collectives, called as its users call them (under Horovod these are its
    own functions, the reference; under hvd_sparse.mpi they are ours): Min, Max and Product,
    async handles with poll and synchronize, grouped forms, alltoall, reducescatter, join."""
    import time

    r, n = hvd.rank(), hvd.size()
    x = torch.tensor([float(r + 1), -float(r + 1), 2.0])
    res["more_min_max_product"] = [hvd.allreduce(x, op=op).tolist()
                                   for op in (hvd.Min, hvd.Max, hvd.Product)]
    ints = torch.tensor([r + 1, 5 - r], dtype=torch.int32)
    got = hvd.allreduce(ints, op=hvd.Max)
    res["more_int_max"] = [got.tolist(), str(got.dtype)]
    got = hvd.allreduce(x.to(torch.float16), op=hvd.Min)
    res["more_half_min"] = [got.tolist(), str(got.dtype)]
    g = torch.full((2,), float(r + 1), requires_grad=True)
    (hvd.allreduce(g, op=hvd.Max) * torch.tensor([1.0, 2.0 + r])).sum().backward()
    res["more_max_grad"] = g.grad.tolist()  # the gradient reduced with Max too

    h1 = hvd.allreduce_async(torch.full((3,), float(r)), op=hvd.Sum, name="more.a")
    y = torch.full((2,), float(r))
    h2 = hvd.allreduce_async_(y, name="more.b")
    h3 = hvd.allgather_async(torch.full((r + 1, 2), float(r)), name="more.c")
    h4 = hvd.broadcast_async(torch.full((2,), float(r)), root_rank=n - 1, name="more.d")
    deadline = time.time() + 60
    while not all(hvd.poll(h) for h in (h1, h2, h3, h4)) and time.time() < deadline:
        time.sleep(0.001)
    res["more_polled"] = all(hvd.poll(h) for h in (h1, h2, h3, h4))
    out2 = hvd.synchronize(h2)  # waited for in another order than started
    res["more_async"] = [hvd.synchronize(h1).tolist(), y.tolist(), out2.tolist(),
                         hvd.synchronize(h4).tolist(), hvd.synchronize(h3).tolist()]

    pair = [torch.full((2,), float(r)), torch.full((3,), 2.0 * r)]
    res["more_grouped"] = [t.tolist() for t in hvd.grouped_allreduce(pair, op=hvd.Sum)]
    hvd.grouped_allreduce_(pair)
    res["more_grouped_"] = [t.tolist() for t in pair]
    res["more_grouped_allgather"] = [t.tolist() for t in hvd.grouped_allgather(
        [torch.full((1,), float(r)), torch.full((r + 1,), 1.0)])]
    h = hvd.grouped_allreduce_async([torch.ones(2) * r, torch.ones(1)], op=hvd.Sum)
    res["more_grouped_async"] = [t.tolist() for t in hvd.synchronize(h)]

    # alltoall with splits: rank j gets j + 1 rows, each marked with sender and receiver
    splits = [j + 1 for j in range(n)]
    rows = torch.tensor([[100.0 * r + j] for j in range(n) for _ in range(j + 1)])
    rows.requires_grad_(True)
    out, received = hvd.alltoall(rows, splits=torch.tensor(splits, dtype=torch.int32))
    (out * (r + 1)).sum().backward()
    res["more_alltoall"] = [out.tolist(), received.tolist(), str(received.dtype),
                            rows.grad.view(-1).tolist()]
    even = torch.tensor([[10.0 * r + i] for i in range(2 * n)])
    res["more_alltoall_even"] = hvd.alltoall(even).view(-1).tolist()
    try:  # without splits the rows must divide evenly
        hvd.alltoall(torch.zeros(2 * n + 1, 1))
        res["more_alltoall_uneven"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        res["more_alltoall_uneven"] = type(e).__name__
    h = hvd.alltoall_async(torch.arange(float(n)) + 10 * r, splits=[1] * n)
    out, received = hvd.synchronize(h)
    res["more_alltoall_async"] = [out.tolist(), received.tolist()]

    base = torch.arange(float(2 * (2 * n + 1))).view(2 * n + 1, 2)
    t = (base * (r + 1)).requires_grad_(True)
    avg = hvd.reducescatter(t)
    # (a weighted sum: the gradient of a plain sum is a broadcast view, which Horovod refuses)
    (avg * (1.0 + torch.arange(float(avg.numel())).view_as(avg))).sum().backward()
    res["more_reducescatter"] = [avg.tolist(), t.grad.tolist(),
                                 hvd.reducescatter(base * (r + 1), op=hvd.Sum).tolist(),
                                 hvd.synchronize(hvd.reducescatter_async(
                                     base * (r + 1), op=hvd.Sum)).tolist()]
    ts = (base * (r + 1)).requires_grad_(True)
    (hvd.reducescatter(ts, op=hvd.Sum) * 3.0 * torch.ones(1)).sum().backward()
    res["more_reducescatter_sum_grad"] = ts.grad.tolist()
    try:
        if r == n - 1:  # the last to arrive, by a wide margin: join() names it
            time.sleep(1.0)
        last = hvd.join()
        res["more_join"] = last == n - 1
    except Exception as e:  # noqa: BLE001 - the type is part of the result
        res["more_join"] = f"{type(e).__name__}: {e}"
    res["more_queries"] = [isinstance(hvd.mpi_threads_supported(), bool), bool(hvd.mpi_built())]
    # ranks that disagree: Horovod's coordinator raises on every rank, and the job goes on
    mismatches = {
        "shape": lambda: hvd.allreduce(torch.ones(3 + r)),
        "op": lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Average),
        "dtype": lambda: hvd.broadcast(torch.ones(2, dtype=torch.float32 if r else torch.float64),
                                       root_rank=0),
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=min(r, 1)),
        "trailing": lambda: hvd.allgather(torch.ones(2, 2 + r))}
    out = {}
    for key, call in mismatches.items():
        try:
            call()
            out[key] = "no error"
        except hvd.HorovodInternalError as e:
            out[key] = ["HorovodInternalError", "Mismatched" in str(e) or "mismatch" in str(e)]
        except Exception as e:  # noqa: BLE001 - the type is part of the result
            out[key] = f"{type(e).__name__}: {str(e)[:200]}"
    res["more_mismatches"] = out
    res["more_after_mismatches"] = hvd.allreduce(torch.ones(1) * (r + 1), op=hvd.Sum).tolist()
    hvd.allreduce(torch.ones(1), name="more.after")  # still in step with the others


def scenario_names_types_and_complex(res):
    """What a Horovod user meets at the edges of the collectives (under Horovod its own
    functions, the reference): a complex allreduce refused (not summed with its imaginary
    part dropped), a name still in use refused, the grouped forms' result types, and async
    collectives started in another order on each rank coming back under their own names or
    failing, never swapped."""
    r, n = hvd.rank(), hvd.size()
    res["names_backend"] = BACKEND
    z = torch.tensor([1 + 2j, 3 - 1j]) * (r + 1)
    for how, call in (("sync", lambda: hvd.allreduce(z, op=hvd.Sum)),
                      ("async", lambda: hvd.synchronize(hvd.allreduce_async(z, op=hvd.Sum))),
                      ("grouped", lambda: hvd.grouped_allreduce([z], op=hvd.Sum))):
        try:
            res[f"names_complex_{how}"] = [str(v) for v in call()[0:2].tolist()] \
                if how != "grouped" else [str(v) for v in call()[0].tolist()]
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            res[f"names_complex_{how}"] = type(e).__name__
    h = hvd.allreduce_async(torch.ones(3), name="names.dup")
    try:
        h2 = hvd.allreduce_async(torch.ones(3), name="names.dup")
        hvd.synchronize(h2)
        res["names_duplicate"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        res["names_duplicate"] = type(e).__name__
    hvd.synchronize(h)
    h = hvd.allreduce_async(torch.ones(3), name="names.dup")  # free again once synchronized
    res["names_reused"] = hvd.synchronize(h).tolist()
    pair = [torch.ones(2), torch.ones(3)]
    res["names_types"] = {
        "grouped_allreduce": type(hvd.grouped_allreduce(pair)).__name__,
        "grouped_allreduce_": type(hvd.grouped_allreduce_([t.clone() for t in pair])).__name__,
        "grouped_allreduce_async": type(hvd.synchronize(
            hvd.grouped_allreduce_async(pair))).__name__,
        "grouped_allgather": type(hvd.grouped_allgather(pair)).__name__,
        "grouped_allgather_async": type(hvd.synchronize(
            hvd.grouped_allgather_async(pair))).__name__,
        "grouped_reducescatter": type(hvd.grouped_reducescatter(pair)).__name__,
        "grouped_reducescatter_async": type(hvd.synchronize(
            hvd.grouped_reducescatter_async(pair))).__name__}
    a, b = torch.full((2,), 1.0 + r), torch.full((2,), 100.0 * (r + 1))
    order = [("names.A", a), ("names.B", b)] if r == 0 else [("names.B", b), ("names.A", a)]
    try:
        handles = {nm: hvd.allreduce_async(t, name=nm, op=hvd.Sum) for nm, t in order}
        res["names_order"] = {nm: hvd.synchronize(hd).tolist() for nm, hd in handles.items()}
    except hvd.HorovodInternalError:
        res["names_order"] = "HorovodInternalError"
    res["names_order_want"] = {"names.A": [float(n * (n + 1) / 2)] * 2,
                               "names.B": [100.0 * n * (n + 1) / 2] * 2}
    res["names_after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="names.after").tolist()
    if BACKEND == "mpi":
        # a name is free again once its operation completed, synchronized or not (as Horovod
        # frees a name in one process; at 2 ranks its background loop still held it): a
        # retry after an exception between start and synchronize; a completed in-place
        # broadcast whose handle was dropped
        x = torch.full((2,), float(r))
        h = hvd.allreduce_async(torch.ones(2), name="names.retry", op=hvd.Sum)
        while not hvd.poll(h):
            pass
        res["names_retry"] = hvd.synchronize(hvd.allreduce_async(
            torch.ones(2), name="names.retry", op=hvd.Sum)).tolist()
        hvd.synchronize(h)
        hvd.broadcast_async_(x, 0, name="names.dropped")
        hvd.synchronize(hvd.broadcast_async_(x, 0, name="names.dropped"))
        res["names_dropped_handle"] = x.tolist()
    # the blocking and the async form of one collective, unnamed, on different ranks
    y = torch.ones(2) * (r + 1)
    res["names_mixed_forms"] = (hvd.allreduce(y, op=hvd.Sum) if r % 2 == 0 else
                                hvd.synchronize(hvd.allreduce_async(y, op=hvd.Sum))).tolist()
    if BACKEND == "mpi":  # (under Horovod a complex tensor on one rank leaves the others waiting)
        try:  # a complex tensor on one rank, a float one on the others: every rank is told
            hvd.allreduce(torch.ones(2, dtype=torch.complex64) if r == 0 else torch.ones(2))
            res["names_complex_one_rank"] = "no error"
        except hvd.HorovodInternalError as e:
            res["names_complex_one_rank"] = ["HorovodInternalError", "dtype" in str(e)]
        except ValueError:
            res["names_complex_one_rank"] = "ValueError"
        res["names_after_complex"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist()


def scenario_sync_batch_norm(res):
    """hvd_sparse.mpi's SyncBatchNorm against one BatchNorm over every rank's batch put
    together: outputs, input and parameter gradients of the sum of all ranks' losses, running
    statistics. (Horovod's own needs CUDA's statistics kernels: under Horovod on the CPU
    there is nothing to compare.)"""
    if BACKEND != "mpi":
        return
    r, n = hvd.rank(), hvd.size()

    def batch(q):
        g = torch.Generator().manual_seed(100 + q)
        rows = 3 + q  # ranks' batches differ in size
        return torch.randn(rows, 4, 5, generator=g) * (q + 1) + q, torch.randn(rows, 4, 5,
                                                                               generator=g)

    torch.manual_seed(0)
    sync = hvd.SyncBatchNorm(4, momentum=0.3)
    ref = torch.nn.BatchNorm1d(4, momentum=0.3)
    with torch.no_grad():
        sync.weight.uniform_(0.5, 1.5)
        sync.bias.uniform_(-0.5, 0.5)
    ref.load_state_dict(sync.state_dict())
    for _ in range(2):  # running statistics over two steps
        x, w = batch(r)
        x.requires_grad_(True)
        y = sync(x)
        (y * w).sum().backward()
        xs, ws = zip(*(batch(q) for q in range(n)))
        full = torch.cat(xs).requires_grad_(True)
        y_ref = ref(full)
        (y_ref * torch.cat(ws)).sum().backward()
        lo = sum(3 + q for q in range(r))
        rows = slice(lo, lo + 3 + r)
        res["sbn_output"] = float((y - y_ref[rows]).abs().max())
        res["sbn_input_grad"] = float((x.grad - full.grad[rows]).abs().max())
        summed = hvd.allreduce(torch.cat([sync.weight.grad, sync.bias.grad]), op=hvd.Sum)
        res["sbn_param_grad"] = float((summed - torch.cat([ref.weight.grad, ref.bias.grad]))
                                      .abs().max())
        sync.zero_grad()
        ref.zero_grad()
    res["sbn_running"] = [float((sync.running_mean - ref.running_mean).abs().max()),
                          float((sync.running_var - ref.running_var).abs().max()),
                          int(sync.num_batches_tracked)]
    sync.eval()
    x, _ = batch(r)
    res["sbn_eval"] = float((sync(x) - ref.eval()(x)).abs().max())


def scenario_two_optimizers_in_rank_order(res):
    """Two DistributedOptimizers over one model, stepped A then B on even ranks and B then A
    on odd ones. Exchanged gradients with no cost model: every collective went out during
    backward, in the same order everywhere, so it trains as under Horovod. Where the
    optimizer's own collectives run in step() (exchanged updates; the time cost model's
    calibration), every rank raises instead of pairing one optimizer's figures with the other's
    (a misleading ConfigMismatchError, a KeyError, a shape error): ExchangeOrderError, or at
    the first exchange, where another model looks alike, ConfigMismatchError naming both
    causes."""
    cases = {"gradient_off": dict(cost_model="off"),
             "gradient_time": dict(cost_model="time", calibration_steps=1),
             "update": dict(exchange="update")}
    for name, kw in cases.items():
        m = model()
        body, head = list(m[0].parameters()), list(m[2].parameters())
        a = hvd.DistributedOptimizer(torch.optim.SGD(body, lr=0.1),
                                     named_parameters=list(m[0].named_parameters(prefix="0")),
                                     density=0.1, min_sparse_numel=0, **kw)
        b = hvd.DistributedOptimizer(torch.optim.SGD(head, lr=0.1),
                                     named_parameters=list(m[2].named_parameters(prefix="2")),
                                     density=0.1, min_sparse_numel=0, **kw)
        order = (a, b) if hvd.rank() % 2 == 0 else (b, a)
        error = None
        try:
            for i in range(4):
                x, y = batch(i)
                a.zero_grad()
                b.zero_grad()
                F.cross_entropy(m(x), y).backward()
                for opt in order:
                    opt.step()
        except Exception as exc:  # noqa: BLE001 - the type is what is checked
            error = type(exc).__name__
            res[f"order_{name}_message"] = str(exc)
        res[f"order_{name}_error"] = error
        if error is None:
            res[f"order_{name}_equal"] = same_everywhere(params(m))


SCENARIOS = [scenario_update_exchange, scenario_adam_all_dense_takes_horovods_step,
             scenario_adam_switch_resumed_on_rank0, scenario_switchable_beside_explicit_updates,
             scenario_sgd_momentum_all_dense_keeps_its_updates,
             scenario_step_hooks, scenario_gradient_hooks_after_wrapping,
             scenario_resume_from_rank0, scenario_broadcast_mid_run, scenario_gradscaler,
             scenario_fresh_state_broadcast,
             scenario_update_nonfinite, scenario_bfloat16_broadcasts,
             scenario_nonfinite_policies, scenario_dense_bucket_skip, scenario_local_steps_nan,
             scenario_sparse_embedding, scenario_sparse_embedding_unused_on_one_rank,
             scenario_memory_layouts, scenario_strided_adam_state, scenario_bfloat16_adam,
             scenario_bfloat16_dense_tensor,
             scenario_step_with_closure, scenario_checkpoint_loads_weights_only,
             scenario_collective_helpers, scenario_more_collectives,
             scenario_names_types_and_complex, scenario_sync_batch_norm,
             scenario_two_optimizers_in_rank_order]


if __name__ == "__main__":
    runner.run_scenarios(hvd, SCENARIOS)
