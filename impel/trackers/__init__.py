"""Layer 5, experiment trackers (faced as ``impel.tracking``, Accelerate's path).

- ``base``: the custom-tracker contract (``GeneralTracker``, ``on_main_process``, ``LoggerType``).
- ``builtin``: the trackers built from a name (JSONL, TensorBoard, W&B, MLflow, trackio).
- ``registry``: names to trackers, registration, and the Accelerator's set of trackers.
"""
