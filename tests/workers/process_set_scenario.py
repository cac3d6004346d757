"""Horovod process sets (``process_set=``): 4 ranks in two static sets, each set wrapping its
optimizer with its own set, as Horovod's optimizer tests do; then every rank wrapping with a
set that leaves ranks 2 and 3 out, where those train on their own gradient as with Horovod's
optimizer (run by tests/test_horovod_parity.py). Each rank writes OUTDIR/rank<r>.json."""
import json
import os
import sys

import torch
import torch.nn.functional as F

import horovod.torch as real
import hvd_sparse as hvd

torch.set_num_threads(1)


def main(outdir):
    even, odd, first = real.ProcessSet([0, 2]), real.ProcessSet([1, 3]), real.ProcessSet([0, 1])
    hvd.init(process_sets=[even, odd, first])
    mine = even if hvd.rank() % 2 == 0 else odd
    res = {"rank": hvd.rank()}
    for name, base in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2))):
        m = model()
        opt = hvd.DistributedOptimizer(base(m.parameters()), named_parameters=m.named_parameters(),
                                       process_set=mine, density=0.05)
        flat = train(m, opt).unsqueeze(0)
        everyone = hvd.allgather(flat)  # the global set: compare within and across sets
        res[f"{name}_even_equal"] = bool(torch.equal(everyone[0], everyone[2]))
        res[f"{name}_odd_equal"] = bool(torch.equal(everyone[1], everyone[3]))
        res[f"{name}_sets_differ"] = not torch.equal(everyone[0], everyone[1])
    res.update(outside_the_set(first))
    with open(os.path.join(outdir, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(res, f)
    hvd.shutdown()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def train(m, opt):
    """Five steps on this rank's own batches; the weights after them, flat."""
    for i in range(5):
        g = torch.Generator().manual_seed(i + 10 * hvd.rank())
        opt.zero_grad()
        F.cross_entropy(m(torch.randn(8, 50, generator=g)),
                        torch.randint(0, 10, (8,), generator=g)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def outside_the_set(first):
    """Every rank wraps with ``first`` ([0, 1]): 0 and 1 exchange, 2 and 3 step alone, the
    same weights as a plain local optimizer on their own batches, and can still checkpoint."""
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=m.named_parameters(), process_set=first,
                                   density=0.05)
    mine = train(m, opt)
    ref = model()
    alone = train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    # named: the two ranks in the set made more collectives, and an unnamed one takes its name
    # from the process's count of them (as under Horovod's own optimizer)
    everyone = hvd.allgather(mine.unsqueeze(0), name="outside_the_set.weights")
    return {"first_pair_equal": bool(torch.equal(everyone[0], everyone[1])),
            "first_equals_local": bool(torch.equal(mine, alone)),
            "first_state_dict": "hvd_sparse" in opt.state_dict()}


if __name__ == "__main__":
    main(sys.argv[1])
