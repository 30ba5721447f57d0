#!/bin/bash
cd /work/main
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
/usr/bin/time -v hf-posext lm-eval-compare smollm2-135m \
  --methods none yarn:factor=2 dynamic-yarn:factor=2 \
  --tasks niah_single_1 --seq-lengths 16384 --limit 1 --max-length 16384 \
  --model-args dtype=float32 --out /tmp/lmx/cmp16k/comparison.json
