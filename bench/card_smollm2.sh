#!/usr/bin/env bash
# Issue 50 §2: the report card on SmolLM2-135M, on CPU, resumable (rerun the same line: finished samples are kept,
# per RULER sample, per passkey/needle/perplexity cell). Run in the background, commit bench/results/card/ as it grows:
#
#   nohup bash bench/card_smollm2.sh cpu   > bench/results/card/cpu.log 2>&1 &    # 20 samples a task, up to 16384
#   nohup bash bench/card_smollm2.sh cpu32 > bench/results/card/cpu32.log 2>&1 &  # 10 samples a task at 32768
#
# Rows (one --models entry each; the methods after @ are that model's):
#   the original model, unscaled, inside its 8192 window (2048/4096/8192: where each task's ability ends; the
#   longer lengths are listed as skipped, over the window); training-free yarn x4 and BEST (x4); the fine-tuned
#   headline model (MERGED: bench/finetune_retrieval_cpu.sh merge, yarn x4 in its config) as saved + string.
# Environment: MERGED (default: the retrieval-varied merge), BEST (default dynamic-ntk), PYTHON, DTYPE, BOOKS.
set -uo pipefail
stage=${1:?stage: cpu|cpu32}
PYTHON=${PYTHON:-python}
BOOKS=${BOOKS:-/work/shared/data/books}
BEST=${BEST:-dynamic-ntk}
DTYPE=${DTYPE:-float32}
MERGED=${MERGED:-$(VARIANT=retrieval-varied PYTHON=$PYTHON bash bench/finetune_retrieval_cpu.sh merge | tail -1)}
MODELS="base=smollm2-135m@none;yarn:4;$BEST:4,fine-tuned=$MERGED@as-saved;string:1"
COMMON=(--models "$MODELS" --tasks perplexity,passkey,needle,ruler --dtype "$DTYPE" --device "${DEVICE:-cpu}"
        --ppl-data "$BOOKS/austen-emma.txt" --haystack "$BOOKS/melville-moby_dick.txt" --skip-over-window --no-progress
        --sample-cache bench/results/card/ruler-samples)
case "$stage" in
cpu)   OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card "${COMMON[@]}" --lengths 2048,4096,8192,16384 \
           --samples "${SAMPLES:-20}" --out bench/results/card/cpu ;;
cpu32) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card "${COMMON[@]}" --lengths 32768 \
           --samples "${SAMPLES:-10}" --out bench/results/card/cpu-32k ;;
*) echo "unknown stage $stage (cpu|cpu32)" >&2; exit 2 ;;
esac
