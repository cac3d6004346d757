#!/usr/bin/env bash
# The main job: set up everything (idempotent), then train a CNN on Fashion-MNIST on 2 ranks
# with hvd_sparse at 1% density. Extra arguments go to `python -m hvd_sparse.train`.
# Both ranks share one machine, where loopback is so fast that the default time cost model
# would send most buckets dense; the main job shows the sparse exchange, so it turns the
# fallback off (pass `--cost-model time` to see the default's choice).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
exec .venv/bin/horovodrun -np "${NP:-2}" .venv/bin/python -m hvd_sparse.train --density 0.01 --cost-model off "$@"
