"""Shared helpers: run a worker script on N real ranks with mpirun, horovodrun or torchrun."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def _env():
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def launch_command(launcher, np_, *python_args):
    """The command that runs ``python *python_args`` on ``np_`` local ranks."""
    py = sys.executable
    args = list(map(str, python_args))
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", str(np_), py, *args]
    if launcher == "horovodrun":  # Horovod's own launcher with its Gloo controller
        hr = Path(py).parent / "horovodrun"
        hr = str(hr) if hr.exists() else shutil.which("horovodrun")
        return [hr, "--gloo", "-np", str(np_), "-H", f"localhost:{np_}", py, *args]
    if launcher == "torchrun":  # PyTorch's launcher; --standalone finds a free port itself
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(np_), *args]
    raise ValueError(launcher)


def run_ranks(launcher, np_, worker, outdir, *args, timeout=240, env=None):
    """Run ``tests/workers/<worker>`` on ``np_`` ranks; return the per-rank JSON results."""
    cmd = launch_command(launcher, np_, WORKERS / worker, outdir, *args)
    full_env = _env()
    full_env.update(env or {})
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{launcher} -np {np_} {worker} hung past {timeout}s:\n{e.stdout}\n{e.stderr}")
    results = []
    for r in range(np_):
        path = Path(outdir) / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result (exit {proc.returncode}):\n"
                        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
        results.append(json.loads(path.read_text()))
    return proc, results


@pytest.fixture(scope="session")
def mpi4py_available():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (run launch/setup.sh)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (run launch/setup.sh)")


@pytest.fixture(scope="session")
def mpi_available():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (run launch/setup.sh)")
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        pytest.skip("Horovod is not installed (run launch/setup.sh)")


@pytest.fixture
def one_bucket_per_tensor(monkeypatch):
    """Scope "tensor" with one bucket per tensor (no shared buckets of short tensors), for
    tests that read a bucket by its tensor's name or count buckets; the ranks launched from
    the test inherit it."""
    monkeypatch.setenv("HVD_SPARSE_PACK_BELOW", "0")


def echo_transport():
    """A transport of two ranks that send the same bytes (every rank's payload echoed), for
    single-process tests of multi-rank paths (the calibration, an averaged update that is
    each rank's own). Like Horovod, it is taken to fuse allreduces started together."""
    import torch
    from hvd_sparse.transport import LocalTransport

    class EchoTransport(LocalTransport):
        fuses_allreduces = True

        def size(self):
            return 2

        def allgather_async(self, payload, name):
            return torch.cat([payload, payload])

        def allreduce_async(self, tensor, name, *, average, prescale=1.0, postscale=1.0):
            return tensor

    return EchoTransport
