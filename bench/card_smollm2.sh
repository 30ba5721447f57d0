#!/usr/bin/env bash
# The report card on SmolLM2-135M, on CPU, resumable (rerun the same line: finished samples are kept,
# per RULER sample, per passkey/needle/perplexity cell). Run in the background, commit bench/results/card/ as it grows:
#
#   nohup bash bench/card_smollm2.sh cpu   > bench/results/card/cpu.log 2>&1 &    # 20 samples a task, up to 16384
#   nohup bash bench/card_smollm2.sh cpu32 > bench/results/card/cpu32.log 2>&1 &  # 10 samples a task at 32768
#   nohup bash bench/card_smollm2.sh counting > bench/results/card/counting.log 2>&1 &   # first: the two tasks that count
#   nohup bash bench/card_smollm2.sh counting32 > bench/results/card/counting32.log 2>&1 &   # then: those two at 32768
#   nohup bash bench/card_smollm2.sh other-tasks > bench/results/card/other-tasks.log 2>&1 &  # any CPU: the rest, float32
#
# `counting` runs the part the targets rest on first: niah_single_1 and ruler_fwe (the tasks the original model
# does inside its window), the original model at 2048 and 8192, training-free yarn x4 and the fine-tuned model
# with string at 2048, 8192 and 16384, 20 samples, into the same folder as `cpu` (which then resumes them:
# sample files are named by row, task, length and dtype). Retrieval runs in bfloat16 on such a CPU (--dtype auto): 0.43x float32's time
# per 16384-token sample with the same responses (bench/results/cpu_retrieval_dtype/).
#
# `counting32` runs the same two tasks at 32768 (where the targets are), 10 samples, the fine-tuned model with string
# first (the headline), then training-free yarn x4, into cpu-32k/ (which `cpu32` then resumes). TASKS sets its tasks
# and their order (default niah_single_1,ruler_fwe); with SAMPLES above 10 it extends the cells (the first 10
# samples are the same ones, checked against the cache). The card written lists the tasks of that run only.
#
# `other-tasks` runs the rest of `cpu` that is not in cpu/ yet, in float32, so that a CPU without native bfloat16 can
# go on with it: the four RULER tasks the original model cannot do inside its window (niah_multikey_2/3, ruler_vt,
# ruler_cwe), perplexity, passkey, needle and the ending row, every row, 2048-16384, 20 samples, into cpu-float32/.
#
# Each folder keeps one dtype, so that any machine resumes it (a sample file is named by its dtype, and a float32
# run never reads a bfloat16 one): cpu/ is bfloat16 for retrieval (--dtype auto on a CPU with native bfloat16;
# perplexity float32), cpu-32k/ is float32 (first run on an AVX2-only CPU, where bfloat16 is emulated: 5.2x
# float32's time for a 4096-token forward, bench/cpu_forward_dtype.py). `cpu` and `counting` refuse to start on a
# CPU without native bfloat16 unless DTYPE is given.
#
# Rows (one --models entry each; the methods after @ are that model's):
#   the original model, unscaled, inside its 8192 window (2048/4096/8192: where each task's ability ends; the
#   longer lengths are listed as skipped, over the window); training-free yarn x4 and BEST (x4); the fine-tuned
#   headline model (MERGED: bench/finetune_retrieval_cpu.sh merge, yarn x4 in its config) as saved + string.
# Environment: MERGED (default: the retrieval-varied merge), BEST (default dynamic-ntk), PYTHON, DTYPE, BOOKS,
# SAMPLES, TASKS (counting32).
set -uo pipefail
stage=${1:?stage: cpu|cpu32|counting|counting32|other-tasks}
PYTHON=${PYTHON:-python}
# BOOKS: a folder with austen-emma.txt and melville-moby_dick.txt for the perplexity and needle cells (default: the
# lab's public-domain books where they are; elsewhere, as in a clone, the CLI's built-in text, said in one line).
LAB_BOOKS="$(cd "$(dirname "$0")/.." && pwd)/../shared/data/books"   # beside the repository in the lab; a clone has none
if [ -z "${BOOKS+set}" ] && [ -d "$LAB_BOOKS" ]; then BOOKS=$LAB_BOOKS; fi
if [ -n "${BOOKS:-}" ]; then
  TEXTS=(--ppl-data "$BOOKS/austen-emma.txt" --haystack "$BOOKS/melville-moby_dick.txt")
else
  TEXTS=()
  case "$stage" in cpu|cpu32|other-tasks) echo "no BOOKS folder: perplexity and needle use the CLI's built-in text (builtin:python-docs)" >&2 ;; esac
fi
BEST=${BEST:-dynamic-ntk}
case "$stage" in cpu|cpu32|counting|counting32|other-tasks) ;; *) echo "unknown stage $stage (cpu|cpu32|counting|counting32|other-tasks)" >&2; exit 2 ;; esac
case "$stage" in
cpu32|counting32|other-tasks) DTYPE=${DTYPE:-float32} ;;
*) if [ -z "${DTYPE:-}" ] && ! "$PYTHON" -c "from hf_posext.evaluation.loading import cpu_has_native_bfloat16 as n; raise SystemExit(not n())"; then
     echo "this CPU has no native bfloat16: bench/results/card/cpu holds bfloat16 samples that --dtype auto (float32 here) would not resume; run counting32, cpu32 or other-tasks here, or set DTYPE=bfloat16 (slower here)" >&2
     exit 2
   fi
   DTYPE=${DTYPE:-auto} ;;   # auto: perplexity float32; passkey, needle, RULER bfloat16 on a CPU with it natively
esac
MERGED=${MERGED:-$(VARIANT=retrieval-varied PYTHON=$PYTHON bash bench/finetune_retrieval_cpu.sh merge | tail -1)}
MODELS="base=smollm2-135m@none;yarn:4;$BEST:4,fine-tuned=$MERGED@as-saved;string:1"
ALL=perplexity,passkey,needle,ruler,ending
COMMON=(--models "$MODELS" --dtype "$DTYPE" --device "${DEVICE:-cpu}"
        "${TEXTS[@]}" --skip-over-window --no-progress
        --sample-cache bench/results/card/ruler-samples)
case "$stage" in
cpu)   OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card "${COMMON[@]}" --tasks $ALL --lengths 2048,4096,8192,16384 \
           --samples "${SAMPLES:-20}" --out bench/results/card/cpu ;;
cpu32) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card "${COMMON[@]}" --tasks $ALL --lengths 32768 \
           --samples "${SAMPLES:-10}" --out bench/results/card/cpu-32k ;;
counting) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card --models "base=smollm2-135m@none;yarn:4,fine-tuned=$MERGED@string:1" \
           --tasks niah_single_1,ruler_fwe --lengths 2048,8192,16384 --samples "${SAMPLES:-20}" --dtype "$DTYPE" \
           --device "${DEVICE:-cpu}" --skip-over-window --no-progress --sample-cache bench/results/card/ruler-samples --out bench/results/card/cpu ;;
counting32) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card --models "fine-tuned=$MERGED@string:1,base=smollm2-135m@yarn:4" \
           --tasks "${TASKS:-niah_single_1,ruler_fwe}" --lengths 32768 --samples "${SAMPLES:-10}" --dtype "$DTYPE" \
           --device "${DEVICE:-cpu}" --no-progress --sample-cache bench/results/card/ruler-samples --out bench/results/card/cpu-32k ;;
other-tasks) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval card "${COMMON[@]}" \
           --tasks perplexity,passkey,needle,niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe,ending --lengths 2048,4096,8192,16384 \
           --samples "${SAMPLES:-20}" --out bench/results/card/cpu-float32 ;;
*) echo "unknown stage $stage (cpu|cpu32|counting|counting32|other-tasks)" >&2; exit 2 ;;
esac
