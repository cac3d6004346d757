#!/usr/bin/env bash
# One machine, N ranks, Horovod's launcher:   launch/horovodrun_local.sh 4 --epochs 3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NP="${1:?usage: $0 NP [train args...]}"; shift
exec "$ROOT/.venv/bin/horovodrun" -np "$NP" -H "localhost:$NP" \
  "$ROOT/.venv/bin/python" -m hvd_sparse.train "$@"
