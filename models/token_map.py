"""Frequency-ranked draft vocabularies (FR-Spec; SGLang's `--speculative-token-map` files): the draft scores only
the K most frequent target tokens, so its lm_head reads K rows instead of the whole vocabulary and its top-k runs
over K logits. Verification is unchanged, so outputs stay the target's; tokens outside the map are never drafted.

usage: dspark-serve token-map --target DIR --data FILE [FILE ...] [--size 32768] --out FILE.pt
  FILE: train-draft's prompts.jsonl (the target's own responses: `response_ids`, the best source), jsonl with
  `prompt` texts, or plain text. The map is a 1-D int32 tensor of token ids, most frequent first (as FR-Spec's).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .config import CheckpointError, read_json
from .dspark import DSparkDraft
from .nvfp4_linear import NVFP4Linear


def load_token_map(path: str | Path, vocab_size: int) -> Tensor:
    """A token map file (.pt: a 1-D integer tensor; .json: a list of ints) -> the sorted unique ids [K] int64."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"token map {path}: file not found")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"token map {path}: not valid JSON ({e})") from e
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise CheckpointError(f"token map {path}: expected a JSON list of token ids")
        ids = torch.tensor(raw, dtype=torch.int64)
    else:
        try:
            ids = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets one clear message
            raise CheckpointError(f"token map {path}: not a torch tensor file ({e})") from e
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise CheckpointError(f"token map {path}: expected a 1-D integer tensor of token ids")
        ids = ids.to(torch.int64)
    if ids.numel() == 0:
        raise CheckpointError(f"token map {path}: no token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise CheckpointError(f"token map {path}: ids must be in [0, {vocab_size}), got {bad[:5].tolist()}")
    unique = ids.unique()  # sorted
    if unique.numel() != ids.numel():
        raise CheckpointError(f"token map {path}: {ids.numel() - unique.numel()} duplicate ids")
    return unique


def restrict_draft_vocab(model: DSparkDraft, ids: Tensor, target_vocab: int) -> None:
    """Make the draft score only the target tokens `ids` [K] (sorted, unique): its lm_head and Markov W2 keep those
    rows (new modules: a lm_head shared with the target stays whole there) and d2t maps draft ids back."""
    cfg = model.config
    if cfg.draft_vocab_size == ids.numel() and torch.equal(model.d2t.cpu() + torch.arange(ids.numel()), ids):
        return  # restricted to these ids already (a second engine on the same draft)
    if cfg.draft_vocab_size != target_vocab or bool(model.d2t.any()):
        raise CheckpointError(f"a token map needs a draft over the target's whole vocabulary ({target_vocab}); this "
                              f"draft has its own reduced vocabulary of {cfg.draft_vocab_size}")
    model.lm_head = _rows(model.lm_head, ids)
    if model.markov_head is not None:
        model.markov_head.markov_w2 = _rows(model.markov_head.markov_w2, ids)
    model.d2t = (ids - torch.arange(ids.numel())).to(model.d2t.device)
    model.config = replace(cfg, draft_vocab_size=ids.numel())


def _rows(layer: nn.Module, ids: Tensor) -> nn.Module:
    """A copy of a bias-free Linear or NVFP4Linear with only output rows `ids`."""
    if isinstance(layer, NVFP4Linear) and layer.bias is None:
        i = ids.to(layer.weight.device)
        return NVFP4Linear.from_tensors(layer.weight[i], layer.weight_scale[i], layer.weight_scale_2)
    if type(layer) is nn.Linear and layer.bias is None:
        out = nn.Linear(layer.in_features, ids.numel(), bias=False, device=layer.weight.device,
                        dtype=layer.weight.dtype)
        out.weight.data.copy_(layer.weight.data[ids.to(layer.weight.device)])
        return out.requires_grad_(layer.weight.requires_grad)
    raise CheckpointError(f"a token map cannot restrict a {type(layer).__name__} (bias-free Linear or NVFP4 only)")


def count_tokens(files: list[Path], tokenizer: Callable[[], Any] | None = None) -> Counter:
    """Token counts: `response_ids` rows of train-draft's prompts.jsonl as they are; `prompt` texts of other jsonl
    files and plain-text files (blank-line separated) through the tokenizer `tokenizer()` returns."""
    counts: Counter = Counter()
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        texts: list[str] = []
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("response_ids"), list):
                    counts.update(row["response_ids"])
                elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
                    texts.append(row["prompt"])
                else:
                    raise ValueError(f"{path}:{n}: expected 'response_ids' (train-draft) or a 'prompt' text")
        else:
            texts = [t for t in path.read_text().split("\n\n") if t.strip()]
        if texts:
            if tokenizer is None:
                raise ValueError(f"{path}: text needs a tokenizer (--target with tokenizer.json)")
            counts.update(t for enc in tokenizer().encode_batch(texts) for t in enc.ids)
    return counts


def rank_tokens(counts: Counter, vocab_size: int, size: int) -> Tensor:
    """The `size` most counted ids in [0, vocab_size), most frequent first; ties (unseen ones too) by lower id
    (earlier BPE merges, the more common tokens)."""
    order = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(order[:size], dtype=torch.int64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dspark-serve token-map", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target directory (config.json; tokenizer.json for text data)")
    ap.add_argument("--data", nargs="+", required=True, type=Path)
    ap.add_argument("--size", type=int, default=32768, help="tokens in the map (default 32768)")
    ap.add_argument("--out", required=True, type=Path, help="the map, a .pt file (or .json)")
    args = ap.parse_args(argv)
    try:
        vocab = read_json(Path(args.target) / "config.json").get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"{args.target}/config.json: no vocab_size")
        if not 0 < args.size <= vocab:
            raise ValueError(f"--size must be in [1, {vocab}], got {args.size}")
        from .tokenizer import load_tokenizer
        counts = count_tokens(args.data, lambda: load_tokenizer(args.target))
    except (ValueError, FileNotFoundError) as e:
        print(f"dspark-serve token-map: error: {e}", file=sys.stderr)
        return 2
    ids = rank_tokens(counts, vocab, args.size)
    total = sum(counts.values())
    covered = sum(counts.get(t, 0) for t in ids.tolist())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".json":
        args.out.write_text(json.dumps(ids.tolist()))
    else:
        torch.save(ids.to(torch.int32), args.out)
    print(f"{args.out}: {args.size} of {vocab} tokens; {len(counts)} distinct in {total} counted tokens, "
          f"{100 * covered / max(total, 1):.2f} % of them in the map")
    return 0


if __name__ == "__main__":
    sys.exit(main())
