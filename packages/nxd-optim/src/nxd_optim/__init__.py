"""nxd-optim: the optimizer side of nxd's data parallelism, on CPU (gloo), CUDA and XLA.

* :class:`NeuronZero1Optimizer`: ZeRO-1. Each param group is flattened, one padded buffer per
  dtype, sharded over the data-parallel group; gradients are reduce-scattered (all-reduced and
  sliced on gloo at 2 ranks), any ``torch.optim`` optimizer steps the local shard (fp32 master
  weights for bf16 params), parameters are all-gathered in place (they are views of the flat
  buffers on CPU and CUDA). torch-xla's attributes (``base_optimizer`` …),
  sharded and full state dicts, safetensors + JSON files, torch-xla state dicts read.
* :class:`NxDOptimizer`: NxD's optimizer wrapper. Without ZeRO-1 it all-reduces gradients over
  data parallelism (bucketed, averaged); it sums sequence-parallel gradients over TP, clips with
  ``nxd_layers.clip_grad_norm`` across TP/PP and exposes ``grad_norm``. At expert parallelism
  > 1 expert gradients are averaged over the expert-DP group.
* :class:`NeuronEPZero1Optimizer`: NxD's EP-aware ZeRO-1 (what ``NxDOptimizer`` with ZeRO-1
  builds at EP > 1): expert state sharded over the expert-DP group, the rest over DP x CP,
  one gradient norm with each expert counted once.
* :class:`OptimizerConfig` and :class:`MixedPrecisionConfig`: NxD's ``optimizer_config`` and
  ``mixed_precision_config`` dicts as validated dataclasses (the only ones: nxd-trainer
  re-exports them), and :func:`build_optimizer`, the factory that applies NxD's two dicts.
  :mod:`nxd_optim.checks`: the validation helpers every NxD config dataclass uses.
* :class:`AdamWFP32OptimParams` (NxD's ``AdamW_FP32OptimParams``): Hugging Face-style AdamW
  keeping fp32 state (and fp32 arithmetic) for bf16/fp16 params.
"""

from importlib.metadata import version as _version

from nxd_optim._buckets import DtypeBucket
from nxd_optim._flat import FlatLayout
from nxd_optim.adamw_fp32 import AdamW_FP32OptimParams, AdamWFP32OptimParams
from nxd_optim.checkpoint_layout import (
    ep_zero1_checkpoint_layout,
    flat_buckets,
    zero1_checkpoint_layout,
)
from nxd_optim.config import MixedPrecisionConfig, OptimizerConfig
from nxd_optim.ep_zero1 import NeuronEPZero1Optimizer
from nxd_optim.wrapper import NxDOptimizer, build_optimizer
from nxd_optim.zero1 import NeuronZero1Optimizer

__version__ = _version("nxd-optim")

__all__ = [
    "AdamWFP32OptimParams",
    "AdamW_FP32OptimParams",
    "DtypeBucket",
    "FlatLayout",
    "MixedPrecisionConfig",
    "NeuronEPZero1Optimizer",
    "NeuronZero1Optimizer",
    "NxDOptimizer",
    "OptimizerConfig",
    "__version__",
    "build_optimizer",
    "ep_zero1_checkpoint_layout",
    "flat_buckets",
    "zero1_checkpoint_layout",
]
