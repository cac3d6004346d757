"""The GPU checks of gpu_check.sh that need no pytest and no Horovod.

    python benchmarks/gpu_check.py kernels OUT.json   # fused forms on CUDA vs definitions
    mpirun -np 2 python benchmarks/gpu_check.py mpi OUT.json   # 2 ranks, one GPU, mpi4py
"""
from __future__ import annotations

import copy
import json
import sys
import traceback

import torch


def check_kernels(path):
    from hvd_sparse.kernels import cuda, select
    from hvd_sparse.sparsifiers import (AdaptiveTopK, GaussianK, HardThreshold,
                                        SelectionContext, SparseBinary, TopK)

    ctx = SelectionContext("b")
    methods = {"topk": TopK, "gaussiank": GaussianK, "sbc": SparseBinary,
               "threshold": lambda: HardThreshold(1.5),
               "adaptive": lambda: AdaptiveTopK(total_steps=10)}
    results, failures = [], 0
    for n, density in ((1000, 0.01), (300_000, 0.001), (1 << 20, 0.01), (3_000_001, 0.001)):
        for kind in ("random", "quantised"):
            gen = torch.Generator().manual_seed(n)
            if kind == "random":
                grad, res = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.3
            else:
                grad = torch.randint(-3, 4, (n,), generator=gen).float()
                res = torch.randint(-1, 2, (n,), generator=gen).float()
            for name, make in methods.items():
                for down in (False, True):
                    row = {"n": n, "density": density, "kind": kind, "method": name,
                           "downlink": down}
                    try:
                        s_fast, s_ref = make(), None
                        s_ref = copy.deepcopy(s_fast)
                        g = None if down else grad.cuda()
                        r_fast = (res + grad).cuda() if down else res.cuda()
                        sel = s_fast.fused(cuda, g, r_fast, density, ctx)
                        if sel is None:
                            row["result"] = "no fused form for this input"
                        else:
                            select.commit(cuda, g, r_fast, sel, sel.values)
                            acc = res + grad
                            idx, vals = s_ref.compress(acc, density, ctx)
                            acc[idx] = acc[idx] - vals
                            ok = (torch.equal(sel.idx.cpu(), idx) and
                                  torch.equal(sel.values.cpu(), vals) and
                                  torch.equal(r_fast.cpu(), acc))
                            row["result"] = "equal" if ok else "DIFFERENT"
                            failures += not ok
                    except Exception:  # noqa: BLE001 - reported, not hidden
                        row["result"] = "ERROR " + traceback.format_exc(limit=3)
                        failures += 1
                    results.append(row)
    out = {"device": torch.cuda.get_device_name(), "failures": failures, "rows": results}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"kernels: {len(results)} cases, {failures} failures")
    return failures == 0


def check_mpi(path):
    """Two ranks on the one GPU over mpi4py: 50 steps per (collective, sparsifier), replicas
    compared bit for bit."""
    import hvd_sparse.mpi as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    runs = {}
    cases = [(c, s, 512, 0.0) for c in ("allgather", "sharded")
             for s in ("topk", "gaussiank", "sbc")]
    cases.append(("sharded", "topk", 8192, 0.0))  # a 2M-entry layer: the global threshold rule
    cases.append(("allgather", "topk", 512, 0.5))  # a floor per tensor in the one bucket
    for collective, sparsifier, width, floor in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 10)).cuda()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), density=0.01, cost_model="off",
            min_sparse_numel=0, collective=collective, sparsifier=sparsifier,
            layer_floor=floor, scope="model" if floor else "tensor")
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(50):
            x = torch.randn(32, 256, generator=gen).cuda()
            y = torch.randint(0, 10, (32,), generator=gen).cuda()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        digests = hvd.allgather_object(flat.numpy().tobytes())
        runs[f"{collective}/{sparsifier}/width{width}" + (f"/floor{floor}" if floor else "")] = {
            "replicas_identical": all(d == digests[0] for d in digests),
            "finite": bool(torch.isfinite(flat).all()),
            "stats": opt.communication_stats()}
    same = all(r["replicas_identical"] and r["finite"] for r in runs.values())
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "ranks": size,
                       "replicas_identical": same, "runs": runs}, f, indent=1, default=str)
        for name, r in runs.items():
            print(f"mpi {name}: {size} ranks on one GPU, replicas identical: "
                  f"{r['replicas_identical']}")
    return same


if __name__ == "__main__":
    what, dest = sys.argv[1], sys.argv[2]
    ok = check_kernels(dest) if what == "kernels" else check_mpi(dest)
    sys.exit(0 if ok else 1)
