"""lm-evaluation-harness: the ``hf-posext`` model, the launcher and the method comparison.

- :mod:`hf_posext.integrations.lm_eval.model`: :class:`PosextHFLM`, registered as ``hf-posext`` when imported (needs the harness);
- :mod:`hf_posext.integrations.lm_eval.launcher`: the harness's own CLI with that model registered
  (``python -m hf_posext.integrations.lm_eval ...``, ``hf-posext lm-eval ...``);
- :mod:`hf_posext.integrations.lm_eval.compare`: one model under several methods on the same tasks (``hf-posext lm-eval-compare``);
- :mod:`hf_posext.integrations.lm_eval.ruler`: the RULER runner of the suite (``hf-posext eval suite``, :mod:`hf_posext.card`);
- :mod:`hf_posext.integrations.lm_eval.cli`: the two ``hf-posext`` subcommands.

Importing this package imports nothing from the harness.
"""
