#!/usr/bin/env bash
# One device call: GPU tests, then the GEMM and Linear benchmarks; logs and tables under $OUT.
# Usage (from the repo root on the device): bash scripts/device_run.sh [tests|rope|lean|host|hostwhy|hostfloor|hostexcess|linearab|groupedab|hostab|persistent|graphs|gemm|linear|grouped|grouped-ws0|casts|variants|cudacast|streams|ltalgos|gluonwgrad|cutlass|steps|probe|tgemm|trace|slowiter|fullgraph|moefused|graphsab|graphsmem|hostnative|review|megatron]...
# Carry nvidia_cutlass-*.whl in .whl for the cutlass step.
# CAST_ARGS, LINEAR_ARGS, GROUPED_ARGS, LT_ARGS, GW_ARGS pass options to profile_casts.py, bench_linear.py, bench_grouped.py, probe_cublaslt_algos.py, probe_gluon_wgrad.py. Carry .whl (torchao for the Linear benchmark's peer) with the call.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests gemm linear grouped)
for what in "${steps[@]}"; do
  case $what in
    # every GPU test (megatron-core from the carried Megatron-LM checkout for the audit's GPTs)
    # the direct cuBLASLt GEMMs first, in their own process: if they fail (or crash), every later
    # test and step of this call runs the HYBRID block GEMMs on Triton instead
    tests) python3 -m pytest -q -rs -s -p no:logging tests/test_cublaslt_gpu.py 2>&1 | tee "$OUT/gpu_tests_cublaslt.log"
      if [ "${PIPESTATUS[0]}" -ne 0 ]; then export MEGATRON_FP8_HYBRID_GEMM=triton
        echo "test_cublaslt_gpu failed: MEGATRON_FP8_HYBRID_GEMM=triton from here on" | tee -a "$OUT/gpu_tests_cublaslt.log"; fi
      PYTHONPATH=$PYTHONPATH:$PWD/.megatron_lm python3 -m pytest -q -rs -s -p no:logging tests/test_segment_casts.py \
        tests/test_*gpu*.py tests/test_persistent_cast.py tests/test_nonfinite_kernels.py tests/test_pad_rows.py tests/test_rope.py \
        --deselect tests/test_cublaslt_gpu.py --deselect tests/test_graphed_linear_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
      # the per-layer CUDA graphs in a process of their own: a capture that fails can leave CUDA's
      # random-number generator unusable for the rest of the process (ops/graphed.py)
      python3 -m pytest -q -rs -p no:logging tests/test_graphed_linear_gpu.py 2>&1 | tee "$OUT/gpu_tests_graphed.log" ;;
    # the lean eager path (ops/lean.py) against the general one on this GPU, bit for bit, fast routes taken
    lean) python3 -m pytest -q -rs -s -p no:logging tests/test_lean_gpu.py tests/test_lean.py 2>&1 | tee "$OUT/lean_gpu.log" ;;
    # the eager host cost per layer (the host-cost issue's table), median of 3 fresh processes
    host) (cd scripts && python3 profile_host.py --processes 3) 2>&1 | tee "$OUT/profile_host.log" ;;
    # where the host time of one step goes (torch.profiler, CPU ops): the grouped rows (FP8 off
    # against torch._grouped_mm first: same GEMMs, 6.5x the host time in run AD) and Linear
    hostwhy) (cd scripts/probes && python3 host_breakdown.py grouped-bf16 grouped-off grouped-current grouped-blockwise \
        bf16 current --steps 30 --rows 40) 2>&1 | tee "$OUT/host_breakdown.log" ;;
    # the host floor of an eager Linear step (run AL): raw ops from Python and C++, routes, glue, the
    # minimal autograd function, alternated routes, kernel time per step; then, where py-spy was
    # carried (.whl/py_spy-*.whl), native stacks at 100 Hz of steps with the weight cast and reused
    hostfloor) (cd scripts/probes && timeout 200 python3 host_floor.py --calls 2000 && timeout 120 python3 host_interleave.py \
        && timeout 120 python3 host_full_vs_reused.py kernels && timeout 120 python3 host_full_vs_reused.py isolate) 2>&1 | tee "$OUT/host_floor.log"
      if [ -x /tmp/site/bin/py-spy ]; then for w in full reused bf16; do
        timeout 90 /tmp/site/bin/py-spy record --native --rate 100 --format raw -o "$OUT/pyspy_$w.txt" -- \
          python3 scripts/probes/host_full_vs_reused.py spin $w 5 2>&1 | tail -2; done
      else echo "hostfloor: no py-spy under /tmp/site (carry its wheel in .whl)"; fi ;;
    # the full step's excess over its glue plus routes: the engine's device thread, syncs, the
    # weight cast's place, then py-spy's native stacks of every thread (idle ones too)
    hostexcess) (cd scripts/probes && timeout 150 python3 host_threads.py --depths 1 && timeout 60 python3 host_full_vs_reused.py sync \
        && timeout 120 python3 host_full_vs_reused.py isolate) 2>&1 | tee "$OUT/host_excess.log"
      if [ -x /tmp/site/bin/py-spy ]; then for w in full reused; do
        timeout 90 /tmp/site/bin/py-spy record --native --threads --idle --rate 100 --format raw -o "$OUT/pyspy_$w.txt" -- \
          python3 scripts/probes/host_full_vs_reused.py spin $w 5 2>&1 | tail -2; done
      else echo "hostexcess: no py-spy under /tmp/site (carry its wheel in .whl)"; fi ;;
    # a Linear's host time per step under two checkouts in one process (carry the old one in _ab/old,
    # e.g. git archive <commit> megatron_fp8 | tar -x -C _ab/old), then the host table
    linearab) (cd scripts/probes && timeout 150 python3 ab_host.py --old ../../_ab/old --new ../.. --layer linear \
        --tokens 256 --k 2048 --n 2048 --recipes current blockwise delayed --rounds 20) 2>&1 | tee "$OUT/ab_linear.log"
      (cd scripts && timeout 200 python3 profile_host.py --processes 3) 2>&1 | tee "$OUT/profile_host.md" ;;
    # a GroupedLinear's host time per step under two checkouts in one process (carry the old one in
    # _ab/old as for linearab): a new router split each step, then even splits (the host table's shape)
    groupedab) (cd scripts/probes && timeout 200 python3 ab_host.py --old ../../_ab/old --new ../.. --tokens 256 \
        --k 2048 --n 2048 --recipes current blockwise --rounds 15 --router \
        && timeout 150 python3 ab_host.py --old ../../_ab/old --new ../.. --tokens 256 --k 2048 --n 2048 \
        --recipes current blockwise --rounds 15) 2>&1 | tee "$OUT/ab_grouped.log" ;;
    # the E4M3 block GEMMs on torch's scaled_mm vs cuBLASLt called directly (the default since run AU), host us,
    # fresh processes alternated
    hostab) (cd scripts/probes && python3 ab_env.py --set MEGATRON_FP8_BLOCK_GEMM=torch --set MEGATRON_FP8_BLOCK_GEMM=cublaslt \
        --rounds 3 --key layer --column "host us per fwd+bwd" --match "Linear" -- ../profile_host.py) 2>&1 | tee "$OUT/ab_block_gemm.log" ;;
    # the one-launch current-scaling cast (the default): its tests, then the GPU suite with it off
    # (the two-launch fallback; a hang would be a barrier bug: the timeouts end it), then its
    # timing against the two-launch cast
    persistent) timeout 300 python3 -m pytest -q -x -p no:logging tests/test_persistent_cast.py 2>&1 | tee "$OUT/persistent_tests.log"
      MEGATRON_FP8_ONE_LAUNCH_CAST=0 timeout 420 python3 -m pytest -q -p no:logging tests/test_*gpu*.py tests/test_grouped.py 2>&1 | tee "$OUT/gpu_tests_two_launch.log"
      timeout 200 python3 scripts/probes/bench_current_cast.py 2>&1 | tee "$OUT/bench_current_cast.log" ;;
    # CUDA graphs: the capture/replay tests (several layers' graphs replayed after all captures),
    # then where a graphed grouped step's time goes (kernels and the gaps between them)
    graphs) timeout 300 python3 -m pytest -q -p no:logging tests/test_cuda_graph_gpu.py 2>&1 | tee "$OUT/graph_tests.log"
      timeout 200 python3 -m pytest -q -rs -p no:logging tests/test_graphed_linear_gpu.py 2>&1 | tee "$OUT/graphed_linear_tests.log"
      (cd scripts && timeout 200 python3 trace_step.py --cases grouped-graphed --out /tmp/traces) 2>&1 | tee "$OUT/trace_graphed.log" ;;
    gemm) python3 scripts/bench_gemm.py --out "$OUT" 2>&1 | tee "$OUT/bench_gemm.log" ;;
    linear) python3 scripts/bench_linear.py ${LINEAR_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench_linear.log" ;;
    grouped) python3 scripts/bench_grouped.py ${GROUPED_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench_grouped.log" ;;
    # the same with cuBLASLt's workspace off (no stream-K memsets before the experts' GEMMs; README)
    grouped-ws0) mkdir -p "$OUT/ws0"; CUBLASLT_WORKSPACE_SIZE=0 python3 scripts/bench_grouped.py ${GROUPED_ARGS:-} --out "$OUT/ws0" 2>&1 | tee "$OUT/bench_grouped_ws0.log" ;;
    casts) python3 scripts/probes/profile_casts.py ${CAST_ARGS:-} 2>&1 | tee "$OUT/profile_casts.log" ;;
    variants) (cd scripts/probes && python3 probe_cast_variants.py && python3 probe_cast_variants.py --segments && python3 probe_cast_variants.py --segments --lookup old) 2>&1 | tee "$OUT/probe_cast_variants.log" ;;
    # the CUDA C tile cast in every mode (1x128, 128x128, tensor) against the Triton cast, bitwise, timed
    cudacast) (cd scripts/probes && python3 probe_cuda_cast.py) 2>&1 | tee "$OUT/probe_cuda_cast.log" ;;
    # the experts' GEMMs of a graphed step on 1, 2 or 3 streams (filling each GEMM's last wave), bitwise
    streams) (cd scripts/probes && CUBLASLT_WORKSPACE_SIZE=0 python3 probe_gemm_streams.py) 2>&1 | tee "$OUT/probe_gemm_streams.log" ;;
    # our Gluon kernels for the blocks wgrad against cuBLAS per expert, timed; exits non-zero on a wrong result
    gluonwgrad) (cd scripts/probes && CUBLASLT_WORKSPACE_SIZE=0 python3 probe_gluon_wgrad.py ${GW_ARGS:-}) 2>&1 | tee "$OUT/probe_gluon_wgrad.log" ;;
    # cuBLASLt's kernels for the blocks wgrad / dgrad beyond torch's first heuristic answer, timed, bitwise
    ltalgos) (cd scripts/probes && CUBLASLT_WORKSPACE_SIZE=0 python3 probe_cublaslt_algos.py ${LT_ARGS:-}) 2>&1 | tee "$OUT/probe_cublaslt_algos.log" ;;
    # CUTLASS 4.2's SM90 blockwise-scaled kernels against cuBLAS per expert, built here with nvcc from
    # the carried nvidia-cutlass wheel's headers, timed, bitwise
    cutlass) if [ ! -d /tmp/site/cutlass_library/source/include ]; then
        echo "cutlass: no CUTLASS headers under /tmp/site: carry nvidia_cutlass-*.whl in .whl" | tee "$OUT/probe_cutlass_blockwise.log"; continue
      fi
      (cd scripts/probes && CUBLASLT_WORKSPACE_SIZE=0 timeout 540 python3 probe_cutlass_blockwise.py \
        --cutlass /tmp/site/cutlass_library/source --build /tmp/cutlass_build --jobs "$(nproc)") 2>&1 | tee "$OUT/probe_cutlass_blockwise.log" ;;
    steps) python3 scripts/profile_steps.py 2>&1 | tee "$OUT/profile_steps.log" ;;
    probe) python3 scripts/probes/probe_grouped_mm.py 2>&1 | tee "$OUT/probe.log" ;;
    tgemm) python3 scripts/probes/bench_triton_grouped.py 2>&1 | tee "$OUT/bench_triton_grouped.log" ;;
    trace) python3 scripts/trace_step.py --out /tmp/traces 2>&1 | tee "$OUT/trace_step.log" ;;
    # Megatron-LM's pretrain_gpt.py (a checkout carried in .megatron_lm, git-ignored) with our plug-in:
    # MEGATRON_ARGS go to bench_megatron.py (e.g. "--smoke --configs dense-1b,moe --layers 2")
    # the fused RoPE (megatron/rope.py) on this GPU: its tests (bitwise against megatron-core's unfused RoPE,
    # special values), then its time against the unfused chain's on dense-8b's q and k
    rope) (PYTHONPATH=$PYTHONPATH:$PWD/.megatron_lm python3 -m pytest -q -rs -p no:logging tests/test_rope.py \
        && PYTHONPATH=$PYTHONPATH:$PWD/.megatron_lm python3 scripts/probes/rope_speed.py) 2>&1 | tee "$OUT/rope.log" ;;
    # the slow interval of our eager runs (run AR): every iteration logged, with Python's collections (gen 1 and 2),
    # Triton's compilations and torch.compile's recompiles in the same log; then ours with Megatron's --manual-gc
    slowiter) (export PYTHONPATH=$PWD/scripts/probes/gc_log:${PYTHONPATH:-$PWD} PROBE_GC_LOG=1 PROBE_GC_MIN_GEN=1 PROBE_TRITON_LOG=1 TORCH_LOGS=recompiles
        args="--megatron-lm .megatron_lm --configs dense-1b --iters 40 --log-interval 1 --fusions rope --no-dropout --timeout 150"
        timeout 260 python3 scripts/bench_megatron.py $args --variants ours-tensorwise,megatron-bf16 --out "$OUT/slowiter"
        timeout 150 python3 scripts/bench_megatron.py $args --variants ours-tensorwise --megatron-args=--manual-gc \
          --out "$OUT/slowiter_manual_gc"
        grep -h "elapsed time per iteration\|gc pid\|recompil\|triton pid" "$OUT"/slowiter*/*.log | cut -c1-200) 2>&1 \
        | tee "$OUT/slowiter.log" ;;
    # FULLGRAPH_CONFIGS (default dense-1b; dense-8b in a call of its own: five processes a config, ~5 min) under
    # Megatron-LM's whole-iteration graph, with and without our wgrad fusion (run AS: dense-1b tensorwise 1.114x,
    # 1.148x fused; blockwise and dense-8b not run with the fusion yet)
    fullgraph) python3 scripts/bench_megatron.py --megatron-lm .megatron_lm --configs "${FULLGRAPH_CONFIGS:-dense-1b}" --iters 24 \
        --variants megatron-bf16-fullgraph,ours-tensorwise-fullgraph,ours-blockwise-fullgraph,ours-tensorwise-fused-fullgraph,ours-blockwise-fused-fullgraph \
        --fusions rope --no-dropout --timeout 110 --out "$OUT/fullgraph-${FULLGRAPH_CONFIGS:-dense-1b}" 2>&1 | grep -v "^ " | tee "$OUT/bench_fullgraph-${FULLGRAPH_CONFIGS:-dense-1b}.txt" ;;
    # where an eager Linear step's host time goes in native code (issue 32's excess of a step over its parts,
    # run AL): py-spy --native at 100 Hz over BF16, current (weight cast and reused) and blockwise Linear steps, then
    # the grouped ones (torch._grouped_mm, FP8 off, current with even and router splits) (~2 min)
    hostnative) python3 scripts/probes/host_native.py --pyspy-bin /tmp/site/bin/py-spy --out "$OUT/host_native" \
        --cases bf16,current,current-reused,blockwise,grouped-bf16,grouped-off,grouped-current,grouped-current-router 2>&1 \
        | tee "$OUT/host_native.log" ;;
    # eager MoE with our wgrad fusion against without, in interleaved rounds: Megatron-LM's default
    # --gradient-accumulation-fusion now trains without apex under the plug-in (run AT), so users get it;
    # runs AN-AP read it -9% to +8% on single processes (~7 min)
    moefused) python3 scripts/bench_megatron.py --megatron-lm .megatron_lm --configs moe --iters 20 --repeats 2 \
        --variants megatron-bf16,ours-tensorwise,ours-tensorwise-fused,ours-blockwise,ours-blockwise-fused \
        --fusions rope --no-dropout --timeout 100 --out "$OUT/moefused" 2>&1 | grep -v "^ " | tee "$OUT/bench_moefused.txt" ;;
    # the opt-in per-layer graphs against eager in Megatron-LM's loop, interleaved rounds, with what the
    # graphs hold as the plug-in prints it (run AV: faster in 4 of 4 pairs, 6.7-8.7 GB more) (~9 min)
    graphsab) python3 scripts/bench_megatron.py --megatron-lm .megatron_lm --configs dense-1b --iters 20 --repeats 2 \
        --variants megatron-bf16,ours-tensorwise-fused,ours-tensorwise-fused-graphs,ours-blockwise-fused,ours-blockwise-fused-graphs \
        --fusions rope --no-dropout --timeout 100 --out "$OUT/graphsab" 2>&1 | grep -v "^ " | tee "$OUT/bench_graphsab.txt" ;;
    # the per-layer graphs' memory (run AW): their GPU tests (the pool-based count, no first-capture retry
    # expected since the static input became a leaf), where a dense-1b stack's memory goes eagerly and graphed,
    # then one Megatron-LM round with the plug-in's count (~4 min)
    graphsmem) timeout 90 python3 -m pytest -q -rs -p no:logging -W always tests/test_graphed_linear_gpu.py 2>&1 \
        | cut -c1-400 | tee "$OUT/graphed_tests.log"
      timeout 120 python3 scripts/probes/graphs_memory.py --modes eager,graphs --history 2>&1 | tee "$OUT/graphs_memory.log"
      timeout 200 python3 scripts/bench_megatron.py --megatron-lm .megatron_lm --configs dense-1b --iters 16 \
        --variants megatron-bf16,ours-tensorwise-fused,ours-tensorwise-fused-graphs --fusions rope --no-dropout \
        --timeout 60 --out "$OUT/graphsmem" 2>&1 | grep -v "^ " | tee "$OUT/bench_graphsmem.txt"
      grep -h "capture failed\|graphs of" "$OUT"/graphsmem/*.log | cut -c1-300 | sort | uniq -c ;;
    # MEGATRON_EXTRA: Megatron-LM arguments for every variant, one string (bench_megatron's --megatron-args)
    # the per-layer graphs' replay guards and the FP8 state fixes (2026-12-08 review) on a GPU
    review) python3 -m pytest -q -rs -p no:logging tests/test_graphed_linear_gpu.py tests/test_graphed_replays.py \
        tests/test_fp8_state.py 2>&1 | tee "$OUT/review_tests.log" ;;
    megatron) python3 scripts/bench_megatron.py --megatron-lm .megatron_lm ${MEGATRON_ARGS:-} \
        ${MEGATRON_EXTRA:+"--megatron-args=$MEGATRON_EXTRA"} --out "$OUT" 2>&1 | tee "$OUT/bench_megatron.txt" ;;
    *) echo "unknown step $what" ;;
  esac
done
