"""Let MPI's waiting threads give their core back when ranks share the node's cores.

Open MPI busy-polls while a call waits. Horovod adds a background thread per rank that enters
MPI every cycle, so each rank has two threads that want a core: the one that trains and the
one that polls. Where a rank's share of the cores is smaller than that, the polling thread
takes the core from the computing one, and each collective then waits for the slowest rank's
delayed compute. Open MPI yields by itself only when it was launched with more ranks than slots;
it does not count threads. On the 2-core development machine (2 ranks, 1 Gbit/s shaped link,
mlp11m, default Top-K 1%) the step took 178-186 ms with yielding against 188-220 ms without
(3 interleaved runs each; docs/results.md).

:func:`prepare` runs before MPI starts (from ``hvd_sparse.init`` and ``hvd_sparse.mpi.init``)
and sets ``OMPI_MCA_mpi_yield_when_idle=1`` only where the rank's share of cores is below the
number of threads that wait in MPI. A value already in the environment (``0`` included) is
kept, and other MPI libraries ignore the variable.
"""
from __future__ import annotations

import os

VAR = "OMPI_MCA_mpi_yield_when_idle"
#: how launchers tell a process how many ranks run on its node (Open MPI, MPICH/Hydra, horovodrun)
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "HOROVOD_LOCAL_SIZE")


def local_size(environ=os.environ):
    """Ranks on this node, as the launcher announced it; None when no launcher said."""
    for var in LOCAL_SIZE_VARS:
        value = environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _cpu_list_size(text: str) -> int:
    """Cores in a Linux CPU list such as ``0-3,8,10-11``."""
    count = 0
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            count += int(hi) - int(lo) + 1
        elif part:
            count += 1
    return count


def _read(path: str):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def node_cores(root: str = "/sys/fs/cgroup") -> int:
    """The cores this node's ranks may use: the machine's, less what the container's cgroup
    withholds (its cpuset, and its CPU quota, rounded up), cgroup v2 or v1; unreadable limits
    are ignored."""
    cores = os.cpu_count() or 1
    v2 = _read(f"{root}/cpuset.cpus.effective")
    v1 = _read(f"{root}/cpuset/cpuset.effective_cpus")
    for cpus in (v2, v1):
        if cpus:
            cores = min(cores, _cpu_list_size(cpus))
    quota = None
    cpu_max = _read(f"{root}/cpu.max")  # "max 100000" or "200000 100000"
    if cpu_max and not cpu_max.startswith("max"):
        q, period = cpu_max.split()[:2]
        quota = int(q) / int(period)
    q1, p1 = _read(f"{root}/cpu/cpu.cfs_quota_us"), _read(f"{root}/cpu/cpu.cfs_period_us")
    if quota is None and q1 and p1 and int(q1) > 0:
        quota = int(q1) / int(p1)
    if quota:
        cores = min(cores, max(1, -int(-quota // 1)))
    return cores


def cores_per_rank(ranks_here: int, usable=None, node=None) -> float:
    """This rank's share of the cores. A rank whose affinity is narrower than the node's cores
    was bound by its launcher and is taken to own its set; otherwise the node's cores are
    split among its ranks."""
    if usable is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    if node is None:
        node = node_cores()
    if usable < node:
        return float(usable)
    return node / max(1, ranks_here)


def prepare(waiting_threads: int, environ=os.environ, usable=None, node=None) -> bool:
    """Before MPI starts: ask Open MPI to yield while idle when this rank has fewer cores than
    ``waiting_threads`` (2 under Horovod: training thread and background loop; 1 with mpi4py
    alone). Returns whether it set the variable."""
    if VAR in environ:
        return False
    ranks_here = local_size(environ)
    if ranks_here is None:
        return False
    if cores_per_rank(ranks_here, usable, node) >= waiting_threads:
        return False
    environ[VAR] = "1"
    return True
