"""nxd-lora: LoRA on plain and tensor-parallel layers, with PEFT-compatible adapters.

``LoRAModel(module, LoraConfig(...))`` puts ``Y = X W^T + s · dropout(X) A^T B^T`` on every
module ``target_modules`` selects (by name or ``.name`` suffix, or a regex): ``nn.Linear``,
``nn.Embedding``, ``nn.Conv2d``, and nxd_layers' column/row-parallel and GQA QKV layers, split
so that no full-size activation is gathered; the rest is frozen. Adapters gather into PEFT's format
(``peft.PeftModel.from_pretrained`` loads them) and load back at any TP degree.
"""

from importlib.metadata import version as _version

from nxd_lora.adapter import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    gather_full_adapter_state_dict,
    gather_peft_state_dict,
    load_peft_adapter,
    load_peft_state_dict,
    peft_adapter_config,
    read_peft_adapter,
    save_peft_adapter,
)
from nxd_lora.checkpoint import (
    BASE_WEIGHTS_NAME,
    gather_base_state_dict,
    load_lora_checkpoint_into,
    lora_checkpoint_dir,
    save_lora,
)
from nxd_lora.checkpoint_state import lora_checkpoint_metadata, lora_checkpoint_tensors
from nxd_lora.config import BIAS_MODES, INIT_MODES, LoraConfig
from nxd_lora.layers import LoraConv2d, LoraEmbedding, LoraLayer, LoraLinear
from nxd_lora.model import LoRAModel, LoraModel, get_lora_model, lora_requested
from nxd_lora.tp_layers import LoraGQAQKVParallelLinear, LoraParallelLinear

__version__ = _version("nxd-lora")

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "BASE_WEIGHTS_NAME",
    "BIAS_MODES",
    "INIT_MODES",
    "LoRAModel",
    "LoraConfig",
    "LoraConv2d",
    "LoraEmbedding",
    "LoraGQAQKVParallelLinear",
    "LoraLayer",
    "LoraLinear",
    "LoraModel",
    "LoraParallelLinear",
    "__version__",
    "gather_base_state_dict",
    "gather_full_adapter_state_dict",
    "gather_peft_state_dict",
    "get_lora_model",
    "load_lora_checkpoint_into",
    "load_peft_adapter",
    "load_peft_state_dict",
    "lora_checkpoint_dir",
    "lora_checkpoint_metadata",
    "lora_checkpoint_tensors",
    "lora_requested",
    "peft_adapter_config",
    "read_peft_adapter",
    "save_lora",
    "save_peft_adapter",
]
