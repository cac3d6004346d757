"""hvd_sparse over torch.distributed (transport="torch", picked by itself under torchrun): the
same models, bit for bit, as over mpi4py, and clear errors where no process group is up."""
import importlib.util
import shutil
import sys

import pytest
import torch

from conftest import run_ranks


def _results(launcher, ranks, tmp_path, mode, env=None):
    out = tmp_path / f"{mode}-{ranks}"
    out.mkdir()
    proc, results = run_ranks(launcher, ranks, "torch_transport_scenarios.py", out, mode,
                              env=env)
    for r in results:
        assert "errors" not in r, f"rank {r['rank']} failed:\n" + "\n".join(r["errors"].values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 3])
def test_torchrun_trains_bitwise_as_the_mpi_transport(tmp_path, ranks):
    if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("the comparison runs the mpi4py transport too (run launch/setup.sh)")
    over_torch = _results("torchrun", ranks, tmp_path, "torch")
    over_mpi = _results("mpirun", ranks, tmp_path, "mpi")
    runs = over_torch[0]["runs"]
    assert set(runs) == {"topk_allgather", "topk_sharded", "dense_by_size", "adamw_updates",
                         "sbc", "gaussiank_model", "dense_regions"}
    for t, m in zip(over_torch, over_mpi):
        assert t["size"] == m["size"] == ranks
        for name, run in t["runs"].items():
            assert run["transport"] == "TorchDistributedTransport"  # picked by itself
            assert m["runs"][name]["transport"] == "MPITransport"
            # replicas agree, and equal what the mpi4py transport trains
            assert run["digest"] == over_torch[0]["runs"][name]["digest"], name
            assert run["digest"] == m["runs"][name]["digest"], name
            assert run["moved"] > 1e-3, name
            assert run["bytes_sent"] == m["runs"][name]["bytes_sent"] > 0, name
    # the runs really differ from one another (the exchange paths are not one path)
    assert len({run["digest"] for run in runs.values()}) == len(runs)
    assert runs["topk_allgather"]["bytes_sent"] < runs["dense_by_size"]["bytes_sent"] / 5
    # regions from 3 ranks: about two (P - 1) / P shares of the vector, not P - 1 copies
    regions = runs["dense_regions"]
    if ranks > 2:
        assert regions["bytes_received"] < 0.8 * (ranks - 1) * regions["dense_bytes"]
    else:
        assert regions["bytes_received"] == regions["dense_bytes"]


def test_transport_torch_without_a_process_group_says_what_to_do():
    import hvd_sparse
    from hvd_sparse.transport import make_transport

    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        make_transport("torch")
    m = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=m.named_parameters(), transport="torch")
    with pytest.raises(ValueError, match="'torch'"):
        make_transport("nccl")


def test_a_one_process_group_is_picked_and_trains(tmp_path):
    """transport=None picks torch.distributed once a group is up (and Horovod is not), and a
    one-process group steps like the wrapped optimizer (every bucket sent and received whole)."""
    import torch.distributed as dist

    import hvd_sparse
    from hvd_sparse.torch_transport import TorchDistributedTransport
    from hvd_sparse.transport import make_transport

    try:
        import horovod.torch as hvd_real
        if hvd_real.is_initialized():
            pytest.skip("Horovod is initialised in this process: it is picked first")
    except ImportError:
        pass
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert isinstance(make_transport(None), TorchDistributedTransport)
        torch.manual_seed(0)
        a, b = torch.nn.Linear(2000, 3), torch.nn.Linear(2000, 3)
        b.load_state_dict(a.state_dict())
        w0 = a.weight.detach().clone()
        opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                              named_parameters=a.named_parameters(),
                                              density=0.01, cost_model="off")
        plain = torch.optim.SGD(b.parameters(), lr=0.1)
        x = torch.randn(8, 2000)
        for o, m in ((opt, a), (plain, b)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
        assert opt.communication_stats()["transport"] == "TorchDistributedTransport"
        moved = a.weight.detach() != w0
        # the weight's Top-K (ceil(0.01 * 6000) entries) moved exactly as under plain SGD, the
        # rest waits in the residual; the 3-entry bias went dense, whole
        assert int(moved.sum()) == 60
        assert torch.equal(a.weight.detach()[moved], b.weight.detach()[moved])
        assert torch.equal(a.bias.detach(), b.bias.detach())
        assert opt.communication_stats()["totals"]["bytes_sent"] > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_torchdist_gives_horovods_helpers_under_torchrun(tmp_path):
    proc, results = run_ranks("torchrun", 2, "torchdist_front_end.py", tmp_path)
    for r in results:
        assert "error" not in r, r["error"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in results:
        assert r["size"] == 2 and r["local_size"] == 2 and r["local_rank"] == r["rank"]
        assert r["weights_from_root"] and r["root_weights_kept"]
        assert r["replicas_identical"] and r["transport"] == "TorchDistributedTransport"
        assert r["lr_after_broadcast"] == 0.05  # rank 0's, loaded from the trained optimizer
        assert r["momentum_buffers"] == 4
        assert r["average"] == [1.5] * 3 and r["sum"] == [3.0] * 3
        # compressed to half, reduced, back to the input's dtype: the 2^-12 is gone
        assert r["fp16_sum"] == ["torch.float64", 2.0, 2.0]
        assert r["bad_root"] == "ValueError"  # a root outside the job, on every rank
        assert r["object"] == {"from": 1}
        assert "broadcast_object: rank 0 could not pickle" in r["unpicklable"]
        assert "allgather_object: rank 1 could not pickle" in r["unpicklable_gather"]
        # ints [1, -1] and [2, -4]: Horovod's integer average truncates toward zero
        assert r["int_average"] == [1, -2] and r["int_sum"] == [3, -5]
        assert r["min_max_product"] == [[1, -4], [2, -1], [2, 4]]
        # each rank's ints scaled in double and truncated, the sum's average folded into the
        # postscale and truncated once: [0, 0] + [1, -2] -> [1, -2] * 1.5; max of [2, -2] and
        # [4, -8] -> [4, -2] * 0.5; [3, -5] * 0.5
        assert r["int_scaled"] == [[1, -3], [2, -1], [1, -2]]
        assert r["allreduce_grad"] == [3.0, 3.0]  # weights 1 and 2, summed back
        assert r["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        # Horovod's allgather gradient is the average over ranks (weights 1 and 2)
        assert r["allgather_grad"] == [[1.5, 1.5]] * (r["rank"] + 1)
        assert r["broadcast_"] == [1.0] * 3 and r["broadcast"] == [0]
        assert r["broadcast_grad"] == ([1.5, 1.5] if r["rank"] == 1 else [0.0, 0.0])
        assert r["numpy_root"] == 1
        assert r["lambda"] == 1 and r["local_class"] == [7, 7]
        assert all(v is not None and "Mismatched" in v for v in r["mismatched"].values()), \
            r["mismatched"]
        assert {"bcast_params_dtype", "bcast_params_shape", "bcast_params_count"} \
            <= set(r["mismatched"])
        assert r["allgather_grad_on_one_rank"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert r["allgather_empty_rows"] == [3, 0]
        assert r["op_and_average"] == "ValueError"
        assert r["broadcast_param_or_tensor"] == [7.0] * 3


@pytest.mark.multirank
def test_training_cli_under_torchrun(tmp_path):
    """python -m hvd_sparse.train --transport torch --ranks 2: relaunched under torchrun, it
    trains, and its dense control is hvd_sparse at density 1."""
    import json
    import subprocess

    from conftest import ROOT, _env

    for optimizer in ("sparse", "dense"):
        metrics = tmp_path / f"{optimizer}.jsonl"
        cmd = [sys.executable, "-m", "hvd_sparse.train", "--transport", "torch", "--ranks", "2",
               "--optimizer", optimizer, "--epochs", "2", "--train-limit", "2048",
               "--test-limit", "500", "--metrics", str(metrics), "--cost-model", "off",
               "--exchange", "gradient", "--no-progress"]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rec = json.loads(metrics.read_text().splitlines()[-1])
        assert rec["ranks"] == 2 and rec["steps"] == 2 * (2048 // 2 // 64)
        assert rec["test_accuracy"] > 0.3  # well above chance (0.1)
        if optimizer == "sparse":
            assert rec["bytes_sent"] * 10 < rec["dense_bytes"]
