"""Coverage by rule: transformers' declared tensor-parallel plan mapped onto nxd's layers, and
the inspection that refuses what the mapping does not reproduce exactly.

transformers declares, per family, ``config.base_model_tp_plan``: module pattern -> style.
The styles map onto nxd's layers (``Y_i = X A_i`` column-parallel, ``Y = sum_i X_i A_i``
row-parallel)::

    colwise                      ColumnParallelLinear(gather_output=False)   local heads/features
    colwise_gather_output        ColumnParallelLinear(gather_output=True)    full output
    rowwise                      RowParallelLinear(input_is_parallel=True)   local input, summed
    rowwise_split_input          RowParallelLinear(input_is_parallel=False)  splits a full input
    replicated_with_grad_allreduce   kept whole; its gradient summed over TP (per-head norms)
    moe_tp_experts / packed_*    the experts kept whole on every TP rank (no expert sharding)

Between a ``colwise`` and its ``rowwise`` the family's own forward runs on this rank's heads
(or intermediate features), so it is exact only when everything there acts per head or per
feature. :func:`inspect_model` checks that before any change and raises
:class:`UnsupportedModelError` naming the family and the first feature it cannot reproduce:
a style it does not map, a module that is not ``nn.Linear``, a parameterised module inside a
sharded block that the plan does not place (a norm over all heads), a forward that reads the
global head count or width, a loss computed outside ``loss_function``, an embedding with a
forward of its own (other than the ``embed_scale`` multiplication it reproduces).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "BlockPlan",
    "ModelPlan",
    "UnsupportedModelError",
    "forward_signature",
    "inspect_model",
    "module_list_at",
    "resolve_plan",
]

COLUMN = {"colwise": False, "colwise_gather_output": True}
"""Column styles -> gather_output."""
ROW = {"rowwise": True, "rowwise_split_input": False}
"""Row styles -> input_is_parallel."""
GRAD_SUM = "replicated_with_grad_allreduce"
EXPERTS = {"moe_tp_experts", "packed_colwise", "packed_rowwise"}
"""Styles of MoE expert blocks: such a block is kept whole (replicated over TP)."""
IGNORED = {"replicate", "embedding_rowwise"}
"""Styles that need nothing (replicated), or that the embedding rule covers (vocab-parallel)."""

_GLOBAL_SIZES = re.compile(
    r"\b(?:self|config|self\.config)\.(num_heads|num_attention_heads|num_key_value_heads|"
    r"hidden_size|all_head_size|embed_dim)\b"
)
_LOGIT_REDUCTIONS = re.compile(r"logits[^\n]*\b(softmax|log_softmax|argmax|topk|logsumexp)\b")


class UnsupportedModelError(NotImplementedError):
    """A model the parallelizer cannot reproduce exactly: ``family`` and ``feature``."""

    def __init__(self, family: str, feature: str) -> None:
        self.family, self.feature = family, feature
        super().__init__(
            f"model type {family!r}: not parallelised, it would not give the unsharded "
            f"model's results: {feature}"
        )


@dataclass
class BlockPlan:
    """One sharded block (``layers.3.self_attn``): its linears and replicated-norm modules."""

    path: str
    columns: dict[str, bool] = field(default_factory=dict)
    """Child name -> gather_output."""
    rows: dict[str, bool] = field(default_factory=dict)
    """Child name -> input_is_parallel."""
    grad_sum: list[str] = field(default_factory=list)

    @property
    def local(self) -> bool:
        """Whether the block's inner activations are this rank's part (not gathered)."""
        return any(not g for g in self.columns.values())


@dataclass
class ModelPlan:
    """What to swap in one model (paths from the model's root)."""

    blocks: list[BlockPlan]
    embed: str
    lm_head: str
    replicated: list[str]
    """Expert blocks kept whole."""


def _normal_source(fn: Callable[..., Any]) -> str:
    """``fn``'s body as an AST dump without docstring, annotations or name: two forwards
    with equal dumps compute the same (given the same module-level helpers)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    func.name, func.decorator_list, func.returns = "f", [], None
    for arg in [*func.args.args, *func.args.kwonlyargs, func.args.vararg, func.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        func.body = body[1:]
    return ast.dump(func)


# A dict, not functools.cache: mypy reads a class argument's __hash__ as unbound (not Hashable).
_SIGNATURES: dict[type[nn.Module], str] = {}


def forward_signature(cls: type[nn.Module]) -> str:
    """The normalised source of ``cls.forward`` (see :func:`_normal_source`), cached."""
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = _normal_source(cls.forward)
    return _SIGNATURES[cls]


def _source(fn: Callable[..., Any]) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _path_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def resolve_plan(model: nn.Module, family: str, tp_plan: dict[str, str]) -> ModelPlan:
    """The plan's patterns expanded over the model's modules; errors for unmapped styles."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    root = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    modules = dict(model.named_modules())
    hf: Any = model  # a transformers PreTrainedModel (its methods are not nn.Module's)
    embed = _path_of(model, hf.get_input_embeddings())
    lm_head = _path_of(model, hf.get_output_embeddings())
    if embed is None or lm_head is None:
        raise UnsupportedModelError(family, "no input embedding / output projection found")
    expert_roots = []
    for pattern, style in tp_plan.items():
        if style in EXPERTS:
            expert_roots.append(pattern if style == "moe_tp_experts" else pattern.rsplit(".", 1)[0])
    blocks: dict[str, BlockPlan] = {}
    replicated: set[str] = set()
    for pattern, style in tp_plan.items():
        regex = re.compile("^" + re.escape(root + pattern).replace(r"\*", r"\d+") + "$")
        matches = [name for name in modules if regex.match(name)]
        under_experts = any(pattern == r or pattern.startswith(r + ".") for r in expert_roots)
        if under_experts:
            replicated.update(matches)
            continue
        if style in IGNORED or not matches:
            continue
        if style not in COLUMN and style not in ROW and style != GRAD_SUM:
            raise UnsupportedModelError(
                family, f"tensor-parallel style {style!r} (for {pattern}) is not mapped onto nxd"
            )
        for name in matches:
            parent, _, child = name.rpartition(".")
            block = blocks.setdefault(parent, BlockPlan(parent))
            if style in COLUMN:
                block.columns[child] = COLUMN[style]
            elif style in ROW:
                block.rows[child] = ROW[style]
            else:
                block.grad_sum.append(child)
    return ModelPlan(
        sorted(blocks.values(), key=lambda b: b.path), embed, lm_head, sorted(replicated)
    )


def _check_block(model: nn.Module, family: str, block: BlockPlan, tp: int) -> None:
    module = model.get_submodule(block.path)
    for child in [*block.columns, *block.rows]:
        layer = module.get_submodule(child)
        if type(layer) is not nn.Linear:
            raise UnsupportedModelError(
                family, f"{block.path}.{child} is a {type(layer).__name__}, not an nn.Linear"
            )
    local_rows = [c for c, parallel in block.rows.items() if parallel]
    if block.local != bool(local_rows):
        raise UnsupportedModelError(
            family,
            f"{block.path}: column-parallel outputs {sorted(block.columns)} and row-parallel "
            f"inputs {sorted(block.rows)} do not pair up (colwise with rowwise)",
        )
    if not block.local:
        if block.grad_sum:  # each rank would hold the whole gradient: summing multiplies it
            raise UnsupportedModelError(
                family,
                f"{block.path}: {block.grad_sum} are replicated with gradients summed over TP, "
                f"but the block's activations are gathered (every rank sees every head)",
            )
        return  # full activations inside: the family's forward sees what it always sees
    for child, gather in block.columns.items():
        linear: Any = module.get_submodule(child)  # a transformers linear
        out = linear.out_features
        if not gather and out % tp:
            raise UnsupportedModelError(
                family, f"{block.path}.{child}: {out} output features do not split over TP={tp}"
            )
    found = _GLOBAL_SIZES.search(_source(type(module).forward))
    if found:
        raise UnsupportedModelError(
            family,
            f"{type(module).__name__}.forward reads {found.group(0)} (the whole model's size), "
            f"while at TP={tp} it holds 1/{tp} of it",
        )
    own = [name for name, p in module.named_parameters(recurse=False)]
    if own:  # per-head parameters of the block itself (attention sinks): not split here
        raise UnsupportedModelError(
            family,
            f"{block.path} ({type(module).__name__}) holds parameters {own} of its own inside a "
            f"sharded block, which the mapping does not split with the heads",
        )
    _check_unplaced_children(module, family, block, _head_dim(model.config))


def _check_unplaced_children(
    module: nn.Module, family: str, block: BlockPlan, head_dim: int | None
) -> None:
    """A sharded block's children the plan does not split hold per-head weights only (q/k
    norms: one head's size, their gradients summed over TP); anything else is refused."""
    placed = {*block.columns, *block.rows}
    for name, sub in module.named_children():
        if name in placed or not any(True for _ in sub.parameters()):
            continue
        sizes = {p.shape[-1] for p in sub.parameters()}
        if name not in block.grad_sum:
            raise UnsupportedModelError(
                family,
                f"{block.path}.{name} ({type(sub).__name__}) has parameters inside a sharded "
                f"block and the tensor-parallel plan does not place it",
            )
        if any(p.dim() != 1 or p.shape[0] != head_dim for p in sub.parameters()):
            raise UnsupportedModelError(
                family,
                f"{block.path}.{name} ({type(sub).__name__}) holds weights of size "
                f"{sorted(sizes)}, not one head's {head_dim}: a norm across heads, which each "
                f"rank does not see",
            )


def module_list_at(model: nn.Module, path: str) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` at ``path`` of ``model`` (a decoder stack), or None where the
    model has no module there or another kind of module."""
    try:
        stack = model.get_submodule(path)
    except AttributeError:
        return None
    return stack if isinstance(stack, nn.ModuleList) else None


def _head_dim(config: Any) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    if head_dim is None and heads:
        head_dim = config.hidden_size // heads
    return head_dim


def inspect_model(
    model: nn.Module, family: str, plan: ModelPlan, tp: int, *, gather_output: bool
) -> None:
    """Refuse (:class:`UnsupportedModelError`) anything the swap would not reproduce exactly."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if any(b.local for b in plan.blocks) and heads and kv and (heads % tp or kv % tp):
        raise UnsupportedModelError(
            family,
            f"{heads} attention heads / {kv} KV heads do not split over TP={tp} (replicated "
            f"KV heads are the Llama-family path's only)",
        )
    for block in plan.blocks:
        _check_block(model, family, block, tp)
    embed = model.get_submodule(plan.embed)
    if type(embed) is not nn.Embedding and not is_scaled_embedding(embed):
        raise UnsupportedModelError(
            family, f"the input embedding {type(embed).__name__} has a forward of its own"
        )
    head = model.get_submodule(plan.lm_head)
    if type(head) is not nn.Linear:
        raise UnsupportedModelError(
            family, f"the output projection {type(head).__name__} is not an nn.Linear"
        )
    forward = _source(type(model).forward)
    if not gather_output:
        if "self.loss_function(" not in forward:
            raise UnsupportedModelError(
                family,
                f"{type(model).__name__}.forward computes its loss itself, on logits that are "
                f"vocabulary-sharded here (gather_output=True gives it full logits)",
            )
        found = _LOGIT_REDUCTIONS.search(forward)
        if found:
            raise UnsupportedModelError(
                family,
                f"{type(model).__name__}.forward reduces the logits over the vocabulary "
                f"({found.group(1)}), which are sharded here (use gather_output=True)",
            )


_SCALED = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"


def is_scaled_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass whose forward is the lookup times ``embed_scale``
    (Gemma 3's ``ScaledWordEmbedding``): reproduced by :class:`ScaledParallelEmbedding`."""
    if not isinstance(module, nn.Embedding) or not hasattr(module, "embed_scale"):
        return False
    body = textwrap.dedent(_source(type(module).forward)).strip().splitlines()
    return bool(body) and body[-1].strip() == _SCALED and len(body) == 2


def _fast_path_forwards() -> dict[str, bool]:
    """Normalised attention forwards the rebuilt forward (:mod:`nxd_trainer.hf._attention`)
    reproduces -> whether they apply per-head Q/K norms (Qwen3's)."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    known = {
        forward_signature(c): False for c in (LlamaAttention, MistralAttention, Qwen2Attention)
    }
    known[forward_signature(Qwen3Attention)] = True
    return known


def inspect_fast_path(
    model: nn.Module, spec: Any, tp: int, *, sequence_parallel: bool, gather_output: bool
) -> None:
    """The Llama-family path (rebuilt attention forward, :class:`~nxd_trainer.hf.ModelSpec`
    names) reproduces ``model`` exactly: its attention forward is one of Llama's, Mistral's,
    Qwen2's or Qwen3's, and nothing with parameters sits where that path does not look."""
    family = spec.model_type
    layers: Any = model.get_submodule(spec.layers)  # the decoder ModuleList
    known = _fast_path_forwards()
    head_dim = _head_dim(model.config)
    for index, layer in enumerate(layers):
        attn: nn.Module = layer.get_submodule(spec.attention)
        cls = type(attn)
        cls = cls.__mro__[1] if cls.__name__.startswith("Parallel") else cls
        norms = known.get(forward_signature(cls))
        if norms is None:
            raise UnsupportedModelError(
                family,
                f"{cls.__name__}.forward differs from the Llama-family attention the registered "
                f"ModelSpec path rebuilds (soft-capping, norms, scaling ...); unregister the "
                f"ModelSpec to use transformers' tensor-parallel plan, which keeps that forward",
            )
        if norms != bool(spec.qk_norms):
            raise UnsupportedModelError(
                family,
                f"{cls.__name__}.forward {'applies' if norms else 'has no'} per-head Q/K norms "
                f"but the ModelSpec declares qk_norms={spec.qk_norms!r}",
            )
        expected = {spec.q_proj, spec.k_proj, spec.v_proj, spec.o_proj, "qkv_proj", *spec.qk_norms}
        for name, sub in attn.named_children():
            if name not in expected and any(True for _ in sub.parameters()):
                raise UnsupportedModelError(
                    family, f"{spec.layers}.{index}.{spec.attention}.{name} is not reproduced"
                )
        for name in spec.qk_norms:
            if any(p.shape != (head_dim,) for p in attn.get_submodule(name).parameters()):
                raise UnsupportedModelError(
                    family, f"{name} does not normalise one head of {head_dim} features"
                )
        if sequence_parallel:
            covered = (spec.attention, *spec.layer_norms, *(n.split(".")[0] for n in spec.mlp_row))
            for name, sub in layer.named_children():
                if name not in covered and any(True for _ in sub.parameters()):
                    raise UnsupportedModelError(
                        family,
                        f"{spec.layers}.{index}.{name} ({type(sub).__name__}) under sequence "
                        f"parallelism is not among the ModelSpec's layer_norms",
                    )
    embed = model.get_submodule(spec.embed_tokens)
    if type(embed) is not nn.Embedding and not is_scaled_embedding(embed):
        raise UnsupportedModelError(
            family, f"the input embedding {type(embed).__name__} has a forward of its own"
        )
    plan = ModelPlan([], spec.embed_tokens, spec.lm_head, [])
    inspect_model(model, family, plan, tp, gather_output=gather_output)
