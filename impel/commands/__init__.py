"""Layer 8, the command line: one module per ``impel`` subcommand; nothing here imports torch at import time.

- ``main``: the ``impel`` command; ``launch`` (with ``flags``: launch flags from the config dataclasses), ``config``
  (with ``questionnaire``), ``env``, ``test`` (runs ``selftest`` on every rank), ``estimate`` (over ``planning/``:
  the memory estimator), ``merge`` (merge-weights), ``compare`` (loss curves); ``preflight`` (checks before any
  rank starts) and ``rank_watch`` (ranks die with the launcher; who left first).
"""
