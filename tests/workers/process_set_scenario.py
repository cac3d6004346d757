"""Horovod process sets (``process_set=``): 4 ranks in two static sets, each set wrapping its
optimizer with its own set, as Horovod's optimizer tests do (run by
tests/test_horovod_parity.py). Each rank writes OUTDIR/rank<r>.json."""
import json
import os
import sys

import torch
import torch.nn.functional as F

import horovod.torch as real
import hvd_sparse as hvd

torch.set_num_threads(1)


def main(outdir):
    even, odd = real.ProcessSet([0, 2]), real.ProcessSet([1, 3])
    hvd.init(process_sets=[even, odd])
    mine = even if hvd.rank() % 2 == 0 else odd
    res = {"rank": hvd.rank()}
    for name, base in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
        opt = hvd.DistributedOptimizer(base(m.parameters()), named_parameters=m.named_parameters(),
                                       process_set=mine, density=0.05)
        for i in range(5):
            g = torch.Generator().manual_seed(i + 10 * hvd.rank())
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(8, 50, generator=g)),
                            torch.randint(0, 10, (8,), generator=g)).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).unsqueeze(0)
        everyone = hvd.allgather(flat)  # the global set: compare within and across sets
        res[f"{name}_even_equal"] = bool(torch.equal(everyone[0], everyone[2]))
        res[f"{name}_odd_equal"] = bool(torch.equal(everyone[1], everyone[3]))
        res[f"{name}_sets_differ"] = not torch.equal(everyone[0], everyone[1])
    with open(os.path.join(outdir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(res, f)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
