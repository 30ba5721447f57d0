#!/bin/bash
# Reproduces one measured run: the project's first SmolLM2-135M 8k -> 32k fine-tune (24 steps of LoRA + PoSE on 2 CPU
# cores, bench/results/finetune_smollm2), then before/after on held-apart text. Not the way to fine-tune: run a recipe
# (recipes/README.md lists them; this one is recipes/configs/smollm2-135m/32k-books-24-steps-cpu.yaml).
#
#   bash bench/reproduce_smollm2_first_finetune.sh [DATA]   # DATA: the books folder (default data/books, shipped in the
#                                                           # repository; the committed cells read the same books from
#                                                           # ../shared/data/books: pass that folder to extend them)
#
# 1. Trains recipes/configs/smollm2-135m/32k-books-24-steps-cpu.yaml (yarn x4, 2048-token PoSE windows
#    spanning [0, 32768); austen-emma.txt and melville-moby_dick.txt are excluded from training).
#    Interrupted? Run the script again: training resumes from its latest checkpoint.
# 2. Evaluates the training-free baseline (SmolLM2 + yarn x4) and the fine-tuned model (its merged
#    weights + yarn x4) at 16384 and 32768 tokens: perplexity on the first 16384 tokens of the books
#    folder (that is austen-emma.txt, held apart: files are read in name order) and passkey at depths
#    0.1/0.5/0.9, one trial each. Results resume too; `hf-posext report` prints the side-by-side table.
#
# Cost on 2 idle CPU cores: training about 14 min on the Trainer engine (24 steps of 32-37 s, from the quiet
# steps of the 2026-11-27 run: bench/results/finetune_smollm2/training/log.jsonl); each evaluated model about 40 min
# (4 forwards at 16384 tokens, 155-195 s each, and 4 at 32768, 436-514 s each). Results: docs/training.md. The baseline cells at 32768 are the ones bench/quality_table.py computes (same settings):
# point OUT at its folder to reuse them.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=$(realpath "${1:-data/books}")  # absolute: the results-file key includes the path
OUT=${OUT:-results/finetune_smollm2}
CONFIG=recipes/configs/smollm2-135m/32k-books-24-steps-cpu.yaml
RUN=$(hf-posext train --config "$CONFIG" --print-config | python -c "import sys, yaml; print(yaml.safe_load(sys.stdin)['output']['dir'])")

if [ -f "$RUN/merged/config.json" ]; then
    echo "fine-tuned model found in $RUN/merged"
elif compgen -G "$RUN/checkpoint-*" > /dev/null; then
    hf-posext train --config "$CONFIG" --resume "data.source=$DATA"
else
    hf-posext train --config "$CONFIG" "data.source=$DATA"
fi

for MODEL in smollm2-135m "$RUN/merged"; do
    hf-posext eval perplexity --model "$MODEL" --methods yarn --factor 4 --lengths 16384,32768 \
        --data "$DATA" --max-tokens 16384 --max-segments 4 --out "$OUT"
    hf-posext eval passkey --model "$MODEL" --methods yarn --factor 4 --lengths 16384,32768 \
        --depths 0.1,0.5,0.9 --trials 1 --out "$OUT" --dtype float32
done
hf-posext report "$OUT"
