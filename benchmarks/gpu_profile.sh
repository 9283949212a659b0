#!/usr/bin/env bash
# Nsight Compute profiles of the kernels against their vendor baselines, to explain the gaps that
# benchmarks/gpu_kernels.sh measures (issue 35: "explained by a profile, not guessed"): for each
# case, every kernel launched inside benchmarks/profile_kernel.py's profiler range, with ncu's
# SpeedOfLight (SM and memory throughput against peak, duration), ComputeWorkloadAnalysis (pipe
# utilisation: the tensor pipe), LaunchStats (registers, shared memory) and Occupancy sections, as
# CSV under $OUT. ncu replays each kernel many times: a case takes tens of seconds. ncu runs with
# --clock-control none (the lent machines' rule: measure the card as it is). Where it cannot read
# the counters (those machines' gVisor runtime), PROFILER=auto falls back to JAX's profiler: each
# case's kernels and their device times from a Perfetto trace (profile_kernel.py --jax-trace).
#
#   bash benchmarks/gpu_profile.sh                      # on the GPU machine, repository root
#   CASES="flash_mosaic flash_cudnn" bash benchmarks/gpu_profile.sh
#   PROFILER=jax bash benchmarks/gpu_profile.sh         # JAX's profiler only (auto | ncu | jax)
#   CPU=1 bash benchmarks/gpu_profile.sh                # the driver only, in interpret mode (a check)
TAIL=${TAIL:-15}
source "$(dirname "$0")/gpu_common.sh"  # OUT, PY, PYTHONPATH and step()
FLASH="flash --seq-len 4096 --head-dim 128 --causal"
declare -A CASE=(
  [flash_pallas]="$FLASH --impl pallas" [flash_mosaic]="$FLASH --impl mosaic"
  [flash_cudnn]="$FLASH --impl cudnn" [flash_tokamax]="$FLASH --impl tokamax"
  [flash_mosaic_bwd]="$FLASH --impl mosaic --backward" [flash_cudnn_bwd]="$FLASH --impl cudnn --backward"
  [flash_mosaic_split_bwd]="$FLASH --impl mosaic_split --backward"
  [w4a16_m16]="quant --impl w4a16 --m 16" [w4a16_m16_nosplit]="quant --impl w4a16 --m 16 --split-k 1"
  [bf16_m16]="quant --impl bf16 --m 16" [w8a8_m64]="quant --impl w8a8 --m 64"
)
CASES=${CASES:-flash_pallas flash_mosaic flash_cudnn flash_tokamax flash_mosaic_bwd flash_mosaic_split_bwd flash_cudnn_bwd w4a16_m16 w4a16_m16_nosplit bf16_m16 w8a8_m64}
PROFILER=${PROFILER:-auto}
if [ "${CPU:-0}" != 1 ] && [ "$PROFILER" = auto ]; then
  # one counter of one tiny kernel: refused where the runtime hides the counters
  if timeout 90 ncu --clock-control none --metrics sm__cycles_elapsed.max --target-processes all \
    $PY -c "import jax.numpy as jnp; jnp.ones(8).sum().block_until_ready()" > "$OUT/ncu_probe.log" 2>&1 \
    && grep -q "sm__cycles_elapsed" "$OUT/ncu_probe.log"; then
    PROFILER=ncu
  else
    PROFILER=jax
    echo "=== ncu cannot read the counters here ($OUT/ncu_probe.log): JAX's profiler instead"
  fi
fi
for name in $CASES; do
  if [ "${CPU:-0}" = 1 ]; then
    case "$name" in *cudnn* | *tokamax*) continue ;; esac  # vendor kernels need a GPU
    JAX_PLATFORMS=cpu step "$name" 300 $PY benchmarks/profile_kernel.py ${CASE[$name]} --interpret \
      --seq-len 128 --head-dim 64 --tokens 128 --heads 2 --kv-heads 2 --m 4 --k 256 --n 256 --iters 1 \
      --jax-trace "$OUT/$name.trace" --trace-process /host:CPU
  elif [ "$PROFILER" = ncu ]; then
    step "$name" 120 ncu --clock-control none --profile-from-start off --target-processes all --csv --page details \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
      --log-file "$OUT/$name.csv" $PY benchmarks/profile_kernel.py ${CASE[$name]} --iters 1
  else
    step "$name" 120 $PY benchmarks/profile_kernel.py ${CASE[$name]} --iters 3 --jax-trace "$OUT/$name.trace"
  fi
done
rm -rf "$OUT"/*.trace  # the tables are in the logs; the traces are large
ls -la "$OUT"
