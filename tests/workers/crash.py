"""A rank dies in the middle of a step (after backward, before synchronisation completes).
The others must end with an error within a bounded time, not hang."""
import os
import sys
import time

import torch
import torch.nn.functional as F

import hvd_sparse as hvd

hvd.init()
torch.manual_seed(0)
m = torch.nn.Linear(64, 8)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters(), density=0.1,
                               min_sparse_numel=0)
for step in range(1000):
    x = torch.randn(16, 64)
    opt.zero_grad()
    F.cross_entropy(m(x), torch.randint(0, 8, (16,))).backward()
    if step == 5 and hvd.rank() == 1:
        print(f"rank 1 exits during step {step} at {time.time():.3f}", flush=True)
        os._exit(3)
    opt.step()
print(f"rank {hvd.rank()} finished without noticing", flush=True)
sys.exit(0)
