"""Parallelize unmodified Hugging Face causal LMs (optimum-neuron's ``optimum.neuron.distributed``
API on nxd): tensor, sequence and pipeline parallelism, lazy loading, sharded checkpoints.

    import nxd_state
    from nxd_trainer.hf import ParallelizersManager, lazy_load_for_parallelism

    nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    with lazy_load_for_parallelism(tensor_parallel_size=2):
        model = LlamaForCausalLM.from_pretrained(folder)  # linears/embedding on meta
    parallelizer = ParallelizersManager.parallelizer_for_model(model)
    model = parallelizer.parallelize(model)  # each rank reads its slices of the folder
    loss = model(input_ids=ids, labels=ids).loss  # the logits stay vocabulary-sharded

Registered families (``ParallelizersManager.get_supported_model_types()``, TP/SP/PP): Llama,
Mistral, Qwen2, Qwen3, each a :class:`ModelSpec` (module names) in
:mod:`nxd_trainer.hf.families`. Every other family with a tensor-parallel plan declared by
transformers: TP by that plan (:mod:`nxd_trainer.hf.plan`); Mixtral, Qwen2-MoE and Qwen3-MoE
also at ``expert_model_parallel_size > 1``, their experts sharded over EP
(:mod:`nxd_trainer.hf._experts`). A model either parallelizer would not reproduce exactly is
refused (:class:`UnsupportedModelError`, naming family and feature).
"""

from nxd_trainer.hf._rules import UnsupportedModelError
from nxd_trainer.hf.checkpoint import load_model_sharded_checkpoint, save_model_sharded_checkpoint
from nxd_trainer.hf.export import export_hf
from nxd_trainer.hf.families import (
    LlamaParallelizer,
    MistralParallelizer,
    Qwen2Parallelizer,
    Qwen3Parallelizer,
)
from nxd_trainer.hf.lazy import lazy_load_for_parallelism
from nxd_trainer.hf.manager import ParallelizersManager
from nxd_trainer.hf.mapping import original_parameter_ids, parameter_mapping
from nxd_trainer.hf.optim import (
    LazyOptimizer,
    make_optimizer_constructor_lazy,
    optimizer_for_mp,
)
from nxd_trainer.hf.parallelizer import Parallelizer
from nxd_trainer.hf.plan import PlanParallelizer, plan_parallelizer
from nxd_trainer.hf.spec import ModelSpec

__all__ = [
    "LazyOptimizer",
    "LlamaParallelizer",
    "MistralParallelizer",
    "ModelSpec",
    "Parallelizer",
    "ParallelizersManager",
    "PlanParallelizer",
    "Qwen2Parallelizer",
    "Qwen3Parallelizer",
    "UnsupportedModelError",
    "export_hf",
    "lazy_load_for_parallelism",
    "load_model_sharded_checkpoint",
    "make_optimizer_constructor_lazy",
    "optimizer_for_mp",
    "original_parameter_ids",
    "parameter_mapping",
    "plan_parallelizer",
    "save_model_sharded_checkpoint",
]
