"""The plainest decoder: one sequence, greedy, the target's paged forward over a private cache (a test oracle)."""

from __future__ import annotations

import torch

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.models.qwen import QwenForCausalLM


def _meta(start: int, num_new: int, block_size: int, num_blocks: int, device: torch.device) -> AttentionMetadata:
    pos = torch.arange(start, start + num_new, device=device)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, num_new], device=device), seq_lens=torch.tensor([start + num_new], device=device),
        slot_mapping=pos, block_table=torch.arange(num_blocks, device=device)[None], max_query_len=num_new,
        max_seq_len=start + num_new)


@torch.inference_mode()
def greedy_generate(target: QwenForCausalLM, prompt_ids: list[int], max_tokens: int,
                    eos_token_ids: tuple[int, ...] = (), block_size: int = 16) -> list[int]:
    """Generated ids only (stops after an EOS id, which is included)."""
    device = target.lm_head.weight.device
    num_blocks = (len(prompt_ids) + max_tokens + block_size - 1) // block_size
    cache = target.allocate_kv_cache(num_blocks, block_size)
    ids = torch.tensor(prompt_ids, device=device)
    start, out = 0, []
    for _ in range(max_tokens):
        meta = _meta(start, len(ids), block_size, num_blocks, device)
        hidden, _ = target(ids, torch.arange(start, start + len(ids), device=device), meta, cache)
        token = int(target.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in eos_token_ids:
            break
        start, ids = start + len(ids), torch.tensor([token], device=device)
    return out
