#!/usr/bin/env bash
# Second GPU session of 2026-11-26 (after gpu_session.sh): training MFU with cuDNN vs the Pallas
# flash kernel inside llama_1b, a tile sweep of the flash kernel at H=128, and narrower N tiles for
# the quantized matmuls at decode batch sizes (more programs for the K loop to spread over).
TAIL=25  # lines of each step's log shown
source "$(dirname "$0")/gpu_common.sh"  # OUT, PY, PYTHONPATH and step()
for impl in cudnn pallas; do
  step train_$impl 80 $PY -m jaxsys.train --config configs/llama_1b.py --workdir /tmp/llama_1b_$impl \
    --config.train.batch_size=16 --config.train.steps=30 --config.train.log_every=10 \
    --config.train.eval_every=0 --config.train.progress=False --config.checkpoint.enabled=False \
    --config.model.attention_impl=$impl
  cat /tmp/llama_1b_$impl/metrics.jsonl | tee "$OUT/train_$impl.jsonl"
done
for blocks in "128 64" "64 128" "128 32"; do
  set -- $blocks
  step flash_q$1_k$2 35 $PY -m jaxsys.kernels.flash_attention.bench --seq-lens 4096 --head-dims 128 \
    --impls pallas --block-q $1 --block-k $2 --repeats 3
done
step quant_narrow 60 $PY -m jaxsys.kernels.quantized_matmul.bench --models llama-7b --batches 1,16 \
  --formats bf16,w8a16,w4a16 --block-ns 32,64 --repeats 3
