"""The target's side of training: regenerate responses with the engine, then capture features for the draft."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from dspark_serve.engine.kv_cache import batch_metadata
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.qwen import QwenForCausalLM

from .anchors import Packed

KV_BLOCK = 16


def regenerate(target: QwenForCausalLM, prompts: list[list[int]], response_len: int, temperature: float = 0.0,
               eos_token_ids: tuple[int, ...] = (), seed: int = 0, max_num_seqs: int = 64,
               max_minutes: float | None = None, enforce_eager: bool | None = None) -> list[list[int]]:
    """The target's own responses (greedy at temperature 0), batched through the plain engine. With
    `max_minutes`, prompts go in rounds of 8 batches and no new round starts past the deadline (the first always
    runs): the result then covers only a prefix of `prompts`."""
    longest = max(len(p) for p in prompts) + response_len
    blocks = max_num_seqs * -(-longest // KV_BLOCK) + 8
    llm = LLM(target, None, device=str(target.lm_head.weight.device), num_kv_blocks=blocks,
              max_num_seqs=max_num_seqs, max_model_len=longest, eos_token_ids=eos_token_ids,
              enforce_eager=enforce_eager or None)
    params = [SamplingParams(temperature=temperature, max_tokens=response_len, seed=seed + i)
              for i in range(len(prompts))]
    t0, every, out = time.perf_counter(), max(1, len(prompts) // 20), []
    rnd = len(prompts) if max_minutes is None else 8 * max_num_seqs

    def report(done: int, _total: int) -> None:
        done += len(out)
        if done % every == 0 or done == len(prompts):
            print(f"regenerate: {done}/{len(prompts)} responses, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for i in range(0, len(prompts), rnd):
        if out and max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
            print(f"regenerate: --max-regen-minutes {max_minutes} reached; keeping {len(out)} responses",
                  file=sys.stderr)
            break
        out += [list(o.token_ids) for o in llm.generate(prompts[i:i + rnd], params[i:i + rnd], progress=report)]
    return out


def write_prompts(path: Path, prompts: list[list[int]], responses: list[list[int]]) -> None:
    """prompts.jsonl: the training prompts and the target's regenerated responses, as token ids."""
    with open(path, "w") as f:
        for p, r in zip(prompts, responses):
            f.write(json.dumps({"prompt_ids": p, "response_ids": r, "prompt_tokens": len(p),
                                "response_tokens": len(r)}) + "\n")


def read_prompts(path: Path, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) from a prompts.jsonl written by write_prompts (to train again without regenerating)."""
    prompts, responses = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt_ids"), list) or not isinstance(row.get("response_ids"), list):
            raise ValueError(f"{path}:{n}: needs 'prompt_ids' and 'response_ids' lists (written by train-draft)")
        ids = row["prompt_ids"] + row["response_ids"]
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{path}:{n}: token ids must be integers in [0, {vocab_size})")
        prompts.append(row["prompt_ids"])
        responses.append(row["response_ids"])
    if not prompts:
        raise ValueError(f"{path}: no rows")
    return prompts, responses


@torch.no_grad()
def target_features(target: QwenForCausalLM, packed: Packed, layer_ids: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """One paged forward over packed sequences -> (raw layer outputs [T, m * H], final-normed hidden [T, H])."""
    dev = target.lm_head.weight.device
    tables, first = [], 0
    for n in packed.lengths:
        used = -(-n // KV_BLOCK)
        tables.append(list(range(first, first + used)))
        first += used
    cache = target.allocate_kv_cache(first, KV_BLOCK)
    meta = batch_metadata(tables, [0] * len(tables), packed.lengths, KV_BLOCK, dev)
    last, feats = target(packed.ids.to(dev), packed.pos.to(dev), meta, cache, capture_layers=layer_ids)
    return feats, last
