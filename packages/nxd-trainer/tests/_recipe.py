"""The training recipe every parity test shares: data, optimizer, reference run, the sample.

Not a test module (no ``test_`` prefix); test files load it by path (``load_sibling``) because
the rank processes find functions by file, and pytest's importlib mode does not put this
directory on ``sys.path``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 64
MAX_GRAD_NORM = 0.5
# eps 1e-4: an exactly-zero gradient in exact arithmetic (the key projection's bias: softmax
# ignores a per-query constant) is pure round-off here, different in every parallel layout;
# with torch's default eps=1e-8 Adam would turn that noise into full-size lr steps.
ADAMW = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}
# fp32 throughout. TP splits matmul sums, PP and DP average micro-batch means instead of one
# mean, ZeRO-1 reduces in another order: re-association round-off only (~1e-7 relative),
# amplified by 3 AdamW steps whose update normalises by sqrt(v) (an ulp in a tiny gradient
# can move a weight by ~lr * 1e-4). A wrong reduction (a missing or doubled DP average, a
# gradient not summed over TP) changes losses in the 2nd decimal and weights by ~lr.
TOL = {"rtol": 1e-4, "atol": 1e-5}
GOLDEN = Path(__file__).parent / "assets" / "losses"


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def get_model(**kwargs: Any) -> torch.nn.Module:
    """NxD's ``get_model``: a TinyLM with deterministic weights (any TP degree)."""
    from nxd_trainer.testing import TinyLM, deterministic_init

    model = TinyLM(vocab=VOCAB, **kwargs)
    for module in model.modules():
        deterministic_init(module)
    return model


def reference_run(steps: int = STEPS, **model_kwargs: Any) -> dict[str, Any]:
    """The same recipe in one process: plain layers, torch's AdamW and clip_grad_norm_."""
    model = get_model(**model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for ids in batches()[:steps]:
        loss = model(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def local_shards(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """This rank's parameters with their TP partition dim (None: not sharded)."""
    return {
        name: (
            p.detach().clone(),
            p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
        )
        for name, p in model.named_parameters()
    }


def check_params(results: list[dict[str, Any]], expected: dict[str, torch.Tensor]) -> None:
    """Every rank's shards equal the reference's slices; every reference parameter is held."""
    covered = set()
    for result in results:
        for name, (value, dim) in result["shards"].items():
            full = expected[name]
            if dim is not None:
                full = full.chunk(result["tp"], dim=dim)[result["tp_rank"]]
            torch.testing.assert_close(value, full, **TOL, msg=lambda m, n=name: f"{n}: {m}")
            covered.add(name)
    assert covered == set(expected), f"never checked: {set(expected) - covered}"


def golden_losses(name: str) -> list[float]:
    return json.loads((GOLDEN / f"{name}.json").read_text())["losses"]
