#!/usr/bin/env bash
# Reproduces one measured run: a committed SmolLM2-135M 8k -> 32k CPU fine-tune of bench/results/finetune_retrieval_cpu
# (VARIANT picks which, below) and the evaluations that compared them (bench/results/long4x). Not the way to
# fine-tune: to fine-tune, run a recipe (recipes/README.md lists them, with their status); the headline model is two
# commands from the repository root:
#   hf-posext train --config recipes/configs/smollm2-135m/32k-stage1-books-cpu.yaml
#   hf-posext train --config recipes/configs/smollm2-135m/32k-stage2-lookups-and-counting-cpu.yaml
#
# What this adds to a recipe is bookkeeping across sessions on 2 CPU cores: it writes to the committed run's own
# folder names, restores a kept checkpoint, keeps the newest one in the repository (a session's background jobs end
# with it), and evaluates with the settings of the committed cells.
#
#   bash bench/reproduce_smollm2_cpu_runs.sh train [BOOKS]   # restore the kept checkpoint if runs/ has none, then train --resume
#   bash bench/reproduce_smollm2_cpu_runs.sh keep            # copy the newest intact checkpoint + log into bench/results/finetune_retrieval_cpu/run
#   bash bench/reproduce_smollm2_cpu_runs.sh floor [BOOKS]   # the training-free floor: yarn and dynamic-ntk x4 at 16384,
#                                                # passkey and needle, 3 trials x 5 depths (15 per task), into bench/results/long4x
#                                                # (FLOOR_METHODS, TASKS, LENGTHS, TRIALS narrow or move it)
#   bash bench/reproduce_smollm2_cpu_runs.sh eval [BOOKS]    # the finished adapter (yarn x4), same trials and texts, into bench/results/long4x
#                                                # (TASKS=passkey or needle for one task; LENGTHS, TRIALS as for floor;
#                                                # DEPTHS=0 for one depth, default 0,0.25,0.5,0.75,1)
#   bash bench/reproduce_smollm2_cpu_runs.sh compare [BOOKS] # eval + floor one trial per depth at a time, 1..TRIALS (default 3): a stop
#                                                # at any point leaves the three models with about the same n
#   bash bench/reproduce_smollm2_cpu_runs.sh accumulate [BOOKS]  # eval one trial a depth at a time, FROM..TRIALS (1..10): 50 trials
#                                                # a task and length, gathered across sessions (TASKS, LENGTHS as for eval)
#   bash bench/reproduce_smollm2_cpu_runs.sh merge           # the adapter merged, yarn x4 in its config.json: runs/merged-KEPT-yarn4
#   bash bench/reproduce_smollm2_cpu_runs.sh string [BOOKS]  # STRING (paper defaults, S = 10813) on the adapter merged with its yarn x4:
#                                                # TASKS (passkey; needle, perplexity), LENGTHS (32768), DEPTHS (0), FROM..TRIALS (1..8)
#   bash bench/reproduce_smollm2_cpu_runs.sh ppl [BOOKS]     # perplexity on the held-apart perplexity book: the adapter at 2048, 8192, 16384
#                                                # and 32768 (PPL_LENGTHS narrows them), the original (none) at 2048 and 8192;
#                                                # same protocol as the README's table
#   bash bench/reproduce_smollm2_cpu_runs.sh report          # bench/results/long4x/report.md, plots and report.html, with the paired
#                                                # comparisons the README quotes (hf-posext report --compare: the trials
#                                                # only one of two models found, exact sign test)
#
# Evaluations pass --dtype float32: the committed cells of bench/results/long4x are float32 (the CLI's default
# on this CPU is now bfloat16 for passkey and needle, which would compute new cells beside them).
# BOOKS: the books folder, default data/books (shipped in the repository). The held-apart books the evaluations
# read are hf_posext.text_sources.PERPLEXITY_BOOK and HAYSTACK_BOOK. A result file's key holds the text's path
# as given: the committed cells of bench/results/long4x were computed with BOOKS=../shared/data/books (the same
# bytes, from before the books moved into the repository), so pass that folder to extend them, and to resume a
# checkpoint kept from then (its config names that data.source); data/books starts cells of its own.
#
# Run `train` in the background (nohup ... &) and `keep` before the session ends, then commit
# bench/results/finetune_retrieval_cpu/.
#
# VARIANT=NAME picks one run of docs/training.md (its recipe, its run folder in runs/, its kept folder
# bench/results/finetune_retrieval_cpu/run-NAME and its results rows); without VARIANT: the base run
# (32k-stage1-books-lr2e-4-cpu.yaml, peak learning rate 2e-4).
#   lr6e-4            stage 1 of the headline recipe: 32k-stage1-books-cpu.yaml (the same at 6e-4)
#   steps400          the base run stretched to 400 steps (train.max_steps=400)
#   retrieval         32k-stage2-lookups-only-cpu.yaml: 50 steps from the kept lr6e-4 adapter on samples that each hide
#                     8 synthetic key-value records and ask for them at their end, trained on the answers only
#   retrieval-mixed   32k-stage2-lookups-one-wording-cpu.yaml: the same with half of the samples plain book text, every
#                     sample weighing the same in the loss (train.loss_average=sequences)
#   retrieval-far     retrieval-mixed with data.pose_far_fraction=0.25 (a quarter of the samples end at position 32767)
#   retrieval-varied  stage 2 of the first recipe: 32k-stage2-lookups-cpu.yaml (retrieval-mixed with each
#                     record and question in several wordings), from the kept lr6e-4 adapter as the committed run was
#   retrieval-tasks   32k-stage2-hard-lookups-cpu.yaml: retrieval-varied with harder practice (distractors,
#                     several values, chains, word values, half of the retrieval samples in the chat template),
#                     from the kept lr6e-4 adapter
#   retrieval-aggregation  32k-stage2-lookups-and-counting-cpu.yaml: retrieval-tasks with a fifth kind of
#                     question, most_often (who did a thing most often; aggregation), 5 questions a sample,
#                     from the kept lr6e-4 adapter
set -euo pipefail
# The whole script is one brace group, read before anything runs: bash reads a script as it executes it,
# so an edit made while a long `compare` runs would otherwise end it mid-way (it happened, 2026-11-27).
{
cd "$(dirname "$0")/.."
R=recipes/configs/smollm2-135m
CONFIG=$R/32k-stage1-books-lr2e-4-cpu.yaml
RUN=runs/smollm2-135m-8k-32k-lora-pose-long
KEPT=bench/results/finetune_retrieval_cpu/run
STAGE1_ADAPTER=bench/results/finetune_retrieval_cpu/run-lr6e-4/adapter   # what every committed stage 2 started from
OVERRIDES=()
case "${VARIANT:-}" in
  "") ;;
  lr6e-4) CONFIG=$R/32k-stage1-books-cpu.yaml ;;
  steps400) OVERRIDES=(train.max_steps=400) ;;
  retrieval) CONFIG=$R/32k-stage2-lookups-only-cpu.yaml ;;
  retrieval-mixed) CONFIG=$R/32k-stage2-lookups-one-wording-cpu.yaml ;;
  retrieval-far) CONFIG=$R/32k-stage2-lookups-one-wording-cpu.yaml; OVERRIDES=(data.pose_far_fraction=0.25) ;;
  retrieval-varied) CONFIG=$R/32k-stage2-lookups-cpu.yaml; OVERRIDES=(finetune.init_adapter=$STAGE1_ADAPTER) ;;
  retrieval-tasks) CONFIG=$R/32k-stage2-hard-lookups-cpu.yaml; OVERRIDES=(finetune.init_adapter=$STAGE1_ADAPTER) ;;
  retrieval-aggregation) CONFIG=$R/32k-stage2-lookups-and-counting-cpu.yaml; OVERRIDES=(finetune.init_adapter=$STAGE1_ADAPTER) ;;
  *) echo "unknown VARIANT=$VARIANT: use lr6e-4, steps400, retrieval, retrieval-mixed, retrieval-far, retrieval-varied, retrieval-tasks or retrieval-aggregation, or leave it unset for the base run" >&2; exit 2 ;;
esac
if [ -n "${VARIANT:-}" ]; then
  RUN=$RUN-$VARIANT; KEPT=$KEPT-$VARIANT
fi
OVERRIDES+=("output.dir=$RUN")   # the run folder names of the committed runs, so that kept checkpoints restore
# The held-apart books, named once in the library (hf_posext.text_sources).
read -r PERPLEXITY_BOOK HAYSTACK_BOOK < <("${PYTHON:-python}" -c "from hf_posext.text_sources import PERPLEXITY_BOOK as p, HAYSTACK_BOOK as h; print(p, h)")
case "${1:?train|keep}" in
train)
  if [ -n "${2:-}" ]; then OVERRIDES+=("data.source=$2"); fi   # default: the recipe's data/books
  if [ -f "$RUN/adapter/posext_adapter.json" ] || [ -f "$KEPT/adapter/posext_adapter.json" ]; then
    echo "the run is finished: its adapter is in $RUN/adapter or $KEPT/adapter (bash $0 eval evaluates it)"; exit 0
  fi
  if ! compgen -G "$RUN/checkpoint-*" > /dev/null && [ -d "$KEPT" ]; then
    mkdir -p "$RUN" && cp -r "$KEPT"/. "$RUN"/
    echo "restored $(ls -d "$RUN"/checkpoint-*) from $KEPT"
  fi
  if compgen -G "$RUN/checkpoint-*" > /dev/null; then
    exec hf-posext train --config "$CONFIG" --resume --no-progress "${OVERRIDES[@]}"
  fi
  exec hf-posext train --config "$CONFIG" --no-progress --overwrite "${OVERRIDES[@]}"   # a run folder without a checkpoint holds nothing to keep
  ;;
floor)
  # Same trials and texts as every other model in bench/results/long4x; finished cells are skipped, so it resumes.
  BOOKS=${2:-data/books}
  E="--model smollm2-135m --factor 4 --lengths ${LENGTHS:-16384} --depths 0,0.25,0.5,0.75,1 --trials ${TRIALS:-3} --out bench/results/long4x --no-progress --dtype float32"
  for m in ${FLOOR_METHODS:-yarn dynamic-ntk}; do
    for task in ${TASKS:-passkey needle}; do
      if [ "$task" = needle ]; then hf-posext eval needle --methods $m --haystack "$BOOKS/$HAYSTACK_BOOK" $E; else hf-posext eval passkey --methods $m $E; fi
    done
  done
  ;;
eval)
  BOOKS=${2:-data/books}
  # The kept (committed) adapter, so that every clone names the same model in the results and extends its cells.
  ADAPTER=${ADAPTER:-$KEPT/adapter}
  [ -f "$ADAPTER/posext_adapter.json" ] || { echo "no finished adapter in $ADAPTER: train to the last step, then run keep" >&2; exit 1; }
  E="--model smollm2-135m --adapter $ADAPTER --methods yarn --factor 4 --lengths ${LENGTHS:-16384} --depths ${DEPTHS:-0,0.25,0.5,0.75,1} --trials ${TRIALS:-3} --out bench/results/long4x --no-progress --dtype float32"
  for task in ${TASKS:-passkey needle}; do
    if [ "$task" = needle ]; then hf-posext eval needle --haystack "$BOOKS/$HAYSTACK_BOOK" $E; else hf-posext eval passkey $E; fi
  done
  ;;
compare)
  for t in $(seq 1 "${TRIALS:-3}"); do
    TRIALS=$t bash "$0" eval "${2:-data/books}"
    TRIALS=$t bash "$0" floor "${2:-data/books}"
  done
  ;;
accumulate)
  # The adapter's cells one trial a depth at a time, FROM..TRIALS (default 1..10: 50 trials a task and length):
  # a stop loses at most the trial in flight (finished cells are read back, a cell asked for with more
  # trials computes only the new ones), so 50 trials a cell can be gathered across CPU sessions.
  for t in $(seq "${FROM:-1}" "${TRIALS:-10}"); do
    TRIALS=$t bash "$0" eval "${2:-data/books}"
  done
  ;;
merge)
  # The adapter merged into SmolLM2 and saved with its yarn x4 in config.json (stock from_pretrained loads it
  # scaled), in runs/merged-KEPT-yarn4; prints that folder. Written once (about 10 s); the string stages read it.
  ADAPTER=${ADAPTER:-$KEPT/adapter}
  [ -f "$ADAPTER/posext_adapter.json" ] || { echo "no finished adapter in $ADAPTER: train to the last step, then run keep" >&2; exit 1; }
  MERGED=runs/merged-$(basename "$KEPT")-yarn4
  if [ ! -f "$MERGED/config.json" ]; then
    "${PYTHON:-python}" - "${MODEL:-smollm2-135m}" "$ADAPTER" "$MERGED" <<'PY'
import sys
from hf_posext.adapters import load_adapted_model
from hf_posext.export import export
from hf_posext.models import load_tokenizer
export(load_adapted_model(sys.argv[1], sys.argv[2]), "transformers", sys.argv[3], overwrite=True, tokenizer=load_tokenizer(sys.argv[1]))
PY
  fi
  echo "$MERGED"
  ;;
string)
  # STRING (An et al. 2025; docs/beyond_rescaling.md, 1c) on the fine-tuned model, passkey and needle at LENGTHS
  # (default 32768) and DEPTHS (default 0), one trial a depth at a time, FROM..TRIALS (default 1..8). The adapter
  # is merged into SmolLM2 and saved with its yarn x4 in config.json (hf_posext.export --for transformers), so
  # `string` runs on yarn's frequencies; patching `string` after `yarn` would replace yarn. The paper's
  # defaults on the window the merged model declares (L = 32768): S = 10813, w = 128 (STRING_S=N sets S),
  # so a key d >= S tokens back is seen d - 10685 back: a fact at depth 0 of 32768 (about 32,700 back) is
  # seen about 22,000 back, where the adapter finds depth 0.25 and 0.5's facts.
  BOOKS=${2:-data/books}
  MERGED=$(bash "$0" merge | tail -1)
  S="--model $MERGED --methods string --factor 1 ${STRING_S:+--param shifted_offset=$STRING_S} --out bench/results/long4x --no-progress --dtype float32"
  if [[ " ${TASKS:-passkey} " == *" perplexity "* ]]; then   # the ppl protocol (same book, windows and lengths)
    hf-posext eval perplexity $S --data "$BOOKS/$PERPLEXITY_BOOK" --max-tokens 16384 --max-segments 4 --lengths ${PPL_LENGTHS:-2048,8192,16384,32768}
  fi
  for t in $(seq "${FROM:-1}" "${TRIALS:-8}"); do
    for task in ${TASKS:-passkey}; do
      E="$S --lengths ${LENGTHS:-32768} --depths ${DEPTHS:-0} --trials $t"
      if [ "$task" = needle ]; then hf-posext eval needle --haystack "$BOOKS/$HAYSTACK_BOOK" $E; elif [ "$task" = passkey ]; then hf-posext eval passkey $E; fi
    done
  done
  ;;
ppl)
  BOOKS=${2:-data/books}
  ADAPTER=${ADAPTER:-$KEPT/adapter}
  P="--data $BOOKS/$PERPLEXITY_BOOK --max-tokens 16384 --max-segments 4 --out bench/results/long4x --no-progress"
  # the lengths of the README's table; finished cells are read back, so the older 8192/32768 cells are not recomputed
  hf-posext eval perplexity --model smollm2-135m --methods none --lengths 2048,8192 $P
  hf-posext eval perplexity --model smollm2-135m --adapter "$ADAPTER" --methods yarn --factor 4 --lengths ${PPL_LENGTHS:-2048,8192,16384,32768} $P
  ;;
report)
  # Each pair: the same trials, same texts; a pair with no shared trial stops the report, so only pairs both sides ran.
  # Once a GPU session's bfloat16 cells join a model's float32 ones, its rows are named "MODEL (float32): ..." and
  # "MODEL (bfloat16): ..." (never pooled): the error then lists the names to put here.
  M=run-retrieval-mixed/adapter; STRING_ON_M=runs/merged-run-retrieval-mixed-yarn4
  hf-posext report bench/results/long4x \
    --compare "$STRING_ON_M: string x1" "$M: yarn x4" \
    --compare "runs/merged-run-retrieval-varied-yarn4: string x1" "$STRING_ON_M: string x1" \
    --compare "runs/merged-run-retrieval-varied-yarn4: string x1" "run-retrieval-varied/adapter: yarn x4" \
    --compare "$M: yarn x4" "smollm2-135m: yarn x4" \
    --compare "$M: yarn x4" "run/adapter: yarn x4" \
    --compare "run-retrieval-far/adapter: yarn x4" "$M: yarn x4" \
    --compare "smollm2-135m: string x1" "smollm2-135m: none"
  ;;
keep)
  tmp=$(mktemp -d "$(dirname "$KEPT")/.keep-XXXX")
  if [ -f "$RUN/adapter/posext_adapter.json" ]; then
    # The run is finished: keep the adapter (about 7 MB, with its model card), not the optimizer state.
    cp -r "$RUN/adapter" "$tmp/"
    cp "$RUN"/log.jsonl "$RUN"/train_config.yaml "$tmp/"; cp "$RUN"/train_result.json "$tmp/" 2>/dev/null || true
    what="the finished adapter"
  else
    latest=$(ls -d "$RUN"/checkpoint-* 2>/dev/null | grep -E 'checkpoint-[0-9]+$' | sort -t- -k2 -n | tail -1)
    [ -n "$latest" ] || { rm -rf "$tmp"; echo "no checkpoint in $RUN yet" >&2; exit 1; }
    python - "$latest" <<'PY'
import sys
from hf_posext.training.checkpoints import verify_checkpoint
verify_checkpoint(sys.argv[1])  # a damaged checkpoint is named here, never kept
PY
    cp -r "$latest" "$tmp/"
    cp "$RUN"/log.jsonl "$RUN"/train_config.yaml "$tmp/"
    what=$(basename "$latest")
  fi
  chmod 755 "$tmp"; rm -rf "$KEPT" && mv "$tmp" "$KEPT"
  du -sh "$KEPT"; echo "kept $what: commit bench/results/finetune_retrieval_cpu/"
  ;;
esac
exit
}
