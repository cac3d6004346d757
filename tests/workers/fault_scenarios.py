"""Hardening scenarios (run by tests/test_faults.py): replica verification, mismatched ranks,
non-finite gradients, elastic state, checkpoints across rank counts. Each rank writes
OUTDIR/rank<r>.json; every scenario runs on every rank with a timeout in the caller."""
import copy

import torch
import torch.nn.functional as F

import hvd_sparse as hvd
from hvd_sparse.safety import ConfigMismatchError, NonFiniteGradientError, ReplicaDivergenceError

from scenario_runner import run_scenarios  # noqa: E402

torch.set_num_threads(1)


def model(seed=0, extra=False, width=32):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)]
    if extra:
        layers.append(torch.nn.Linear(4, 4))
    return torch.nn.Sequential(*layers)


def step(m, opt, i, poison=None):
    g = torch.Generator().manual_seed(i * 31 + hvd.rank())
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    if poison is not None:  # reaches the gradients during backward, before any exchange
        x[0, 0] = poison
    opt.zero_grad()
    F.cross_entropy(m(x), y).backward()
    return opt.step()


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def make(m, base=None, **kw):
    kw.setdefault("density", 0.1)
    kw.setdefault("min_sparse_numel", 0)
    kw.setdefault("cost_model", "off")  # these scenarios test the sparse path itself
    if not base:  # SGD's gradients (the path these scenarios follow), not its updates
        kw.setdefault("exchange", "gradient")
    base = base(m.parameters()) if base else torch.optim.SGD(m.parameters(), lr=0.1,
                                                              momentum=0.9)
    return hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(), **kw)


def scenario_verify(res):
    m = model()
    opt = make(m, verify_every=10, sparsifier="gaussiank")
    for i in range(40):
        step(m, opt, i)
    res["verify_clean"] = True
    if hvd.rank() == 1:
        with torch.no_grad():
            m[2].bias.add_(1e-6)  # a rank-local change that hvd_sparse did not make
    try:
        for i in range(40, 60):
            step(m, opt, i)
        res["verify_error"] = None
    except ReplicaDivergenceError as e:
        res["verify_error"] = str(e)
        res["verify_error_step"] = i


def scenario_mismatch(res):
    rank = hvd.rank()

    def reordered(ps):  # the parameters listed in another order on rank 1
        ps = list(ps)
        return torch.optim.SGD(ps[::-1] if rank == 1 else ps, lr=0.1)

    cases = {
        "extra_layer": lambda: (model(extra=rank == 1), {}),
        "shape": lambda: (model(width=32 if rank == 0 else 33), {}),
        "density": lambda: (model(), {"density": 0.1 if rank == 0 else 0.2}),
        "bpps": lambda: (model(), {"backward_passes_per_step": 1 + (rank == 1)}),
        "sparsifier": lambda: (model(), {"sparsifier": "topk" if rank == 0 else "randomk"}),
        "optimizer": lambda: (model(), {"base": None if rank == 0 else (
            lambda ps: torch.optim.AdamW(ps, lr=1e-3))}),
        # every bucket dense (nothing replicated to agree on): a rank-dependent parameter
        # order stalled Horovod (names differed) or, packed into one bucket of the same name
        # and length, summed unrelated entries in silence
        "dense_order": lambda: (model(), {"density": 1.0, "base": reordered}),
        "packed_order": lambda: (model(), {"min_sparse_numel": 1024, "base": reordered}),
    }
    out = {}
    for name, build in cases.items():
        m, kw = build()
        opt = make(m, **kw)
        try:
            step(m, opt, 0)
            out[name] = None
        except ConfigMismatchError as e:
            out[name] = str(e)
        except AssertionError as e:  # bpps mismatch shows up on the rank with fewer passes too
            out[name] = f"AssertionError: {e}"
    res["mismatch"] = out
    hvd.allreduce(torch.zeros(1), name="after.mismatch")  # the job is still in step


def scenario_nonfinite(res):
    for mode in ("raise", "skip"):
        m = model()
        opt = make(m, nonfinite=mode)
        for i in range(3):
            step(m, opt, i)
        before = flat(m).clone()
        up_before = torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse]).clone()
        poison = float("nan") if mode == "raise" else float("inf")
        try:
            step(m, opt, 3, poison=poison if hvd.rank() == 1 else None)
            res[f"nonfinite_{mode}_error"] = None
        except NonFiniteGradientError as e:
            res[f"nonfinite_{mode}_error"] = str(e)
        up_after = torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse])
        res[f"nonfinite_{mode}_residual_finite"] = bool(torch.isfinite(up_after).all())
        res[f"nonfinite_{mode}_params_unchanged"] = bool(torch.equal(before, flat(m)))
        if mode == "skip":
            res["nonfinite_skip_residual_rolled_back"] = bool(torch.equal(up_before, up_after))
        for i in range(4, 10):  # training goes on, replicas still identical
            step(m, opt, i)
        digests = hvd.allgather_object(flat(m).numpy().tobytes())
        res[f"nonfinite_{mode}_then_identical"] = all(d == digests[0] for d in digests)


def scenario_elastic_state(res):
    m = model()
    opt = make(m)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    state = hvd.elastic.TorchState(model=m, optimizer=opt, epoch=0)
    for i in range(5):
        step(m, opt, i)
    state.commit()
    committed_up = torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse]).clone()
    committed_params = flat(m).clone()
    for i in range(5, 9):
        step(m, opt, i)
    state.restore()
    res["elastic_restore_uplink"] = bool(torch.equal(
        committed_up, torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse])))
    res["elastic_restore_params"] = bool(torch.equal(committed_params, flat(m)))
    own_up = torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse]).clone()
    state.sync()  # broadcast from rank 0, as elastic does after a reset
    res["elastic_sync_keeps_own_uplink"] = bool(torch.equal(
        own_up, torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse])))
    down = torch.cat([v.downlink for v in opt.engine_state().values() if v.sparse])
    digests = hvd.allgather_object(down.numpy().tobytes())
    res["elastic_sync_downlink_identical"] = all(d == digests[0] for d in digests)
    for i in range(9, 12):
        step(m, opt, i)
    res["elastic_trains_after_sync"] = True


def scenario_checkpoint_other_size(res):
    m = model()
    opt = make(m)
    for i in range(5):
        step(m, opt, i)
    sd = copy.deepcopy(opt.state_dict())
    sd["hvd_sparse"]["world_size"] = hvd.size() + 1  # as if written by a larger job
    m2 = model()
    opt2 = make(m2)
    opt2.load_state_dict(sd)
    res["other_size_downlink_restored"] = all(
        torch.equal(a.downlink, b.downlink)
        for a, b in zip(opt2.engine_state().values(), opt.engine_state().values()) if a.sparse)
    res["other_size_uplink_fresh"] = all(v.uplink is None for v in opt2.engine_state().values() if v.sparse)
    for i in range(5, 8):
        step(m2, opt2, i)
    res["other_size_trains"] = True


SCENARIOS = [scenario_verify, scenario_mismatch, scenario_nonfinite, scenario_elastic_state,
             scenario_checkpoint_other_size]


if __name__ == "__main__":
    run_scenarios(hvd, SCENARIOS)
