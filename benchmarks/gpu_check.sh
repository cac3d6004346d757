#!/usr/bin/env bash
# One command to verify the CuPy path on a machine with a GPU, torch, CuPy and mpi4py, and no
# Horovod: GPU kernel equivalence (every sparsifier's fused form against its torch definition),
# the selection benchmark (against torch.topk and a device copy floor), the two exact Top-K
# forms against each other (benchmarks/topk_paths.py), the engine benchmark,
# and a 2-process run on the one GPU over the mpi4py transport (the optimizer's replicas, then
# hvd_sparse.mpi's collectives and SyncBatchNorm on CUDA against CPU), then a whole training
# step (benchmarks/gpu_step.py, and benchmarks/profile_gpu_step.py's tables). JSON results and
# the whole log (gpu_check.log) go to $OUT when it is set (the device tool: eight files, its limit;
# draw the PNGs here afterwards), else benchmarks/results/. Each step has a time limit
# (GPU_CHECK_STEP_S, default 150 s) so that one hang cannot eat a lease. Exits non-zero when a
# check fails.
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
DEST="${OUT:-benchmarks/results}"
mkdir -p "$DEST"
exec > >(tee "$DEST/gpu_check.log") 2>&1
LIMIT="timeout ${GPU_CHECK_STEP_S:-150}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$PY" -c "import torch, cupy; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" || exit 2

echo "== 1. kernels: fused forms on CUDA equal their torch definitions"
$LIMIT "$PY" benchmarks/gpu_check.py kernels "$DEST/gpu_kernels.json" || status=1
if "$PY" -c "import pytest" 2>/dev/null; then
  # every test that has a CUDA case: kernels, Golomb coder, payload decoding on the device
  $LIMIT "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/test_kernels.py tests/test_units.py tests/test_sparsifiers.py tests/test_layer_floor.py \
    tests/test_variance_correction.py \
    -k "cupy or cuda or golomb or decode_where" 2>&1 || status=1
fi

echo "== 2. selection: fused Top-K vs torch.topk vs device copy floor"
(cd benchmarks && $LIMIT "$PY" selection.py --sizes 1e6 25e6 100e6 --densities 0.01 0.001) \
  || status=1
cp benchmarks/results/selection_cuda.json "$DEST"/ 2>/dev/null

echo "== 2b. exact Top-K: the direct form vs the scan, to place DIRECT_TOPK_MAX"
# JSON only under $OUT (the device tool returns 8 files); redraw the PNG with --replot
(cd benchmarks && $LIMIT "$PY" topk_paths.py) || status=1
cp benchmarks/results/topk_paths_cuda.json "$DEST"/ 2>/dev/null

echo "== 3. engine alone on the GPU vs its pass-budget floor"
(cd benchmarks && $LIMIT "$PY" engine.py --device cuda --sizes 11.4e6 100e6 --ranks 2 4) \
  || status=1
cp benchmarks/results/engine_cuda.json "$DEST"/ 2>/dev/null

echo "== 4. two processes on the one GPU over mpi4py"
LAUNCH=""
for l in mpirun mpiexec; do command -v "$l" >/dev/null && LAUNCH="$l" && break; done
if [ -z "$LAUNCH" ]; then
  echo "no mpirun/mpiexec on this machine: step 4 not run" | tee "$DEST/gpu_mpi.txt"
  status=1
else
  extra=""
  "$LAUNCH" --version 2>&1 | grep -qi "open mpi" && extra="--allow-run-as-root --oversubscribe"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    $LIMIT "$LAUNCH" $extra -np 2 "$PY" benchmarks/gpu_check.py mpi "$DEST/gpu_mpi.json" \
    || status=1
fi

echo "== 5. a whole training step: scopes against the no-exchange floor, and where it goes"
if [ -n "$LAUNCH" ]; then
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $LIMIT "$LAUNCH" $extra -np 2 \
    "$PY" benchmarks/gpu_step.py --variants floor sparse_tensor sparse_model sparse_bucket \
    sparse_model_layerwise sparse_bucket_layerwise \
    --out "$DEST/gpu_step_cuda.json" || status=1
  # the tables only (the stall counts are in the log): the device tool returns eight files
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 $LIMIT "$LAUNCH" $extra -np 2 \
    "$PY" benchmarks/profile_gpu_step.py --variant sparse_model --out "$DEST" || status=1
  rm -f "$DEST"/profile_gpu_step_*.json
fi
echo "gpu_check: $([ $status = 0 ] && echo all checks passed || echo SOME CHECKS FAILED)"
exit $status
