#!/usr/bin/env bash
# Several machines with Open MPI and a hostfile (one line per host: "node1 slots=4").
# The repository (and its .venv) must be at the same path on every host.
#   launch/mpirun_hostfile.sh hosts.txt 8 --epochs 3 --density 0.001
# Without Horovod on the cluster, add --transport mpi (hvd_sparse's mpi4py path).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${1:?usage: $0 HOSTFILE NP [train args...]}"; NP="${2:?NP}"; shift 2
exec mpirun -np "$NP" -hostfile "$HOSTFILE" --bind-to none --map-by slot \
  -x PATH -x LD_LIBRARY_PATH -x OMP_NUM_THREADS=1 \
  --mca pml ob1 --mca btl ^openib \
  "$ROOT/.venv/bin/python" -m hvd_sparse.train "$@"
