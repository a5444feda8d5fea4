"""``nxd-train --dry-run``: the resolved layout, computed without any process or weight.

* rank -> (PP, DP, TP) coordinates on NxD's ``[PP, DP, TP]`` mesh (TP innermost), and CP
  between DP and TP (``[PP, DP, CP, TP]``) with ``cp`` > 1 (parameters are replicated over CP);
* with ``ep`` > 1, each MoE layer's experts split over ``ep`` consecutive DP ranks (the EP
  rank is the DP rank mod ``ep``);
* parameters held by each rank: the model is built on the ``meta`` device; a parameter lives
  on the pipeline stage of its layer (embedding on the first, final norm and head on the
  last; the cuts are the run's even cuts), and the parallelizer's TP layers (attention and
  MLP projections, embedding, head) hold 1/TP of it; K/V projections replicate their heads
  when there are fewer KV heads than TP ranks;
* the pipeline schedule grid (nxd-pipeline's dry run) when ``pp`` > 1.
"""

from __future__ import annotations

from typing import Any

import torch

from nxd_trainer.train.config import TrainConfig

__all__ = ["format_layout", "parameters_per_stage"]

_TP_SHARDED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "embed_tokens", "lm_head"}  # fmt: skip


def _stage_of(name: str, where: tuple[str, str], layers: int, pp: int) -> list[int]:
    """The stage holding parameter ``name``: ``where`` is (the decoder stack's path, the
    input embedding's path)."""
    stack, embedding = where
    if name.startswith(stack + "."):
        layer = int(name[len(stack) + 1 :].split(".")[0])
        return [layer * pp // layers]  # the inverse of the even cuts (model._cuts)
    if name.startswith(embedding + "."):
        return [0]
    return [pp - 1]


def _plan_sharded(config: Any, model: Any) -> set[str] | None:
    """The parameters a family's tensor-parallel plan splits over TP (its column layers'
    weights and biases, its row layers' weights: their biases are whole on every rank, the
    embedding and the head); None for the Llama-family path (known by module names)."""
    from nxd_trainer.hf._rules import resolve_plan
    from nxd_trainer.hf.plan import PlanParallelizer, text_tp_plan
    from nxd_trainer.train.model import parallelizer_of

    if not issubclass(parallelizer_of(config), PlanParallelizer):
        return None
    plan = resolve_plan(model, config.model_type, text_tp_plan(config.model_type, config))
    sharded = {f"{plan.embed}.weight", f"{plan.lm_head}.weight"}
    for block in plan.blocks:
        for child in block.columns:
            sharded |= {f"{block.path}.{child}.weight", f"{block.path}.{child}.bias"}
        sharded |= {f"{block.path}.{child}.weight" for child in block.rows}
    return sharded


def _where(config: Any, model: Any) -> tuple[str, str]:
    from nxd_trainer.train.model import parallelizer_of

    embedding = model.get_input_embeddings()
    path = next(n for n, m in model.named_modules() if m is embedding)
    return parallelizer_of(config).spec.layers, path


def parameters_per_stage(cfg: TrainConfig, config: Any) -> list[int]:
    """Parameters held by one rank of each pipeline stage (its TP shard)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counts = [0] * cfg.pp
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    seen: set[int] = set()
    tied = getattr(config, "tie_word_embeddings", False)
    plan_sharded, where = _plan_sharded(config, model), _where(config, model)
    for name, param in model.named_parameters(remove_duplicate=False):
        module = name.split(".")[-2] if "." in name else name
        n = param.numel()
        if plan_sharded is not None:
            n = n // cfg.tp if name in plan_sharded else n
        elif module in _TP_SHARDED:
            replicas = max(1, cfg.tp // kv) if module in ("k_proj", "v_proj") else 1
            n = n * replicas // cfg.tp
        if module == "experts" and param.dim() == 3:  # packed (experts, rows, columns)
            # ep > 1: this rank's experts, TP inside each; ep = 1: kept whole on every rank
            n = n // (cfg.ep * cfg.tp) if cfg.ep > 1 else n
        stages = _stage_of(name, where, config.num_hidden_layers, cfg.pp)
        if id(param) in seen and not (tied and cfg.pp > 1):
            continue
        seen.add(id(param))
        for stage in stages:
            counts[stage] += n
    return counts


def format_layout(cfg: TrainConfig, config: Any, vocab_note: str = "") -> str:
    """The text ``--dry-run`` prints."""
    from nxd_state import ParallelLayout

    world = cfg.world_size
    dp = cfg.check_world(world)
    layout = ParallelLayout(
        world_size=world,
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
    )
    per_stage = parameters_per_stage(cfg, config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    total = sum(p.numel() for p in _full_model(config).parameters())
    micro = cfg.batch_size // (dp * cfg.grad_accum)
    lines = [
        f"nxd-train dry run: {cfg.nnodes} node(s) x {cfg.nproc_per_node} process(es) = world "
        f"{world}; tp={cfg.tp} pp={cfg.pp}"
        + (f" cp={cfg.cp} ({cfg.cp_algorithm})" if cfg.cp > 1 else "")
        + f" dp={dp}"
        + (f" ep={cfg.ep} (expert-dp {dp // cfg.ep})" if cfg.ep > 1 else "")
        + (" zero1" if cfg.zero1 else "")
        + (" sequence-parallel" if cfg.sequence_parallel else "")
        + (" bf16" if cfg.bf16 else ""),
        f"model {cfg.model}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads / {kv_heads} KV heads, vocab "
        f"{config.vocab_size}{vocab_note}; {total:,} parameters",
        f"batch: {cfg.batch_size} sequences x {cfg.seq_len} tokens per step = "
        f"{cfg.batch_size * cfg.seq_len:,} tokens; per rank {micro} sequences x "
        f"{cfg.grad_accum} accumulation step(s)"
        + (f", {cfg.seq_len // cfg.cp} tokens of each on a CP rank" if cfg.cp > 1 else "")
        + (f" in {cfg.microbatches} micro-batches" if cfg.pp > 1 else ""),
        "",
        f"{'rank':>5} {'node':>5} {'pp':>3} {'dp':>3}"
        + (f" {'cp':>3}" if cfg.cp > 1 else "")
        + f" {'tp':>3} {'parameters':>12}",
    ]
    for rank in range(world):
        c = layout.coordinates(rank)
        lines.append(
            f"{rank:>5} {rank // cfg.nproc_per_node:>5} {c.pp:>3} {c.dp:>3}"
            + (f" {c.cp:>3}" if cfg.cp > 1 else "")
            + f" {c.tp:>3} {per_stage[c.pp]:>12,}"
        )
    if cfg.pp > 1:
        from nxd_pipeline import build_schedule, format_grid

        lines += ["", "pipeline schedule (one row per stage, F/B = forward/backward of a "
                  "micro-batch):", format_grid(build_schedule(cfg.schedule, cfg.pp,
                                                              cfg.microbatches))]  # fmt: skip
    return "\n".join(lines)


def _full_model(config: Any) -> torch.nn.Module:
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)
