#!/usr/bin/env bash
# The report card on SmolLM2-135M, on 2 CPU cores, in parts that resume (rerun the same line: finished samples
# are kept, per RULER sample, per passkey/needle/perplexity cell), combined into one card at the end. Run a part
# in the background and commit bench/results/card/ as it grows:
#
#   nohup bash bench/card_smollm2.sh PART > bench/results/card/PART.log 2>&1 &
#
# The headline row is the fine-tune with aggregation practice ("fine-tuned with aggregation practice, yarn x4 + string";
# AGGREGATION), since card run 27; the first recipe's fine-tune ("fine-tuned, yarn x4 + string"; MERGED) was the
# headline before, and the parts run before then measured it in the headline's place.
# Parts, in the order they were run (the two tasks the targets rest on first):
#   counting    niah_single_1 and ruler_fwe (the tasks the original model does inside its window), 2048/8192/16384,
#               20 samples: the original model, training-free yarn x4, fine-tuned + string.        -> cpu/ (bfloat16)
#   counting32  the same two tasks at 32768, 10 samples (SAMPLES, TASKS: their order; more samples
#               extend the cells on the same first samples): the headline + string, then yarn x4 (WITH_FIRST=1: the
#               first recipe's fine-tune between them, on the same samples).                       -> cpu-32k/ (float32)
#   ending      the chat-ending row: 48 instructions in the model's chat template, the three fine-tunes. -> ending/ (float32)
#   ruler       the six offline RULER tasks, every row, 2048-16384, 20 samples (resumes counting). -> cpu/ (bfloat16)
#               GRID=training-free: only yarn x4 and BEST x4 at 16384 (the floor's cells that do not depend on which
#               fine-tune is the headline). GRID=floor: only the floor's three rows at 16384 (yarn x4, BEST x4, the headline + string), the
#               way to the floor on a CPU with native bfloat16 (a 16384-token sample: 80-100 s on an AMD EPYC
#               with AVX-512 BF16, against 114 s in float32 on one without); GRID=base: the original model on
#               niah_single_1 and ruler_fwe at 2048-8192 (its other four tasks are ruler-float32's).
#   ruler-float32  the four RULER tasks the original model cannot do inside its window
#               (niah_multikey_2/3, ruler_vt, ruler_cwe) on the floor's grid, for a CPU without native
#               bfloat16: the original model at 2048/4096/8192 first (where each task's ability ends),
#               then yarn x4, BEST x4 and the headline + string at 16384, 20 samples (GRID=base: the
#               original model's cells only; on a CPU with native bfloat16 the 16384 rows are `GRID=floor
#               ruler`'s: run one of the two there, never both, nor `ruler` without GRID beside this: the
#               combined card refuses a cell held by two folders).                                -> cpu-float32/
#   tasks       perplexity, passkey and needle on the same grid (the original model inside its window,
#               then the three rows at 16384), 20 trials a cell.                                 -> cpu-tasks/ (float32)
#   tasks-bfloat16  the same three tasks on the floor's three rows at 16384, for a CPU with native bfloat16
#               (--dtype auto: perplexity in float32, passkey and needle in bfloat16); run it or `GRID=floor tasks`,
#               never both (the combined card refuses a cell held by two folders).          -> cpu-tasks-16k/ (auto)
#   best32      niah_single_1 and ruler_fwe at 32768 for BEST x4, 10 samples.                    -> cpu-32k-best/ (float32)
#   tasks32     perplexity, passkey and needle at 32768 (the headline + string and yarn x4, the floor's two rows there;
#               WITH_BEST=1 adds BEST x4 as a third row, which the floor does not need), 10 trials; --dtype auto:
#               passkey and needle in bfloat16 where the CPU runs it natively (a 4096-token forward took 0.70x float32's time on an
#               AMD EPYC with AVX-512 BF16), in float32 elsewhere; perplexity always float32.
#               WITH_FIRST=1 adds the first recipe's fine-tune, WITH_HARDER=1 the harder-practice fine-tune (see harder),
#               after the headline, on the same trials. TASKS: some of the three, in the card's order (rows one after another).
#               The other RULER tasks are beyond the base model: the floor lets 32768 skip them. -> cpu-32k-tasks/ (auto)
#   harder      the fine-tune on the harder practice (VARIANT=retrieval-tasks of bench/reproduce_smollm2_cpu_runs.sh)
#               beside the committed fine-tune and the original model, paired on the same samples: ruler_fwe and
#               niah_single_1 at 2048 and 8192, 20 samples. A float32 side study for a CPU without native
#               bfloat16 (cpu/ holds these cells in bfloat16), so its card is not combined (its cells would be
#               the same rows and lengths as cpu/'s): read cpu-harder/card.html.               -> cpu-harder/ (float32)
#   harder16    the harder-practice fine-tune on the RULER tasks that count, at 16384 beside the floor's rows there (same
#               samples, paired), 20 samples: niah_multikey_2 first (the task of distractors that share a key's wording,
#               which only the harder practice practised, in its own wordings), then ruler_fwe and niah_single_1 (TASKS,
#               SAMPLES). Does it hold up on tasks it never practised as well as the first recipe's fine-tune does? -> cpu/ (bfloat16)
#   harder32    ruler_fwe, then niah_single_1, at 32768 for it beside counting32's two rows, 20 samples (SAMPLES,
#               TASKS; the rows' finished samples are kept, so it extends counting32).          -> cpu-32k/ (float32)
#   aggregation16  the fine-tune with aggregation practice (VARIANT=retrieval-aggregation of
#               bench/reproduce_smollm2_cpu_runs.sh: the harder practice plus most_often questions, who did a thing most
#               often) on ruler_fwe, then niah_single_1, at 16384 beside the floor's rows there (same samples, paired),
#               20 samples (TASKS, SAMPLES): does practice at counting lift word-frequency extraction?  -> cpu/ (bfloat16)
#   aggregation32  the same at 32768 beside counting32's rows (and harder32's), 20 samples (SAMPLES, TASKS): the
#               ruler_fwe target's task and length.                                              -> cpu-32k/ (float32)
#   string-offset  a training-free lever for ruler_fwe at 32768: the first recipe's fine-tune with STRING's shifted offset
#               at half the length (S = 16384, so the farthest distance it sees is about 16.5k, where it scores
#               0.25, instead of about 22k with the paper's S = L/3), beside counting32's rows on the same samples
#               (paired), 10 samples (SAMPLES, TASKS); never beside another part writing cpu-32k/. Not run on the
#               CPU: on the H200 (run 18) it scored 0.03 against the default offset's 0.10 (paired 3:12, p = 0.035),
#               so it is not taken.                                                              -> cpu-32k/
#   as-saved32  ruler_fwe at 32768 for the fine-tuned model as saved (yarn x4 in its config, no STRING) beside
#               counting32's rows on the same samples (paired), 10 samples (SAMPLES, TASKS): does the first fine-tune's
#               degenerate answer (an empty numbered list, or one word repeated) come from STRING's remapped
#               positions or from the fine-tune? Never beside another part writing cpu-32k/.          -> cpu-32k/
#   floor       every part the CPU floor still needs, one after another, in FLOOR.md's order (`python bench/card_floor.py
#               --commands`: float32 twins on a CPU without native bfloat16), then combine: the one line that resumes
#               the floor where a session left it (hours: run it in the background, commit as it grows).
#   combine     one card from every part that has run: bench/results/card/card.html (+ card.json, card.md, plots),
#               and FLOOR.md: every cell the issue's sample floor needs, with what it has (bench/card_floor.py).
#
# Rows (one --models entry each; the methods after @ are that model's): the original model, unscaled, inside its
# 8192 window (2048/4096/8192: where each task's ability ends; longer lengths are listed as skipped, over the
# window); training-free yarn x4 and BEST x4; the headline fine-tune (AGGREGATION: VARIANT=retrieval-aggregation
# bench/reproduce_smollm2_cpu_runs.sh merge, yarn x4 in its config) with string; the other fine-tunes (MERGED: the first
# recipe's; HARDER) where a part names them.
#
# Each part has a folder of its own, so that parts on different machines never write the same folder (`ruler`
# extends `counting`'s cells, so the two share cpu/), and each folder keeps one dtype, so that any machine resumes
# it (a sample file is named by its dtype, and a float32 run never reads a bfloat16 one). bfloat16 parts refuse to
# start on a CPU without native bfloat16 (there it is emulated: 5.2x float32's time for a 4096-token forward,
# bench/cpu_forward_dtype.py); on one with it, retrieval in bfloat16 took 0.43x float32's time per 16384-token
# sample with the same responses (bench/results/cpu_retrieval_dtype/).
# Environment: AGGREGATION (the headline; default: the retrieval-aggregation merge), MERGED (default: the retrieval-varied
# merge), HARDER, BEST (default dynamic-ntk), WITH_BEST, WITH_FIRST and WITH_HARDER (tasks32), PYTHON, SAMPLES, TASKS
# (counting32, harder32, string-offset, and GRID=floor ruler: e.g. TASKS=niah_multikey_2,ruler_fwe for the tasks
# that count first), BOOKS, GRID (ruler-float32 and tasks: base = the original model's cells only, floor = the
# three rows at 16384 only, default both, in that order; ruler: floor = the three rows at 16384 only, base =
# the original model's niah_single_1 and ruler_fwe).
set -uo pipefail
# One brace group, read whole before anything runs: an edit made while a part runs cannot change what it does next.
{
PARTS="counting|counting32|ending|ruler|ruler-float32|tasks|tasks-bfloat16|best32|tasks32|harder|harder16|harder32|aggregation16|aggregation32|string-offset|as-saved32|floor|combine"
part=${1:?part: $PARTS}
PYTHON=${PYTHON:-python}
R=bench/results/card
case "$part" in counting|counting32|ending|ruler|ruler-float32|tasks|tasks-bfloat16|best32|tasks32|harder|harder16|harder32|aggregation16|aggregation32|string-offset|as-saved32|floor|combine) ;; *) echo "unknown part $part ($PARTS)" >&2; exit 2 ;; esac
# WITH_AGGREGATION (before card run 27) added the aggregation-practice row; that row is the headline now, in every part
[ -z "${WITH_AGGREGATION:-}" ] || { echo "WITH_AGGREGATION is gone: the aggregation-practice fine-tune is the headline row of every part now (WITH_FIRST=1 adds the first recipe's fine-tune); unset it" >&2; exit 2; }
# GRID narrows ruler, ruler-float32 and tasks; a misspelt one would run the whole grid (hours), so it is refused
case "$part:${GRID:-all}" in *:all|ruler:floor|ruler:base|ruler:training-free|ruler-float32:floor|ruler-float32:base|tasks:floor|tasks:base) ;;
  ruler:*|ruler-float32:*|tasks:*) echo "unknown GRID=$GRID for $part: use all, floor or base (ruler also takes training-free)" >&2; exit 2 ;; esac
if [ "$part" = floor ]; then
  bash "$0" combine > /dev/null || exit
  commands=$("$PYTHON" bench/card_floor.py --commands) || exit
  [ -n "$commands" ] || { echo "the CPU floor is met: $R/FLOOR.md"; exit 0; }
  while IFS= read -r command; do
    echo "floor: $command ($(date -u +%T) UTC)"
    eval "$command" < /dev/null || echo "floor: $command stopped with status $? ($(date -u +%T) UTC)" >&2
  done <<< "$commands"
  exec bash "$0" combine
fi
if [ "$part" = combine ]; then
  folders=()
  for f in cpu cpu-float32 cpu-tasks cpu-tasks-16k cpu-32k cpu-32k-best cpu-32k-tasks ending; do [ -f "$R/$f/card.json" ] && folders+=("$R/$f"); done
  "$PYTHON" -m hf_posext.cli report "${folders[@]}" --out "$R" || exit
  exec "$PYTHON" bench/card_floor.py --card "$R/card.json"   # what the sample floor still needs: $R/FLOOR.md
fi
# BOOKS: a folder with austen-emma.txt and melville-moby_dick.txt for the perplexity and needle cells (default: the
# repository's data/books, as the committed cells record it, "data/books/austen-emma.txt"; BOOKS= uses the CLI's
# built-in text, said in one line).
REPO_BOOKS=data/books   # relative, as the committed cells' keys hold it (this script runs from the repository root)
[ -d "$REPO_BOOKS" ] || REPO_BOOKS="$(cd "$(dirname "$0")/.." && pwd)/data/books"
if [ -z "${BOOKS+set}" ] && [ -d "$REPO_BOOKS" ]; then BOOKS=$REPO_BOOKS; fi
if [ -n "${BOOKS:-}" ]; then
  TEXTS=(--data "$BOOKS/austen-emma.txt" --haystack "$BOOKS/melville-moby_dick.txt")
else
  TEXTS=()
  case "$part" in tasks|tasks-bfloat16|tasks32) echo "no BOOKS folder: perplexity and needle use the CLI's built-in text (builtin:python-docs)" >&2 ;; esac
fi
case "$part" in
counting|ruler|tasks-bfloat16|harder16|aggregation16) DTYPE=bfloat16; [ "$part" = tasks-bfloat16 ] && DTYPE=auto  # auto: perplexity stays float32
  if ! "$PYTHON" -c "from hf_posext.evaluation.loading import cpu_has_native_bfloat16 as n; raise SystemExit(not n())"; then
    echo "this CPU has no native bfloat16: $part runs in bfloat16 (emulated here, about 5x float32's time); run counting32, ruler-float32, tasks, best32 or tasks32 here" >&2
    exit 2
  fi ;;
tasks32) DTYPE=auto ;;  # perplexity float32; passkey and needle bfloat16 where the CPU runs it natively, else float32
*) DTYPE=float32 ;;
esac
BEST=${BEST:-dynamic-ntk}
# the first recipe's fine-tune (stage 2: lookups in varied wordings), the headline until card run 27: row "fine-tuned"
MERGED=${MERGED:-$(VARIANT=retrieval-varied PYTHON=$PYTHON bash bench/reproduce_smollm2_cpu_runs.sh merge | tail -1)}
ALL_ROWS="base=smollm2-135m@none;yarn:4;$BEST:4,fine-tuned=$MERGED@as-saved;string:1"
# the CPU floor's grid: the original model inside its window; the three other rows at 16384
BASE_ROW="base=smollm2-135m@none"
# the harder practice's fine-tune, merged with its yarn x4 (needs its kept adapter): its parts, and tasks32 WITH_HARDER
case "$part" in harder|harder16|harder32|ending) NEEDS_HARDER=1 ;; tasks32) NEEDS_HARDER=${WITH_HARDER:-} ;; *) NEEDS_HARDER= ;; esac
if [ -n "$NEEDS_HARDER" ]; then
  HARDER=${HARDER:-$(VARIANT=retrieval-tasks PYTHON=$PYTHON bash bench/reproduce_smollm2_cpu_runs.sh merge | tail -1)}
  [ -f "$HARDER/config.json" ] || { echo "no merged harder-practice model: VARIANT=retrieval-tasks bash bench/reproduce_smollm2_cpu_runs.sh train, keep, then merge" >&2; exit 1; }
fi
# The README's headline: the fine-tune with aggregation practice (VARIANT=retrieval-aggregation, merged with its yarn
# x4 from the committed adapter), since card run 27 (bench/results/card/README.md, "Which fine-tune is the headline?").
# Every part that measures the headline's cells, and the ending row, needs it; the original model's cells do not.
case "$part:${GRID:-all}" in ruler:base|ruler:training-free|ruler-float32:base|tasks:base) NEEDS_AGGREGATION= ;;
  aggregation16:*|aggregation32:*|ending:*|counting32:*|ruler:floor|ruler-float32:*|tasks:*|tasks-bfloat16:*|tasks32:*) NEEDS_AGGREGATION=1 ;;
  *) NEEDS_AGGREGATION= ;; esac
if [ -n "$NEEDS_AGGREGATION" ]; then
  AGGREGATION=${AGGREGATION:-$(VARIANT=retrieval-aggregation PYTHON=$PYTHON bash bench/reproduce_smollm2_cpu_runs.sh merge | tail -1)}
  [ -f "$AGGREGATION/config.json" ] || { echo "no merged aggregation-practice model: VARIANT=retrieval-aggregation bash bench/reproduce_smollm2_cpu_runs.sh merge (from the committed adapter)" >&2; exit 1; }
fi
HEADLINE_ROW="fine-tuned with aggregation practice=${AGGREGATION:-}@string:1"
# the CPU floor's three rows at 16384: yarn x4, BEST x4 and the headline
FLOOR_ROWS="base=smollm2-135m@yarn:4;$BEST:4,$HEADLINE_ROW"
card() { OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PYTHON" -m hf_posext.cli eval suite --dtype "$DTYPE" --device "${DEVICE:-cpu}" \
           --no-progress --sample-cache $R/ruler-samples "$@"; }
case "$part" in
counting)   card --models "base=smollm2-135m@none;yarn:4,fine-tuned=$MERGED@string:1" --tasks niah_single_1,ruler_fwe \
                 --lengths 2048,8192,16384 --trials "${SAMPLES:-20}" --skip-over-window --out $R/cpu ;;
counting32) card --models "$HEADLINE_ROW${WITH_FIRST:+,fine-tuned=$MERGED@string:1},base=smollm2-135m@yarn:4" --tasks "${TASKS:-niah_single_1,ruler_fwe}" \
                 --lengths 32768 --trials "${SAMPLES:-10}" --out $R/cpu-32k ;;
ending)     card --models "base=smollm2-135m@none;yarn:4,fine-tuned=$MERGED@string:1,fine-tuned on harder practice=$HARDER@string:1,fine-tuned with aggregation practice=$AGGREGATION@string:1" \
                 --tasks ending --lengths 2048 --out $R/ending ;;
ruler)
            # GRID=floor: the floor's three rows at 16384 only; GRID=training-free: its two training-free rows there
            # (what does not wait on which fine-tune is the headline); GRID=base: the original model's two tasks here
            if [ "${GRID:-all}" = floor ] || [ "${GRID:-all}" = training-free ]; then
              rows=$FLOOR_ROWS; [ "$GRID" = training-free ] && rows="base=smollm2-135m@yarn:4;$BEST:4"
              card --models "$rows" --tasks "${TASKS:-ruler}" --lengths 16384 --trials "${SAMPLES:-20}" --out $R/cpu
            elif [ "${GRID:-all}" = base ]; then  # the original model on the two tasks cpu/ holds for it (the other four: cpu-float32/)
              card --models "$BASE_ROW" --tasks niah_single_1,ruler_fwe --lengths 2048,4096,8192 --trials "${SAMPLES:-20}" \
                   --skip-over-window --out $R/cpu
            else
              card --models "$ALL_ROWS" --tasks ruler --lengths 2048,4096,8192,16384 --trials "${SAMPLES:-20}" --skip-over-window \
                   --out $R/cpu
            fi ;;
ruler-float32|tasks)
            if [ "$part" = tasks ]; then T=perplexity,passkey,needle; O=$R/cpu-tasks; else
              T=niah_multikey_2,niah_multikey_3,ruler_vt,ruler_cwe; O=$R/cpu-float32; TEXTS=(); fi
            if [ "${GRID:-all}" != floor ]; then
              card --models "$BASE_ROW" "${TEXTS[@]}" --tasks $T --lengths 2048,4096,8192 --trials "${SAMPLES:-20}" \
                   --skip-over-window --out $O || exit; fi
            if [ "${GRID:-all}" != base ]; then
              card --models "$FLOOR_ROWS" "${TEXTS[@]}" --tasks $T --lengths 16384 --trials "${SAMPLES:-20}" --out $O; fi ;;
tasks-bfloat16) card --models "$FLOOR_ROWS" "${TEXTS[@]}" --tasks perplexity,passkey,needle --lengths 16384 \
                 --trials "${SAMPLES:-20}" --out $R/cpu-tasks-16k ;;
best32)     card --models "base=smollm2-135m@$BEST:4" --tasks niah_single_1,ruler_fwe --lengths 32768 --trials "${SAMPLES:-10}" \
                 --out $R/cpu-32k-best ;;
harder)     card --models "base=smollm2-135m@none,fine-tuned=$MERGED@string:1,fine-tuned on harder practice=$HARDER@string:1" \
                 --tasks ruler_fwe,niah_single_1 --lengths 2048,8192 --trials "${SAMPLES:-20}" --skip-over-window \
                 --out $R/cpu-harder ;;
harder16)   card --models "fine-tuned on harder practice=$HARDER@string:1" --tasks "${TASKS:-niah_multikey_2,ruler_fwe,niah_single_1}" \
                 --lengths 16384 --trials "${SAMPLES:-20}" --out $R/cpu ;;
harder32)   card --models "fine-tuned=$MERGED@string:1,base=smollm2-135m@yarn:4,fine-tuned on harder practice=$HARDER@string:1" \
                 --tasks "${TASKS:-ruler_fwe,niah_single_1}" --lengths 32768 --trials "${SAMPLES:-20}" --out $R/cpu-32k ;;
aggregation16) card --models "fine-tuned with aggregation practice=$AGGREGATION@string:1" --tasks "${TASKS:-ruler_fwe,niah_single_1}" \
                 --lengths 16384 --trials "${SAMPLES:-20}" --out $R/cpu ;;
aggregation32) card --models "fine-tuned with aggregation practice=$AGGREGATION@string:1" --tasks "${TASKS:-ruler_fwe,niah_single_1}" \
                 --lengths 32768 --trials "${SAMPLES:-20}" --out $R/cpu-32k ;;
string-offset) card --models "fine-tuned=$MERGED@string:1" --param shifted_offset=16384 --tasks "${TASKS:-ruler_fwe}" \
                 --lengths 32768 --trials "${SAMPLES:-10}" --out $R/cpu-32k ;;
as-saved32) card --models "fine-tuned=$MERGED@as-saved" --tasks "${TASKS:-ruler_fwe}" --lengths 32768 --trials "${SAMPLES:-10}" \
                 --out $R/cpu-32k ;;
tasks32)    card --models "$HEADLINE_ROW${WITH_FIRST:+,fine-tuned=$MERGED@string:1}${WITH_HARDER:+,fine-tuned on harder practice=$HARDER@string:1},base=smollm2-135m@yarn:4${WITH_BEST:+;$BEST:4}" \
                 "${TEXTS[@]}" --tasks "${TASKS:-perplexity,passkey,needle}" --lengths 32768 --trials "${SAMPLES:-10}" --out $R/cpu-32k-tasks ;;
esac
exit
}
