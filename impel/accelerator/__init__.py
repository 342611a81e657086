"""Layer 5, the Accelerator (``impel.accelerator`` is also Accelerate's ``accelerate.accelerator`` path).

- ``facade``: ``Accelerator``, the one object a training loop talks to; it forwards to the modules below.
- ``resolve``: every value of a run settled before anything is built (the ``RunRecord``).
- ``prepared``: the record of what was prepared and registered.
- ``settings``, ``process_methods``: the run's settings and the collectives / process-control methods.
- ``save_load``: the ``save_state`` / ``load_state`` sequence; ``load_accelerate`` and
  ``load_accelerate_weights``: checkpoints written by Accelerate.
- ``resilience``: automatic resume, preemption, non-finite losses; ``local_sgd``: Local SGD.
"""
from __future__ import annotations

from impel.exports import lazy_face

# lazily: the facade imports torch, and the command line imports ``resilience`` from here without it
_EXPORTS = {"Accelerator": "impel.accelerator.facade"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
