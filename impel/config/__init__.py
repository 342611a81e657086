"""Layer 1, configuration: every value a run can be given, checked, before anything is built.

- ``environment``: the only module that reads or writes ``os.environ`` (launch variables, topology).
- ``schema``: ``option()`` field declarations, coercion, ``ConfigError``.
- ``run_config``: the run config (typed dataclasses), validation and the one-way merge.
- ``yaml_file``: config files in Accelerate's YAML layout; ``convert``: FSDP <-> DeepSpeed translation.
- ``plugins``, ``kwargs_handler``, ``ddp_hooks``, ``profiling``, ``dynamo``: the objects users build in code
  (Accelerate's plugins and kwargs handlers).
- ``mesh_sizes``: the ``parallelism_config`` section; ``parallelism``: ``ParallelismConfig`` and its device mesh.
- ``deepspeed_json``: the DeepSpeed JSON, reconciled with impel's settings; ``deepspeed_plugin_members``: Accelerate's
  ``DeepSpeedPlugin`` members (``deepspeed_config``, ``selected``, ...) on impel's plugin.
- ``environment_settings``: Accelerate's ``ACCELERATE_*`` / ``FSDP_*`` variables (and ``IMPEL_*``) as run settings.
- ``fsdp_values``: the FSDP plugin's values in their several spellings, normalised; ``plugin_refusals``: plugin
  arguments accepted by name and refused when set, with the reason.
- ``elastic``: the rules of an elastic job (``--nnodes MIN:MAX``): the accumulation that keeps the global batch.
- ``constants``: Accelerate's constants; ``unsupported``: the names impel deliberately does not provide, each with
  its reason (they import, and raise on use).
"""
