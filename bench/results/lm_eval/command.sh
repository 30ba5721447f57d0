#!/bin/bash
# The RULER comparisons in eval/lm_eval.md (SmolLM2-135M, offline, 2 samples per task and method).
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
for task in niah_single_1 ruler_vt; do
  /usr/bin/time -v hf-posext lm-eval-compare smollm2-135m \
    --methods none yarn:factor=2 dynamic-yarn:factor=2 \
    --tasks $task --seq-lengths 16384 --limit 2 --max-length 16384 \
    --model-args dtype=float32 --out bench/results/lm_eval/${task}_16384.json
done
# inside the window, for reference
/usr/bin/time -v hf-posext lm-eval-compare smollm2-135m --methods none yarn:factor=2 \
  --tasks ruler_vt niah_single_1 --seq-lengths 4096 --limit 2 --max-length 16384 \
  --model-args dtype=float32 --out bench/results/lm_eval/niah_vt_4096.json
