"""hvd_sparse.mpi (no Horovod): one rank leaves while the others go on. Under Horovod their
next collective fails with HorovodInternalError ('Horovod has been shut down'); under plain MPI
they waited for the leaver for ever. Each rank prints one line ``RESULT <json>``.

    leave_mpi.py exit CODE   rank 1 calls sys.exit(CODE) before step 5's exchange
    leave_mpi.py shutdown    rank 1 calls hvd.shutdown() and returns; rank 0 broadcasts
    leave_mpi.py late        rank 0 finishes first; rank 1 waits for their last collective
                             only after rank 0 has gone (it completes), then starts another
    leave_mpi.py local_error the root of broadcast_object fails between the object's size
                             and its bytes (an error on it alone, after the ranks agreed
                             on the broadcast); it leaves, the others raise
    leave_mpi.py unpicklable the root cannot pickle its object: every rank raises the same
                             TypeError, and the job goes on
    leave_mpi.py finalize    every rank calls MPI.Finalize() itself before exit
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

sys.modules["horovod"] = None  # the mpi4py path never needs Horovod
import hvd_sparse.mpi as hvd  # noqa: E402

mode = sys.argv[1]
hvd.init()
me = hvd.rank()
res = {"rank": me, "error": None}


def report():
    print("RESULT " + json.dumps(res), flush=True)


if mode == "exit":
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), density=0.1,
                                   min_sparse_numel=0)
    try:
        for step in range(50):
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(16, 64)), torch.randint(0, 8, (16,))).backward()
            if step == 5 and me == 1:
                res["left_at"] = step
                report()
                sys.exit(int(sys.argv[2]))
            opt.step()
            hvd.allreduce(torch.ones(1), name="metric")
        res["steps"] = step + 1
    except hvd.HorovodInternalError as e:
        res["error"], res["at_step"] = str(e), step
elif mode == "shutdown":
    hvd.allreduce(torch.ones(1), name="before")
    if me == 1:
        hvd.shutdown()
        res["left"] = True
    else:
        time.sleep(0.5)
        try:
            hvd.broadcast_object({"x": 1}, root_rank=0)
        except hvd.HorovodInternalError as e:
            res["error"] = str(e)
elif mode == "late":
    h = hvd.allreduce_async(torch.full((4,), float(me + 1)), name="last")
    if me == 1:
        time.sleep(2.0)  # rank 0 has finished and left by now
    res["last"] = hvd.synchronize(h).tolist()
    if me == 1:
        try:
            hvd.allreduce(torch.ones(1), name="one more")
        except hvd.HorovodInternalError as e:
            res["error"] = str(e)
elif mode == "local_error":
    if me == 0:
        def fail(buf, root_rank):
            raise RuntimeError("the root gives up")

        hvd._bcast_bytes = fail  # (the size went out; the bytes never follow)
    try:
        hvd.broadcast_object({"x": 1}, root_rank=0)
    except hvd.HorovodInternalError as e:
        res["error"] = str(e)
    except RuntimeError:
        res["left"] = True  # the root gives up and leaves
elif mode == "unpicklable":
    import threading

    try:
        hvd.broadcast_object(threading.Lock() if me == 0 else None, root_rank=0)
    except TypeError as e:
        res["error"] = str(e)
    try:
        hvd.allgather_object(threading.Lock() if me == 1 else me)
    except TypeError as e:
        res["error_gather"] = str(e)
    res["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
elif mode == "finalize":
    from mpi4py import MPI

    res["sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    MPI.Finalize()
report()
