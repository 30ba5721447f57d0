"""The suite (``hf-posext eval suite``): perplexity, passkey, needle, RULER and chat endings, models × methods × lengths,
in one card (``card.json``, ``card.md``, ``card.html``, one plot a task).

One package, and control flows one way, top to bottom:

- :mod:`~hf_posext.card.run`: :func:`~hf_posext.card.run.run_card` takes a :class:`~hf_posext.card.settings.CardSettings`
  (the command line, :mod:`hf_posext.cli.card_command`, builds it) and runs the phases;
- :mod:`~hf_posext.card.tasks`: one runner per task (perplexity, passkey, needle, chat endings); the RULER runner, which
  needs lm-evaluation-harness, is :mod:`hf_posext.integrations.lm_eval.ruler`. Runners hand cells back;
- :mod:`~hf_posext.card.folder`: ``card.json`` read once (:class:`~hf_posext.card.folder.CardFolder`) and written once per
  write; the earlier card's and the running cells; combining cards (``hf-posext report A B --out C``);
- :mod:`~hf_posext.card.render`: markdown, HTML (``html_report``'s page) and plots;
- :mod:`~hf_posext.card.stats`: the :class:`~hf_posext.card.stats.Cell`, scores, intervals and paired comparisons;
- :mod:`~hf_posext.card.checks`: numbers no run writes, refused when a card is read;
- :mod:`~hf_posext.card.rows`: each row built on its model;
- :mod:`~hf_posext.card.samples`, :mod:`~hf_posext.card.budgets`: the RULER sample cache, per-sample results, budgets;
- :mod:`~hf_posext.card.settings`, :mod:`~hf_posext.card.spec`: what a run asks for; rows, labels, identity, task names.

``hf-posext report CARD_FOLDER`` needs only ``folder`` and ``render`` (and what they read). Importing this package
imports none of its modules.
"""
