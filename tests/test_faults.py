"""Never hang, never drift, never lose a residual: real 2-3 rank runs, each with a timeout."""
import subprocess
import time

import pytest
import torch

import hvd_sparse
from conftest import WORKERS, _env, launch_command, run_ranks
from hvd_sparse import wire
from hvd_sparse.transport import LocalTransport

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def faults(request, tmp_path_factory, mpi_available):
    out = tmp_path_factory.mktemp(f"faults-{request.param}")
    proc, results = run_ranks("mpirun", request.param, "fault_scenarios.py", out, timeout=300)
    for r in results:
        assert "errors" not in r, "\n".join(r["errors"].values())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results


def test_replica_verification_names_the_diverging_tensor(faults):
    for r in faults:
        assert r["verify_clean"]
        assert r["verify_error"] is not None, "a rank-local change went unnoticed"
        assert "'2.bias'" in r["verify_error"] and "rank(s) [1]" in r["verify_error"]
        assert r["verify_error_step"] < 60
    assert len({r["verify_error_step"] for r in faults}) == 1  # the same step on every rank


@pytest.mark.parametrize("case,word", [("extra_layer", "buckets"), ("shape", "numel"),
                                       ("density", "density"), ("bpps", "backward_passes"),
                                       ("sparsifier", "sparsifier"),
                                       ("optimizer", "'optimizer' is 'SGD' on rank 0 but "
                                                     "'AdamW'"),
                                       ("dense_order", "buckets"), ("packed_order", "buckets")])
def test_mismatched_ranks_fail_clearly_on_every_rank(faults, case, word):
    for r in faults:
        msg = r["mismatch"][case]
        assert msg is not None, f"{case}: rank {r['rank']} noticed nothing"
        assert word in msg, msg


def test_nonfinite_gradient_raises_on_every_rank_and_stays_out_of_residuals(faults):
    for r in faults:
        msg = r["nonfinite_raise_error"]
        # the bucket named by its first tensor (short tensors share one)
        assert msg is not None and "rank(s) [1]" in msg and "bucket '0.weight" in msg
        if r["rank"] == 1:
            assert "0.weight" in msg.split("this rank:")[1]
        assert r["nonfinite_raise_residual_finite"]
        assert r["nonfinite_raise_params_unchanged"]
        assert r["nonfinite_raise_then_identical"]


def test_nonfinite_gradient_skip_is_consistent(faults):
    for r in faults:
        assert r["nonfinite_skip_error"] is None
        assert r["nonfinite_skip_params_unchanged"]  # no rank stepped
        assert r["nonfinite_skip_residual_rolled_back"]  # nothing half-applied
        assert r["nonfinite_skip_residual_finite"]
        assert r["nonfinite_skip_then_identical"]


def test_elastic_torch_state_keeps_error_feedback(faults):
    for r in faults:
        assert r["elastic_restore_uplink"] and r["elastic_restore_params"]
        assert r["elastic_sync_keeps_own_uplink"]
        assert r["elastic_sync_downlink_identical"]
        assert r["elastic_trains_after_sync"]


def test_checkpoint_from_another_rank_count_follows_the_rule(faults):
    for r in faults:
        assert r["other_size_downlink_restored"]
        assert r["other_size_uplink_fresh"]
        assert r["other_size_trains"]


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_a_dying_rank_ends_the_job_in_bounded_time(launcher, mpi_available):
    cmd = launch_command(launcher, 2, WORKERS / "crash.py")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{launcher}: the surviving rank hung after its peer died")
    took = time.perf_counter() - start
    assert proc.returncode != 0, "the job reported success although a rank died"
    assert "finished without noticing" not in proc.stdout
    assert took < 120


def test_an_exception_on_one_rank_ends_an_mpi4py_job(mpi4py_available):
    """hvd_sparse.mpi: an uncaught exception on one rank aborts the job (its traceback
    first), as Horovod's shutdown ends its ranks; it used to hang every rank (a peer's probe)."""
    cmd = launch_command("mpirun", 2, WORKERS / "crash_mpi.py")
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung after an exception on rank 1")
    assert proc.returncode != 0
    assert "rank 1 fails during step 5" in proc.stderr
    assert "aborting the job" in proc.stderr
    assert "finished without noticing" not in proc.stdout


def _leave_run(np_, *args, timeout=90):
    """tests/workers/leave_mpi.py on ``np_`` ranks: (process, {rank: its RESULT line})."""
    import json

    cmd = launch_command("mpirun", np_, WORKERS / "leave_mpi.py", *args)
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"leave_mpi.py {' '.join(args)}: the ranks that stayed hung")
    # ranks share the launcher's stdout: one rank's line may run into another's
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(chunk)[0] for chunk in proc.stdout.split("RESULT ")[1:]]
    return proc, {r["rank"]: r for r in results}


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_exits_early_gives_the_others_an_error_not_a_wait(np_, mpi4py_available):
    """hvd_sparse.mpi: rank 1 calls sys.exit(0) in the middle of a step. Under Horovod the
    others' next collective fails ('Horovod has been shut down'); under MPI they waited for
    rank 1 for ever. Now each gets HorovodInternalError naming rank 1 at that step, and the
    leaver's own collective in flight finishes cleanly (no crash in MPI_Finalize)."""
    proc, res = _leave_run(np_, "exit", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "signal" not in proc.stderr, proc.stderr[-3000:]
    assert res[1]["left_at"] == 5
    for r in range(np_):
        if r != 1:
            assert "rank(s) [1]" in res[r]["error"] and "finished execution" in res[r]["error"]
            assert res[r]["at_step"] == 5


def test_a_rank_that_exits_with_an_error_code_ends_the_job(mpi4py_available):
    proc, res = _leave_run(3, "exit", "3")
    assert proc.returncode != 0
    assert not any("steps" in r for r in res.values()), "a rank trained on without rank 1"


def test_shutdown_on_one_rank_fails_the_others_collectives(mpi4py_available):
    proc, res = _leave_run(2, "shutdown")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res[1]["left"] and res[1]["error"] is None
    assert "rank(s) [1]" in res[0]["error"]


def test_a_collective_the_leaver_took_part_in_still_completes(mpi4py_available):
    """Rank 0 (and 2) leave after their last allreduce; rank 1 waits for it only later: it
    completes with every rank's contribution. Its next collective, which they never start,
    raises."""
    proc, res = _leave_run(3, "late")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        assert res[r]["last"] == [2.0] * 4  # the average of 1, 2 and 3
    assert res[0]["error"] is None and res[2]["error"] is None
    assert "rank(s) [0" in res[1]["error"] and "finished execution" in res[1]["error"]


def test_a_rank_that_gives_up_inside_a_collective_is_noticed(mpi4py_available):
    """The root of broadcast_object fails between the object's size and its bytes: an error on
    it alone, after every rank agreed on the broadcast. It leaves; the others, waiting for the
    bytes, raise instead of waiting for ever (every MPI call after the agreement is watched)."""
    proc, res = _leave_run(3, "local_error")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert res[0]["left"]
    for r in (1, 2):
        assert "rank(s) [0]" in res[r]["error"]


def test_an_object_one_rank_cannot_pickle_raises_on_every_rank(mpi4py_available):
    """broadcast_object from a root, allgather_object from one rank, of an object that cannot
    be pickled: the same TypeError on every rank naming it (the root alone raised before, and
    the others failed or hung in their next collective), and the job goes on."""
    proc, res = _leave_run(3, "unpicklable")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        assert "broadcast_object: rank 0 could not pickle" in res[r]["error"], res[r]
        assert "allgather_object: rank 1 could not pickle" in res[r]["error_gather"], res[r]
        assert res[r]["after"] == 3.0


def test_a_script_that_finalizes_mpi_itself_exits_cleanly(mpi4py_available):
    """mpi4py scripts often end with MPI.Finalize(): leaving sends nothing then (MPI would
    abort the job for a call after Finalize)."""
    proc, res = _leave_run(2, "finalize")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [res[r]["sum"] for r in (0, 1)] == [2.0, 2.0]


def test_int64_indices_above_the_int32_limit(monkeypatch):
    """Selection and the wire switch to int64 past 2**31-1 entries (limit lowered to test it)."""
    monkeypatch.setattr(wire, "INT32_LIMIT", 999)
    m = torch.nn.Linear(100, 20, bias=False)  # 2000 entries > the lowered limit
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                          named_parameters=m.named_parameters(), density=0.05,
                                          bidirectional=False, transport=LocalTransport())
    assert list(opt.engine_state().values())[0].index_dtype == torch.int64
    m(torch.randn(3, 100)).sum().backward()
    raw = m.weight.grad.clone().reshape(-1)
    opt.step()
    assert opt.communication_stats()["bytes_sent"] == 16 + 100 * 8 + 100 * 4
    assert torch.equal(m.weight.grad.reshape(-1) + list(opt.engine_state().values())[0].uplink, raw)


def test_large_buckets_are_split_and_behave_like_one():
    """max_bucket_numel cuts a bucket (and a parameter) into pieces; the result per piece is
    Top-K of that piece, and the pieces together cover every entry exactly once."""
    torch.manual_seed(0)
    m = torch.nn.Linear(300, 10)  # weight 3000 entries, bias 10
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                          named_parameters=m.named_parameters(), density=0.1,
                                          bidirectional=False, scope="model",
                                          max_bucket_numel=1000, min_sparse_numel=0,
                                          transport=LocalTransport())
    assert [b.numel for b in list(opt.engine_state().values())] == [1000, 1000, 1000, 10]
    assert list(opt.engine_state().values())[0].name.startswith("weight[0:1000]")
    m(torch.randn(4, 300)).pow(2).sum().backward()
    raw = torch.cat([m.weight.grad.reshape(-1), m.bias.grad]).clone()
    opt.step()
    applied = torch.cat([m.weight.grad.reshape(-1), m.bias.grad])
    residual = torch.cat([v.uplink for v in opt.engine_state().values()])
    assert torch.equal(applied + residual, raw)
    for i, lo in enumerate((0, 1000, 2000)):
        piece = applied[lo:lo + 1000]
        assert int((piece != 0).sum()) == 100  # Top-K within each piece
    with pytest.raises(ValueError, match="max_bucket_numel"):
        hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                        named_parameters=m.named_parameters(),
                                        max_bucket_numel=0, transport=LocalTransport())


def test_pieces_of_a_large_tensor_stay_sparse_below_min_sparse_numel():
    """A cap below ``min_sparse_numel`` still leaves the pieces of a large tensor sparse (the
    size rule is the tensor's, not the piece's); tensors below it stay dense."""
    torch.manual_seed(0)
    m = torch.nn.Linear(770, 10)  # weight 7,700 entries: pieces of 1,000; bias 10: dense
    opt = hvd_sparse.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                          named_parameters=m.named_parameters(), density=0.01,
                                          bidirectional=False, max_bucket_numel=1000,
                                          cost_model="off", transport=LocalTransport())
    views = list(opt.engine_state().values())
    assert [v.sparse for v in views if v.name.startswith("weight")] == [True] * 8
    assert [v.sparse for v in views if v.name == "bias"] == [False]
    m(torch.randn(4, 770)).pow(2).sum().backward()
    opt.step()
    stats = opt.communication_stats()
    assert stats["bytes_sent"] < 7700 * 4 / 4  # not the whole weight
