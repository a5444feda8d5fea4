"""The ``config.json`` and ``generation_config.json`` of a Hugging Face export.

An export is for inference, so ``use_cache`` is true (training turns it off). ``generate()``
stops at the generation config's ``eos_token_id``: it must be the tokenizer's end-of-text
token. So the special token ids written are, for each of bos/eos/pad:

* the caller's ``token_ids`` when given (their word, written as is);
* else the config's; a tokenizer given with the export that names another id for the same
  token is an error naming both ids (unless the config itself was passed explicitly: the
  caller's word again). A config without an id takes the tokenizer's.

``generation_config.json`` holds those ids, as ``transformers``' ``GenerationConfig.
from_model_config`` would derive them from ``config.json`` (transformers is not imported).
A tokenizer is an object with ``bos_token_id`` … attributes, or a folder whose
``tokenizer_config.json`` names the tokens, resolved to ids through its added tokens or
``tokenizer.json``'s vocabulary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

__all__ = ["TOKEN_KEYS", "export_configs", "tokenizer_ids"]

logger = logging.getLogger(__name__)

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _content(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _folder_ids(folder: Path) -> dict[str, tuple[str, int | None]]:
    """{key: (token, id)} from a tokenizer folder's files (id None: not resolved)."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    special_path = folder / "special_tokens_map.json"
    if special_path.is_file():
        config = {**json.loads(special_path.read_text()), **config}
    vocab: dict[str, int] = {}
    tokenizer_path = folder / "tokenizer.json"
    if tokenizer_path.is_file():
        data = json.loads(tokenizer_path.read_text())
        model_vocab = (data.get("model") or {}).get("vocab")
        if isinstance(model_vocab, dict):
            vocab.update(model_vocab)
        for added in data.get("added_tokens") or []:
            vocab[added["content"]] = int(added["id"])
    for number, added in (config.get("added_tokens_decoder") or {}).items():
        if _content(added) is not None:
            vocab[_content(added)] = int(number)  # type: ignore[index]
    out = {}
    for key in TOKEN_KEYS:
        token = _content(config.get(key.removesuffix("_id")))
        if token is not None:
            out[key] = (token, vocab.get(token))
    return out


def tokenizer_ids(tokenizer: Any) -> dict[str, tuple[str, int]]:
    """{key: (token, id)} of the tokenizer's bos/eos/pad tokens that it defines."""
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, (str, Path)):
        found = _folder_ids(Path(tokenizer))
        unresolved = {k: t for k, (t, i) in found.items() if i is None}
        if unresolved:
            logger.warning(
                "tokenizer folder %s: could not resolve the ids of %s; the export's ids for "
                "them are not checked against the tokenizer",
                tokenizer,
                unresolved,
            )
        return {k: (t, i) for k, (t, i) in found.items() if i is not None}
    out = {}
    for key in TOKEN_KEYS:
        number = getattr(tokenizer, key, None)
        if isinstance(number, int) and not isinstance(number, bool):
            token = getattr(tokenizer, key.removesuffix("_id"), None)
            out[key] = (str(token), number)
    return out


def _agrees(configured: Any, number: int) -> bool:
    if isinstance(configured, list):  # several EOS ids (Llama 3): the tokenizer's among them
        return number in configured
    return configured == number


def export_configs(
    config: dict[str, Any],
    *,
    tokenizer: Any,
    token_ids: dict[str, Any] | None,
    explicit_config: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) of an export (see the module docstring)."""
    out = dict(config)
    out["use_cache"] = True
    if token_ids is not None:
        unknown = sorted(set(token_ids) - set(TOKEN_KEYS))
        if unknown:
            raise ValueError(f"token_ids keys must be among {TOKEN_KEYS}, got {unknown}")
        out.update(token_ids)
    else:
        for key, (token, number) in tokenizer_ids(tokenizer).items():
            configured = out.get(key)
            if configured is None:
                out[key] = number
            elif not explicit_config and not _agrees(configured, number):
                raise ValueError(
                    f"the model config's {key} is {configured} but the tokenizer's "
                    f"{key.removesuffix('_id')} {token!r} is id {number}: generate() from this "
                    f"export would not stop where the tokenizer ends text; build the model "
                    f"config with the tokenizer's ids, or pass config= or token_ids= "
                    f"(e.g. {{{key!r}: {number}}}) explicitly"
                )
    generation = {key: out[key] for key in TOKEN_KEYS if out.get(key) is not None}
    return out, generation
