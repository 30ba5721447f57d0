#!/usr/bin/env bash
# Installs hf-posext and its dependencies into the current Python (idempotent, seconds when done).
# The pinned CPU torch goes first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install --quiet "torch==2.13.0"
fi
$PY -m pip install --quiet -e ".[test,train,eval,lm-eval,deepspeed,serve]"
# DeepSpeed (sequence parallelism) builds a small C++ op with g++ and ninja on first use (DS_ACCELERATOR=cpu on CPU).
command -v g++ >/dev/null || echo "setup.sh: warning: g++ not found; DeepSpeed sequence parallelism (tests/test_training_sequence_parallel.py) needs it: apt-get install g++" >&2
