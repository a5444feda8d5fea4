"""TP=2 LoRA on Column/Row/GQA layers equals the unsharded LoRA model (outputs, adapter grads).

Each rank builds the unsharded reference (plain ``nn.Linear`` + LoRA) and the TP model from
the same weights: base shards sliced from the reference, adapter loaded from the reference's
PEFT-format state dict (which exercises the slicing). Gathering the TP adapter back must give
the reference's adapter exactly.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import nxd_lora
import nxd_state
from nxd_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_gradients,
    full_tensor,
    gather_tensor_parallel_shards,
    shard_for_rank,
)
from nxd_lora import LoraConfig, LoRAModel
from nxd_state.testing import run_distributed

# TP splits the reductions of the base and adapter matmuls into two partial sums added by an
# all-reduce: fp32 reassociation over 16-32 terms of O(1) values stays far below 1e-5.
TP_TOL = {"rtol": 1e-5, "atol": 1e-5}
# Gradients add up to s·b = 8 token contributions of products reaching ~10 (squared loss, random
# adapters at alpha/r = 2), summed in another order under TP/SP: fp32 error ~ 8 · 10 · 1e-7
# per term and a few terms deep, so 1e-4 (observed worst: 2e-5).
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-4}
HIDDEN, FFN, RANK = 16, 32, 4


class Mlp(nn.Module):
    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def randomize_(module: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def _mlp_pair(sequence_parallel: bool, tp: int, rank: int) -> tuple[LoRAModel, LoRAModel]:
    torch.manual_seed(0)
    reference = Mlp(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN))
    parallel = Mlp(
        ColumnParallelLinear(
            HIDDEN, FFN, gather_output=False, sequence_parallel_enabled=sequence_parallel
        ),
        RowParallelLinear(
            FFN, HIDDEN, input_is_parallel=True, sequence_parallel_enabled=sequence_parallel
        ),
    )
    with torch.no_grad():
        parallel.up.weight.copy_(shard_for_rank(reference.up.weight, 0, rank, tp))
        parallel.up.bias.copy_(shard_for_rank(reference.up.bias, 0, rank, tp))
        parallel.down.weight.copy_(shard_for_rank(reference.down.weight, 1, rank, tp))
        parallel.down.bias.copy_(reference.down.bias)
    config = LoraConfig(
        lora_rank=RANK, lora_alpha=8, target_modules=["up", "down"], bias="lora_only"
    )
    ref_lora, tp_lora = LoRAModel(reference, config), LoRAModel(parallel, config)
    randomize_(ref_lora, seed=5)
    nxd_lora.load_peft_state_dict(tp_lora, nxd_lora.gather_peft_state_dict(ref_lora))
    return ref_lora, tp_lora


def column_row_parity() -> dict[str, object]:
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank, tp = state.tensor_parallel_group, state.tensor_parallel_rank, 2
    checks: dict[str, object] = {}
    for sequence_parallel in (False, True):
        ref, par = _mlp_pair(sequence_parallel, tp, rank)
        x = torch.randn(4, 2, HIDDEN, generator=torch.Generator().manual_seed(9))  # (s, b, h)
        x_local = x.chunk(tp, dim=0)[rank] if sequence_parallel else x
        with nxd_state.count_collectives() as lora_traffic:
            out = par(x_local)
        want = ref(x)
        got = nxd_state.collectives.all_gather(out.detach(), group, dim=0)
        torch.testing.assert_close(got if sequence_parallel else out, want, **TP_TOL)
        want.square().sum().backward()
        out.square().sum().backward()  # with SP: this shard's part of the same loss
        if sequence_parallel:  # replicated params that saw one sequence shard: sum over TP
            allreduce_sequence_parallel_gradients(list(par.parameters()), group)
        ref_params = dict(ref.module.named_parameters())
        compared = []
        for name, param in par.module.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, name  # the frozen base gets no gradient
                continue
            grad = full_tensor(param, param.grad, group)
            torch.testing.assert_close(
                grad,
                ref_params[name].grad,
                **GRAD_TOL,
                msg=lambda m, n=name, sp=sequence_parallel: f"{n} sp={sp}: {m}",
            )
            compared.append(name)
        checks[f"sp={sequence_parallel}:grads"] = sorted(compared)
        # The adapter only moves rank-sized activations: without SP one all-reduce of
        # (s, b, r) for the row-parallel A, beyond the base's own (s, b, h) all-reduce.
        checks[f"sp={sequence_parallel}:traffic"] = lora_traffic.as_dict()
        # Gathering the TP adapter gives the reference's adapter exactly.
        theirs, mine = (nxd_lora.gather_peft_state_dict(m) for m in (ref, par))
        assert set(mine) == set(theirs)
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
        # Merging on TP equals the unmerged TP output (W_i + s·B_i A or W_i + s·B A_i).
        with torch.no_grad():
            before = par(x_local)
            par.merge_lora()
            after = par(x_local)
            par.unmerge_lora()
        torch.testing.assert_close(after, before, **TP_TOL)
    # Any TP degree initialises the same adapter: TP=1 layers on a one-rank group, same seed.
    singles = [dist.new_group([r]) for r in range(tp)]
    adapters = []
    for layer_group in (group, singles[rank]):
        torch.manual_seed(0)
        model = Mlp(
            ColumnParallelLinear(
                HIDDEN, FFN, gather_output=False, tensor_parallel_group=layer_group
            ),
            RowParallelLinear(
                FFN, HIDDEN, input_is_parallel=True, tensor_parallel_group=layer_group
            ),
        )
        torch.manual_seed(11)
        adapters.append(
            nxd_lora.gather_peft_state_dict(
                LoRAModel(model, LoraConfig(lora_rank=RANK, target_modules=["up", "down"]))
            )
        )
    for key in adapters[0]:
        torch.testing.assert_close(adapters[0][key], adapters[1][key], rtol=0, atol=0, msg=key)
    checks["init_keys"] = sorted(adapters[0])
    checks.update(_dropout_and_skip_bias_add(group))
    return checks


def _dropout_and_skip_bias_add(group: dist.ProcessGroup) -> dict[str, object]:
    """Dropout on TP-sharded inputs needs the model-parallel RNG stream; skip_bias_add bases
    keep returning ``(output, bias)`` with the adapter added to the output."""
    out: dict[str, object] = {}
    torch.manual_seed(0)
    model = Mlp(
        ColumnParallelLinear(HIDDEN, FFN, gather_output=False),
        RowParallelLinear(FFN, HIDDEN, input_is_parallel=True),
    )
    lora = LoRAModel(model, LoraConfig(lora_rank=RANK, lora_dropout=0.5, target_modules=["down"]))
    randomize_(lora, seed=2)
    x = torch.randn(4, HIDDEN)
    nxd_state.get_rng_tracker().reset()
    try:
        lora(x)
    except KeyError as error:  # the row-parallel A sees a sharded input: TP-distinct stream
        out["no_stream_error"] = str(error)
    nxd_state.model_parallel_manual_seed(123)
    lora.eval()
    evaluated = lora(x).detach()
    lora.train()
    out["dropout_changes_output"] = not torch.allclose(lora(x), evaluated)

    torch.manual_seed(0)
    base = ColumnParallelLinear(HIDDEN, FFN, gather_output=True, skip_bias_add=True)
    plain_y, plain_bias = copy.deepcopy(base)(x)
    wrapped = LoRAModel(nn.Sequential(base), LoraConfig(lora_rank=RANK, target_modules=["0"]))
    randomize_(wrapped, seed=4)
    y, bias = wrapped(x)
    layer = wrapped.module[0]
    adapter = layer.lora_B(layer.lora_A(x)) * layer.scaling  # gathered B output
    torch.testing.assert_close(bias, plain_bias, rtol=0, atol=0)
    torch.testing.assert_close(y, plain_y + adapter, **TP_TOL)
    out["skip_bias_add"] = True
    return out


def test_column_and_row_parallel_lora_match_unsharded() -> None:
    results = run_distributed(column_row_parity, 2)
    for checks in results:
        trained = {
            "up.lora_A.weight",
            "up.lora_B.weight",
            "up.base_layer.bias",
            "down.lora_A.weight",
            "down.lora_B.weight",
            "down.base_layer.bias",
        }
        assert set(checks["sp=False:grads"]) == trained
        assert set(checks["sp=True:grads"]) == trained
        plain = checks["sp=False:traffic"]
        # base row-parallel all-reduce of (4, 2, 16) fp32 + the adapter's (4, 2, r=4)
        assert plain["all_reduce@tp"] == {
            "calls": 2,
            "bytes": 4 * 2 * (HIDDEN + RANK) * 4,
            "wire_bytes": 4 * 2 * (HIDDEN + RANK) * 4,
        }
        assert "all_gather@tp" not in plain  # no activation is gathered without SP
        sp = checks["sp=True:traffic"]
        # SP: the adapter all-gathers the (s, b, r) A output, not the (s, b, h) input
        assert sp["all_gather@tp"]["bytes"] == 2 * 2 * (HIDDEN + RANK) * 4
        assert len(checks["init_keys"]) == 4
        assert "model_parallel_manual_seed" in checks["no_stream_error"]
        assert checks["dropout_changes_output"] is True
        assert checks["skip_bias_add"] is True


def merged_sharded_adapter() -> dict[str, list[str]]:
    """NxD's merge_sharded_lora: the TP=2 state dict is the unsharded model's adapter."""
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    ref, par = _mlp_pair(False, 2, state.tensor_parallel_rank)
    reference = {  # the unsharded model's adapter under its own names
        ref.original_name(key.removeprefix(nxd_lora.adapter.PEFT_PREFIX)): value
        for key, value in nxd_lora.gather_peft_state_dict(ref).items()
    }
    local_shapes = {k: tuple(v.shape) for k, v in par.state_dict().items()}
    par.lora_config.merge_sharded_lora = True  # shared with ref: state_dict is now gathered
    merged = par.state_dict()
    assert set(merged) == set(reference)
    for key, value in reference.items():
        # the same numbers gathered from the shards: exact
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0, msg=key)
    return {
        "sharded": sorted(k for k, v in merged.items() if tuple(v.shape) != local_shapes[k]),
    }


def test_merge_sharded_lora_gathers_the_full_adapter() -> None:
    for result in run_distributed(merged_sharded_adapter, 2):
        # B and the (lora_only-trained) bias of the column-parallel `up`, A of the
        # row-parallel `down`: the tensors that are sharded, and came back full
        assert result["sharded"] == ["down.lora_A.weight", "up.bias", "up.lora_B.weight"]


class SeparateQkv(nn.Module):
    """The unsharded reference: three projections, as in a Hugging Face attention block."""

    def __init__(self, kv_size: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, kv_size)
        self.v_proj = nn.Linear(HIDDEN, kv_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class FusedQkv(nn.Module):
    def __init__(self, qkv_proj: GQAQKVColumnParallelLinear) -> None:
        super().__init__()
        self.qkv_proj = qkv_proj

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.qkv_proj(x)


HEAD_DIM = 4


def _replicated(full: torch.Tensor, multiplier: int) -> torch.Tensor:
    heads = full.reshape(-1, HEAD_DIM, *full.shape[1:])
    return heads.repeat_interleave(multiplier, dim=0).reshape(-1, *full.shape[1:])


def _local_parts(layer: GQAQKVColumnParallelLinear, kind: str, grads: bool) -> list[torch.Tensor]:
    def value(t: torch.Tensor) -> torch.Tensor:
        return t.grad if grads else t.detach()

    if layer.fuse_qkv:
        sizes = [layer.q_output_size_per_partition, *[layer.kv_output_size_per_partition] * 2]
        return list(value(getattr(layer, f"{kind}_qkv")).split(sizes, dim=0))
    return [value(getattr(layer, f"{kind}_{p}")) for p in "qkv"]


def gqa_parity() -> list[str]:
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank, tp = state.tensor_parallel_group, state.tensor_parallel_rank, 2
    done = []
    # (kv heads, kv_size_multiplier, fuse_qkv, gather_output)
    for kv_heads, multiplier, fused, gather in [
        (2, 1, False, True),
        (1, 2, True, True),
        (2, 1, True, False),
    ]:
        kv_size = kv_heads * HEAD_DIM
        torch.manual_seed(0)
        reference = SeparateQkv(kv_size)
        base = GQAQKVColumnParallelLinear(
            HIDDEN,
            [HIDDEN, kv_size],
            gather_output=gather,
            kv_size_multiplier=multiplier,
            fuse_qkv=fused,
            head_dim=HEAD_DIM,
        )
        with torch.no_grad():
            for kind in ("weight", "bias"):
                fulls = [getattr(getattr(reference, f"{p}_proj"), kind) for p in "qkv"]
                fulls = [fulls[0]] + [_replicated(f, multiplier) for f in fulls[1:]]
                shards = [shard_for_rank(f, 0, rank, tp) for f in fulls]
                if fused:
                    getattr(base, f"{kind}_qkv").copy_(torch.cat(shards))
                else:
                    for p, shard in zip("qkv", shards):
                        getattr(base, f"{kind}_{p}").copy_(shard)
        config = LoraConfig(
            lora_rank=RANK, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]
        )
        ref = LoRAModel(reference, config)
        par = LoRAModel(
            FusedQkv(base), LoraConfig(lora_rank=RANK, lora_alpha=8, target_modules=["qkv_proj"])
        )
        randomize_(ref, seed=3)
        with torch.no_grad():  # the fused layer shares one A between q, k and v
            for p in "kv":
                ref.module.get_submodule(f"{p}_proj").lora_A.weight.copy_(
                    ref.module.q_proj.lora_A.weight
                )
        nxd_lora.load_peft_state_dict(par, nxd_lora.gather_peft_state_dict(ref))
        x = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(4))
        want, got = ref(x), par(x)
        for i, (w, g) in enumerate(zip(want, got)):
            expected = (
                w
                if gather
                else shard_for_rank(_replicated(w.T, multiplier).T if i else w, -1, rank, tp)
            )
            torch.testing.assert_close(g, expected, **TP_TOL)
        sum(w.square().sum() for w in want).backward()
        sum(g.square().sum() for g in got).backward()  # gathered: every rank has the full loss
        layer = par.module.qkv_proj
        a_grad = sum(ref.module.get_submodule(f"{p}_proj").lora_A.weight.grad for p in "qkv")
        torch.testing.assert_close(layer.lora_A.weight.grad, a_grad, **GRAD_TOL)
        for i, local in enumerate(_local_parts(layer.lora_B, "weight", grads=True)):
            full = gather_tensor_parallel_shards(local, 0, 1, group)
            if i and multiplier > 1:  # every replica of a head holds that head's gradient
                full = full.reshape(kv_heads, multiplier, HEAD_DIM, -1)[:, 0].reshape(kv_size, -1)
            p = "qkv"[i]
            torch.testing.assert_close(
                full,
                ref.module.get_submodule(f"{p}_proj").lora_B.weight.grad,
                **GRAD_TOL,
                msg=lambda m, p=p: f"B_{p} grad: {m}",
            )
        theirs, mine = (nxd_lora.gather_peft_state_dict(m) for m in (ref, par))
        assert set(mine) == set(theirs)
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0, msg=key)
        # merge_sharded_lora keeps the layer's names, one copy of each K/V head (as NxD)
        full = nxd_lora.gather_full_adapter_state_dict(par)
        ref_b = [ref.module.get_submodule(f"{p}_proj").lora_B.weight for p in "qkv"]
        want_b = (
            {"qkv_proj.lora_B.weight_qkv": torch.cat(ref_b)}
            if fused
            else {f"qkv_proj.lora_B.weight_{p}": b for p, b in zip("qkv", ref_b)}
        )
        assert set(full) == {"qkv_proj.lora_A.weight", *want_b}
        torch.testing.assert_close(
            full["qkv_proj.lora_A.weight"], ref.module.q_proj.lora_A.weight, rtol=0, atol=0
        )
        for key, value in want_b.items():
            torch.testing.assert_close(full[key], value.detach(), rtol=0, atol=0, msg=key)
        with torch.no_grad():
            before = par(x)
            par.merge_lora()
            after = par(x)
            par.unmerge_lora()
        for b, a in zip(before, after):
            torch.testing.assert_close(a, b, **TP_TOL)
        done.append(f"kv_heads={kv_heads},m={multiplier},fused={fused},gather={gather}")
    return done


def test_gqa_qkv_lora_matches_separate_unsharded_projections() -> None:
    results = run_distributed(gqa_parity, 2)
    assert results == [results[0]] * 2
    assert len(results[0]) == 3
