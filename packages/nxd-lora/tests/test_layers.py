"""LoRA on plain layers equals PEFT's LoRA on the same base with the same adapter weights.

Same base (deepcopy) + same adapter tensors (copied across through PEFT's own state-dict
format, which also checks our key mapping) must give the same outputs and gradients.
"""

from __future__ import annotations

import copy
import math

import peft
import pytest
import torch
from peft.utils import get_peft_model_state_dict
from torch import nn

import nxd_lora
from nxd_lora import LoraConfig, LoRAModel

# Identical math in the same order on the same tensors: only fp32 summation order can differ
# (PEFT adds the adapter out of place, nxd in place), so a few ulps of slack.
EXACT = {"rtol": 1e-6, "atol": 1e-6}


class Toy(nn.Module):
    """Embedding -> Linear -> head, plus a Conv2d branch: every plain layer type LoRA supports."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 16, padding_idx=0)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)
        self.conv = nn.Conv2d(3, 4, 3, padding=1, stride=2)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(torch.tanh(self.proj(self.emb(ids)))), self.conv(image)


def toy_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, (3, 5), generator=generator)
    image = torch.randn(2, 3, 6, 6, generator=generator)
    return ids, image


def randomize_(module: nn.Module, seed: int = 1) -> None:
    """Give every parameter whose name contains ``lora_`` random values (init has B = 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def build_pair(
    *,
    bias: str = "none",
    use_rslora: bool = False,
    init: str = "default",
    dropout: float = 0.0,
    seed: int = 0,
    modules_to_save: list[str] | None = None,
) -> tuple[nn.Module, LoRAModel]:
    """The same Toy wrapped by PEFT and by nxd, both initialised from the same seed."""
    torch.manual_seed(1234)
    base = Toy()
    peft_config = peft.LoraConfig(
        r=4,
        lora_alpha=6,
        target_modules=["emb", "proj", "conv"],
        bias=bias,
        use_rslora=use_rslora,
        init_lora_weights=True if init == "default" else "gaussian",
        lora_dropout=dropout,
        modules_to_save=modules_to_save,
    )
    config = LoraConfig(
        enable_lora=True,
        lora_rank=4,
        lora_alpha=6,
        target_modules=["emb", "proj", "conv"],
        bias=bias,
        use_rslora=use_rslora,
        init_lora_weights=init,
        lora_dropout=dropout,
        modules_to_save=modules_to_save,
    )
    torch.manual_seed(seed)
    reference = peft.get_peft_model(copy.deepcopy(base), peft_config)
    torch.manual_seed(seed)
    ours = LoRAModel(copy.deepcopy(base), config)
    return reference, ours


def peft_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's gradients under PEFT's saved key names (adapter name dropped)."""
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        key = name.replace(".default", "").replace(".modules_to_save", "")
        out[key] = param.grad
    return out


@pytest.mark.parametrize(
    ("bias", "use_rslora", "modules_to_save"),
    [
        ("none", False, None),
        ("all", False, None),
        ("lora_only", True, None),
        ("none", False, ["head"]),
    ],
)
def test_outputs_and_grads_match_peft(
    bias: str, use_rslora: bool, modules_to_save: list[str] | None
) -> None:
    reference, ours = build_pair(bias=bias, use_rslora=use_rslora, modules_to_save=modules_to_save)
    randomize_(reference)
    nxd_lora.load_peft_state_dict(ours, get_peft_model_state_dict(reference))
    ids, image = toy_inputs()
    ref_out, ours_out = reference(ids, image), ours(ids, image)
    for ref, got in zip(ref_out, ours_out):
        torch.testing.assert_close(got, ref, **EXACT)
    (sum(o.square().sum() for o in ref_out)).backward()
    (sum(o.square().sum() for o in ours_out)).backward()
    ref_grads = peft_grads(reference)
    ours_grads = {
        "base_model.model." + name: p.grad
        for name, p in ours.module.named_parameters()
        if p.grad is not None
    }
    assert set(ours_grads) == set(ref_grads)  # the same parameters train
    for key, grad in ref_grads.items():
        torch.testing.assert_close(ours_grads[key], grad, **EXACT, msg=key)


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_initialisation_matches_peft_under_the_same_seed(init: str) -> None:
    reference, ours = build_pair(init=init, seed=7)
    theirs = get_peft_model_state_dict(reference)
    mine = nxd_lora.gather_peft_state_dict(ours)
    assert set(mine) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    assert torch.count_nonzero(mine["base_model.model.proj.lora_B.weight"]) == 0  # B starts at 0
    a = mine["base_model.model.proj.lora_A.weight"]
    if init == "gaussian":  # N(0, 1/r): r = 4 -> std 0.25; 64 samples, loose bound
        assert 0.1 < a.std().item() < 0.4
    else:  # kaiming-uniform(a=sqrt 5) on fan_in 16: |A| <= 1/sqrt(16)
        assert a.abs().max().item() <= 1 / math.sqrt(16) + 1e-6


def test_dropout_matches_peft_under_the_same_seed() -> None:
    reference, ours = build_pair(dropout=0.5)
    randomize_(reference)
    nxd_lora.load_peft_state_dict(ours, get_peft_model_state_dict(reference))
    reference.train()
    ours.train()
    ids, image = toy_inputs()
    torch.manual_seed(99)
    ref_out = reference(ids, image)
    torch.manual_seed(99)
    ours_out = ours(ids, image)
    for ref, got in zip(ref_out, ours_out):
        torch.testing.assert_close(got, ref, **EXACT)
    torch.manual_seed(100)  # another mask gives another output: dropout is really applied
    assert not torch.allclose(ours(ids, image)[0], ours_out[0])


def test_rslora_scaling() -> None:
    assert LoraConfig(lora_rank=16, lora_alpha=8).scaling == 8 / 16
    assert LoraConfig(lora_rank=16, lora_alpha=8, use_rslora=True).scaling == 8 / 4
    _, ours = build_pair(use_rslora=True)
    assert ours.module.proj.scaling == pytest.approx(6 / 2)


def test_merge_equals_unmerged_and_unmerge_restores() -> None:
    _, ours = build_pair()
    randomize_(ours)
    ours.eval()
    ids, image = toy_inputs()
    before = [o.detach() for o in ours(ids, image)]
    weights = {n: p.detach().clone() for n, p in ours.module.named_parameters()}
    ours.merge_lora()
    assert all(layer.merged for layer in ours.lora_layers().values())
    merged = ours(ids, image)
    # W + s·BA then one matmul vs two low-rank matmuls: fp32 rounding of the reassociated sum
    for got, want in zip(merged, before):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The merged forward uses only the base: zeroing the adapter changes nothing now.
    with torch.no_grad():
        ours.module.proj.lora_B.weight.zero_()
    torch.testing.assert_close(ours(ids, image)[0], merged[0], rtol=0, atol=0)
    with torch.no_grad():
        ours.module.proj.lora_B.weight.copy_(weights["proj.lora_B.weight"])
    ours.unmerge_lora()
    for name, param in ours.module.named_parameters():  # W + ΔW - ΔW: a few ulps
        torch.testing.assert_close(param, weights[name], rtol=1e-6, atol=1e-6, msg=name)
    for got, want in zip(ours(ids, image), before):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize(
    ("bias", "modules_to_save", "trainable"),
    [
        ("none", None, set()),
        ("lora_only", None, {"proj.base_layer.bias", "conv.base_layer.bias"}),
        ("all", None, {"proj.base_layer.bias", "conv.base_layer.bias", "head.bias"}),
        ("none", ["head"], {"head.weight", "head.bias"}),
    ],
)
def test_only_adapters_and_selected_extras_train(
    bias: str, modules_to_save: list[str] | None, trainable: set[str]
) -> None:
    _, ours = build_pair(bias=bias, modules_to_save=modules_to_save)
    requires_grad = {n for n, p in ours.module.named_parameters() if p.requires_grad}
    adapters = {n for n in requires_grad if ".lora_" in n}
    assert adapters == {
        "emb.lora_embedding_A",
        "emb.lora_embedding_B",
        "proj.lora_A.weight",
        "proj.lora_B.weight",
        "conv.lora_A.weight",
        "conv.lora_B.weight",
    }
    assert requires_grad - adapters == trainable
    count, total = ours.get_nb_trainable_parameters()
    assert count == sum(p.numel() for n, p in ours.module.named_parameters() if n in requires_grad)
    assert total == sum(p.numel() for p in ours.module.parameters())


def test_target_matching_follows_nxd_and_peft() -> None:
    """An entry selects the module of that name or ending in ".<entry>" (not a substring); a
    string is a regular expression over the whole name. PEFT selects the same modules."""
    model = nn.Sequential()
    model.add_module("attn_q_proj", nn.Linear(4, 4))
    model.add_module("q_proj", nn.Linear(4, 4))
    model.add_module("mlp", nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    by_list = LoRAModel(copy.deepcopy(model), LoraConfig(lora_rank=2, target_modules=["q_proj"]))
    assert by_list.lora_module_names == ["q_proj"]  # not attn_q_proj
    by_suffix = LoRAModel(copy.deepcopy(model), LoraConfig(lora_rank=2, target_modules=["0"]))
    assert by_suffix.lora_module_names == ["mlp.0"]
    regex = LoraConfig(lora_rank=2, target_modules=r".*q_proj")
    assert LoRAModel(copy.deepcopy(model), regex).lora_module_names == ["attn_q_proj", "q_proj"]
    for targets in (["q_proj", "0"], r".*q_proj"):
        theirs = peft.get_peft_model(
            copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=targets)
        )
        mine = LoRAModel(copy.deepcopy(model), LoraConfig(lora_rank=2, target_modules=targets))
        peft_selected = sorted(
            name.removeprefix("base_model.model.")
            for name, module in theirs.named_modules()
            if name.endswith(("q_proj", "0")) and hasattr(module, "lora_A")
        )
        assert sorted(mine.lora_module_names) == peft_selected
    with pytest.raises(ValueError, match="does not compile"):
        LoraConfig(target_modules="(unclosed")


def test_bad_targets_and_unsupported_layers_raise() -> None:
    with pytest.raises(ValueError, match=r"target_modules \['nope'\] matched no module"):
        LoRAModel(Toy(), LoraConfig(lora_rank=2, target_modules=["nope"]))
    with pytest.raises(ValueError, match="model type None has no default"):
        LoRAModel(Toy(), LoraConfig(lora_rank=2))
    conv = nn.Sequential(nn.Conv2d(2, 2, 3, groups=2))
    with pytest.raises(ValueError, match=r"groups=1 and dilation"):
        LoRAModel(conv, LoraConfig(lora_rank=2, target_modules=["0"]))
    with pytest.raises(TypeError, match=r"must be a nxd_lora\.LoraConfig"):
        LoRAModel(Toy(), {"lora_rank": 2})  # type: ignore[arg-type]


def test_lora_layers_refuses_a_replaced_lora_module() -> None:
    """A LoRA layer swapped out after injection is named, not handed back as a LoRA layer."""
    model = LoRAModel(nn.Sequential(nn.Linear(4, 4)), LoraConfig(lora_rank=2, target_modules=["0"]))
    assert list(model.lora_layers()) == ["0"]
    model.module.set_submodule("0", nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"module '0' is a Linear, no longer LoRA"):
        model.lora_layers()
