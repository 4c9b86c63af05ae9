#!/usr/bin/env bash
# Issue 17's adaptive table on a lent GPU, inside one device call: bench_adaptive.py for each
# METHOD[:BATCHES] in turn, each under the time left before the deadline (a method cut off keeps
# the cases it finished: bench_adaptive.py rewrites its JSON after every case).
#   bash benchmarks/gpu_adaptive.sh OUTDIR SECONDS sd:1,8 pld:1 csd:1 ...
# Extra bench_adaptive.py flags come from $BENCH_FLAGS (default: --lengths 1,2,4,8 --repeats 3).
set -u
out=$1
deadline=$(( $(date +%s) + $2 ))
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Compilations shared between the methods' processes (AR, the prefill) are compiled once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ssd_jax_jit_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
for spec in "$@"; do
  method=${spec%%:*}
  batches=1,8
  [ "$method" != "$spec" ] && batches=${spec#*:}
  left=$(( deadline - $(date +%s) ))
  if (( left < 30 )); then echo "gpu_adaptive: no time left for $spec"; break; fi
  echo "gpu_adaptive: $spec with ${left}s left ($(date -u +%T))"
  timeout "$left" python3 benchmarks/bench_adaptive.py --method "$method" --batch "$batches" \
    ${BENCH_FLAGS:---lengths 1,2,4,8 --repeats 3} --out "$out/adaptive_gpu_${method}_b${batches//,/}"
  echo "gpu_adaptive: $spec ended with status $? ($(date -u +%T))"
done
