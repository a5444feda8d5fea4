"""Context parallelism through the trainer API: a tiny Hugging Face Llama (GQA, 2 layers)
built by ``initialize_parallel_model`` at ``context_parallel_size`` 2 (ring and all-to-all),
TP2 x CP2 (with sequence parallelism and full activation checkpointing) and CP2 x DP2 with
ZeRO-1, LoRA adapters at CP2 and CP2 x DP2, and a right-padded batch (its attention_mask
against transformers' own masking), one SGD step through
``initialize_parallel_optimizer``, against the unmodified model (with the same adapters) in one
process.

``NxDModel.run_train`` gets the whole sequences and splits them itself. Some labels are
``-100`` (ignored), unevenly over the CP ranks: the loss averaged over CP must still be the
token-weighted mean over the whole sequence (a mean of per-rank means would differ at 1e-2).
Compared on every rank: the loss averaged over DP x CP and every parameter's update under
SGD(lr=1), which is minus the gradient averaged over DP x CP (TP shards gathered).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from nxd_state.testing import load_sibling, run_distributed

H = load_sibling(__file__, "_hf")
SEQ, BATCH = 16, 2  # SEQ divisible by 2 x CP (zigzag) and by TP under sequence parallelism
# fp32: CP splits the attention's softmax sums (ring: merged block by block with log-sum-exp)
# and the loss sum over ranks, TP the matmul sums: re-association round-off of ~1e-7 relative
# per op, a few 1e-7 on O(1) values after two layers. 1e-5 is ~30x that margin and far below
# a wrong split, mask, position or reduction (O(1e-2) or more; the uneven ignored labels move
# a mean of per-rank means by ~5e-2).
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _data(padded: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Ids, labels and (``padded``) an attention_mask: row 1 right-padded from position 11,
    its labels there ignored, as a padding collator writes them."""
    ids = torch.randint(0, H.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 1:7] = -100  # ignored targets at positions 0..5 of row 0: CP rank 0's first chunk
    if not padded:
        return ids, labels, None
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 11:] = 0
    labels[1, 11:] = -100
    return ids, labels, mask


LORA = {
    "enable_lora": True,
    "lora_rank": 4,
    "lora_alpha": 8.0,
    "target_modules": ["q_proj", "v_proj", "o_proj"],
}


def _model() -> torch.nn.Module:
    model = H.model("llama")
    model.config.use_cache = False
    return model


def _fill_adapters(model: torch.nn.Module) -> None:
    """Deterministic adapter weights (B non-zero too, so A gets a gradient), keyed by module
    name: the same in the one-process and the CP model."""
    from nxd_trainer.testing import deterministic_init

    for name, module in model.named_modules():
        if ".lora_" in name:
            module.init_key = 1000 + 7 * len(name) + sum(map(ord, name))
            deterministic_init(module)


def _reference(dp: int, lora: bool, padded: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean over DP replicas of each replica's loss (token mean), and its gradients
    (``padded``: under the attention_mask, as transformers masks it)."""
    model = _model()
    if lora:
        from nxd_lora import LoraConfig, LoRAModel

        model = LoRAModel(model, LoraConfig(**LORA))
        _fill_adapters(model)
    ids, labels, mask = _data(padded)
    per = BATCH // dp
    loss = (
        sum(
            model(
                input_ids=ids[r * per : (r + 1) * per],
                labels=labels[r * per : (r + 1) * per],
                **({} if mask is None else {"attention_mask": mask[r * per : (r + 1) * per]}),
            ).loss
            for r in range(dp)
        )
        / dp
    )
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def step(tp: int, cp: int, algorithm: str, extra: dict[str, Any]) -> list[str]:
    import nxd_state
    import nxd_trainer as nxd

    zero1 = extra.pop("zero1", False)
    lora = extra.pop("lora", False)
    padded = extra.pop("padded", False)
    if lora:
        from nxd_lora import LoraConfig

        extra["lora_config"] = LoraConfig(**LORA)
    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        context_parallel_algorithm=algorithm,
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": False},
        **extra,
    )
    model = nxd.initialize_parallel_model(cfg, _model)
    if lora:
        _fill_adapters(model.local_module())
    optimizer = nxd.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=1.0)
    state = nxd_state.get_parallel_state()
    dp, dp_rank = state.data_parallel_size, state.data_parallel_rank
    ref_loss, ref_grads = _reference(dp, lora, padded)
    ids, labels, mask = _data(padded)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masked = {} if mask is None else {"attention_mask": mask[rows]}
    loss = model.run_train(input_ids=ids[rows], labels=labels[rows], **masked)
    optimizer.step()
    mean = loss.clone()
    dist.all_reduce(mean, group=state.data_context_parallel_group)
    mean /= state.data_context_parallel_size
    bad = []
    checks = [("loss", mean, ref_loss)]
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if trained != set(ref_grads):
        bad.append(f"trainable parameters differ: {sorted(trained ^ set(ref_grads))}")
    for name, param in model.named_parameters():
        update = H.full(param, before[name] - param.detach(), name, model.config)
        if name in trained:
            checks.append((f"grad {name}", update, ref_grads.get(name, torch.zeros(()))))
        else:  # frozen (the base weights under LoRA): not moved at all
            checks.append((f"frozen {name}", update, torch.zeros_like(update)))
    return bad + H.mismatches(checks, **TOL)


CASES = {
    "cp2-ring": (2, 1, 2, "ring", {}),
    "cp2-all-to-all": (2, 1, 2, "all_to_all", {}),
    "tp2xcp2-sp-checkpointing-ring": (
        4, 2, 2, "ring", {"sequence_parallel": True, "activation_checkpoint_config": "full"}
    ),
    "cp2xdp2-zero1-all-to-all": (4, 1, 2, "all_to_all", {"zero1": True}),
    "cp2-lora-ring": (2, 1, 2, "ring", {"lora": True}),
    "cp2-right-padding-all-to-all": (2, 1, 2, "all_to_all", {"padded": True}),
    "cp2xdp2-lora-all-to-all": (4, 1, 2, "all_to_all", {"lora": True}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_llama_matches_one_process(case: str) -> None:
    world, tp, cp, algorithm, extra = CASES[case]
    for rank, bad in enumerate(run_distributed(step, world, tp, cp, algorithm, dict(extra))):
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


def refusals() -> dict[str, str]:
    """What a CP=2 model refuses, before any collective of the step."""
    import nxd_trainer as nxd

    out = {}
    ring = nxd.neuronx_distributed_config(context_parallel_size=2)
    model = nxd.initialize_parallel_model(ring, _model)
    ids = torch.zeros(BATCH, 10, dtype=torch.long)
    full = torch.zeros(BATCH, SEQ, dtype=torch.long)
    padded = torch.ones(BATCH, SEQ, dtype=torch.long)
    padded[0, 0] = 0
    right = torch.ones(BATCH, SEQ, dtype=torch.long)
    right[1, 12:] = 0
    attempts = {
        "seq": lambda: model.run_train(input_ids=ids, labels=ids),
        "mask": lambda: model.run_train(input_ids=full, labels=full, attention_mask=padded),
        "counted": lambda: model.run_train(input_ids=full, labels=full, attention_mask=right),
        "no-labels": lambda: model.run_train(input_ids=full, attention_mask=right),
        "unknown": lambda: model.run_train(input_ids=full, token_type_ids=padded),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    atoa = nxd.neuronx_distributed_config(
        context_parallel_size=2, context_parallel_algorithm="all_to_all"
    )
    try:  # 6 query heads split over CP=2, 3 K/V heads do not
        nxd.initialize_parallel_model(
            atoa, lambda: H.model("llama", heads=6, kv_heads=3, hidden=24)
        )
        out["heads"] = "no error"
    except ValueError as error:
        out["heads"] = str(error)
    return out


def test_context_parallel_refusals() -> None:
    for out in run_distributed(refusals, 2):
        assert (
            "sequence length 10 is not divisible by 2 x context_parallel_size(2) = 4"
            in (out["seq"])
        )
        assert "right padding only" in out["mask"]
        assert "left padding" in out["mask"]
        assert "padded positions predict a counted target" in out["counted"]
        assert "needs the labels" in out["no-labels"]
        assert "inputs ['token_type_ids'] would not be split" in out["unknown"]
        assert (
            "splits heads over context_parallel_size(2), but the model has 3 key/value "
            in (out["heads"])
        )
