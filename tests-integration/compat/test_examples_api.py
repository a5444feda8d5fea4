"""NxD's example and unit-test call patterns that used to stop a script, each run the way NxD
calls it (issue #24, items 2-10); all cheap: in-process or 1-2 gloo ranks, tiny tensors.

* LoRA: ``get_lora_model(model, LoraConfig(...))`` wraps whenever a config is given (no
  ``enable_lora`` gate, as NxD's code); ``LoraModel`` / ``LoRAModel``; an adapter checkpoint
  loaded with ``load_state_dict(lora_ckpt=...)``; the output equals ``W x + (alpha/r) B A x``.
* ``save_checkpoint(..., num_kept_ckpts=-1)`` keeps every tag.
* ``neuronx_distributed_config``: NxD's ``pipeline_config`` keys (``fuse_microbatches``,
  ``broadcast_and_average_loss``, the private XLA runtime knobs) and int flags.
* Meta-device init with ``include_buffers`` (positional) and a ``param_init_fn`` that replaces
  the child holding a buffer: the model equals the one built eagerly.
* Tracing: ``get_model`` returning ``(model, {})``, neuronx-cc ``compiler_args`` ignored.
* Item 8's names, item 10's patch points.

Tolerances: exact (0) where the same kernels run on the same values; where noted, float32
reassociation of a sum of a few products (rtol 1e-6, atol 1e-6).
"""

from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from nxd_state.testing import run_distributed

EXACT = {"rtol": 0.0, "atol": 0.0}
REASSOC = {"rtol": 1e-6, "atol": 1e-6}  # x W^T + s (x A^T) B^T vs x (W + s B A)^T


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.v_proj(x)


# LoRA (item 2) ---------------------------------------------------------------------------
def test_get_lora_model_wraps_whenever_a_config_is_given() -> None:
    from neuronx_distributed.modules.lora import LoraConfig, LoraModel, get_lora_model
    from neuronx_distributed.modules.lora.model import LoRAModel

    assert LoRAModel is LoraModel
    torch.manual_seed(0)
    base = _Attention()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    # NxD's LoRA example: no enable_lora (its dataclass default False is not consulted)
    config = LoraConfig(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_lora_model(base, config)
    assert isinstance(model, LoraModel)  # before the fix: the model came back unwrapped
    x = torch.randn(3, 8)
    adapter = {
        k: torch.randn_like(v) for k, v in model.state_dict().items() if "lora_" in k
    }  # the adapter checkpoint NxD's loader hands over
    fresh = get_lora_model(_Attention(), config)
    fresh.load_state_dict(weights, strict=False)
    fresh.load_state_dict(lora_ckpt=adapter)
    scale = 8 / 4
    expected = 0
    for name in ("q_proj", "v_proj"):
        a = next(v for k, v in adapter.items() if name in k and "lora_A" in k)
        b = next(v for k, v in adapter.items() if name in k and "lora_B" in k)
        w, bias = weights[f"{name}.weight"], weights[f"{name}.bias"]
        expected = expected + x @ w.T + bias + scale * (x @ a.T) @ b.T
    torch.testing.assert_close(fresh(x), expected, **REASSOC)
    off = get_lora_model(_Attention(), LoraConfig(enable_lora=False, target_modules=["q_proj"]))
    assert isinstance(off, LoraModel)  # NxD applies it too: the flag is not consulted


# save_checkpoint(num_kept_ckpts=-1) (item 3) -------------------------------------------------
def _save_three(folder: str) -> list[str]:
    import neuronx_distributed as nxd

    config = nxd.neuronx_distributed_config()
    model = nxd.initialize_parallel_model(config, lambda: nn.Linear(2, 2))
    optimizer = nxd.initialize_parallel_optimizer(
        config, torch.optim.SGD, model.parameters(), lr=0.1
    )
    for step in range(3):
        nxd.save_checkpoint(folder, f"step_{step}", model, optimizer, None, {}, 8, True, -1)
    with pytest.raises(ValueError, match="num_kept_ckpts must be None or -1"):
        nxd.save_checkpoint(folder, "bad", model, num_kept_ckpts=0)
    return sorted(p.name for p in Path(folder).iterdir() if p.is_dir())


def test_save_checkpoint_minus_one_keeps_every_tag(tmp_path: Path) -> None:
    (kept,) = run_distributed(_save_three, 1, str(tmp_path))
    assert kept == ["step_0", "step_1", "step_2"]


# neuronx_distributed_config (item 4) ---------------------------------------------------------
def test_config_takes_nxd_pipeline_keys_and_int_flags() -> None:
    import neuronx_distributed as nxd

    config = nxd.neuronx_distributed_config(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_config={
            "transformer_layer_cls": nn.Linear,
            "num_microbatches": 2,
            "output_loss_value_spec": (True, False),
            "input_names": ["input_ids", "labels"],
            "auto_partition": True,
            "use_zero1_optimizer": 1,  # args.use_zero1_optimizer > 0 written as an int
            "use_optimizer_wrapper": True,
            "broadcast_and_average_loss": 0,
            "fuse_microbatches": 1,
            "_use_gloo_for_metadata_comm": True,
        },
        optimizer_config={"zero_one_enabled": 1, "grad_clipping": True, "max_grad_norm": 1.0},
        sequence_parallel=1,  # --use_sequence_parallel 1
        model_init_config={"meta_device_init": 0},
    )
    assert config["sequence_parallel"] is True
    assert config["optimizer_config"]["zero_one_enabled"] is True
    pipe = config["pipeline_config"]
    assert (pipe["fuse_microbatches"], pipe["use_zero1_optimizer"]) == (True, True)
    assert pipe["_use_gloo_for_metadata_comm"] is True  # a top-level key, as in NxD's dict
    assert pipe["return_loss_on_cpu"] is False  # fuse_microbatches turns it off, as NxDPPModel
    with pytest.raises(TypeError, match=r"sequence_parallel.*the int 0 or 1"):
        nxd.neuronx_distributed_config(tensor_parallel_size=2, sequence_parallel=2)
    with pytest.raises(ValueError, match="_use_glo_for"):
        nxd.neuronx_distributed_config(
            pipeline_parallel_size=2,
            pipeline_config={"num_microbatches": 2, "_use_glo_for_metadata_comm": True},
        )


# Meta-device init (items 1, 9) ----------------------------------------------------------------
class _Rotary(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (100 ** (torch.arange(0, dim, 2).float() / dim)))


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.rotary_emb = _Rotary()


def _get_net(width: int) -> nn.Module:
    return _Net(width)


def _init_weights(module: nn.Module, device: torch.device) -> None:
    """The examples' ``param_init_fn``: replaces the rotary child (its tables were on meta)."""
    if isinstance(module, _Net):
        module.rotary_emb = _Rotary().to(device)
    elif isinstance(module, nn.Linear):
        torch.manual_seed(7)
        nn.init.normal_(module.weight)
        nn.init.zeros_(module.bias)


def _build(meta: bool) -> dict[str, torch.Tensor]:
    import neuronx_distributed as nxd

    config = nxd.neuronx_distributed_config(
        model_init_config={"meta_device_init": meta, "param_init_fn": _init_weights}
    )
    include_buffers = True
    model = nxd.initialize_parallel_model(config, _get_net, include_buffers, 4)
    if not meta:
        for module in model.modules():
            _init_weights(module, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()} | {
        "inv_freq": model.local_module().rotary_emb.inv_freq.clone()
    }


def test_meta_init_with_include_buffers_equals_eager_build() -> None:
    (meta,) = run_distributed(_build, 1, True)
    (eager,) = run_distributed(_build, 1, False)
    assert not meta["inv_freq"].is_meta
    torch.testing.assert_close(meta, eager, **EXACT)  # the same init on the same shapes


def test_include_buffers_is_nxd_third_parameter() -> None:
    import neuronx_distributed as nxd

    with pytest.raises(TypeError, match="include_buffers must be a bool, got int 4"):
        nxd.initialize_parallel_model(nxd.neuronx_distributed_config(), _get_net, 4)


# Tracing (item 6) -------------------------------------------------------------------------------
class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from neuronx_distributed.parallel_layers.layers import (
            ColumnParallelLinear,
            RowParallelLinear,
        )

        torch.manual_seed(3)
        self.up = ColumnParallelLinear(8, 16, gather_output=False)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _unsharded(x: torch.Tensor) -> torch.Tensor:
    from neuronx_distributed.parallel_layers import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with torch.no_grad():
        return _Mlp()(x)  # the same master weights, unsharded


def get_model() -> tuple[nn.Module, dict]:
    """NxD's inference ``get_model``: ``(model, input_output_alias)``, no aliases."""
    return _Mlp(), {}


def test_trace_get_model_with_empty_alias_and_neuronx_cc_flags(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import neuronx_distributed as nxd

    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING):
        traced = nxd.trace.parallel_model_trace(
            get_model,
            x,
            tp_degree=2,
            compiler_args="--model-type=transformer --enable-fast-loading-neuron-binaries",
        )
    try:
        assert "neuronx-cc flags: ignored" in caplog.text
        (reference,) = run_distributed(_unsharded, 1, x)
        # row-parallel partial sums added in another order: float32 reassociation
        torch.testing.assert_close(traced(x), reference, rtol=1e-5, atol=1e-6)
    finally:
        traced.close()


# Item 8's names ------------------------------------------------------------------------------
def test_item8_names_resolve_and_behave() -> None:
    from neuronx_distributed.optimizer import NeuronEPZero1Optimizer, NeuronZero1Optimizer
    from neuronx_distributed.parallel_layers import layers, parallel_state
    from neuronx_distributed.pipeline import comm
    from neuronx_distributed.trace import model_builder
    from neuronx_distributed.utils import serialization

    assert issubclass(NeuronEPZero1Optimizer, NeuronZero1Optimizer)
    assert callable(parallel_state.initialize_pp_gloo_groups)
    assert callable(comm.send_python_object)
    assert callable(comm.recv_python_object)
    with pytest.raises(NotImplementedError, match="ModelBuilder"):
        model_builder.ModelBuilder()
    manager = serialization.SerializationManager()
    obj = {"a": (torch.ones(2), 3), "b": [torch.zeros(1), "x"]}
    stubbed, tensors, stubs = manager.serialize(obj)
    assert len(tensors) == len(stubs) == 2
    back = manager.deserialize(stubbed, tensors)
    torch.testing.assert_close(back["a"][0], obj["a"][0], **EXACT)
    assert back["b"][1] == "x"
    assert back["a"][1] == 3
    assert layers._initialize_parameter_cpu is not None


def _tp2_names() -> dict[str, object]:
    from neuronx_distributed.parallel_layers import layers, parallel_state
    from neuronx_distributed.pipeline import comm

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    parallel_state.initialize_pp_gloo_groups()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    for method in ("tcp", "gloo"):
        if stage == 0:
            comm.send_python_object({"shape": (2, 3), "method": method}, method=method)
        else:
            got = comm.recv_python_object(method=method)
            assert got == {"shape": (2, 3), "method": method}
    embedding = layers.ParallelEmbedding(10, 4, collect_output=True)
    with pytest.raises(ValueError, match="collect_output=False is not supported"):
        layers.ParallelEmbedding(10, 4, collect_output=False)
    return {"rows": embedding.weight.shape[0]}


def test_pipeline_objects_and_embedding_on_two_stages() -> None:
    results = run_distributed(_tp2_names, 2)
    assert [r["rows"] for r in results] == [10, 10]  # TP=1 here: the whole table


# Item 10: NxD's unit tests patch module-level names -------------------------------------------
def test_patched_tp_rank_reaches_create_local_weight() -> None:
    from neuronx_distributed.parallel_layers import layers

    full = torch.arange(12.0).reshape(4, 3)
    target = "neuronx_distributed.parallel_layers.layers.get_tensor_model_parallel_"
    with (
        mock.patch(target + "rank", return_value=1),
        mock.patch(target + "size", return_value=2),
    ):
        shard = layers.create_local_weight(full, 0, 2, 1)
    torch.testing.assert_close(shard, full[2:], **EXACT)


# Item 7: NxD's ZeRO-1 clipping test zips param_groups with base_optimizer.param_groups ---------
def _zero1_clipping_pattern() -> tuple[float, float, float]:
    """NxD's ``test_tp_zero1_pp_gradient_clipping`` steps, at TP=2 x DP=2: identical full
    gradients on every rank, the TP layers' shards of them, ZeRO-1 with clipping, the inner
    zero_grad patched out, then ``get_grad_norm`` over the zipped shards."""
    from neuronx_distributed.optimizer import NeuronZero1Optimizer
    from neuronx_distributed.parallel_layers import layers, parallel_state
    from neuronx_distributed.parallel_layers.grads import get_grad_norm

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(5)
    cpu_layer = nn.Linear(6, 10)
    for p in cpu_layer.parameters():
        p.grad = 10 * torch.randn(p.shape)
    layer = layers.ColumnParallelLinear(6, 10, gather_output=False)
    layer.weight.grad = cpu_layer.weight.grad.chunk(2)[tp_rank].clone()
    layer.bias.grad = cpu_layer.bias.grad.chunk(2)[tp_rank].clone()
    opt = NeuronZero1Optimizer(
        list(layer.parameters()),
        torch.optim.SGD,
        lr=0.01,
        pin_layout=False,
        sharding_groups=parallel_state.get_data_parallel_group(as_list=True),
        grad_norm_groups=parallel_state.get_tensor_model_parallel_group(as_list=True),
        max_norm=1.0,
        grad_clipping=True,
    )
    opt.base_optimizer.zero_grad = lambda set_to_none: set_to_none
    opt.step()
    before = float(torch.nn.utils.clip_grad_norm_(list(cpu_layer.parameters()), 1.0))
    shards = []
    for group, sharded in zip(opt.param_groups, opt.base_optimizer.param_groups):
        for param, shard in zip(group["params"], sharded["params"], strict=True):
            if param.grad is not None:
                shard.tensor_model_parallel = param.tensor_model_parallel
                shards.append(shard)
    after = get_grad_norm(
        shards,
        norm_type=2,
        zero1_optimizer=True,
        zero1_optimizer_groups=parallel_state.get_data_parallel_group(as_list=True),
    )
    cpu_after = torch.sqrt(sum(torch.square(p.grad).sum() for p in cpu_layer.parameters()))
    return float(opt.grad_norm) - before, float(after), float(cpu_after)


def test_zero1_base_optimizer_shards_zip_per_parameter() -> None:
    """Before the fix ``base_optimizer`` held one flat shard per group: the zip paired the
    weight with the whole shard and the norm was wrong. Tolerance: float32 sums of 70
    squares reduced in another order (rtol 1e-5)."""
    for diff, after, cpu_after in run_distributed(_zero1_clipping_pattern, 4):
        assert abs(diff) <= 1e-5 * abs(diff + 1)
        assert after == pytest.approx(cpu_after, rel=1e-5)
        assert after <= 1.0 + 1e-6  # clipped to max_norm


# Item 5: NeuronLTModule's two argument orders, model_fn optional; NeuronHooksCallback ---------
def test_neuron_lt_module_takes_both_nxd_orders() -> None:
    import neuronx_distributed as nxd
    from neuronx_distributed.lightning import NeuronLTModule

    config = nxd.neuronx_distributed_config()

    class LlamaModule(NeuronLTModule):  # NxD's example: builds its model in setup()
        def setup(self, stage: str | None = None) -> None:
            include_buffers = True
            self.model = nxd.initialize_parallel_model(
                self.nxd_config, _get_net, include_buffers, 4
            )

    current = LlamaModule(config, torch.optim.AdamW, None, opt_kwargs={"lr": 1e-3}, log_rank0=1)
    assert current.model_fn is None
    assert (current.opt_cls, current.opt_kwargs) == (torch.optim.AdamW, {"lr": 1e-3})
    earlier = NeuronLTModule(_get_net, config, torch.optim.SGD, None, (4,))
    assert (earlier.model_fn, earlier.model_args, earlier.opt_cls) == (
        _get_net,
        (4,),
        torch.optim.SGD,
    )
    with pytest.raises(TypeError, match=r"NeuronLTModule\(nxd_config, opt_cls"):
        NeuronLTModule(config, torch.optim.SGD, None, model_fn=_get_net, bogus=1)


def test_neuron_hooks_callback_dumps_what_the_layer_saw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from neuronx_distributed.lightning import NeuronHooksCallback

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    cfg = SimpleNamespace(
        hooks=True,
        master_print_model_layers=False,
        target_layers="1",
        dump_only_master_rank=False,
        dump_only_norms=False,
        hooks_interval=2,
        enable_activation_dumps=True,
        enable_grad_dumps=True,
        enable_tb_logging_master_rank_activation_norms=False,
        enable_tb_logging_master_rank_grad_norms=False,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    module = SimpleNamespace(model=model, global_step=0)
    callback = NeuronHooksCallback(cfg)
    callback.on_train_start(None, module)  # type: ignore[arg-type]
    x = torch.randn(3, 4)
    for step in (0, 1):  # interval 2: step 1 is not dumped
        module.global_step = step
        model(x).sum().backward()
    folder = tmp_path / "hooks_outputs/7/hooks_dumps/1"
    assert sorted(p.name for p in folder.iterdir()) == ["global_step_0"]
    files = folder / "global_step_0"
    seen_in = torch.load(files / "dp0_pp0_tp0_layer_input_raw.pt", weights_only=True)
    seen_out = torch.load(files / "dp0_pp0_tp0_layer_output_raw.pt", weights_only=True)
    hidden = model[0](x)
    torch.testing.assert_close(seen_in, hidden, **EXACT)  # the same ops on the same values
    torch.testing.assert_close(seen_out, torch.tanh(hidden), **EXACT)
    grad_out = torch.load(files / "dp0_pp0_tp0_grad_output_raw.pt", weights_only=True)
    torch.testing.assert_close(grad_out, model[2].weight.sum(0).expand(3, 4), **EXACT)
