"""The target's side of training: regenerate responses with the engine, then capture features for the draft."""

from __future__ import annotations

import json
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
               eos_token_ids: tuple[int, ...] = (), seed: int = 0, max_num_seqs: int = 64) -> list[list[int]]:
    """The target's own responses (greedy at temperature 0), batched through the plain engine."""
    longest = max(len(p) for p in prompts) + response_len
    blocks = max_num_seqs * -(-longest // KV_BLOCK) + 8
    llm = LLM(target, None, device=str(target.lm_head.weight.device), num_kv_blocks=blocks,
              max_num_seqs=max_num_seqs, max_model_len=longest, eos_token_ids=eos_token_ids)
    params = [SamplingParams(temperature=temperature, max_tokens=response_len, seed=seed + i)
              for i in range(len(prompts))]
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def write_prompts(path: Path, prompts: list[list[int]], responses: list[list[int]]) -> None:
    """prompts.jsonl: the training prompts with their token counts (and the regenerated response length)."""
    with open(path, "w") as f:
        for p, r in zip(prompts, responses):
            f.write(json.dumps({"prompt_ids": p, "prompt_tokens": len(p), "response_tokens": len(r)}) + "\n")


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
