"""hvd_sparse.mpi (no Horovod): rank 1 raises in the middle of training. Under Horovod every
rank then gets HorovodInternalError and the job ends; under plain MPI the raising rank waited
in MPI_Finalize and rank 0 in its next collective, for ever. The job must end, with an error."""
import sys

import torch
import torch.nn.functional as F

sys.modules["horovod"] = None  # the mpi4py path never needs Horovod
import hvd_sparse.mpi as hvd  # noqa: E402

hvd.init()
torch.manual_seed(0)
m = torch.nn.Linear(64, 8)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters(), density=0.1,
                               min_sparse_numel=0)
for step in range(1000):
    opt.zero_grad()
    F.cross_entropy(m(torch.randn(16, 64)), torch.randint(0, 8, (16,))).backward()
    if step == 5 and hvd.rank() == 1:
        raise RuntimeError("rank 1 fails during step 5")
    opt.step()
    hvd.allreduce(torch.ones(1), name="metric")
print(f"rank {hvd.rank()} finished without noticing", flush=True)
