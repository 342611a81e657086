"""Accelerate's ``accelerate.test_utils`` path under impel's name: Accelerate's own test-suite helpers, which read
and reset Accelerate's internal state; impel does not ship them. Importing this path raises ImportError naming the
reason and what to use: ``impel.testing.run_on_ranks`` for multi-rank tests, ``impel.utils.patch_environment``
for environment variables."""
from __future__ import annotations

raise ImportError(f"{__name__} is not provided: it is Accelerate's own test-suite helpers (accelerate.test_utils, "
                  "which read and reset Accelerate's internal state); run a function on N CPU ranks with "
                  "impel.testing.run_on_ranks, patch the environment with impel.utils.patch_environment, or keep "
                  "importing accelerate.test_utils from Accelerate", name=__name__)
