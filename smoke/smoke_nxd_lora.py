"""nxd-lora installed alone: LoRA on an nn.Linear (only the adapter trains, the output starts
as the base's), saved as a PEFT adapter (safetensors, which needs numpy) and loaded back."""

import copy
import sys
import tempfile

import torch

import nxd_lora
from nxd_lora import LoraConfig, LoRAModel


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.o_proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(x)))


def main() -> None:
    torch.manual_seed(0)
    base = Attention()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = base(x).detach()
    config = LoraConfig(enable_lora=True, lora_rank=4, lora_alpha=8, target_modules=["q_proj"])
    model = LoRAModel(copy.deepcopy(base), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable, "nothing trains"
    assert all("lora_" in n for n in trainable), trainable
    # B starts at zero, so the LoRA term is exactly 0 and the output is the base's
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(x).square().mean().backward()
    optimizer.step()
    tuned = model(x).detach()
    assert not torch.equal(tuned, expected)

    with tempfile.TemporaryDirectory() as folder:
        nxd_lora.save_peft_adapter(model, folder)
        again = LoRAModel(copy.deepcopy(base), config)
        nxd_lora.load_peft_adapter(again, folder)
    torch.testing.assert_close(again(x), tuned, rtol=0, atol=0)
    print("nxd-lora smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
