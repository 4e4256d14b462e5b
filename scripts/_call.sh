#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}
timeout 260 python3 -m pytest -q -x -p no:logging tests/test_cublaslt_gpu.py tests/test_gpu.py tests/test_cuda_graph_gpu.py > $O/tests1.log 2>&1; echo "tests rc $?"; tail -3 $O/tests1.log
(cd scripts && CUBLASLT_WORKSPACE_SIZE=0 timeout 60 python3 probe_cublaslt_algos.py --host > $O/host_probe.log 2>&1); tail -14 $O/host_probe.log
(cd scripts && CUBLASLT_WORKSPACE_SIZE=0 timeout 60 python3 profile_grouped_host.py --paths auto triton loop > $O/host_paths.log 2>&1); grep -A9 "grouped GEMM path" $O/host_paths.log | head -9
(cd scripts && CUBLASLT_WORKSPACE_SIZE=0 timeout 150 python3 bench_grouped.py --recipes current blockwise --out $O > $O/bench.log 2>&1); echo "bench rc $?"; grep "|" $O/bench.log | tail -30
