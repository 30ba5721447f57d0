"""``python -m hf_posext.cli``: the same as the ``hf-posext`` command."""

import sys

from hf_posext.cli.main import main

sys.exit(main())
