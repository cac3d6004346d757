"""When ranks share a node's cores, Open MPI is asked to yield while idle, before MPI starts;
never where each rank has cores to spare, never over the user's own setting."""
import os
import subprocess
import sys

import pytest

from hvd_sparse import core_sharing
from hvd_sparse.core_sharing import VAR


@pytest.mark.parametrize("env,usable,node,threads,expect", [
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2, 2, 2, "1"),  # 1 core each, 2 waiting threads
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 16, 16, 2, None),  # 8 cores each
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2, 2, 1, None),  # mpi4py alone: 1 thread, 1 core
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 2, 2, 1, "1"),  # more ranks than cores
    ({"MPI_LOCALNRANKS": "8"}, 8, 8, 2, "1"),  # MPICH's launcher
    ({"HOROVOD_LOCAL_SIZE": "2"}, 4, 4, 2, None),  # horovodrun, 2 cores each
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 1, 64, 2, "1"),  # bound to one core of 64
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 4, 64, 2, None),  # bound to four cores
    ({}, 2, 2, 2, None),  # no launcher said how many ranks share the node
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", VAR: "0"}, 2, 2, 2, "0"),  # the user's choice stays
])
def test_yield_only_where_cores_are_short(env, usable, node, threads, expect):
    user_set = VAR in env
    env = dict(env)
    changed = core_sharing.prepare(threads, environ=env, usable=usable, node=node)
    assert env.get(VAR) == expect
    assert changed == (expect == "1" and not user_set)


def test_node_cores_reads_the_cgroup_limits(tmp_path):
    """A container's cpuset and CPU quota (cgroup v2 and v1 files) cap the node's cores."""
    machine = os.cpu_count()
    assert core_sharing.node_cores(str(tmp_path)) == machine  # no limits readable
    (tmp_path / "cpuset.cpus.effective").write_text("0-1\n")
    assert core_sharing.node_cores(str(tmp_path)) == min(machine, 2)
    (tmp_path / "cpuset.cpus.effective").write_text("0-3,8,10-11\n")
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: 2 usable
    assert core_sharing.node_cores(str(tmp_path)) == min(machine, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert core_sharing.node_cores(str(tmp_path)) == min(machine, 7)
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert core_sharing.node_cores(str(v1)) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert core_sharing.node_cores(str(v1)) == machine


def test_hvd_sparse_init_prepares_before_horovod_starts(monkeypatch):
    """``hvd_sparse.init`` is Horovod's init (same arguments, same result) with the variable
    already in place when Horovod's init runs."""
    hvd_torch = pytest.importorskip("horovod.torch")
    import hvd_sparse

    seen = {}

    def fake_init(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        seen["var"] = core_sharing.os.environ.get(VAR)
        return "started"

    monkeypatch.setattr(hvd_torch, "init", fake_init)
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "100000")  # surely more ranks than cores
    assert hvd_sparse.init(comm=None, process_sets=None) == "started"
    assert seen == {"args": (), "kwargs": {"comm": None, "process_sets": None}, "var": "1"}


@pytest.mark.parametrize("started_first,expect", [(False, "1"), (True, None)])
def test_mpi_front_end_prepares_only_before_mpi_starts(mpi4py_available, started_first, expect):
    """``hvd_sparse.mpi.init`` sets the variable before mpi4py starts MPI; once MPI runs it
    could not take effect, and is left unset."""
    code = ("import os, sys\n"
            + ("from mpi4py import MPI\n" if started_first else "")
            + "import hvd_sparse.mpi as hvd\n"
            "hvd.init()\n"
            "assert 'mpi4py.MPI' in sys.modules and hvd.size() == 1\n"
            f"print('VALUE', os.environ.get({VAR!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env.update(OMPI_COMM_WORLD_LOCAL_SIZE="100000", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"VALUE {expect}" in out.stdout
