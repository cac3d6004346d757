"""One short run under whatever Horovod run-time settings the environment holds
(``HOROVOD_AUTOTUNE``, ``HOROVOD_CACHE_CAPACITY``, ``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_TIMELINE``...): sparse and dense buckets, gradients (SGD) and updates (Adam)
exchanged; with ``KNOBS_TIMELINE`` set, a timeline started and stopped from the script
(Horovod's ``start_timeline``). Run by tests/test_horovod_parity.py, which compares the runs'
weights. Each rank writes OUTDIR/rank<r>.json."""
import hashlib
import json
import os
import sys

import torch
import torch.nn.functional as F

import hvd_sparse as hvd

torch.set_num_threads(1)


def weights_after(base, sparsifier):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64),
                            torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(m.state_dict(), 0)
    opt = hvd.DistributedOptimizer(base(m.parameters()), named_parameters=m.named_parameters(),
                                   density=0.02, min_sparse_numel=5000, cost_model="off",
                                   sparsifier=sparsifier)
    for i in range(12):
        g = torch.Generator().manual_seed(i * 7 + hvd.rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes()
                                 for p in m.parameters())).hexdigest()


def main(outdir):
    hvd.init()
    timeline = os.environ.get("KNOBS_TIMELINE")
    if timeline:
        hvd.start_timeline(timeline)
    res = {"rank": hvd.rank()}
    for name, base, sparsifier in (
            ("sgd_topk", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), "topk"),
            ("adam_sbc", lambda ps: torch.optim.Adam(ps, lr=1e-3), "sbc")):
        res[name] = weights_after(base, sparsifier)
    if timeline:
        hvd.stop_timeline()
    with open(os.path.join(outdir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
