#!/usr/bin/env bash
# One prepared GPU session (about 9 minutes): the kernels' correctness on the device, the kernel
# benchmarks against the vendor baselines, and training-step MFU. Every step has its own time limit
# and writes its log and JSON under $OUT, so a step that fails or runs long loses nothing else.
#
#   bash benchmarks/gpu_session.sh            # from the repository root on a GPU machine
#
# What the machine needs: benchmarks/gpu_common.sh.
TAIL=40  # lines of each step's log shown
source "$(dirname "$0")/gpu_common.sh"  # OUT, PY, PYTHONPATH and step()

nvidia-smi -L; $PY -c "import jax; print(jax.__version__, jax.devices())"

step check 110 $PY benchmarks/gpu_check.py --out "$OUT/gpu_check.json"
# flash attention: H=128 needs 64x64 tiles (128x128 asks for more shared memory than a block gets)
step flash128 110 $PY -m jaxsys.kernels.flash_attention.bench --seq-lens 4096,16384 --head-dims 128 \
  --block-q 64 --block-k 64 --repeats 5 --out "$OUT/flash_h128.json"
step flash64 70 $PY -m jaxsys.kernels.flash_attention.bench --seq-lens 4096,16384 --head-dims 64 \
  --repeats 5 --out "$OUT/flash_h64.json"
step quant 90 $PY -m jaxsys.kernels.quantized_matmul.bench --models llama-7b --batches 1,16,128 \
  --block-ns 128 --repeats 5 --out "$OUT/quantized_matmul.json"
# llama_1b on one GPU: batch 16 x 2048 tokens, remat dots, cuDNN attention, no checkpoints
step train_llama1b 140 $PY -m jaxsys.train --config configs/llama_1b.py --workdir /tmp/llama_1b \
  --config.train.batch_size=16 --config.train.steps=30 --config.train.log_every=10 \
  --config.train.eval_every=0 --config.train.progress=False --config.checkpoint.enabled=False \
  --config.model.attention_impl=cudnn
step linear 50 $PY -m jaxsys.kernels.linear_attention.bench --seq-lens 4096,16384 --head-dims 128 \
  --out "$OUT/linear_attention.json"
ls -la "$OUT"
