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
# the six RULER tasks that build offline (bench/ruler_offline_check.py -> ruler_offline.json), end to end,
# one sample each at 1024 tokens: 3:04 wall, 208 s user CPU on the shared 2-core CPU (2026-11-26)
/usr/bin/time -v hf-posext lm-eval-compare smollm2-135m --methods none dynamic-ntk:factor=2 \
  --tasks niah_single_1 niah_multikey_2 niah_multikey_3 ruler_vt ruler_cwe ruler_fwe \
  --seq-lengths 1024 --max-length 16384 --limit 1 --model-args dtype=float32 \
  --out bench/results/lm_eval/ruler_offline_smoke_1024.json
