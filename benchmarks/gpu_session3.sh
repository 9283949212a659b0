#!/usr/bin/env bash
# Third GPU session (2026-11-26, issue 22): the planner's predicted step time against measured step
# time on one GPU (experiments/planner/gpu_rank.py), the ladder residual's step time beside the
# standard block's on one GPU (no tensor parallelism there: it checks that the variant costs no
# compute, not the overlap), and the serving engine's throughput with a plain and a KIVI-4 cache.
TAIL=16  # lines of each step's log shown
source "$(dirname "$0")/gpu_common.sh"  # OUT, PY, PYTHONPATH and step()
HW=${HW:-h200}  # the cost-model profile of this GPU
step gpu_rank 180 $PY experiments/planner/gpu_rank.py --hardware "$HW" --attention-impl cudnn --out "$OUT/gpu_rank_$HW.json"
for residual in standard ladder; do
  step train_$residual 60 $PY -m jaxsys.train --config configs/llama_1b.py --workdir /tmp/llama_1b_$residual \
    --config.train.batch_size=8 --config.train.steps=30 --config.train.log_every=10 \
    --config.train.eval_every=0 --config.train.progress=False --config.checkpoint.enabled=False \
    --config.model.residual=$residual --config.model.attention_impl=cudnn
  cp /tmp/llama_1b_$residual/metrics.jsonl "$OUT/train_$residual.jsonl" 2>/dev/null
done
for kv in none kivi4; do
  step serve_$kv 100 $PY -m jaxsys.bench_serve --config configs/llama_1b.py --requests 32 --rate 0 \
    --prompt-len 128:512 --output-len 64:128 --pages 1024 --max-seqs 16 --json --config.serve.kv_quant=$kv
done
