"""Fresh-prompt attention (one causal SDPA over the slots just written) against the paged reference."""

import pytest
import torch

from dspark_serve.engine.kv_cache import batch_metadata
from dspark_serve.kernels.attention import paged_attention, prompt_attention, store_kv


@pytest.mark.parametrize("lens,heads,kv_heads", [([37], 4, 4), ([37], 14, 2), ([20, 5, 33], 14, 2)])
def test_prompt_attention_equals_paged_reference(lens, heads, kv_heads):
    g, d, bs = torch.Generator().manual_seed(0), 16, 8
    perm = torch.randperm(24, generator=g).tolist()  # shuffled blocks, 8 per request
    tables = [perm[8 * i:8 * i + 8] for i in range(len(lens))]
    meta = batch_metadata(tables, [0] * len(lens), lens, bs, torch.device("cpu"))
    assert meta.prompt_lens == tuple(lens)
    k_cache = torch.randn(24, bs, kv_heads, d, generator=g)  # stale values everywhere: only written slots count
    v_cache = torch.randn(24, bs, kv_heads, d, generator=g)
    q = torch.randn(sum(lens), heads, d, generator=g)
    store_kv(torch.randn(sum(lens), kv_heads, d, generator=g), torch.randn(sum(lens), kv_heads, d, generator=g),
             k_cache, v_cache, meta.slot_mapping, meta.all_slots_valid)
    got = prompt_attention(q, k_cache, v_cache, meta, d ** -0.5)
    want = paged_attention(q, k_cache, v_cache, meta, d ** -0.5)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_fresh_causal_batches_are_prompts():
    cpu = torch.device("cpu")
    assert batch_metadata([[0, 1, 2]], [0], [20], 8, cpu).prompt_lens == (20,)
    assert batch_metadata([[0, 1, 2]], [3], [20], 8, cpu).prompt_lens == ()  # context before the new tokens
    assert batch_metadata([[0, 1, 2], [3, 4]], [0, 1], [20, 4], 8, cpu).prompt_lens == ()
    assert batch_metadata([[0, 1]], [0], [7], 8, cpu, causal=False).prompt_lens == ()  # a draft block
