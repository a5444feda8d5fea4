"""Saving: the sequence, the planner, the writer and the (async) saver.

``_save`` is one save, top to bottom (check, plan, stage, write, commit, clean up), each step
a named call to the modules below.
``_plan`` turns a model, optimizer, scheduler and user content into this rank's chunks and
declarations (one walk of the model, no I/O); ``_optim_save`` the optimizer's part of it;
``_write`` writes the rank's file and manifest and merges the manifests into the index;
``_saver`` runs one save (synchronous or in the background) and its commit; ``_memcopy``
and ``_step_gate`` are the async save's host copy and the gate on the next optimizer step.

Internal: the public entry point is :func:`nxd_ckpt.save_checkpoint`.
"""

__all__: list[str] = []
