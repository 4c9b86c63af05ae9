#!/usr/bin/env bash
# Issue 17's adaptive table on a lent GPU, inside one device call: bench_adaptive.py for each
# METHOD[:BATCHES[:LENGTHS]] in turn, each under the time left before the deadline (a method cut off
# keeps the cases it finished: bench_adaptive.py rewrites its JSON after every case).
#   bash benchmarks/gpu_adaptive.sh OUTDIR SECONDS sd:1,8:1,2,4 pld:1,8:2,8 csd:1 ...
# Extra bench_adaptive.py flags come from $BENCH_FLAGS (default: --repeats 3; --lengths 1,2,4,8
# where the spec names none).
# PREWARM=SECONDS first runs every (method, prompt set, temperature) of the specs as its own
# untimed process, all at once, for at most that long: they fill JAX's persistent compilation
# cache, so the timed runs after them, one at a time, load their programs instead of compiling
# them (compiling is most of a case's time on a GPU: 50-90 s against seconds of decoding).
# The specs' order is their priority (each later one runs 5 nicer). Nothing they measure is kept; the timed runs measure everything again.
# The script's output also goes to OUTDIR/gpu_adaptive.log. PACK_TO=DIR packs OUTDIR into
# DIR/gpu_adaptive.tgz at the end (a device call returns at most 8 files: PACK_TO=$OUT).
# CACHE_TO=DIR also hands JAX's compilation cache back, as DIR/jit_cache_N.tgz (at most CACHE_MB,
# default 15, MiB); CACHE_FROM=DIR unpacks such parts, carried by a later call, before anything
# runs, so that call loads the programs an earlier one compiled (`benchmarks/jit_cache_parts.py`).
# Keep the parts a call returns in the repository's .gpu_cache/ (git ignores it); the next call
# names it in its carry and runs with CACHE_FROM=.gpu_cache (the carried tree's limit is 64 MiB).
set -u
out=$1
deadline=$(( $(date +%s) + $2 ))
shift 2
mkdir -p "$out"
exec > >(tee -a "$out/gpu_adaptive.log") 2>&1
export PYTHONUNBUFFERED=1
# Compilations shared between processes (AR, the prefill, a prewarmed case) are compiled once.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ssd_jax_jit_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
flags=${BENCH_FLAGS:---repeats 3}
if [ -n "${CACHE_FROM:-}" ]; then
  python3 benchmarks/jit_cache_parts.py unpack "$CACHE_FROM" "$JAX_COMPILATION_CACHE_DIR"
fi

spec_fields() {   # spec -> "method batches lengths"
  local method=${1%%:*} rest batches=1,8 lengths=1,2,4,8
  if [ "$method" != "$1" ]; then
    rest=${1#*:}
    batches=${rest%%:*}
    [ "$batches" != "$rest" ] && lengths=${rest#*:}
  fi
  echo "$method $batches $lengths"
}

if [ -n "${PREWARM:-}" ]; then
  warm_dir=$(mktemp -d /tmp/gpu_adaptive_prewarm.XXXX)
  echo "gpu_adaptive: prewarming for at most ${PREWARM}s ($(date -u +%T))"
  niceness=0   # the first spec's cases compile first where the cores are short
  for spec in "$@"; do
    read -r method batches lengths <<<"$(spec_fields "$spec")"
    for set in ${PREWARM_SETS:-code,repeat short badguess}; do
      for t in 0 1; do
        name=${method}_${set//,/_}_t$t
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$PREWARM" nice -n "$niceness" python3 benchmarks/bench_adaptive.py \
          --method "$method" --batch "$batches" --lengths "$lengths" $flags --repeats 1 \
          --sets "$set" --temperatures "$t" --out "$warm_dir/$name" >"$warm_dir/$name.log" 2>&1 &
      done
    done
    niceness=$(( niceness < 15 ? niceness + 5 : 19 ))
  done
  wait
  for log in "$warm_dir"/*.log; do
    if grep -q Traceback "$log"; then echo "gpu_adaptive: prewarm $(basename "$log") failed:"; tail -5 "$log"; fi
  done
  echo "gpu_adaptive: prewarm done ($(date -u +%T)); cache $(du -sh "$JAX_COMPILATION_CACHE_DIR" | cut -f1)"
fi

for spec in "$@"; do
  read -r method batches lengths <<<"$(spec_fields "$spec")"
  left=$(( deadline - $(date +%s) ))
  if (( left < 30 )); then echo "gpu_adaptive: no time left for $spec"; break; fi
  echo "gpu_adaptive: $spec with ${left}s left ($(date -u +%T))"
  timeout "$left" python3 benchmarks/bench_adaptive.py --method "$method" --batch "$batches" \
    --lengths "$lengths" $flags --out "$out/adaptive_gpu_${method}_b${batches//,/}"
  echo "gpu_adaptive: $spec ended with status $? ($(date -u +%T))"
done
if [ -n "${PACK_TO:-}" ]; then
  mkdir -p "$PACK_TO" && tar czf "$PACK_TO/gpu_adaptive.tgz" -C "$out" . && echo "gpu_adaptive: packed into $PACK_TO/gpu_adaptive.tgz"
fi
if [ -n "${CACHE_TO:-}" ]; then
  python3 benchmarks/jit_cache_parts.py pack "$JAX_COMPILATION_CACHE_DIR" "$CACHE_TO" --mb "${CACHE_MB:-15}"
fi
