"""nxd-layers: tensor- and sequence-parallel layers under NeuronX Distributed's names.

Column/RowParallelLinear (and their base BaseParallelLinear), ParallelEmbedding, the GQA QKV
projection and the output/input-channel-parallel Conv2d shard their weights
over the tensor-parallel group of the current :mod:`nxd_state` parallel state (or an explicit
``tensor_parallel_group``); every parameter carries its sharding attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) for clipping, optimizers
and checkpoints. Weights are sliced from a full master weight drawn from the seed, so any TP
degree builds the TP=1 model. The autograd collectives are in :mod:`nxd_layers.mappings`.
"""

from importlib.metadata import version as _version

from nxd_layers import checkpoint_shards, mappings, utils
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
from nxd_layers.checkpoint_shards import module_checkpoint_tensors, tensor_shard_spec
from nxd_layers.conv import (
    BaseParallelConv,
    InputChannelParallelConv2d,
    OutputChannelParallelConv2d,
)
from nxd_layers.embedding import ParallelEmbedding
from nxd_layers.grads import (
    allreduce_sequence_parallel_gradients,
    bucket_allreduce_gradients,
    clip_grad_norm,
    clip_grads_with_norm,
    get_grad_norm,
    param_is_not_shared,
    tensor_norms,
)
from nxd_layers.linear import BaseParallelLinear, ColumnParallelLinear, RowParallelLinear
from nxd_layers.loss_functions import from_parallel_logits_to_logprobs, parallel_cross_entropy
from nxd_layers.meta_init import init_on_device, parameters_on_meta
from nxd_layers.pad import (
    HEAD_ALIGNED,
    PER_RANK,
    TensorParallelPadding,
    get_number_of_extra_heads,
    pad_model,
)
from nxd_layers.qkv_linear import (
    GQAQKVColumnParallelLinear,
    get_kv_size_multiplier,
    gqa_kv_replica_rows,
    neuronx_gqa_rank_map,
)
from nxd_layers.utils import (
    EmbeddingUtility,
    cast_all,
    cast_tensor,
    get_padding_length,
    is_torch_version_greater_than_2,
    split_tensor_along_dim,
    split_tensor_along_last_dim,
    split_tensor_along_second_dim,
)
from nxd_state import move_model_to_device

__version__ = _version("nxd-layers")

__all__ = [
    "HEAD_ALIGNED",
    "PER_RANK",
    "BaseParallelConv",
    "BaseParallelLinear",
    "ColumnParallelLinear",
    "EmbeddingUtility",
    "GQAQKVColumnParallelLinear",
    "InputChannelParallelConv2d",
    "OutputChannelParallelConv2d",
    "ParallelEmbedding",
    "RowParallelLinear",
    "TensorParallelPadding",
    "__version__",
    "allreduce_sequence_parallel_gradients",
    "bucket_allreduce_gradients",
    "cast_all",
    "cast_tensor",
    "checkpoint_shards",
    "clip_grad_norm",
    "clip_grads_with_norm",
    "copy_tensor_model_parallel_attributes",
    "divide",
    "ensure_divisibility",
    "from_parallel_logits_to_logprobs",
    "full_tensor",
    "gather_tensor_parallel_shards",
    "get_grad_norm",
    "get_kv_size_multiplier",
    "get_number_of_extra_heads",
    "get_padding_length",
    "gqa_kv_replica_rows",
    "init_on_device",
    "is_torch_version_greater_than_2",
    "mappings",
    "mark_sequence_parallel_parameter",
    "merge_shards",
    "module_checkpoint_tensors",
    "move_model_to_device",
    "neuronx_gqa_rank_map",
    "pad_model",
    "parallel_cross_entropy",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "parameters_on_meta",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_for_rank",
    "split_tensor_along_dim",
    "split_tensor_along_last_dim",
    "split_tensor_along_second_dim",
    "tensor_norms",
    "tensor_shard_spec",
    "utils",
]
