#!/usr/bin/env bash
# Issue 31's serving table on one GPU (an H100 or H200; about 6 minutes): llama_1b
# (configs/llama_1b.py) with random bf16 weights, served by jaxsys.serve.engine on one GPU.
#   1. the decode roofline at batch 64 (jaxsys.analyze --mode decode: weights + KV read, formulas);
#   2. the host gap at batch 64 (bench_serve --host-gap 64: an engine step against its compiled
#      function called back to back, 64 sequences decoding at context ~60);
#   3. 256 requests, all at once, prompts 128-512, outputs 64-256 tokens (bench_serve): output
#      tokens/s, TTFT and TPOT p50/p99;
#   4. the table (benchmarks/serving_table.py), then
#   5. the host gap again with a 4x larger page pool: does a step's time grow with the pool? On CPU
#      it does: the compiled step copies every layer's pool (benchmarks/serving_step_pool.py), and the
#      engine's per-row page tables are as wide as the pool (max_len defaults to the pool's tokens),
#      which the engine step pays on the host and the compiled one does not.
# Each step has its own time limit and writes its JSON under $OUT, so one that fails loses nothing
# else; the JSON and the table are copied to docs/benchmarks/gpu_serving_<date>/ at the end.
#
#   bash benchmarks/gpu_serving.sh               # from the repository root on a GPU machine
#   CPU=1 bash benchmarks/gpu_serving.sh         # every command on CPU with tiny stand-ins (a check)
#
# What the machine needs: benchmarks/gpu_common.sh. HW (h100 | h200) picks the roofline's profile;
# by default from nvidia-smi's name.
TAIL=${TAIL:-12}  # lines of each step's log shown
source "$(dirname "$0")/gpu_common.sh"  # OUT, PY, PYTHONPATH and step()
DATE=${DATE:-$(date -u +%F)}
if [ "${CPU:-0}" = 1 ]; then  # tiny stand-ins: configs/tiny.py, a few requests, small pools
  export JAX_PLATFORMS=cpu
  CONFIG=configs/tiny.py REQUESTS=8 PROMPT=16:48 OUTPUT=8:16 BATCH=8 SEQS=8
  PAGES=384 BIG=1536 BUDGET=64 CHUNK=32 GAP_BUDGET=64 LIMIT_SERVE=300 LIMIT_GAP=300 LIMIT_BIG=300
  HW=${HW:-h100} DEVICE="CPU stand-in (configs/tiny.py)" DEST=${DEST:-}
else
  CONFIG=configs/llama_1b.py REQUESTS=256 PROMPT=128:512 OUTPUT=64:256 BATCH=64 SEQS=64
  PAGES=4096 BIG=16384 BUDGET=512 CHUNK=256 GAP_BUDGET=64 LIMIT_SERVE=210 LIMIT_GAP=150 LIMIT_BIG=120
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)
  case "$DEVICE" in *H200*) HW=${HW:-h200} ;; *) HW=${HW:-h100} ;; esac
  DEST=${DEST:-docs/benchmarks/gpu_serving_$DATE}
fi
# the compiled programs of one run are reused by the next (same model, same row buckets)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache_serving}
MODEL="--config.mesh.fsdp=1 --config.model.param_dtype=bfloat16"
ENGINE="--page-size 16 --max-seqs $SEQS"
SERVE="$ENGINE --token-budget $BUDGET --chunk-size $CHUNK"
# the host-gap runs decode 64 sequences (row bucket 64): a 64-token budget compiles 4 row buckets, not 7
GAP="$ENGINE --token-budget $GAP_BUDGET --chunk-size $GAP_BUDGET --host-gap $BATCH --json"
echo "device: ${DEVICE:-unknown}, roofline profile $HW, $CONFIG"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"

step roofline 30 sh -c "$PY -m jaxsys.analyze --config $CONFIG --mode decode --hardware $HW \
  --contexts 64,512 --batches 1,$BATCH $MODEL --json > $OUT/decode.json"
step host_gap "$LIMIT_GAP" sh -c "$PY -m jaxsys.bench_serve --config $CONFIG $MODEL $GAP --pages $PAGES \
  > $OUT/host_gap.json"
step serve "$LIMIT_SERVE" sh -c "$PY -m jaxsys.bench_serve --config $CONFIG $MODEL $SERVE --pages $PAGES \
  --requests $REQUESTS --rate 0 --prompt-len $PROMPT --output-len $OUTPUT --seed 0 --json > $OUT/serve.json"
TABLE="$PY benchmarks/serving_table.py --dir $OUT --device \"$DEVICE\" --pages $PAGES --big-pages $BIG --summary $OUT/summary.json"
step table 15 sh -c "$TABLE > $OUT/table.md"
step host_gap_bigpool "$LIMIT_BIG" sh -c "$PY -m jaxsys.bench_serve --config $CONFIG $MODEL $GAP --pages $BIG \
  > $OUT/host_gap_bigpool.json"
sh -c "$TABLE" > "$OUT/table.md" && cat "$OUT/table.md"
# at most 8 files come back from a lent machine: the logs go into one
for f in "$OUT"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done > "$OUT/logs.txt" && rm -f "$OUT"/*.log
if [ -n "$DEST" ]; then
  mkdir -p "$DEST" && cp "$OUT"/*.json "$OUT/table.md" "$DEST/" && echo "copied to $DEST"
fi
ls -la "$OUT"
