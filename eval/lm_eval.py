"""lm-evaluation-harness on a scaled model: ``python eval/lm_eval.py <lm_eval arguments>``.

Same as ``hf-posext lm-eval`` / ``python -m hf_posext.integrations.lm_eval`` (see eval/lm_eval.md), e.g.::

    python eval/lm_eval.py run --model hf-posext --device cpu \\
        --model_args pretrained=smollm2-135m,posext=yarn:factor=2,dtype=float32,max_length=16384 \\
        --tasks niah_single_1 ruler_vt --metadata '{"max_seq_lengths": [16384]}' --limit 4
"""

import sys
from pathlib import Path

# This file is named like the harness's package: keep its folder off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from hf_posext.integrations.lm_eval.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
