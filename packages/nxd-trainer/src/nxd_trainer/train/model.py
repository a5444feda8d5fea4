"""The model of a run: a preset Llama, an HF ``config.json`` or an HF folder to fine-tune,
and NxD's config for it (``neuronx_distributed_config`` from the run's flags).

Every rank builds the same full model from the seed (a folder: lazily, only its slices are
read) and ``initialize_parallel_model`` parallelises it through the HF parallelizer
(``nxd_trainer.hf``), so any TP/PP degree starts from the same weights as one process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from nxd_trainer.train.config import PRESETS, ConfigError, TrainConfig

__all__ = [
    "PRESET_SHAPES",
    "build_nxd_config",
    "fp32_gradient_sums",
    "hf_config",
    "make_model_fn",
    "model_source",
]

# hidden, layers, heads, kv heads, MLP width. Tiny: ~0.8 M parameters at a 2048 vocabulary.
# Values typed Any: they are keyword arguments of transformers.LlamaConfig (of many types).
PRESET_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 352},
    "small": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "intermediate_size": 1408},
    # A Mixtral: 4 experts per layer (each of width 176, the tiny Llama's MLP split in two),
    # 2 chosen per token; ~1.1 M parameters at a 2048 vocabulary.
    "tiny-moe": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 176, "num_local_experts": 4,
                 "num_experts_per_tok": 2},
}  # fmt: skip
MOE_PRESETS = ("tiny-moe",)
"""Presets that build a Mixtral (the others build a Llama)."""


def _expert_count(config: Any) -> int | None:
    """Experts per MoE layer of a transformers config (Mixtral's ``num_local_experts``,
    Qwen-MoE's ``num_experts``); None for a dense model."""
    for key in ("num_local_experts", "num_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_source(cfg: TrainConfig) -> tuple[str, Path | None]:
    """``("preset" | "config" | "folder", path)``; a folder without weights is an error."""
    if cfg.model in PRESETS:
        return "preset", None
    path = Path(cfg.model).expanduser()
    if path.is_file():
        if path.suffix != ".json":
            raise ConfigError(f"model {cfg.model!r} is a file but not a config.json")
        return "config", path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {cfg.model!r} has no config.json")
        weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
        if not weights:
            raise ConfigError(
                f"model folder {cfg.model!r} holds no weights (*.safetensors): give its "
                "config.json to train from scratch, or a folder saved with save_pretrained"
            )
        return "folder", path
    raise ConfigError(
        f"model {cfg.model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
        "config.json or model folder"
    )


def hf_config(cfg: TrainConfig, vocab: int, tokenizer: Any = None) -> Any:
    """The ``transformers`` config of the run's model (the preset's vocabulary is the
    tokenizer's, rounded up to a multiple of 64 so every TP degree splits it evenly).

    With ``tokenizer`` (the run's), the config's BOS/EOS/padding ids are the tokenizer's:
    they are what the model learns between documents and what ``generate()`` of the export
    stops at."""
    import transformers

    kind, path = model_source(cfg)
    if kind == "preset":
        moe = cfg.model in MOE_PRESETS
        config = (transformers.MixtralConfig if moe else transformers.LlamaConfig)(
            vocab_size=-(-vocab // 64) * 64,
            max_position_embeddings=max(cfg.seq_len, 128),
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            architectures=["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
            **PRESET_SHAPES[cfg.model],
        )
    else:
        assert path is not None
        folder = path if kind == "folder" else path.parent
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(folder) if kind == "folder" else str(path)
            )
        except (OSError, ValueError) as error:
            raise ConfigError(f"model {cfg.model!r}: {error}") from None
        if vocab > config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is "
                f"{config.vocab_size}: pass the model's own tokenizer with --tokenizer"
            )
    from nxd_trainer.hf._experts import MOE_FAMILIES

    parallelizer = parallelizer_of(config)
    if cfg.pp > 1 and not parallelizer.spec.supports_pipeline_parallel:
        raise ConfigError(
            f"pp={cfg.pp} with model type {config.model_type!r}: transformers declares no "
            f"pipeline plan (base_model_pp_plan) for it, so nxd does not know where to cut "
            f"its stages; use pp=1"
        )
    if cfg.ep > 1:
        _check_experts(cfg, config, list(MOE_FAMILIES))
    heads = config.num_attention_heads
    if heads % cfg.tp:
        raise ConfigError(f"tp({cfg.tp}) does not divide the model's {heads} attention heads")
    if cfg.cp > 1 and cfg.cp_algorithm == "all-to-all":
        _check_all_to_all_heads(cfg, config)
    if cfg.pp > config.num_hidden_layers:
        raise ConfigError(f"pp({cfg.pp}) exceeds the model's {config.num_hidden_layers} layers")
    config._attn_implementation = _attention_implementation(config)
    if tokenizer is not None:
        _special_ids_from(tokenizer, config)
    return config


def _attention_implementation(config: Any) -> str:
    """torch's scaled-dot-product attention where the family's model supports it, else the
    family's eager attention (Gemma 2: soft-capped scores)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def parallelizer_of(config: Any) -> Any:
    """The HF parallelizer of the model's family: a registered one (Llama, Mistral, Qwen2,
    Qwen3), else the one following the tensor-parallel plan transformers declares for it
    (:mod:`nxd_trainer.hf.plan`); a family with neither is a :class:`ConfigError` naming it.
    Whether the model itself is reproduced exactly is checked when it is built."""
    from types import SimpleNamespace

    from nxd_trainer.hf import ParallelizersManager, UnsupportedModelError

    try:
        return ParallelizersManager.parallelizer_for_model(SimpleNamespace(config=config))
    except UnsupportedModelError as error:
        raise ConfigError(str(error)) from None


def _check_experts(cfg: TrainConfig, config: Any, families: list[str]) -> None:
    """``ep`` > 1 shards a MoE model's experts: the family must have them, in a count ``ep``
    divides."""
    experts = _expert_count(config)
    if config.model_type not in families or experts is None:
        raise ConfigError(
            f"ep={cfg.ep} needs a mixture-of-experts model ({', '.join(families)}; the preset "
            f"tiny-moe), got model type {config.model_type!r}"
        )
    if experts % cfg.ep:
        raise ConfigError(
            f"ep({cfg.ep}) does not divide the model's {experts} experts per layer (each EP "
            f"rank holds experts / ep of them)"
        )


def _check_all_to_all_heads(cfg: TrainConfig, config: Any) -> None:
    """All-to-all attention splits each TP rank's query and K/V heads over ``cp``."""
    from nxd_trainer._context_parallel import check_heads
    from nxd_trainer.hf._swap import layout_for

    layout = layout_for(config, cfg.tp, None)
    try:
        check_heads(layout.local_heads, layout.local_kv_heads, cfg.cp, "all_to_all", cfg.tp)
    except ValueError as error:
        raise ConfigError(f"cp_algorithm='all-to-all': {error}") from None


def _special_ids_from(tokenizer: Any, config: Any) -> None:
    """Set the config's bos/eos/pad ids to the tokenizer's where they differ (an id list, as
    Llama 3's EOS, is kept when it holds the tokenizer's id)."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is None:
            continue
        current = getattr(config, key, None)
        if value == current or (isinstance(current, list) and value in current):
            continue
        setattr(config, key, value)


def make_model_fn(cfg: TrainConfig, config: Any) -> Any:
    """``model_fn`` for ``initialize_parallel_model``: the seeded model (or the folder's)."""
    kind, path = model_source(cfg)

    def model_fn() -> torch.nn.Module:
        import transformers

        from nxd_trainer.hf import lazy_load_for_parallelism

        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        if kind == "folder":
            with lazy_load_for_parallelism(tensor_parallel_size=cfg.tp):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path), config=config, dtype=dtype
                )
        else:
            torch.manual_seed(cfg.seed)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.config.use_cache = False
        return model

    return model_fn


def _cuts(stack: str, layers: int, pp: int) -> list[str]:
    """Even stages of the decoder ``stack``: cut after layer ``⌈L·i/P⌉ - 1``, i = 1..P-1."""
    return [f"{stack}.{-(-layers * i // pp) - 1}" for i in range(1, pp)]


def build_nxd_config(cfg: TrainConfig, config: Any, world: int) -> dict[str, Any]:
    """NxD's config dict for the run at ``world`` processes (initialises model parallelism;
    collective-free)."""
    import nxd_trainer as nxd

    pipeline_config = None
    if cfg.pp > 1:
        pipeline_config = {
            "num_microbatches": cfg.microbatches,
            "input_names": ["input_ids", "labels"],
            "pipeline_cuts": _cuts(
                parallelizer_of(config).spec.layers, config.num_hidden_layers, cfg.pp
            ),
            "schedule": cfg.schedule,
        }
    checkpointing: Any = None
    if cfg.activation_checkpointing == "full":
        checkpointing = "full"
    elif cfg.activation_checkpointing == "selective":
        checkpointing = [attention_class(config)]
    lora_config = None
    if cfg.lora_rank:
        from nxd_lora import LoraConfig

        lora_config = LoraConfig(
            enable_lora=True,
            lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=list(cfg.lora_targets),
        )
    mixed = (
        {"use_master_weights": True, "use_fp32_grad_acc": fp32_gradient_sums(cfg, world)}
        if cfg.bf16
        else None
    )
    return nxd.neuronx_distributed_config(
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_parallel_size=cfg.ep,
        context_parallel_algorithm=cfg.cp_algorithm_name,
        pipeline_config=pipeline_config,
        optimizer_config={
            "zero_one_enabled": cfg.zero1,
            # The norm is measured at every step; clip 0 clips at infinity (scales nothing).
            "grad_clipping": True,
            "max_grad_norm": cfg.clip if cfg.clip > 0 else math.inf,
        },
        activation_checkpoint_config=checkpointing,
        sequence_parallel=cfg.sequence_parallel,
        lora_config=lora_config,
        mixed_precision_config=mixed,
    )


def attention_class(config: Any) -> type:
    """The attention module class of a transformers family (``LlamaAttention``,
    ``MixtralAttention``, ...): what ``--activation-checkpointing selective`` recomputes."""
    import importlib

    kind = config.model_type
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    found = [
        value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, torch.nn.Module)
        and name.endswith("Attention")
        and value.__module__ == module.__name__
    ]
    if len(found) != 1:
        raise ConfigError(
            f"activation_checkpointing='selective': model type {kind!r} has "
            f"{[c.__name__ for c in found]} as attention classes, expected exactly one"
        )
    return found[0]


def fp32_gradient_sums(cfg: TrainConfig, world: int) -> bool:
    """bf16: whether gradients are summed in fp32 (Megatron's bf16 default), G = Σ float32(g).

    Wherever a step's gradient is a sum (micro-steps, pipeline micro-batches, or a reduction
    over ranks), each term is added into an fp32 buffer, so the sum is rounded once instead of
    once per addition in bf16. One process with one micro-step sums nothing: its gradient is
    one backward's bf16 tensor, and casting it to fp32 at the step gives the same values
    bit for bit, without the buffer's 4 bytes per parameter and its add and zeroing each step.
    """
    return world > 1 or cfg.grad_accum > 1 or cfg.zero1


def describe(config: Any) -> str:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    sizes = {k: getattr(config, k, None) for k in keys}  # GPT-NeoX has no KV head count
    return json.dumps(sizes | {"vocab_size": config.vocab_size})
