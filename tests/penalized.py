"""Test helper: the penalized target, one token at a time by plain loops (the oracle of the engine's logit_bias,
penalties, min_tokens and logprobs)."""

import torch

from dspark_serve.engine.reference import _meta
from dspark_serve.engine.sampling_params import SamplingParams


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
              banned: tuple[int, ...] = ()) -> torch.Tensor:
    """One position's logits [V] after logit_bias, min_tokens and the penalties, token by token."""
    x = logits.clone().float()
    for t, bias in params.logit_bias:
        x[t] += bias
    if len(output) < params.min_tokens:
        for t in banned:
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] = x[t] - params.frequency_penalty * output.count(t) - params.presence_penalty
    return x


def next_logits(target, seq: list[int]) -> torch.Tensor:
    """The target's logits [V] after seq: a plain forward over a private cache."""
    blocks = -(-len(seq) // 8)
    with torch.inference_mode():
        cache = target.allocate_kv_cache(blocks, 8)
        hidden, _ = target(torch.tensor(seq), torch.arange(len(seq)), _meta(0, len(seq), 8, blocks, "cpu"), cache)
        return target.compute_logits(hidden[-1:])[0].float()


def penalized_greedy(target, prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = ()) -> list[int]:
    """Plain greedy decoding of the penalized target, one token at a time; stops after an EOS or stop id."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    out: list[int] = []
    while len(out) < params.max_tokens:
        out.append(int(penalized(next_logits(target, prompt + out), prompt, out, params, tuple(stops)).argmax()))
        if out[-1] in stops:
            break
    return out
