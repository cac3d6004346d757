"""Multi-rank scenarios for the drop-in optimizer, run by tests/test_multirank.py under
mpirun or horovodrun. Each rank writes its findings to OUTDIR/rank<r>.json; the pytest side
asserts on them. Every scenario runs on every rank, so a hang shows up as the launcher's timeout.
"""
import copy
import hashlib
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

BACKEND = os.environ.get("HVD_SPARSE_TEST_BACKEND", "horovod")
if BACKEND == "mpi":
    sys.modules["horovod"] = None  # prove the mpi4py path never needs Horovod
    import hvd_sparse.mpi as hvd
else:
    import hvd_sparse as hvd

from scenario_runner import run_scenarios  # noqa: E402

torch.set_num_threads(1)


def make_model(seed, extra=False):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleDict({
        "l1": torch.nn.Linear(20, 48),
        "l2": torch.nn.Linear(48, 5),
    })
    if extra:
        layers["side"] = torch.nn.Linear(20, 5)
    return layers


def forward(m, x, use_side=False):
    out = m["l2"](torch.tanh(m["l1"](x)))
    if use_side:
        out = out + m["side"](x)
    return out


def batch(step, rank, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g)


def flat_params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def digest(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def all_equal_digest(t):
    """True when every rank holds bitwise the same tensor."""
    d = digest(t)
    ds = hvd.allgather_object(d)
    return all(x == ds[0] for x in ds)


# ------------------------------------------------------------------ float64 reference
def topk_np(x, k):
    n = x.size
    if k >= n:
        return np.arange(n)
    mag = np.abs(x)
    order = np.lexsort((np.arange(n), -mag))  # by magnitude desc, then index asc
    return np.sort(order[:k])


def k_for(n, density):
    import math
    return min(n, max(1, math.ceil(density * n)))


def scenario_reference(res):
    """Each applied gradient equals a float64 simulation of the algorithm over all ranks."""
    size, rank = hvd.size(), hvd.rank()
    m = make_model(1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters(), cost_model="off",
                                   density=0.1,
                                   downlink_density=0.05, min_sparse_numel=0,
                                   dense_fallback=False)
    names = [n for n, _ in m.named_parameters()]
    up = [{n: 0.0 for n in names} for _ in range(size)]
    down = {n: 0.0 for n in names}
    worst = 0.0
    for step in range(6):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(forward(m, x), y).backward()
        raw = {n: p.grad.detach().reshape(-1).clone() for n, p in m.named_parameters()}
        gathered = {n: hvd.allgather(raw[n][None], name=f"ref.raw.{n}").double().numpy()
                    for n in names}
        opt.synchronize()
        for n, p in m.named_parameters():
            numel = p.numel()
            dense = np.zeros(numel)
            for r in range(size):
                acc = gathered[n][r] + up[r][n]
                idx = topk_np(acc, k_for(numel, 0.1))
                dense[idx] += acc[idx]
                acc = acc.copy()
                acc[idx] = 0.0
                up[r][n] = acc
            dense /= size
            agg = dense + down[n]
            idx = topk_np(agg, k_for(numel, 0.05))
            expected = np.zeros(numel)
            expected[idx] = agg[idx]
            agg = agg.copy()
            agg[idx] = 0.0
            down[n] = agg
            got = p.grad.detach().reshape(-1).double().numpy()
            scale = max(np.abs(expected).max(), 1e-12)
            worst = max(worst, float(np.abs(got - expected).max() / scale))
        with opt.skip_synchronize():
            opt.step()
    res["reference_max_rel_err"] = worst


def train(m, opt, steps, start=0, use_side=None):
    rank = hvd.rank()
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        side = use_side(step) if use_side else False
        F.cross_entropy(forward(m, x, side), y).backward()
        opt.step()


def scenario_bitwise(res):
    """200 steps, bidirectional, momentum: parameters and downlink residuals identical."""
    for scope, bucketing in (("tensor", {}), ("model", {"scope": "model"}),
                             ("groups", {"groups": 2})):
        m = make_model(2)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), exchange="gradient",
            cost_model="off", density=0.02,
            min_sparse_numel=0, **bucketing)
        hvd.broadcast_parameters(m.state_dict(), root_rank=0)
        start = flat_params(m).clone()
        train(m, opt, 200)
        down = torch.cat([v.downlink for v in opt.engine_state().values() if v.sparse])
        up = torch.cat([v.uplink for v in opt.engine_state().values() if v.sparse])
        res[f"bitwise_{scope}_params_equal"] = all_equal_digest(flat_params(m))
        res[f"bitwise_{scope}_downlink_equal"] = all_equal_digest(down)
        res[f"bitwise_{scope}_uplink_differs"] = not all_equal_digest(up)
        res[f"bitwise_{scope}_moved"] = float((flat_params(m) - start).abs().max())
        stats = opt.communication_stats()
        res[f"bitwise_{scope}_stats"] = stats


def scenario_watch_mixed(res):
    """Rank 1 scans its downlink residual every step, the others select from their watched
    positions (as after a resume or join, when a rank's list is gone): still the same bits.
    One bucket per tensor: the watch serves buckets of one tensor (shared ones scan)."""
    if hvd.rank() == 1:
        os.environ["HVD_SPARSE_DOWNLINK_WATCH"] = "off"
    os.environ["HVD_SPARSE_PACK_BELOW"] = "0"
    try:
        m = make_model(5)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), exchange="gradient",
            cost_model="off", density=0.02,
            min_sparse_numel=0)
    finally:
        os.environ.pop("HVD_SPARSE_DOWNLINK_WATCH", None)
        os.environ.pop("HVD_SPARSE_PACK_BELOW", None)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    train(m, opt, 100)
    down = torch.cat([v.downlink for v in opt.engine_state().values() if v.sparse])
    res["watch_params_equal"] = all_equal_digest(flat_params(m))
    res["watch_downlink_equal"] = all_equal_digest(down)
    res["watch_paths"] = opt.communication_stats()["totals"]["downlink_selections"]


def scenario_watch_mixed_sbc(res):
    """As scenario_watch_mixed for SBC, whose list keeps a bound per sign, on a layer long
    enough for its fused path and a density low enough for the list (81,920 weights, 0.5%)."""
    if hvd.rank() == 1:
        os.environ["HVD_SPARSE_DOWNLINK_WATCH"] = "off"
    try:
        torch.manual_seed(6)
        m = torch.nn.Sequential(torch.nn.Linear(20, 4096), torch.nn.Tanh(),
                                torch.nn.Linear(4096, 5))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), cost_model="off", density=0.005,
            sparsifier="sbc", min_sparse_numel=0, collective="allgather")
    finally:
        os.environ.pop("HVD_SPARSE_DOWNLINK_WATCH", None)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    rank = hvd.rank()
    for step in range(60):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    down = torch.cat([v.downlink for v in opt.engine_state().values()
                      if v.sparse and v.downlink is not None])
    res["watch_sbc_params_equal"] = all_equal_digest(flat_params(m))
    res["watch_sbc_downlink_equal"] = all_equal_digest(down)
    res["watch_sbc_paths"] = opt.communication_stats()["totals"]["downlink_selections"]


def scenario_hybrid_transport(res):
    """The Horovod front end with transport="mpi" (mpi4py collectives, no Horovod cycle): the
    same training where mpi4py sees Horovod's ranks, a clear error where it cannot."""
    if BACKEND != "horovod":
        return
    m = make_model(6)
    try:
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            named_parameters=m.named_parameters(), exchange="gradient",
            cost_model="off", density=0.02,
            min_sparse_numel=0, transport="mpi")
    except ValueError as e:
        res["hybrid_error"] = str(e)
        return
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    start = flat_params(m).clone()
    train(m, opt, 20)
    res["hybrid_params_equal"] = all_equal_digest(flat_params(m))
    res["hybrid_moved"] = float((flat_params(m) - start).abs().max())
    res["hybrid_bytes"] = opt.communication_stats()["totals"]["bytes_sent"]


EQUIVALENCE_CASES = {
    "bpps1": {},
    "bpps2": {"backward_passes_per_step": 2},
    "sum": {"op": "Sum"},
    "predivide": {"gradient_predivide_factor": 2.0},
}


class DenseReference:
    """Plain dense data parallelism (average of full gradients), for runs without Horovod."""

    def __init__(self, base, named_parameters, backward_passes_per_step=1, op=None,
                 gradient_predivide_factor=1.0):
        self.base, self.params = base, [p for _, p in named_parameters]
        self.average = op is None or op == hvd.Average

    def zero_grad(self):
        self.base.zero_grad()

    def step(self):
        for p in self.params:
            p.grad.copy_(hvd.allreduce(p.grad, op=hvd.Average if self.average else hvd.Sum))
        self.base.step()


def scenario_dense_equivalence(res):
    """density=1.0 follows the same trajectory as horovod.torch.DistributedOptimizer
    (over mpi4py: as dense gradient averaging)."""
    if BACKEND == "mpi":
        real_hvd = hvd
        real_hvd_optimizer = DenseReference
    else:
        import horovod.torch as real_hvd
        real_hvd_optimizer = real_hvd.DistributedOptimizer
    for label, case in EQUIVALENCE_CASES.items():
        kwargs = dict(case)
        if "op" in kwargs:
            kwargs["op"] = getattr(real_hvd, kwargs["op"])
        bpps = kwargs.get("backward_passes_per_step", 1)
        trajectories = []
        for which in ("horovod", "sparse"):
            m = make_model(3)
            base = torch.optim.SGD(m.parameters(), lr=0.1 if "op" not in kwargs else 0.03,
                                   momentum=0.9)
            if which == "horovod":
                opt = real_hvd_optimizer(base, named_parameters=m.named_parameters(), **kwargs)
            else:
                opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                               cost_model="off",
                                               density=1.0, min_sparse_numel=0, **kwargs)
            rank = hvd.rank()
            for step in range(20):
                opt.zero_grad()
                for micro in range(bpps):
                    x, y = batch(10 * step + micro, rank)
                    F.cross_entropy(forward(m, x), y).backward()
                opt.step()
            trajectories.append(flat_params(m))
        res[f"dense_equiv_{label}_max_abs_diff"] = float(
            (trajectories[0] - trajectories[1]).abs().max())


def scenario_adam_nothing_sparse(res):
    """Adam with the library's defaults on a model whose tensors are all below
    min_sparse_numel: nothing can go sparse, so exchange="auto" keeps Horovod's contract
    (gradients averaged, then the wrapped step) and the trajectory is Horovod's."""
    if BACKEND == "mpi":
        reference = DenseReference
    else:
        import horovod.torch as real_hvd
        reference = real_hvd.DistributedOptimizer
    trajectories = []
    for which in ("horovod", "sparse"):
        torch.manual_seed(5)
        m = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 5))
        base = torch.optim.Adam(m.parameters(), lr=1e-2)
        make = reference if which == "horovod" else hvd.DistributedOptimizer
        opt = make(base, named_parameters=m.named_parameters())
        if which == "sparse":
            res["adam_nothing_sparse_exchange"] = opt.communication_stats().get("exchange")
        g = torch.Generator().manual_seed(100 + hvd.rank())
        for _ in range(10):
            opt.zero_grad()
            x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
            F.cross_entropy(m(x), y).backward()
            opt.step()
        trajectories.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    res["adam_nothing_sparse_max_abs_diff"] = float((trajectories[0] - trajectories[1])
                                                    .abs().max())


def scenario_bpps_guards(res):
    """backward_passes_per_step=2: zero_grad between passes and a third pass raise, as Horovod."""
    m = make_model(4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), cost_model="off",
                                   backward_passes_per_step=2, min_sparse_numel=0)
    x, y = batch(0, hvd.rank())
    F.cross_entropy(forward(m, x), y).backward()
    try:
        opt.zero_grad()
        res["zero_grad_guard"] = "no error"
    except AssertionError as e:
        res["zero_grad_guard"] = str(e)
    F.cross_entropy(forward(m, x), y).backward()
    try:
        F.cross_entropy(forward(m, x), y).backward()
        res["third_pass_guard"] = "no error"
    except AssertionError as e:
        res["third_pass_guard"] = str(e)
    opt.step()
    opt.set_backward_passes_per_step(1)
    opt.zero_grad()
    F.cross_entropy(forward(m, x), y).backward()
    opt.step()
    res["bpps_guard_survived"] = True


def scenario_missing_grad(res):
    """A parameter only rank 0 uses: no hang, identical replicas, the others get zeros+avg."""
    m = make_model(5, extra=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), cost_model="off",
                                   density=0.2,
                                   min_sparse_numel=0)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    side0 = m["side"].weight.detach().clone()
    train(m, opt, 10, use_side=lambda step: hvd.rank() == 0)
    res["missing_grad_params_equal"] = all_equal_digest(flat_params(m))
    res["missing_grad_side_moved"] = float((m["side"].weight.detach() - side0).abs().max())


def scenario_checkpoint(res):
    """Checkpoint at step 50 and resume to 100 equals 100 uninterrupted steps, bitwise."""
    def build():
        m = make_model(6)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=m.named_parameters(), exchange="gradient",
                                       cost_model="off",
                                       density=0.05,
                                       min_sparse_numel=0)
        return m, opt

    m, opt = build()
    train(m, opt, 100)
    straight = flat_params(m).clone()

    m, opt = build()
    train(m, opt, 50)
    ckpt = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict()})
    res["checkpoint_has_residuals"] = all(
        v["uplink"] is not None and v["downlink"] is not None
        for v in ckpt["opt"]["hvd_sparse"]["buckets"].values())
    m2, opt2 = build()
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(m2, opt2, 50, start=50)
    res["checkpoint_resume_bitwise"] = bool(torch.equal(straight, flat_params(m2)))
    res["checkpoint_steps"] = opt2.communication_stats()["steps"]


def scenario_bad_input(res):
    """Bad arguments raise the same clear error on every rank; the job goes on."""
    m = make_model(7)
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    cases = {
        "density_zero": dict(density=0.0),
        "density_above_one": dict(density=1.5),
        "downlink_negative": dict(downlink_density=-0.1),
        "unknown_keyword": dict(denisty=0.1),
        "adasum": dict(op=hvd.Adasum),
        "predivide_with_sum": dict(op=hvd.Sum, gradient_predivide_factor=2.0),
        "bpps_zero": dict(backward_passes_per_step=0),
        "bad_sparsifier": dict(sparsifier="nope"),
    }
    errors = {}
    for name, kwargs in cases.items():
        try:
            hvd.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                     cost_model="off", **kwargs)
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    cm = torch.nn.Linear(3, 3).to(torch.complex64)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(cm.parameters(), lr=0.1),
                                 named_parameters=cm.named_parameters())
        errors["complex_param"] = None
    except TypeError as e:
        errors["complex_param"] = f"TypeError: {e}"
    res["bad_input_errors"] = errors
    hvd.allreduce(torch.ones(1), name="after.bad.input")  # still in step with the others
    res["bad_input_survived"] = True


def scenario_dense_fallback(res):
    """The cost model sends a bucket dense when P * density makes the allgather too big."""
    for det in (True, False):
        m = make_model(8)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                       named_parameters=m.named_parameters(), density=0.7,
                                       cost_model="bytes",
                                       min_sparse_numel=0, deterministic_dense=det)
        train(m, opt, 5)
        s = opt.communication_stats()
        res[f"fallback_det{det}"] = {"selected": s["selected"], "numel": s["numel"],
                                     "equal": all_equal_digest(flat_params(m))}
    m = make_model(8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters(), density=0.01,
                                   cost_model="bytes",
                                   min_sparse_numel=0, deterministic_dense=False)
    train(m, opt, 2)
    s = opt.communication_stats()
    res["no_fallback_selected"] = [s["selected"], s["numel"]]


def scenario_time_cost_model(res):
    """The time rule: the same per-bucket choice on every rank, from agreed measurements; at
    density 0.5 the sparse path moves more bytes than dense and also computes, so it loses."""
    m = make_model(8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters(), density=0.5,
                                   min_sparse_numel=0, calibration_steps=2)
    train(m, opt, 1)
    res["time_before"] = {k: v["mode"] for k, v in
                          opt.communication_stats()["cost_model"]["buckets"].items()}
    train(m, opt, 4, start=1)
    s = opt.communication_stats()
    report = s["cost_model"]
    res["time_report"] = report
    modes = {k: v["mode"] for k, v in report["buckets"].items()}
    res["time_modes_equal"] = all(x == modes for x in hvd.allgather_object(modes))
    res["time_after"] = [s["selected"], s["numel"]]
    res["time_params_equal"] = all_equal_digest(flat_params(m))
    saved = opt.state_dict()["hvd_sparse"]["buckets"]
    res["time_modes_saved"] = {k: v["mode"] for k, v in saved.items()} == modes
    m = make_model(8)  # recalibration every 2 steps after the first 2
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                   named_parameters=m.named_parameters(), density=0.5,
                                   min_sparse_numel=0, calibration_steps=2,
                                   recalibrate_every=2)
    train(m, opt, 6)
    res["time_recalibrated_at"] = opt.communication_stats()["cost_model"]["calibrated_at_step"]


def scenario_index_coding(res):
    """Golomb-Rice positions are lossless on a real exchange: Top-K trains the same bits with
    plain positions and with ``index_coding="golomb"``; under ``"auto"`` the time rule, told
    of a slow link, codes every sparse bucket, alike on every rank."""
    from hvd_sparse.engine import calibration

    def run(coding, cost_model):
        m = make_model(9)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                       named_parameters=m.named_parameters(), density=0.05,
                                       min_sparse_numel=0, collective="allgather",
                                       cost_model=cost_model, calibration_steps=1,
                                       index_coding=coding)
        train(m, opt, 4)
        return m, opt

    digests = {}
    for coding in ("plain", "golomb"):
        m, opt = run(coding, "off")
        digests[coding] = digest(flat_params(m))
    measure = calibration.measure_link
    # 1 kB/s for the allgather, a second for any allreduce: every bucket sparse, coded (at
    # 1 MB/s a slow first step, priced with calibration_steps=1, sent a bucket of 3 ranks'
    # gathered dense copies dense: the sparse path's margin was 10 ms)
    calibration.measure_link = lambda transport, device, large_bytes: [
        1e-4, 1e-4 + transport.size() * large_bytes / 1e3, 1.0, 1.0 + large_bytes / 1e3]
    try:
        m, opt = run("auto", "time")
    finally:
        calibration.measure_link = measure
    buckets = opt.communication_stats()["cost_model"]["buckets"]
    # (a bucket may go dense: at 3 or more ranks dense buckets are gathered too, and for the
    # smallest ones P dense copies cost less than a payload's header)
    codings = {name: (b["mode"], b["index_coding"]) for name, b in buckets.items()}
    res["coding_digests"] = digests
    res["coding_auto"] = codings
    res["coding_auto_equal"] = all(x == codings for x in hvd.allgather_object(codings))
    res["coding_params_equal"] = all_equal_digest(flat_params(m))


def scenario_dense_regions(res):
    """Dense buckets at 3 or more ranks under deterministic_dense (here the dense warm-up):
    large ones summed region by region (an all-to-all, then an allgather) give the bits of the
    gather path, with fewer bytes; a bucket whose length is no multiple of the world size, in
    float32 and float16 on the wire."""
    from hvd_sparse.engine import dense_regions

    def run(regions, compression):
        torch.manual_seed(3)
        m = torch.nn.ModuleDict({"big": torch.nn.Linear(401, 409),  # 164,009 + 409 entries
                                 "small": torch.nn.Linear(20, 5)})
        kw = {"compression": hvd.Compression.fp16} if compression == "fp16" else {}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=m.named_parameters(), exchange="gradient",
                                       dense_warmup_steps=100, **kw)
        saved = dense_regions.REGIONS_FROM_BYTES
        dense_regions.REGIONS_FROM_BYTES = saved if regions else 1 << 62
        try:
            for step in range(4):
                g = torch.Generator().manual_seed(100 * step + hvd.rank())
                x = torch.randn(8, 401, generator=g)
                opt.zero_grad()
                (m["big"](x) ** 2).mean().backward()
                (m["small"](x[:, :20]) ** 2).mean().backward()
                opt.step()
        finally:
            dense_regions.REGIONS_FROM_BYTES = saved
        t = opt.communication_stats()["totals"]
        return flat_params(m), t["bytes_received"]

    for compression in ("none", "fp16"):
        a, got_regions = run(True, compression)
        b, got_gather = run(False, compression)
        res[f"regions_{compression}"] = {
            "same_bits": bool(torch.equal(a, b)), "replicas_equal": all_equal_digest(a),
            "received": [got_regions, got_gather]}


SCENARIOS = [scenario_bad_input, scenario_reference, scenario_bitwise, scenario_dense_equivalence,
             scenario_adam_nothing_sparse,
             scenario_bpps_guards, scenario_missing_grad, scenario_checkpoint,
             scenario_dense_fallback, scenario_time_cost_model, scenario_watch_mixed,
             scenario_watch_mixed_sbc,
             scenario_hybrid_transport, scenario_index_coding, scenario_dense_regions]


if __name__ == "__main__":
    run_scenarios(hvd, SCENARIOS)
