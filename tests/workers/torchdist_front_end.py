"""hvd_sparse.torchdist, Horovod's training API over torch.distributed, under torchrun (run by
tests/test_torch_transport.py): the helpers a script calls around its optimizer. Each rank
writes OUTDIR/rank<r>.json."""
import json
import os
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import hvd_sparse.torchdist as hvd

torch.set_num_threads(1)


def main(outdir):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    res = {"rank": rank, "size": size, "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size()}
    try:
        torch.manual_seed(rank)  # different weights per rank until the broadcast
        m = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
        hvd.broadcast_parameters(m.state_dict(), root_rank=1)
        res["weights_from_root"] = hvd.allgather_object(
            m[0].weight.detach().numpy().tobytes()) == [m[0].weight.detach().numpy().tobytes()] * size
        torch.manual_seed(1)
        res["root_weights_kept"] = bool(torch.equal(
            m[0].weight.detach(), torch.nn.Linear(30, 64).weight.detach()))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=m.named_parameters(), density=0.05,
                                       cost_model="off")
        for i in range(12):
            g = torch.Generator().manual_seed(100 * rank + i)
            opt.zero_grad()
            F.cross_entropy(m(torch.randn(8, 30, generator=g)),
                            torch.randint(0, 5, (8,), generator=g)).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        res["replicas_identical"] = len(set(hvd.allgather_object(flat.numpy().tobytes()))) == 1
        res["transport"] = opt.communication_stats()["transport"]
        # a fresh optimizer takes rank 0's state: momentum buffers and hyper-parameters
        fresh = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.5 if rank else 0.01, momentum=0.9),
            named_parameters=m.named_parameters(), density=0.05, cost_model="off")
        fresh.load_state_dict(opt.state_dict()) if rank == 0 else None
        hvd.broadcast_optimizer_state(fresh, root_rank=0)
        res["lr_after_broadcast"] = fresh.param_groups[0]["lr"]
        res["momentum_buffers"] = sum("momentum_buffer" in s for s in fresh.state.values())
        t = torch.full((3,), float(rank + 1))
        res["average"] = hvd.allreduce(t).tolist()
        res["sum"] = hvd.allreduce(t, op=hvd.Sum).tolist()
        # fp16 compression as Horovod's: 1 + 2^-12 (rank 0) does not survive half precision
        fine = torch.full((2,), 1.0 + 2.0 ** -12 if rank == 0 else 1.0, dtype=torch.float64)
        half = hvd.allreduce(fine, op=hvd.Sum, compression=hvd.Compression.fp16)
        res["fp16_sum"] = [str(half.dtype)] + half.tolist()
        res["object"] = hvd.broadcast_object({"from": rank}, root_rank=size - 1)
        import threading  # an object one rank cannot pickle: a TypeError on every rank
        for key, call in (("unpicklable", lambda: hvd.broadcast_object(
                              threading.Lock() if rank == 0 else None, root_rank=0)),
                          ("unpicklable_gather", lambda: hvd.allgather_object(
                              threading.Lock() if rank == 1 else rank))):
            try:
                call()
            except TypeError as e:
                res[key] = str(e)
        ints = torch.tensor([rank + 1, -3 * rank - 1])
        res["int_average"] = hvd.allreduce(ints).tolist()  # truncated toward zero
        res["int_sum"] = hvd.allreduce(ints, op=hvd.Sum).tolist()
        res["min_max_product"] = [hvd.allreduce(ints, op=op).tolist()
                                  for op in (hvd.Min, hvd.Max, hvd.Product)]
        # integers with scale factors, as Horovod scales them (refused before)
        res["int_scaled"] = [
            hvd.allreduce(ints, prescale_factor=0.5, postscale_factor=3.0).tolist(),
            hvd.allreduce(ints, op=hvd.Max, prescale_factor=2.0, postscale_factor=0.5).tolist(),
            hvd.allreduce(ints, op=hvd.Sum, postscale_factor=0.5).tolist()]
        x = torch.full((2,), float(rank + 1), requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum) * (rank + 1)).sum().backward()
        res["allreduce_grad"] = x.grad.tolist()  # the sum over ranks of each one's weight
        rows = torch.full((rank + 1, 2), float(rank), requires_grad=True)
        gathered = hvd.allgather(rows)
        res["allgather"] = gathered.tolist()
        (gathered * (rank + 1)).sum().backward()
        res["allgather_grad"] = rows.grad.tolist()
        hvd.barrier()
        try:
            hvd.broadcast_object(1, root_rank=size)
            res["bad_root"] = None
        except ValueError as e:
            res["bad_root"] = type(e).__name__
        b = torch.full((3,), float(rank))
        hvd.broadcast_(b, root_rank=1)
        res["broadcast_"] = b.tolist()
        res["broadcast"] = hvd.broadcast(torch.tensor([rank]), root_rank=0).tolist()
        # a peer's probe of the front end against Horovod's answers:
        y = torch.full((2,), float(rank + 1), requires_grad=True)
        (hvd.broadcast(y, root_rank=1) * (rank + 1)).sum().backward()
        res["broadcast_grad"] = y.grad.tolist()  # averaged, kept by the root
        res["numpy_root"] = hvd.broadcast_object(rank, root_rank=np.int64(1))

        class Local:  # a local class and a lambda travel (cloudpickle, as Horovod's)
            v = 7
        res["lambda"] = hvd.broadcast_object(lambda q: q + rank, root_rank=0)(1)
        res["local_class"] = [o.v for o in hvd.allgather_object(Local())]
        mismatched = {}
        for case, t in (("shape", torch.zeros(3 + rank)), ("dtype", torch.zeros(
                3, dtype=torch.float32 if rank == 0 else torch.float64))):
            try:
                hvd.allreduce(t)
                mismatched[case] = None
            except hvd.HorovodInternalError as e:
                mismatched[case] = str(e)[:60]
        try:
            hvd.allgather(torch.zeros(2, 3) if rank == 0 else torch.zeros(3, 2))
            mismatched["allgather"] = None
        except hvd.HorovodInternalError as e:
            mismatched["allgather"] = str(e)[:60]
        a, b = torch.full((2,), 1.0 + rank), torch.full((2,), 100.0 * (rank + 1))
        try:  # equal shapes in another order on each rank: refused by name, never swapped
            pairs = [("td.A", a), ("td.B", b)] if rank == 0 else [("td.B", b), ("td.A", a)]
            [hvd.allreduce(t, name=n, op=hvd.Sum) for n, t in pairs]
            mismatched["names"] = None
        except hvd.HorovodInternalError as e:
            mismatched["names"] = str(e)[:60]
        for case, params in (  # Horovod's check of broadcast_parameters' tensors
                ("bcast_params_dtype", {"w": torch.zeros(8) if rank == 0 else
                                        torch.zeros(4, dtype=torch.float64)}),
                ("bcast_params_shape", {"w": torch.zeros(2, 3) if rank == 0 else
                                        torch.zeros(3, 2)}),
                ("bcast_params_count", {"a": torch.zeros(3), **(
                    {"b": torch.zeros(2)} if rank == 1 else {})})):
            try:  # (reinterpreted bytes, a silent reshape and a hang before)
                hvd.broadcast_parameters(params, root_rank=0)
                mismatched[case] = None
            except hvd.HorovodInternalError as e:
                mismatched[case] = str(e)[:60]
        res["mismatched"] = mismatched
        # a tensor that requires grad on one rank only (a parameter on the root): the same
        # collectives on every rank (an extra gather of the row counts on the root had the
        # others read its bytes as their rows)
        mixed = torch.full((rank + 1, 2), float(rank), requires_grad=rank == 0)
        res["allgather_grad_on_one_rank"] = hvd.allgather(mixed).tolist()
        res["allgather_empty_rows"] = list(hvd.allgather(torch.zeros(rank + 1, 0)).shape)
        # a parameter on the root, a plain tensor elsewhere, one name: Horovod's common case
        src = torch.nn.Parameter(torch.full((3,), 7.0)) if rank == 0 else torch.zeros(3)
        res["broadcast_param_or_tensor"] = hvd.broadcast(src, root_rank=0, name="w").tolist()
        try:
            hvd.allreduce(t, average=True, op=hvd.Sum)
            res["op_and_average"] = None
        except ValueError as e:
            res["op_and_average"] = type(e).__name__
    except Exception:  # noqa: BLE001 - reported to the test
        res["error"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    hvd.barrier()  # every rank done before gloo is torn down (see torch_transport_scenarios)
    hvd.shutdown()
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization: see torch_transport_scenarios


if __name__ == "__main__":
    main(sys.argv[1])
