"""Fine-tune a model for a longer context window (LoRA or full, optional PoSE) with accelerate.

    accelerate launch [--config_file recipes/accelerate/X.yaml] recipes/finetune.py \
        --config recipes/configs/<model>/<name>.yaml [key=value ...] [--resume [DIR]] [--overwrite]

Same as `hf-posext train`; the work is done by hf_posext.training (see docs/training.md).
"""

import sys

from hf_posext.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
