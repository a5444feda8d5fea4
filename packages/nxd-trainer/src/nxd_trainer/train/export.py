"""Export a run to a Hugging Face folder and generate a sample from that folder.

``export_run(run_dir)`` assembles the newest complete checkpoint (any TP/PP degrees it was
saved at) into ``<run>/hf``: ``config.json``, ``model.safetensors`` and the run's tokenizer,
which ``transformers.AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer`` load. The
sample printed at the end of training is generated from that folder, so it shows what a user
of the export gets.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nxd_trainer.train.config import ConfigError

__all__ = ["export_run", "generate_sample"]


def export_run(
    run_dir: str | Path, out_dir: str | Path | None = None, tag: str | None = None
) -> Path:
    """Write the HF folder of ``run_dir``'s newest (or ``tag``) checkpoint; returns it."""
    from nxd_trainer.hf import export_hf
    from nxd_trainer.train.data import load_tokenizer
    from nxd_trainer.train.loop import CHECKPOINT_DIR, newest_tag

    run = Path(run_dir)
    ckpt = run / CHECKPOINT_DIR
    if not run.is_dir():
        raise ConfigError(f"run folder {str(run)!r} does not exist")
    tag = tag or newest_tag(ckpt)
    if tag is None or not (ckpt / tag / "done").is_file():
        raise ConfigError(f"no complete checkpoint in {ckpt}" + (f" named {tag!r}" if tag else ""))
    source = ckpt / tag
    import nxd_ckpt

    if nxd_ckpt.read_index(source).lora is not None:
        source = run / "export_checkpoint"  # the merged model the worker wrote at the end
        if not (source / "done").is_file():
            raise ConfigError(f"{run} is a LoRA run without a merged export checkpoint")
    tokenizer = load_tokenizer(run / "tokenizer")
    out = Path(out_dir) if out_dir is not None else run / "hf"
    export_hf(
        source, out, tag="" if source.name == "export_checkpoint" else None, tokenizer=tokenizer
    )
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
        out = model.generate(
            ids, max_new_tokens=tokens, do_sample=True, top_k=40, temperature=0.8,
            pad_token_id=tokenizer.eos_token_id, attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    return tokenizer.decode(out[0], skip_special_tokens=False)
