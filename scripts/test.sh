#!/usr/bin/env bash
# Set up, then run the test suite: everything on the newest transformers 5.x, then the parity and
# patching tests again on transformers 4.57.x (in .venv-tf457, sharing the installed torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
$PY -m pytest -q "$@"
if [[ "${HF_POSEXT_SKIP_TF4:-0}" != "1" ]]; then
  if [[ ! -x .venv-tf457/bin/python ]]; then
    $PY -m venv --system-site-packages .venv-tf457
  fi
  .venv-tf457/bin/python -m pip install --quiet "transformers>=4.57,<4.58"
  .venv-tf457/bin/python -m pytest -q -m "not real_model and not multiprocess" tests/test_methods_parity.py tests/test_patching.py
fi
