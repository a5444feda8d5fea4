"""A LoRA adapter trained at TP=2 on a tiny Hugging Face Llama, gathered into a PEFT adapter,
loads with ``peft.PeftModel.from_pretrained`` on the unsharded model and gives the same logits;
and loads back into a TP=2 model through ``load_lora_from_ckpt``.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from torch import nn
from transformers import LlamaForCausalLM

import nxd_lora
import nxd_state
from nxd_layers import ColumnParallelLinear, RowParallelLinear, shard_for_rank
from nxd_lora import LoraConfig, LoRAModel
from nxd_state.testing import run_distributed

# TP=2 splits every projection's reduction in two partial sums: fp32 reassociation through two
# layers of O(1) activations, far below 1e-5 (logits are O(1)).
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def tensor_parallel_llama(path: str, rank: int, tp: int) -> LlamaForCausalLM:
    """The Hugging Face model with its projections swapped for nxd's parallel layers
    (attention heads and MLP columns split over TP; the reshapes in HF's attention use -1
    for the head count, so local heads just work)."""
    model = LlamaForCausalLM.from_pretrained(path).eval()
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in COLUMN + ROW:
            continue
        assert isinstance(module, nn.Linear)
        if leaf in COLUMN:
            layer = ColumnParallelLinear(
                module.in_features, module.out_features, bias=False, gather_output=False
            )
            weight = shard_for_rank(module.weight.detach(), 0, rank, tp)
        else:
            layer = RowParallelLinear(
                module.in_features, module.out_features, bias=False, input_is_parallel=True
            )
            weight = shard_for_rank(module.weight.detach(), 1, rank, tp)
        with torch.no_grad():
            layer.weight.copy_(weight)
        model.set_submodule(name, layer)
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))


def train_gather_and_reload(base_path: str, save_dir: str) -> dict[str, torch.Tensor]:
    state = nxd_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, tp = state.tensor_parallel_rank, 2
    torch.manual_seed(0)  # the same adapter init on every rank (A drawn full, then sliced)
    model = LoRAModel(
        tensor_parallel_llama(base_path, rank, tp),
        LoraConfig(enable_lora=True, lora_rank=4, lora_alpha=8, target_modules=TARGETS),
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = batch()
    for _ in range(2):  # two steps: B leaves zero, then A and B both move
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    nxd_lora.save_lora(model, save_dir, tag="step2")
    torch.distributed.barrier()  # rank 0 has written the files
    reloaded = LoRAModel(
        tensor_parallel_llama(base_path, rank, tp),
        LoraConfig(load_lora_from_ckpt=True, lora_save_dir=save_dir, lora_load_tag="step2"),
    ).eval()
    with torch.no_grad():
        again = reloaded(input_ids=ids).logits
    return {"trained": trained, "reloaded": again}


def test_tp2_adapter_gathers_into_a_peft_adapter(tmp_path: Path, tiny_llama_dir: Path) -> None:
    base = tiny_llama_dir
    results = run_distributed(train_gather_and_reload, 2, str(base), str(tmp_path / "lora"))
    trained = results[0]["trained"]
    torch.testing.assert_close(results[1]["trained"], trained, rtol=0, atol=0)  # replicated
    for result in results:  # the checkpoint reloads into TP=2 exactly
        torch.testing.assert_close(result["reloaded"], trained, rtol=0, atol=0)

    plain = LlamaForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        untrained = plain(input_ids=batch()).logits
    assert (trained - untrained).abs().max() > 1e-3  # training moved the adapter
    theirs = peft.PeftModel.from_pretrained(plain, tmp_path / "lora" / "step2").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=batch()).logits, trained, **LOGITS_TOL)
