#!/usr/bin/env bash
# Set up everything (idempotent), then run the whole test suite: unit tests and real
# multi-process runs under mpirun and horovodrun. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest -q -ra "$@" tests
