"""One save or load as it runs (a room of ``impel.checkpoint``, layer 3): the session handed to every writer, the
asynchronous machinery and the training state around the model.

``session`` (``SaveSession``: the temporary directory, the leader, the process group, staging or sealing; every
writer takes it first), ``staging`` (asynchronous saves: the recorded writes, the background thread and its gloo
group), ``stager`` (CPU copies into buffers reused from one save to the next), ``collective`` (steps every rank
must call, failures shared with every rank), ``state`` (RNG, counters, dataloaders), ``registered`` (a registered
object's state, read back at the save), ``options`` (``save_state`` / ``load_state`` keyword arguments),
``save_object`` (Accelerate's ``save``).

The sequence that runs them for ``save_state`` / ``load_state`` is the Accelerator's
(``impel.accelerator.save_load``).
"""
