"""NxD's ``neuronx_distributed.trainer.checkpoint``: sharded safetensors checkpoints."""

from nxd_trainer import finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["finalize_checkpoint", "has_checkpoint", "load_checkpoint", "save_checkpoint"]
