#!/usr/bin/env bash
# Makes (or brings up to date) the transformers-4.57 environment the tests use beside the newest transformers:
#   bash scripts/tf457_venv.sh [FOLDER]        (default .venv-tf457; scripts/test.sh calls it)
# It shares the installed packages (--system-site-packages: torch is not downloaded again) and adds
# transformers 4.57.x on top. Two pins keep pip's resolver satisfied, so the set-up prints no
# "ERROR: pip's dependency resolver ..." line:
#   * datasets<5: transformers 4.57 needs huggingface-hub<1, which datasets 5.x refuses (it needs >=1.31);
#     datasets 4.x accepts both, so the venv gets a datasets that works with its huggingface-hub.
#   * --upgrade-deps: a venv of Python 3.11 carries its own setuptools 65, which shadows the installed one
#     and is older than torch 2.13 requires (>=77.0.3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-.venv-tf457}
if [[ ! -x "$VENV/bin/python" ]]; then
  $PY -m venv --system-site-packages --upgrade-deps "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "transformers>=4.57,<4.58" "datasets<5"
