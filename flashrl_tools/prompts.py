"""Prompt sets: the built-in math/code/chat prompts (data/prompts.jsonl) or a user file. Used by
`verify`, `tune` and the runtime's FP8 KV-cache calibration."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from flashrl_tools.errors import FlashRLError


def load_prompts(path: Path | None = None) -> list[str]:
    """JSONL lines with a "prompt" field, or plain text (one prompt per line)."""
    if path is None:
        text = resources.files("flashrl_tools").joinpath("data/prompts.jsonl").read_text()
        where = "built-in prompts"
    else:
        if not Path(path).is_file():
            raise FlashRLError("prompts file not found", str(path), "give a JSONL or text file")
        text, where = Path(path).read_text(), str(path)
    prompts = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise FlashRLError(f"line {i} is not a JSON object with a \"prompt\" field", where,
                                   'write {"prompt": "..."} per line, or plain text lines') from None
        else:
            prompt = line
        prompts.append(str(prompt))
    if not prompts:
        raise FlashRLError("no prompts", where, "add at least one prompt")
    return prompts


def tokenize(prompts: list[str], model_dir: Path) -> list[list[int]]:
    """Token ids of each prompt as a single-turn chat (the model's chat template) when the
    tokenizer has one, else the plain text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if getattr(tok, "chat_template", None):
        return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)) for p in prompts]
    return [tok(p)["input_ids"] for p in prompts]
