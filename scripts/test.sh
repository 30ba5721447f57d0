#!/usr/bin/env bash
# Set up, then run the test suite: everything on the newest transformers 5.x, then the parity and
# patching tests again on transformers 4.57.x (in .venv-tf457, sharing the installed torch). The 4.57
# venv is made first: tests/test_export.py loads exported folders with it from the main pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
if [[ "${HF_POSEXT_SKIP_TF4:-0}" != "1" ]]; then
  bash scripts/tf457_venv.sh .venv-tf457
fi
$PY -m pytest -q --durations=30 "$@"
if [[ "${HF_POSEXT_SKIP_TF4:-0}" != "1" ]]; then
  .venv-tf457/bin/python -m pytest -q -m "not real_model and not multiprocess" tests/test_methods_parity.py tests/test_patching.py
fi
