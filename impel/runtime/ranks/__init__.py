"""The process and its ranks (a room of ``impel.runtime``, layer 2).

``process`` (topology, device and process-group setup: ``PartialState`` / ``AcceleratorState``),
``process_control`` (who runs what: ``main_process_first``, ``on_*_process``), ``collectives`` (cross-rank
operations: gather, broadcast, reduce, pad), ``splitting`` (per-rank shares: ``split_between_processes``),
``rank_health`` (who waits for whom, the stall watchdog, the ranks' normal-exit notes), ``teardown`` (a clean exit
of the process group).
"""
