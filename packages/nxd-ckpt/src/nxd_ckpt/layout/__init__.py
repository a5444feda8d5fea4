"""Where this rank's tensors sit in the global tensors: the part both save and load share.

* ``_context``: this process's TP/PP/DP/EP coordinates and the few collectives a checkpoint
  call needs;
* ``_sharding``: a local tensor's blocks in its global tensor (:class:`ShardSpec`, from the
  sharding attributes: TP, GQA, padding, experts, stored parts);
* ``_model_tensors``: the one walk of a model (plain, ``NxDPPModel`` stages, ``LoRAModel``,
  a state dict) into named local tensors and their specs;
* ``_optim_common``: an optimizer resolved into its parameters by name (plain or ZeRO-1);
* ``_items``: a tensor to save or load with where its local data lives, and who writes it.

Internal: nothing here is public API (``nxd_ckpt`` and its public modules are).
"""

__all__: list[str] = []
