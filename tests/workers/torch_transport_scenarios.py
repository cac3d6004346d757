"""The same training runs over ``torch.distributed`` (under torchrun, gloo) or over mpi4py (under
mpirun), so tests/test_torch_transport.py can check that the two transports give bitwise the
same models. Each rank writes OUTDIR/rank<r>.json.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/workers/torch_transport_scenarios.py OUTDIR torch
    mpirun -np 2 python tests/workers/torch_transport_scenarios.py OUTDIR mpi
"""
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

torch.set_num_threads(1)

# (name, optimizer, DistributedOptimizer keywords): the allgather and the sharded (all-to-all)
# exchanges, the dense path (every tensor below min_sparse_numel: allreduce), weight updates
# exchanged under AdamW, and two other methods
RUNS = [
    ("topk_allgather", "sgd", dict(collective="allgather")),
    ("topk_sharded", "sgd", dict(collective="sharded", sharded_selection="region")),
    ("dense_by_size", "sgd", dict(min_sparse_numel=10**9)),
    ("adamw_updates", "adamw", dict(exchange="update")),
    ("sbc", "sgd", dict(sparsifier="sbc")),
    ("gaussiank_model", "sgd", dict(sparsifier="gaussiank", scope="model")),
    # a dense bucket of 347 kB: from 3 ranks summed by regions (all-to-all, then allgather)
    ("dense_regions", "sgd", dict(dense_warmup_steps=100, wide=True)),
]


def model(wide=False):
    torch.manual_seed(0)
    if wide:
        return torch.nn.Sequential(torch.nn.Linear(40, 1700), torch.nn.ReLU(),
                                   torch.nn.Linear(1700, 10))
    return torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.ReLU(),
                               torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(hvd_sparse, transport, rank, base, options, steps=25):
    options = dict(options)
    wide = options.pop("wide", False)
    m = model(wide)
    inner = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) if base == "sgd"
             else torch.optim.AdamW(m.parameters(), lr=3e-3))
    if base == "sgd":  # its gradients: the runs cover the gradient paths, AdamW the updates
        options.setdefault("exchange", "gradient")
    opt = hvd_sparse.DistributedOptimizer(inner, named_parameters=m.named_parameters(),
                                          density=0.05, cost_model="off", transport=transport,
                                          **options)
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + i)
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(16, 40, generator=g)),
                        torch.randint(0, 10, (16,), generator=g)).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    stats = opt.communication_stats()
    return {"digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "moved": float((flat - torch.cat([p.detach().reshape(-1)
                                              for p in model(wide).parameters()])).abs().max()),
            "bytes_sent": stats["totals"]["bytes_sent"],
            "bytes_received": stats["totals"]["bytes_received"],
            "dense_bytes": stats["totals"]["dense_bytes"],
            "transport": stats["transport"]}


def main(outdir, mode):
    import hvd_sparse

    if mode == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        transport = None  # picked by itself: the process group is up, Horovod is not
    else:
        import hvd_sparse.mpi as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        transport = "mpi"
    res = {"rank": rank, "size": size, "mode": mode, "runs": {}, "errors": {}}
    for name, base, options in RUNS:
        try:
            res["runs"][name] = train(hvd_sparse, transport, rank, base, options)
        except Exception:  # noqa: BLE001 - reported to the test
            res["errors"][name] = traceback.format_exc()
    if not res["errors"]:
        del res["errors"]
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if mode == "torch":
        dist.barrier()
        dist.destroy_process_group()
        # a rare SIGABRT ("terminate called without an active exception") at interpreter exit
        # under torchrun, 3 ranks on 2 cores, after every result was written and the group
        # destroyed (twice in about 15 full runs; not reproduced alone): the results are what
        # this test checks, so the process leaves without the interpreter's finalization
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
