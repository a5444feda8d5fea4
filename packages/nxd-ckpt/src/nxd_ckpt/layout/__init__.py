"""Where this rank's tensors sit in the global tensors: the part both save and load share.

* ``_context``: this process's TP/PP/DP/EP coordinates (``nxd_state.shards.RankContext``) and
  the few collectives a checkpoint call needs;
* ``_sharding``: a local tensor's blocks in its global tensor (``nxd_state.shards.ShardSpec``,
  from the layers' sharding attributes by ``nxd_layers.checkpoint_shards``), under nxd-ckpt's
  old names;
* ``_model_tensors``: the one walk of a model into named local tensors and their specs: asked
  of a model that describes its own state (``nxd_state.shards.CheckpointState``: a pipeline
  model, a LoRA model), else read from its layers; a state dict; stored parts;
* ``_optim_common``: an optimizer resolved into its parameters by name (plain, or ZeRO-1 as
  it describes its flat layout: ``nxd_state.shards.FlatShardedState``);
* ``_items``: a tensor to save or load with where its local data lives, and who writes it.

Internal: nothing here is public API (``nxd_ckpt`` and its public modules are).
"""

__all__: list[str] = []
