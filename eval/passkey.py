#!/usr/bin/env python
"""passkey evaluation, scaling methods side by side (see docs/evaluation.md).

    python eval/passkey.py --model smollm2-135m --methods none,yarn,dynamic-yarn --lengths 4096,8192,16384
    accelerate launch --num_processes 2 eval/passkey.py ...   # splits the work across processes
"""

import sys

from hf_posext.evaluation.cli import main_task

if __name__ == "__main__":
    sys.exit(main_task("passkey"))
