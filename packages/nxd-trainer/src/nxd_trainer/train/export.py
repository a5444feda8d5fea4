"""Export a run to a Hugging Face folder and generate a sample from that folder.

``export_run(run_dir)`` assembles the newest complete checkpoint (any TP/PP degrees it was
saved at) into ``<run>/hf``: ``config.json`` (the tokenizer's BOS/EOS/padding ids),
``generation_config.json``, ``model.safetensors`` and the run's tokenizer, which
``transformers.AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer`` load. The folder is
written next to its place and renamed into it, so an interrupted export leaves the previous
one whole. The sample printed at the end of training is generated from that folder with the
run's seed, so it shows what a user of the export gets.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nxd_trainer.train.config import ConfigError, default_of, load_toml

__all__ = ["export_run", "generate_sample", "run_settings"]

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def run_settings(run_dir: str | Path) -> dict[str, Any]:
    """The sample settings of a run (its ``config.toml``; the defaults for a run without one):
    ``seed``, ``prompt``, ``sample_tokens``."""
    keys = ("seed", "prompt", "sample_tokens")
    path = Path(run_dir) / "config.toml"
    saved = load_toml(path) if path.is_file() else {}
    return {k: saved.get(k, default_of(k)) for k in keys}


def export_run(
    run_dir: str | Path, out_dir: str | Path | None = None, tag: str | None = None
) -> Path:
    """Write the HF folder of ``run_dir``'s newest (or ``tag``) checkpoint; returns it."""
    from nxd_trainer.hf import export_hf
    from nxd_trainer.train.data import load_tokenizer
    from nxd_trainer.train.rundir import RunDir, replace_dir

    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"run folder {str(run)!r} does not exist")
    tags = RunDir(run).complete_tags()
    ckpt = run / "checkpoints"
    if tag is None:
        tag = tags[-1] if tags else None
    elif tag not in tags:
        raise ConfigError(f"{tag!r} is not a complete checkpoint of {run}; complete: {tags}")
    if tag is None:
        raise ConfigError(f"no complete checkpoint in {ckpt}")
    source = ckpt / tag
    import nxd_ckpt

    if nxd_ckpt.read_index(source).lora is not None:
        source = run / "export_checkpoint"  # the merged model the worker wrote at the end
        if not (source / "done").is_file():
            raise ConfigError(f"{run} is a LoRA run without a merged export checkpoint")
    tokenizer = load_tokenizer(run / "tokenizer")
    out = Path(out_dir) if out_dir is not None else run / "hf"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        # The run's tokenizer defines what the model learned between documents: its ids are
        # the export's (runs saved before the model config carried them had Llama's 1 / 2).
        ids = {key: getattr(tokenizer, key) for key in _TOKEN_IDS}
        export_hf(
            source, tmp, tag="" if source.name == "export_checkpoint" else None,
            tokenizer=tokenizer, token_ids={k: v for k, v in ids.items() if v is not None},
        )  # fmt: skip
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def generate_sample(hf_dir: str | Path, prompt: str, tokens: int, seed: int) -> str:
    """``tokens`` new tokens after ``prompt`` from the exported folder (top-k 40 sampling,
    temperature 0.8, seeded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(  # type: ignore[misc]  # transformers types the auto class' self apart
            ids, max_new_tokens=tokens, do_sample=True, top_k=40, temperature=0.8,
            pad_token_id=tokenizer.eos_token_id, attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    text = tokenizer.decode(out[0], skip_special_tokens=False)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return text
