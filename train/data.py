"""The prompt corpus: text (one prompt per paragraph or line), .jsonl with a "prompt" field, or token-id lines."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

FORMATS = ("auto", "text", "jsonl", "ids")
CHAT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def read_prompt_texts(path: str | Path, fmt: str = "auto") -> list[str]:
    """Prompts as strings; text files split on blank lines when they have any, else on lines."""
    path = Path(path)
    fmt = ("jsonl" if path.suffix == ".jsonl" else "text") if fmt == "auto" else fmt
    raw = path.read_text()
    if fmt == "jsonl":
        rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        bad = [i for i, r in enumerate(rows) if not isinstance(r, dict) or not isinstance(r.get("prompt"), str)]
        if bad:
            raise ValueError(f"{path}: line {bad[0] + 1} has no string 'prompt' field")
        return [r["prompt"] for r in rows if r["prompt"].strip()]
    parts = raw.split("\n\n") if "\n\n" in raw.strip() else raw.splitlines()
    return [p.strip() for p in parts if p.strip()]


def read_prompt_ids(path: str | Path) -> list[list[int]]:
    """One prompt per line as integers separated by spaces or commas."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append([int(t) for t in line.replace(",", " ").split()])
            except ValueError:
                raise ValueError(f"{path}:{n}: expected integer token ids, got {line[:60]!r}") from None
    return out


def load_prompts(paths: list[str], tokenizer: Tokenizer | None, fmt: str = "auto", chat: bool = False,
                 max_prompt_len: int = 1024, vocab_size: int | None = None) -> list[list[int]]:
    """Token ids of every prompt of every file (truncated to the last `max_prompt_len` tokens)."""
    if fmt not in FORMATS:
        raise ValueError(f"--data-format must be one of {FORMATS}, got {fmt!r}")
    prompts: list[list[int]] = []
    for path in paths:
        if fmt == "ids":
            prompts += read_prompt_ids(path)
            continue
        if tokenizer is None:
            raise ValueError(f"{path}: text prompts need a tokenizer in the target directory (or --data-format ids)")
        texts = [CHAT_TEMPLATE.format(t) if chat else t for t in read_prompt_texts(path, fmt)]
        prompts += [e.ids for e in tokenizer.encode_batch(texts)]
    prompts = [p[-max_prompt_len:] for p in prompts if p]
    if vocab_size is not None:
        bad = [t for p in prompts for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
    if not prompts:
        raise ValueError(f"no prompts in {paths}")
    return prompts
