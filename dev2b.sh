set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 400 python3 scripts/bench_grouped.py --recipes current blockwise delayed --out $OUT > $OUT/bench_grouped.log 2>&1; grep -E "^\| 8x" $OUT/bench_grouped.log | cut -c1-170
