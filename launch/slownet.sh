#!/usr/bin/env bash
# Run N ranks on this machine behind a rate-limited network: a private network namespace whose
# loopback is shaped with tc (token bucket), and MPI (hence Horovod's MPI controller) over TCP on
# that interface only. Everything the ranks exchange crosses the shaped link, so one machine
# reproduces a bandwidth-bound cluster.
#
#   launch/slownet.sh RATE NP -- COMMAND [ARGS...]
#   launch/slownet.sh 100mbit 2 -- .venv/bin/python -m hvd_sparse.train --epochs 1
#
# RATE: a tc rate (100mbit, 1gbit, 10gbit, ...) or "none" for unshaped loopback (same namespace
# and transport, no limit). All ranks share the one shaped loopback, like ranks behind one link
# of that capacity. The namespace, and the shaping with it, vanish when the command ends.
# Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN), unshare (util-linux) and tc (iproute2).
set -euo pipefail

if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 RATE NP -- COMMAND [ARGS...]   (RATE e.g. 100mbit, 1gbit, none)" >&2
  exit 2
fi
RATE="$1"; NP="$2"; shift 3

for tool in unshare tc ip mpirun; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "slownet: '$tool' is missing (unshare: util-linux, tc/ip: iproute2, mpirun: openmpi-bin)" >&2
    exit 2
  fi
done
if ! unshare -n true 2>/dev/null; then
  echo "slownet: cannot create a network namespace here (needs root, or CAP_SYS_ADMIN and" \
       "CAP_NET_ADMIN; in a container, run it privileged or use --cap-add)" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SLOWNET_RATE="$RATE" SLOWNET_NP="$NP" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

exec unshare -n bash -c '
set -euo pipefail
ip link set lo up
if [ "$SLOWNET_RATE" != "none" ]; then
  tc qdisc add dev lo root tbf rate "$SLOWNET_RATE" burst 256kb latency 100ms
fi
pass_env=(-x PYTHONPATH -x OMP_NUM_THREADS=1 -x SLOWNET_RATE)
for v in HVD_SPARSE_TRANSPORT HVD_SPARSE_KERNELS; do
  if [ -n "${!v:-}" ]; then pass_env+=(-x "$v"); fi
done
exec mpirun --oversubscribe --bind-to none -np "$SLOWNET_NP" \
  --mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
  "${pass_env[@]}" "$@"
' slownet "$@"
