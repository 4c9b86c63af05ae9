#!/usr/bin/env bash
# The adaptive loop's per-step overhead over fixed programs on a lent GPU, inside one device call:
# benchmarks/loop_overhead.py (the "auto" program forced to each cap against fixed L=cap, and its
# plain step against AR's) under each XLA_FLAGS variant in turn, until the deadline.
#   bash benchmarks/gpu_loop_overhead.sh OUTDIR SECONDS [loop_overhead.py flags...]
# Variants (VARIANTS, space-separated names, default "default ondevice"):
#   default   XLA:GPU as shipped: a while_loop turn or a lax.switch reads its predicate or index
#             back to the host (command buffers capture fusions and library calls only);
#   ondevice  command buffers also capture while loops and conditionals (CUDA graph conditional
#             nodes, CUDA >= 12.3), so the loop's control flow stays on the device.
# PYTHON: the interpreter (default python3). Each variant writes OUTDIR/loop_overhead_<variant>.json and .log.
set -u
out=$1
deadline=$(( $(date +%s) + $2 ))
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
base_flags=${XLA_FLAGS:-}
command_buffers="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
for variant in ${VARIANTS:-default ondevice}; do
  case $variant in
    default) flags=$base_flags ;;
    ondevice) flags="$base_flags --xla_gpu_enable_command_buffer=$command_buffers,CONDITIONAL,WHILE" ;;
    *) echo "gpu_loop_overhead: unknown variant $variant (default, ondevice)"; exit 2 ;;
  esac
  left=$(( deadline - $(date +%s) ))
  if (( left < 30 )); then echo "gpu_loop_overhead: no time left for $variant"; break; fi
  echo "gpu_loop_overhead: $variant (XLA_FLAGS='$flags'), ${left}s left ($(date -u +%T))"
  XLA_FLAGS=$flags timeout "$left" "${PYTHON:-python3}" benchmarks/loop_overhead.py "$@" \
    --out "$out/loop_overhead_$variant" >"$out/loop_overhead_$variant.log" 2>&1
  status=$?
  echo "gpu_loop_overhead: $variant exit $status"
  grep -E "vs|wrote|Error|error" "$out/loop_overhead_$variant.log" | tail -8
done
