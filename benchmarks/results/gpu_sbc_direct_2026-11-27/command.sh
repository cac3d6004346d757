export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_kernels.py tests/test_sparsifiers.py -k "cupy or cuda or golomb or fixed_point" 2>&1 | tail -4 | tee $OUT/tests.log
python3 benchmarks/gpu_check.py kernels $OUT/gpu_kernels.json
cd benchmarks
echo "== direct SBC up to 2^25"
timeout 70 python3 engine.py --device cuda --sizes 11.4e6 32e6 100e6 --ranks 2 --sparsifiers topk sbc --pieces 1 --exchanges gradient 2>&1 | grep "n=" | cut -c1-150
cp results/engine_cuda.json $OUT/engine_cuda_sbc_direct.json
echo "== same run, SBC by the scan (DIRECT_SBC_MAX=0)"
timeout 40 python3 -c "
import sys, runpy; import hvd_sparse.kernels.cuda as c; c.DIRECT_SBC_MAX = 0
sys.argv = ['engine.py', '--device', 'cuda', '--sizes', '11.4e6', '32e6', '--ranks', '2', '--sparsifiers', 'sbc', '--pieces', '1', '--exchanges', 'gradient']
runpy.run_path('engine.py', run_name='__main__')" 2>&1 | grep "n=" | cut -c1-150
cp results/engine_cuda.json $OUT/engine_cuda_sbc_scan.json
cd ..
timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 python3 benchmarks/gpu_check.py mpi $OUT/gpu_mpi.json 2>&1 | tail -9
