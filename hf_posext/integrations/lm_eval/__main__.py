"""``python -m hf_posext.integrations.lm_eval <lm_eval arguments>``: the harness's CLI with ``hf-posext`` registered."""

import sys

from hf_posext.integrations.lm_eval.launcher import main

sys.exit(main())
