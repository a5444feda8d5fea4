"""Expert MLPs, sharded over the expert-parallel (EP) group, computed as batched matmuls.

Expert ``e`` is the gated MLP (Mixtral, Qwen-MoE) ``y = (act(x G_e) * (x U_e)) D_e`` with
``[G_e | U_e]`` the ``(H, 2I)`` slice ``gate_up_proj.weight[e]`` and ``D_e`` the ``(I, H)``
slice ``down_proj.weight[e]`` (without ``glu_mlp``: ``y = act(x U_e) D_e``). The layer output is
``out_t = sum_{kept (t, e)} w_te y_e(x_t)`` with ``w_te`` the router affinity of the chosen
expert (divided by the sum over the token's kept choices with ``normalize_top_k_affinities``).

EP rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``: the weights are drawn full from the seed
and sliced, so any EP degree builds the EP=1 layer. A forward pass plans the dispatch
(:mod:`~nxd_layers.moe.dispatch`), sends each kept assignment's row to the rank of its expert
(all-to-all), runs the local experts as grouped products over the rows sorted by expert
(``torch._grouped_mm``: no padding, no host sync) on CUDA where torch has that kernel for the
dtype, else as one ``torch.bmm`` over ``(E/ep, M, H)`` (rows padded to the busiest local
expert's ``M``), sends the results back (all-to-all) and combines them.
Tensor parallelism inside each expert (Megatron's MLP split): TP rank ``t`` holds columns
``t`` of ``G_e`` and ``U_e`` (``I / tp`` each, ``gate_up_proj.weight`` ``(E/ep, H, 2I/tp)``,
``partition_dim=2``, ``partition_stride=2``) and the matching rows of ``D_e`` (``(E/ep, I/tp,
H)``, ``partition_dim=1``), so each TP rank computes a partial sum of every expert's output:
the tokens and affinities enter through ``copy_to_tensor_model_parallel_region`` (gradients
summed over TP) and the combined output leaves through
``reduce_from_tensor_model_parallel_region`` (one all-reduce per layer, after the combine).
Every TP rank routes the same tokens the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from nxd_layers._attributes import set_tensor_model_parallel_attributes
from nxd_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from nxd_layers.moe._comm import all_to_all_rows, group_size
from nxd_layers.moe.dispatch import DispatchPlan, plan_dispatch
from nxd_layers.moe.model_utils import ACT2FN, MoESequenceParallelMode
from nxd_state import (
    collectives,
    get_expert_model_parallel_group,
    get_tensor_model_parallel_group,
    model_parallel_is_initialized,
)

__all__ = [
    "ExpertMLPs",
    "ExpertMLPsCapacityFactor",
    "grouped_mm_supported",
    "resolve_expert_parallel_group",
]

InitMethod = Callable[[torch.Tensor], object]


def _group_or_current(
    group: ProcessGroup | None, current: Callable[[], object]
) -> ProcessGroup | None:
    """``group``, else ``current()`` of the parallel state, else ``None`` (no state)."""
    if group is not None:
        return group
    if model_parallel_is_initialized():
        found = current()
        assert isinstance(found, ProcessGroup)  # the getters return this rank's group
        return found
    return None


def resolve_expert_parallel_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, else the current state's EP group, else ``None`` (no expert parallelism)."""
    return _group_or_current(group, get_expert_model_parallel_group)


def resolve_tensor_parallel_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, else the current state's TP group, else ``None`` (no tensor parallelism)."""
    return _group_or_current(group, get_tensor_model_parallel_group)


def _mark_expert_parallel(param: torch.nn.Parameter, ep: int) -> None:
    """Sharding attributes: dim 0 (experts) split over the EP group, replicated over TP."""
    param.expert_model_parallel = True  # type: ignore[attr-defined]
    param.expert_partition_dim = 0  # type: ignore[attr-defined]
    param.expert_model_parallel_size = ep  # type: ignore[attr-defined]


class _WeightHolder(torch.nn.Module):
    """A submodule holding one parameter, ``weight`` (NxD's ``gate_up_proj.weight`` and
    ``down_proj.weight`` state-dict keys)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


def grouped_mm_supported(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``rows`` (R, K) against ``weights`` (G, K, N): on
    CPU in float32 or bfloat16 (torch >= 2.9), on CUDA in bfloat16 on compute capability
    >= 9.0 (torch's kernel), with every row a multiple of 16 bytes (its alignment rule).
    Elsewhere (XLA, older GPUs, float16) the experts run as one padded ``bmm``."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    tensors = (rows, *weights)
    dtypes = {t.dtype for t in tensors}
    device = rows.device
    if device.type == "cpu":
        fits = dtypes <= {torch.float32, torch.bfloat16} and len(dtypes) == 1
    elif device.type == "cuda":
        fits = dtypes == {torch.bfloat16} and torch.cuda.get_device_capability(device) >= (9, 0)
    else:
        fits = False
    widths = [rows.shape[-1], *(w.shape[-1] for w in weights), *(w.shape[-2] for w in weights)]
    return fits and all(width * rows.element_size() % 16 == 0 for width in widths)


def _check_arguments(
    num_experts: int,
    top_k: int,
    hidden_act: str,
    capacity_factor: float | None,
    normalize_top_k_affinities: bool,
    return_bias: bool,
    sequence_parallel_mode: str | MoESequenceParallelMode,
    permute_strategy: str,
) -> MoESequenceParallelMode:
    """One clear error for a bad or unsupported argument of :class:`ExpertMLPs`; returns the
    sequence-parallel mode."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if hidden_act not in ACT2FN:
        raise ValueError(f"hidden_act={hidden_act!r}: expected one of {sorted(ACT2FN)}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor!r}")
    if normalize_top_k_affinities and top_k == 1:
        raise ValueError("normalize_top_k_affinities needs top_k > 1, got top_k=1")
    if return_bias:
        raise NotImplementedError("return_bias=True: MoE expert MLPs have no bias")
    mode = MoESequenceParallelMode(sequence_parallel_mode)
    if mode != MoESequenceParallelMode.NO_SP:
        raise NotImplementedError(
            f"sequence_parallel_mode={mode.value}: nxd's MoE runs NO_SP only (gather the "
            f"sequence before the MoE layer)"
        )
    if permute_strategy not in ("matmul", "index"):
        raise ValueError(f"permute_strategy={permute_strategy!r}: expected matmul or index")
    return mode


class ExpertMLPs(torch.nn.Module):
    """The experts of one MoE layer (NxD's ``ExpertMLPs`` arguments); ``capacity_factor=None``
    is dropless, a number drops assignments beyond each expert's capacity."""

    grouped_mm: bool | None = None
    """How the local experts run: None (default) grouped products on CUDA where torch has the
    kernel for the dtype (:func:`grouped_mm_supported`: no padding, no host sync), else one
    padded ``bmm`` (on CPU, torch's grouped products measured 1.16x slower than the padded
    ``bmm``: ``bench/moe.py``); True grouped (an error where unsupported); False always the
    padded ``bmm``."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        glu_mlp: bool = True,
        capacity_factor: float | None = None,
        normalize_top_k_affinities: bool = False,
        return_bias: bool = False,
        init_method: InitMethod = torch.nn.init.kaiming_uniform_,
        output_layer_init_method: InitMethod = torch.nn.init.kaiming_uniform_,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sequence_parallel_mode: str | MoESequenceParallelMode = MoESequenceParallelMode.NO_SP,
        permute_strategy: str = "matmul",
        expert_model_parallel_group: ProcessGroup | None = None,
        tensor_model_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        mode = _check_arguments(
            num_experts,
            top_k,
            hidden_act,
            capacity_factor,
            normalize_top_k_affinities,
            return_bias,
            sequence_parallel_mode,
            permute_strategy,
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.glu_mlp, self.act_fn = glu_mlp, ACT2FN[hidden_act]
        self.capacity_factor = capacity_factor
        self.normalize_top_k_affinities = normalize_top_k_affinities
        self.return_bias = False
        self.sequence_parallel_mode = mode
        self.permute_strategy = permute_strategy
        self.last_dropped = 0
        """Assignments this rank dropped for capacity in the last forward pass."""
        ep, tp, tp_rank = self._split_over_groups(
            expert_model_parallel_group, tensor_model_parallel_group
        )
        self._build_weights(
            tp_rank, tp, init_method, output_layer_init_method, dtype=dtype, device=device
        )
        for param, dim, stride in (
            (self.gate_up_proj.weight, 2, 2 if glu_mlp else 1),
            (self.down_proj.weight, 1, 1),
        ):
            _mark_expert_parallel(param, ep)
            set_tensor_model_parallel_attributes(
                param, tp > 1, dim if tp > 1 else -1, stride if tp > 1 else 1
            )

    def _split_over_groups(
        self,
        expert_model_parallel_group: ProcessGroup | None,
        tensor_model_parallel_group: ProcessGroup | None,
    ) -> tuple[int, int, int]:
        """Resolve the EP group (``group``: the experts split over it) and the TP group
        (``tp_group``: the intermediate size split over it), refusing sizes that do not divide;
        returns ``(ep, tp, tp_rank)``."""
        self.group = resolve_expert_parallel_group(expert_model_parallel_group)
        ep = group_size(self.group)
        if self.num_experts % ep != 0:
            raise ValueError(
                f"num_experts({self.num_experts}) is not divisible by "
                f"expert_model_parallel_size({ep})"
            )
        self.num_local_experts = self.num_experts // ep
        self.expert_model_parallel_rank = 0 if ep == 1 else collectives.group_rank(self.group)
        self.tp_group = resolve_tensor_parallel_group(tensor_model_parallel_group)
        tp = group_size(self.tp_group)
        if self.intermediate_size % tp != 0:
            raise ValueError(
                f"intermediate_size({self.intermediate_size}) is not divisible by "
                f"tensor_parallel_size({tp})"
            )
        return ep, tp, 0 if tp == 1 else collectives.group_rank(self.tp_group)

    def _build_weights(
        self,
        tp_rank: int,
        tp: int,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Draw every expert's full weights (so any EP x TP degree builds the same experts) and
        keep this rank's: its experts, and within them its TP columns of gate/up (gate then up,
        stride 2 with ``glu_mlp``) and its rows of down."""
        num_experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        width = inter // tp
        columns = torch.arange(tp_rank * width, (tp_rank + 1) * width, device=device)
        if self.glu_mlp:  # this rank's gate columns, then its up columns (stride 2)
            columns = torch.cat([columns, columns + inter])
        mine = slice(
            self.expert_model_parallel_rank * self.num_local_experts,
            (self.expert_model_parallel_rank + 1) * self.num_local_experts,
        )
        up = (2 if self.glu_mlp else 1) * inter
        full = torch.empty((num_experts, hidden, up), dtype=dtype, device=device)
        init_method(full)
        self.gate_up_proj = _WeightHolder(full[mine][:, :, columns].clone())
        full = torch.empty((num_experts, inter, hidden), dtype=dtype, device=device)
        output_layer_init_method(full)
        self.down_proj = _WeightHolder(
            full[mine][:, tp_rank * width : (tp_rank + 1) * width].clone()
        )

    # Compute -------------------------------------------------------------------------------
    def mlp_op(self, x: torch.Tensor) -> torch.Tensor:
        """Local experts on ``x`` (E/ep, M, H) -> (E/ep, M, H), two (three) batched matmuls."""
        h = torch.bmm(x, self.gate_up_proj.weight)  # (E/ep, M, 2I) or (E/ep, M, I)
        if self.glu_mlp:
            gate, up = h.chunk(2, dim=-1)
            h = self.act_fn(gate) * up  # (E/ep, M, I)
        else:
            h = self.act_fn(h)
        return torch.bmm(h, self.down_proj.weight)  # (E/ep, M, H)

    def grouped_mlp_op(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Local experts on ``x`` (R, H), its rows sorted by expert, expert ``e`` owning rows
        ``[ends[e-1], ends[e])``: two grouped matmuls (``torch._grouped_mm``), no padding and no
        host sync; the same products as :meth:`mlp_op` on each expert's rows."""
        h = torch._grouped_mm(x, self.gate_up_proj.weight, offs=ends)  # (R, 2I) or (R, I)
        if self.glu_mlp:
            gate, up = h.chunk(2, dim=-1)
            h = self.act_fn(gate) * up  # (R, I)
        else:
            h = self.act_fn(h)
        return torch._grouped_mm(h.contiguous(), self.down_proj.weight, offs=ends)  # (R, H)

    def _use_grouped_mm(self, rows: torch.Tensor) -> bool:
        """:attr:`grouped_mm`, or where it is None whether torch's grouped kernel runs here."""
        weights = (self.gate_up_proj.weight, self.down_proj.weight)
        supported = grouped_mm_supported(rows, *weights)
        if self.grouped_mm is None:  # on CPU the padded bmm measured faster (bench/moe.py)
            return supported and rows.device.type == "cuda"
        if self.grouped_mm and not supported:
            raise ValueError(
                f"ExpertMLPs.grouped_mm=True: torch._grouped_mm does not run {rows.dtype} rows "
                f"of width {rows.shape[-1]} on {rows.device} (torch {torch.__version__}: CPU in "
                f"float32/bfloat16, CUDA in bfloat16 on compute capability >= 9.0, every row "
                f"a multiple of 16 bytes); set grouped_mm=None or False for the padded bmm"
            )
        return self.grouped_mm

    def _run_local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """``rows`` (R, H), each for local expert ``expert[i]``, through their experts: sorted
        by expert into grouped products (:meth:`grouped_mlp_op`) where torch runs them, else
        grouped into a zero-padded (E/ep, M, H) batch, one ``mlp_op``, unpadded."""
        if self._use_grouped_mm(rows):
            by_expert = torch.sort(expert, stable=True).indices  # rows grouped by expert
            per_expert = torch.bincount(expert, minlength=self.num_local_experts)
            ends = per_expert.cumsum(0).to(torch.int32)  # (E/ep,) end row of each expert
            out = self.grouped_mlp_op(rows[by_expert], ends)
            return rows.new_zeros(rows.shape).index_copy(0, by_expert, out)
        n_local, hidden = self.num_local_experts, rows.shape[-1]
        per_expert = torch.bincount(expert, minlength=n_local)  # (E/ep,)
        widest = int(per_expert.max()) if rows.shape[0] else 0
        by_expert = torch.sort(expert, stable=True).indices  # rows grouped by expert
        first = per_expert.cumsum(0) - per_expert  # (E/ep,) first row of each expert
        sorted_expert = expert[by_expert]
        slot = sorted_expert * widest + (
            torch.arange(rows.shape[0], device=rows.device) - first[sorted_expert]
        )
        batch = rows.new_zeros(n_local * widest, hidden).index_copy(0, slot, rows[by_expert])
        out = self.mlp_op(batch.view(n_local, widest, hidden)).reshape(n_local * widest, hidden)
        return rows.new_zeros(rows.shape).index_copy(0, by_expert, out[slot])

    def combine_weights(
        self, expert_affinities: torch.Tensor, expert_index: torch.Tensor, plan: DispatchPlan
    ) -> torch.Tensor:
        """``w`` (N,) of the kept assignments in ``plan.order``: the chosen affinities, zero
        where dropped, divided by each token's kept sum with ``normalize_top_k_affinities``."""
        chosen = expert_affinities.gather(1, expert_index)  # (T, k)
        kept = torch.zeros(chosen.numel(), dtype=torch.bool, device=chosen.device)
        kept[plan.order] = True
        chosen = chosen * kept.view_as(chosen)
        if self.normalize_top_k_affinities:  # F.normalize(p=1): w / max(sum |w|, 1e-12)
            chosen = chosen / chosen.abs().sum(1, keepdim=True).clamp(min=1e-12)
        return chosen.reshape(-1)[plan.order]

    def forward(
        self,
        hidden_states: torch.Tensor,
        expert_affinities: torch.Tensor,
        expert_index: torch.Tensor,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """``out`` (T, H) for tokens ``hidden_states`` (T, H) routed by ``expert_index`` (T, k)
        with ``expert_affinities`` (T, E); ``seq_len`` (NxD's) is unused."""
        del seq_len
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (T, H)
        tp = group_size(self.tp_group)
        if tp > 1:  # each TP rank computes a partial sum: their gradients add up over TP
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
            expert_affinities = copy_to_tensor_model_parallel_region(
                expert_affinities, self.tp_group
            )
        plan = plan_dispatch(expert_index, self.num_experts, self.capacity_factor, self.group)
        self.last_dropped = plan.dropped
        token = plan.order // self.top_k  # (N,) token of each kept assignment
        sent = all_to_all_rows(x[token], self.group, plan.send_counts, plan.recv_counts)
        done = self._run_local_experts(sent, plan.recv_expert)  # (R, H)
        back = all_to_all_rows(done, self.group, plan.recv_counts, plan.send_counts)  # (N, H)
        weight = self.combine_weights(expert_affinities, expert_index, plan)  # (N,)
        out = x.new_zeros(x.shape).index_add(0, token, back * weight.unsqueeze(1).to(back.dtype))
        if tp > 1:
            out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        return out.view(shape)


class ExpertMLPsCapacityFactor(ExpertMLPs):
    """NxD's capacity-factor experts (argument order kept): at most
    ``C = min(ceil(T k c / E), T)`` assignments per expert; ``capacity_factor=None`` or
    ``c >= E / k`` drops nothing."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        capacity_factor: float | None,
        glu_mlp: bool,
        sequence_parallel_mode: str | MoESequenceParallelMode = MoESequenceParallelMode.NO_SP,
        permute_strategy: str = "matmul",
        normalize_top_k_affinities: bool = False,
        return_bias: bool = False,
        init_method: InitMethod = torch.nn.init.kaiming_uniform_,
        output_layer_init_method: InitMethod = torch.nn.init.kaiming_uniform_,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_model_parallel_group: ProcessGroup | None = None,
        tensor_model_parallel_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            hidden_act=hidden_act,
            glu_mlp=glu_mlp,
            capacity_factor=capacity_factor,
            normalize_top_k_affinities=normalize_top_k_affinities,
            return_bias=return_bias,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            dtype=dtype,
            device=device,
            sequence_parallel_mode=sequence_parallel_mode,
            permute_strategy=permute_strategy,
            expert_model_parallel_group=expert_model_parallel_group,
            tensor_model_parallel_group=tensor_model_parallel_group,
        )
