"""nxd-layers: tensor- and sequence-parallel layers under NeuronX Distributed's names.

Column/RowParallelLinear, ParallelEmbedding and the GQA QKV projection shard their weights
over the tensor-parallel group of the current :mod:`nxd_state` parallel state (or an explicit
``tensor_parallel_group``); every parameter carries its sharding attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) for clipping, optimizers
and checkpoints. Weights are sliced from a full master weight drawn from the seed, so any TP
degree builds the TP=1 model. The autograd collectives are in :mod:`nxd_layers.mappings`.
"""

from importlib.metadata import version as _version

from nxd_layers import mappings
from nxd_layers._attributes import (
    copy_tensor_model_parallel_attributes,
    divide,
    ensure_divisibility,
    full_tensor,
    gather_tensor_parallel_shards,
    mark_sequence_parallel_parameter,
    merge_shards,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    shard_for_rank,
)
from nxd_layers.embedding import ParallelEmbedding
from nxd_layers.grads import allreduce_sequence_parallel_gradients, clip_grad_norm, get_grad_norm
from nxd_layers.linear import ColumnParallelLinear, RowParallelLinear
from nxd_layers.loss_functions import parallel_cross_entropy
from nxd_layers.pad import get_number_of_extra_heads, pad_model
from nxd_layers.qkv_linear import GQAQKVColumnParallelLinear, get_kv_size_multiplier
from nxd_state import move_model_to_device

__version__ = _version("nxd-layers")

__all__ = [
    "ColumnParallelLinear",
    "GQAQKVColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "__version__",
    "allreduce_sequence_parallel_gradients",
    "clip_grad_norm",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "full_tensor",
    "gather_tensor_parallel_shards",
    "get_grad_norm",
    "get_kv_size_multiplier",
    "get_number_of_extra_heads",
    "mappings",
    "mark_sequence_parallel_parameter",
    "merge_shards",
    "move_model_to_device",
    "pad_model",
    "parallel_cross_entropy",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_for_rank",
]
