"""The swap: a Hugging Face model's linears and embedding become nxd's parallel layers.

Every new layer is built on the ``meta`` device (no memory) and remembers, per parameter, the
:class:`~nxd_trainer.hf._sources.Source` of its values: which original tensor, and which
rows/columns of it this TP rank holds (a fused ``weight_qkv``: the concatenation of three).
:class:`Plan` fills them later (each rank reading only its part), after the pipeline has
decided which layers this rank keeps. Module names stay the original ones, except the GQA
projection (``qkv_proj`` replaces ``q_proj`` / ``k_proj`` / ``v_proj``, its parameters
``weight_q`` / ``weight_k`` / ``weight_v``, or one ``weight_qkv`` with ``fuse_qkv``).

Checkpoints do not see that difference: the GQA projection declares its parameters' stored
names (``nxd_checkpoint_parts``, :mod:`nxd_ckpt.parts`): ``weight_k`` is stored as
``k_proj.weight``, ``weight_qkv`` as ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``
(row ranges of its global ``[Q; K; V]``), so a checkpoint holds the Hugging Face names at every
TP degree and resumes at any other. The Q/K/V column-parallel layers used when TP divides the
KV heads accept the GQA names checkpoints written before that declaration held
(``qkv_proj.weight_k``) as aliases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import nxd_state
from nxd_layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from nxd_trainer.hf._attention import parallel_attention_class
from nxd_trainer.hf._loss import ParallelCausalLMLoss
from nxd_trainer.hf._rules import BlockPlan, is_scaled_embedding
from nxd_trainer.hf._sequence import gather_sequence, on_first_input, scatter_sequence
from nxd_trainer.hf._sources import FolderStore, MemoryStore, Source, Store
from nxd_trainer.hf.spec import ModelSpec

__all__ = ["Layout", "Plan", "layout_for", "make_meta", "qkv_stored_parts", "swap_layers"]

logger = logging.getLogger(__name__)

GQA_NAME = "qkv_proj"
SourceSpec = Source | tuple[Source, ...]
"""Where one parallel tensor comes from: one source, or sources concatenated along dim 0."""


@dataclass(frozen=True)
class Layout:
    """The head split of one model at one TP degree (validated on creation)."""

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_size_multiplier: int
    vocab: int

    @property
    def gqa(self) -> bool:
        """Whether K/V heads are replicated (the GQA QKV projection)."""
        return self.kv_size_multiplier > 1

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads * self.kv_size_multiplier // self.tp

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp


def layout_for(config: Any, tp: int, kv_size_multiplier: int | None) -> Layout:
    """The heads of ``config`` split over ``tp`` ranks; clear errors when they cannot be."""
    from nxd_layers import get_kv_size_multiplier

    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if heads % tp:
        raise ValueError(
            f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}: "
            f"choose a TP degree dividing it (heads are not padded here)"
        )
    if kv_size_multiplier is None:
        multiplier = 1 if kv % tp == 0 else get_kv_size_multiplier(kv, tp)
    else:
        multiplier = kv_size_multiplier
        if not isinstance(multiplier, int) or isinstance(multiplier, bool) or multiplier < 1:
            raise ValueError(f"kv_size_multiplier must be a positive int, got {multiplier!r}")
        if (kv * multiplier) % tp:
            raise ValueError(
                f"kv_size_multiplier={multiplier} gives {kv} x {multiplier} = {kv * multiplier} "
                f"KV heads, not divisible by tensor_parallel_size={tp} (the smallest valid "
                f"multiplier is {get_kv_size_multiplier(kv, tp)})"
            )
    if heads % (kv * multiplier):
        raise ValueError(
            f"kv_size_multiplier={multiplier}: {kv} x {multiplier} KV heads do not divide "
            f"num_attention_heads={heads} (each rank's Q heads must share whole KV heads)"
        )
    return Layout(tp, heads, kv, head_dim, multiplier, int(config.vocab_size))


@dataclass
class Plan:
    """Sources of every tensor to fill, and the stores they are read from."""

    sources: dict[str, SourceSpec] = field(default_factory=dict)
    memory: MemoryStore = field(default_factory=lambda: MemoryStore({}))
    folder: FolderStore | None = None
    deferred: bool = False
    """Values come later (a sharded checkpoint): tensors without a source stay uninitialised."""
    names: dict[int, str] = field(default_factory=dict)
    """id(module) -> its name in the parallelised model (set by :meth:`index`)."""
    leaves: list[type] = field(default_factory=list)
    """Module classes a pipeline capture must keep as calls (set for PP > 1)."""
    sequence_hooks: list[RemovableHandle] = field(default_factory=list)
    """The sequence-parallel hooks (scatter before the first decoder layer, gather before a
    replicated head). A pipeline's capture records what they do into its stage graphs, which
    then call the hooked modules: the hooks are removed after the capture (else they would
    apply twice, splitting the sequence again inside the first layer)."""

    def index(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}

    def captured(self) -> None:
        """A pipeline has captured the model: remove :attr:`sequence_hooks` (their work is in
        the stage graphs now)."""
        for hook in self.sequence_hooks:
            hook.remove()
        self.sequence_hooks.clear()

    def keep_unswapped(self, model: nn.Module) -> None:
        """Every tensor of the swapped ``model`` without a source yet is kept as it is (its
        whole original tensor), the new modules' buffers (the loss's) included; then index
        the modules."""
        buffers = dict(model.named_buffers(remove_duplicate=False))
        for name, buffer in buffers.items():
            if name not in self.memory.tensors and not buffer.is_meta:
                self.memory.tensors[name] = buffer
        for name, _ in [*model.named_parameters(remove_duplicate=False), *buffers.items()]:
            if name not in self.sources:
                self.sources[name] = Source(name, memory=name in buffers)
        self.index(model)

    @torch.no_grad()
    def fill(self, module: nn.Module, *, buffers_only: bool = False) -> list[str]:
        """Read the values of ``module``'s own parameters and buffers that have a source;
        returns the names of those that have none (left as they are)."""
        prefix = self.names.get(id(module))
        if prefix is None:
            raise KeyError(f"{type(module).__name__} is not a module of the parallelised model")
        tensors: list[tuple[str, torch.Tensor | None]] = (
            [] if buffers_only else list(module._parameters.items())
        )
        tensors += list(module._buffers.items())
        unsourced = []
        for name, tensor in tensors:
            if tensor is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            source = self.sources.get(full)
            if source is None or not self.has(source):
                unsourced.append(full)
                continue
            value = self.read(source)
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{full}: {_source_names(source)} give a piece of shape "
                    f"{tuple(value.shape)}, the parallel tensor has shape {tuple(tensor.shape)}"
                )
            if name in module._buffers and tensor.is_meta:
                module._buffers[name] = value.to(dtype=tensor.dtype)
            else:
                tensor.copy_(value)
        return unsourced

    def store(self, source: Source) -> Store:
        return self.memory if source.memory or self.folder is None else self.folder

    def has(self, source: SourceSpec) -> bool:
        parts = source if isinstance(source, tuple) else (source,)
        return all(self.store(part).has(part.name) for part in parts)

    def read(self, source: SourceSpec) -> torch.Tensor:
        if isinstance(source, tuple):  # a fused tensor: its pieces one after another
            return torch.cat([self.read(part) for part in source], dim=0)
        with self.store(source).view(source.name) as (view, shape):
            return source.read(view, shape)

    def init_fn(
        self, fallback: Callable[[nn.Module], None] | None = None, *, buffers_only: bool = False
    ) -> Callable[[nn.Module], None]:
        """``param_init_fn(module)``: fill from the sources; a module with tensors that have
        none goes to ``fallback`` (an error without one, unless values come later)."""

        def init(module: nn.Module) -> None:
            unsourced = self.fill(module, buffers_only=buffers_only)
            if not unsourced:
                return
            if fallback is not None:
                fallback(module)
            elif not self.deferred:
                where = f"the folder {self.folder.folder}" if self.folder else "the model"
                raise ValueError(
                    f"{unsourced[:4]}: no values for them in {where} (and no param_init_fn)"
                )

        return init


def _source_names(source: SourceSpec) -> str:
    return ", ".join(part.name for part in (source if isinstance(source, tuple) else (source,)))


def qkv_stored_parts(
    spec: ModelSpec, layout: Layout, *, fused: bool, bias: bool
) -> dict[str, tuple[Any, ...]]:
    """The GQA projection's ``nxd_checkpoint_parts``: each parameter stored under the Hugging
    Face names of the projections it holds (relative to the attention module); fused, the
    global ``[Q; K; V]`` is cut at ``q_size`` and ``q_size + kv_size`` rows."""
    from nxd_ckpt import StoredPart

    q_rows = layout.heads * layout.head_dim
    kv_rows = layout.kv_heads * layout.head_dim
    projections = (
        ("q", spec.q_proj, q_rows),
        ("k", spec.k_proj, kv_rows),
        ("v", spec.v_proj, kv_rows),
    )
    parts: dict[str, tuple[Any, ...]] = {}
    for kind in ("weight", "bias") if bias else ("weight",):
        if fused:
            parts[f"{kind}_qkv"] = tuple(
                StoredPart(f"{proj}.{kind}", rows) for _, proj, rows in projections
            )
        else:
            for part, proj, _ in projections:
                parts[f"{kind}_{part}"] = (StoredPart(f"{proj}.{kind}"),)
    return parts


def _meta_like(param: nn.Parameter) -> nn.Parameter:
    new = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


class _Swapper:
    """One model's swap (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        layout: Layout,
        sp: bool,
        plan: Plan,
        fuse_qkv: bool = False,
    ) -> None:
        self.model, self.spec, self.layout, self.sp, self.plan = model, spec, layout, sp, plan
        self.fuse_qkv = fuse_qkv
        self.rank = nxd_state.get_tensor_model_parallel_rank()

    def shard(self, name: str, dim: int, padded: int | None = None) -> Source:
        return Source(name, "shard", dim=dim, rank=self.rank, size=self.layout.tp, padded=padded)

    def column(
        self,
        path: str,
        *,
        pad: bool = False,
        name: str | None = None,
        gather: bool = False,
        sequence_parallel: bool | None = None,
    ) -> ColumnParallelLinear:
        """``sequence_parallel``: whether the layer gathers its input's sequence (default:
        the swap's setting; False under a block that gathers its input itself)."""
        # Any: a transformers linear read by its attributes (nn.Module.__getattr__ is untyped)
        old: Any = self.model.get_submodule(path)
        layer = ColumnParallelLinear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            gather_output=gather,
            sequence_parallel_enabled=self.sp if sequence_parallel is None else sequence_parallel,
            dtype=old.weight.dtype,
            device="meta",
            sequence_dimension=1,
            pad=pad and old.out_features % self.layout.tp != 0,
        )
        padded = layer.output_size
        self.plan.sources[f"{path}.weight"] = self.shard(f"{path}.weight", 0, padded)
        if old.bias is not None:
            self.plan.sources[f"{path}.bias"] = self.shard(f"{path}.bias", 0, padded)
        self.model.set_submodule(path, layer)
        return layer

    def row(self, path: str, *, parallel: bool = True) -> RowParallelLinear:
        """Under sequence parallelism the output is this rank's slice of the sequence:
        reduce-scattered, or for a whole input (``parallel=False``, which nxd's layer splits
        by features itself) all-reduced and then split."""
        old: Any = self.model.get_submodule(path)  # a transformers linear, read by attributes
        layer = RowParallelLinear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            input_is_parallel=parallel,
            sequence_parallel_enabled=self.sp and parallel,
            dtype=old.weight.dtype,
            device="meta",
            sequence_dimension=1,
        )
        if self.sp and not parallel:
            layer.register_forward_hook(_split_output)
        self.plan.sources[f"{path}.weight"] = self.shard(f"{path}.weight", 1)
        if old.bias is not None:
            self.plan.sources[f"{path}.bias"] = Source(f"{path}.bias")
        self.model.set_submodule(path, layer)
        return layer

    def gqa(self, attn_path: str) -> None:
        """Q, K, V -> one GQA projection with K/V heads replicated ``kv_size_multiplier``
        times, head by head (``[k0, k0, k1, k1]``): local replicated head j is head j // m;
        ``fuse_qkv``: one ``weight_qkv`` holding this rank's Q, K, V rows one after another."""
        from nxd_ckpt.parts import CHECKPOINT_PARTS
        from nxd_layers import GQAQKVColumnParallelLinear

        spec, layout, fused = self.spec, self.layout, self.fuse_qkv
        attn = self.model.get_submodule(attn_path)
        q: Any = attn.get_submodule(spec.q_proj)  # a transformers linear, read by attributes
        bias = q.bias is not None
        layer = GQAQKVColumnParallelLinear(
            q.in_features,
            [layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim],
            bias=bias,
            gather_output=False,
            sequence_parallel_enabled=self.sp,
            dtype=q.weight.dtype,
            device="meta",
            kv_size_multiplier=layout.kv_size_multiplier,
            fuse_qkv=fused,
            head_dim=layout.head_dim,
            sequence_dimension=1,
        )
        first = self.rank * layout.local_kv_heads
        heads = [
            j // layout.kv_size_multiplier for j in range(first, first + layout.local_kv_heads)
        ]
        rows = tuple(h * layout.head_dim + i for h in heads for i in range(layout.head_dim))
        for kind in ("weight", "bias") if bias else ("weight",):
            pieces = []
            for part, proj in (("q", spec.q_proj), ("k", spec.k_proj), ("v", spec.v_proj)):
                original = f"{attn_path}.{proj}.{kind}"
                source = (
                    self.shard(original, 0) if part == "q" else Source(original, "rows", rows=rows)
                )
                pieces.append(source)
                if not fused:
                    self.plan.sources[f"{attn_path}.{GQA_NAME}.{kind}_{part}"] = source
            if fused:
                self.plan.sources[f"{attn_path}.{GQA_NAME}.{kind}_qkv"] = tuple(pieces)
        setattr(layer, CHECKPOINT_PARTS, qkv_stored_parts(spec, layout, fused=fused, bias=bias))
        for proj in (spec.q_proj, spec.k_proj, spec.v_proj):
            delattr(attn, proj)
        attn.add_module(GQA_NAME, layer)

    def attention(self, layer_path: str) -> None:
        from nxd_ckpt.parts import CHECKPOINT_PARTS

        spec, layout = self.spec, self.layout
        attn_path = f"{layer_path}.{spec.attention}"
        if layout.gqa:
            self.gqa(attn_path)
            qkv: tuple[str, ...] = (GQA_NAME,)
        else:
            for part, proj in (("q", spec.q_proj), ("k", spec.k_proj), ("v", spec.v_proj)):
                layer = self.column(f"{attn_path}.{proj}")
                aliases = _legacy_gqa_aliases(proj, part, layer.bias is not None)
                setattr(layer, CHECKPOINT_PARTS, aliases)
            qkv = (spec.q_proj, spec.k_proj, spec.v_proj)
        self.row(f"{attn_path}.{spec.o_proj}")
        # Any: the family's attention, given a parallel class and the attributes it reads
        attn: Any = self.model.get_submodule(attn_path)
        attn.__class__ = parallel_attention_class(type(attn))
        attn._nxd_qkv, attn._nxd_o, attn._nxd_qk_norms = qkv, spec.o_proj, spec.qk_norms
        attn.num_key_value_groups = layout.local_heads // layout.local_kv_heads

    def decoder_layer(self, layer_path: str) -> None:
        from nxd_layers import mark_sequence_parallel_parameter

        self.attention(layer_path)
        for name in self.spec.mlp_column:
            self.column(f"{layer_path}.{name}")
        for name in self.spec.mlp_row:
            self.row(f"{layer_path}.{name}")
        if self.sp:
            for name in self.spec.layer_norms:
                for param in self.model.get_submodule(f"{layer_path}.{name}").parameters():
                    mark_sequence_parallel_parameter(param)

    def block(self, block: BlockPlan) -> None:
        """One block of a transformers tensor-parallel plan (:mod:`nxd_trainer.hf._rules`);
        under sequence parallelism the block gathers its input's sequence once, and its
        row-parallel outputs are reduce-scattered (:mod:`nxd_trainer.hf._sequence`)."""
        if self.sp:
            module = self.model.get_submodule(block.path)
            hook = on_first_input(module, gather_sequence)
            module.register_forward_pre_hook(hook, with_kwargs=True)
        for child, gather in block.columns.items():
            self.column(f"{block.path}.{child}", gather=gather, sequence_parallel=False)
        for child, parallel in block.rows.items():
            self.row(f"{block.path}.{child}", parallel=parallel)
        for child in block.grad_sum:
            module = self.model.get_submodule(f"{block.path}.{child}")
            module.__class__ = grad_summed_class(type(module))

    def embeddings(self, gather_output: bool = False) -> None:
        """Vocabulary-parallel embedding and LM head (tied ones stay one parameter);
        ``gather_output``: the LM head's logits gathered to the whole vocabulary."""
        from nxd_layers import ParallelEmbedding

        spec, layout = self.spec, self.layout
        # Any: transformers' embedding and head, read by their attributes
        old: Any = self.model.get_submodule(spec.embed_tokens)
        head: Any = self.model.get_submodule(spec.lm_head)
        tied = head.weight is old.weight
        embedding_cls = ScaledParallelEmbedding if is_scaled_embedding(old) else ParallelEmbedding
        embedding = embedding_cls(
            old.num_embeddings,
            old.embedding_dim,
            padding_idx=old.padding_idx,
            device="meta",
            dtype=old.weight.dtype,
            pad=old.num_embeddings % layout.tp != 0,
        )
        name = f"{spec.embed_tokens}.weight"
        self.plan.sources[name] = self.shard(name, 0, embedding.num_embeddings)
        if isinstance(embedding, ScaledParallelEmbedding):
            embedding.embed_scale = old.embed_scale.detach().clone()
        self.model.set_submodule(spec.embed_tokens, embedding)
        lm_head = self.column(spec.lm_head, pad=True, gather=gather_output)
        if tied:
            lm_head.weight = embedding.weight
            self.plan.sources[f"{spec.lm_head}.weight"] = self.plan.sources[name]
        if gather_output:  # full logits: the family's own loss; padding columns dropped
            lm_head.register_forward_hook(_drop_padding(layout.vocab))
            return
        # What PreTrainedModel.loss_function returns when set (a submodule: it holds no
        # tensors, and the pipeline's capture sees a module call).
        self.model._loss_function = ParallelCausalLMLoss(layout.vocab)


class ScaledParallelEmbedding(ParallelEmbedding):
    """``ParallelEmbedding(ids) · embed_scale`` (Gemma 3's scaled word embedding: the scale
    cast to the weight's dtype first, as there)."""

    embed_scale: torch.Tensor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(1.0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _drop_padding(vocab: int) -> Callable[..., torch.Tensor]:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out[..., :vocab]

    return hook


_GRAD_SUMMED: dict[type, type] = {}


def grad_summed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` whose parameters enter its forward through an identity whose backward sums
    the gradient over TP: a per-head norm replicated on every rank, each rank applying it to
    its own heads, holds the whole gradient (the heads' parts summed) everywhere."""
    if cls not in _GRAD_SUMMED:

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:  # Any: sets _nxd_inside
            from nxd_layers.mappings import copy_to_tensor_model_parallel_region

            if self.__dict__.get("_nxd_inside"):
                return cls.forward(self, *args, **kwargs)
            weights = {
                n: copy_to_tensor_model_parallel_region(p) for n, p in self.named_parameters()
            }
            self._nxd_inside = True
            try:
                return torch.func.functional_call(self, weights, args, kwargs)
            finally:
                self._nxd_inside = False

        _GRAD_SUMMED[cls] = type(f"GradSummed{cls.__name__}", (cls,), {"forward": forward})
    return _GRAD_SUMMED[cls]


def _legacy_gqa_aliases(proj: str, part: str, bias: bool) -> dict[str, tuple[Any, ...]]:
    """A Q/K/V column-parallel layer stored under its own names, also read from the GQA
    projection's names that checkpoints written before the stored parts held (at a TP degree
    above the KV heads): ``k_proj.weight`` from ``qkv_proj.weight_k``."""
    from nxd_ckpt import StoredPart

    kinds = ("weight", "bias") if bias else ("weight",)
    return {
        kind: (StoredPart(f"{proj}.{kind}", aliases=(f"{GQA_NAME}.{kind}_{part}",)),)
        for kind in kinds
    }


def _split_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: this rank's slice of the module's whole-sequence output."""
    del module, args
    return scatter_sequence(output)


def _split_sequence(
    model: nn.Module,
    spec: ModelSpec,
    plan: Plan,
    norms: list[str],
    *,
    gather_for_head: bool,
) -> None:
    """Sequence parallelism around the decoder stack: the sequence split before the first
    layer, the weights of ``norms`` (modules after it) marked (their gradients summed over TP)
    and, before a replicated head (``gather_for_head``), the sequence gathered back. The hooks
    are kept in ``plan.sequence_hooks`` (see there)."""
    from nxd_layers import mark_sequence_parallel_parameter

    for norm in norms:
        for param in model.get_submodule(norm).parameters():
            mark_sequence_parallel_parameter(param)
    stack: Any = model.get_submodule(spec.layers)  # a ModuleList (checked by the rules)
    first = stack[0]
    split = first.register_forward_pre_hook(
        on_first_input(first, scatter_sequence), with_kwargs=True
    )
    plan.sequence_hooks.append(split)
    if gather_for_head:
        head = model.get_submodule(spec.lm_head)
        hook = on_first_input(head, gather_sequence)
        plan.sequence_hooks.append(head.register_forward_pre_hook(hook, with_kwargs=True))


def swap_layers(
    model: nn.Module,
    spec: ModelSpec,
    layout: Layout,
    *,
    sequence_parallel: bool,
    parallelize_embeddings: bool,
    should_parallelize_layer: Callable[[nn.Module], bool] | None = None,
    swap_at_tp1: bool = False,
    fuse_qkv: bool = False,
    blocks: list[BlockPlan] | None = None,
    gather_output: bool = False,
    sequence_parallel_norms: list[str] | None = None,
) -> Plan:
    """Swap ``model``'s layers in place for parallel ones on ``meta``; returns their sources.

    The model's other tensors keep their values (in memory); their sources name themselves.
    At TP = 1 nothing is swapped (the plan still says where every tensor comes from), unless
    ``swap_at_tp1`` (benchmarks: the parallel layers' own cost). ``fuse_qkv``: the GQA
    projection (when K/V heads are replicated) holds one fused ``weight_qkv``. ``blocks``:
    swap these blocks of a transformers tensor-parallel plan instead of ``spec``'s decoder
    layers (the family's own attention forward is kept). ``gather_output``: full-vocabulary
    logits from the LM head (and the family's own loss on them). ``sequence_parallel_norms``:
    with ``blocks``, the norms that act on the split sequence
    (:func:`nxd_trainer.hf._sequence.sequence_parallel_modules`); the Llama-family path marks
    its spec's norms.
    """

    plan = Plan()
    originals = {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }
    plan.memory = MemoryStore({n: t for n, t in originals.items() if not t.is_meta})
    swapper = _Swapper(model, spec, layout, sequence_parallel, plan, fuse_qkv)
    swap = layout.tp > 1 or swap_at_tp1
    if blocks is not None:
        for block in blocks if swap else ():
            swapper.block(block)
    else:
        for index, layer in enumerate(model.get_submodule(spec.layers).children()):
            if swap and (should_parallelize_layer is None or should_parallelize_layer(layer)):
                swapper.decoder_layer(f"{spec.layers}.{index}")
    if parallelize_embeddings and swap:
        swapper.embeddings(gather_output)
    if sequence_parallel:
        norms = [spec.final_norm] if blocks is None else list(sequence_parallel_norms or ())
        _split_sequence(model, spec, plan, norms, gather_for_head=not parallelize_embeddings)
    plan.keep_unswapped(model)
    logger.info(
        "parallelised %s for TP=%d: %d local heads, %d local KV heads (multiplier %d)%s",
        type(model).__name__,
        layout.tp,
        layout.local_heads,
        layout.local_kv_heads,
        layout.kv_size_multiplier,
        ", sequence parallel" if sequence_parallel else "",
    )
    return plan


def make_meta(model: nn.Module, *, buffers: bool) -> None:
    """Move the model's remaining real parameters (and buffers) to ``meta``: their values are
    read from the plan's sources when materialised (a lazy model's from its folder). Tied
    parameters stay one parameter."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_meta:
                if id(param) not in replaced:
                    replaced[id(param)] = _meta_like(param)
                module._parameters[name] = replaced[id(param)]
        if buffers:
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device="meta")
