"""After the attention warm-up, batches of any composition compile no Triton kernel: the kernel's varying ints
(block table width, max_seq_len, row tiles, scratch strides) are not specialised, and every (row tile, key split)
the default config can pick is compiled by the warm-up. Counted through Triton's own compile hooks."""

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from dspark_serve.kernels.attention import AttentionMetadata
    from dspark_serve.kernels.jit_watch import WATCH
    from dspark_serve.kernels.paged_attention_triton import paged_attention_triton, warm_up

DEV = "cuda"


def _batch(rng: random.Random, k_cache, heads: int):
    """A random batch: 1-40 sequences, query lengths 1-300, contexts up to 3000 keys, any block table width."""
    bs, n_blocks = k_cache.shape[1], k_cache.shape[0]
    reqs = rng.randint(1, 40)
    q_lens = [rng.choice([1, 1, 8, rng.randint(1, 300)]) for _ in range(reqs)]
    seq_lens = [q + rng.randint(0, 2700) for q in q_lens]
    width = max(-(-s // bs) for s in seq_lens) + rng.randint(0, 3)
    table = torch.randint(0, n_blocks, (reqs, width), device=DEV)
    q = torch.randn(sum(q_lens), heads, k_cache.shape[3], device=DEV, dtype=k_cache.dtype)
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0] + q_lens, device=DEV).cumsum(0),
                             seq_lens=torch.tensor(seq_lens, device=DEV),
                             slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEV), block_table=table,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens) + rng.randint(0, 40))
    return q, meta


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (32, 8, 128)])
def test_no_compile_after_warm_up(heads, kv_heads, head_dim):
    assert WATCH.install()
    cache = torch.randn(2, 200, 16, kv_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    warm_up(cache[0], cache[1], heads, torch.bfloat16)
    torch.cuda.synchronize()
    before = WATCH.count
    rng = random.Random(0)
    for _ in range(60):
        q, meta = _batch(rng, cache[0], heads)
        paged_attention_triton(q, cache[0], cache[1], meta, head_dim ** -0.5)
    torch.cuda.synchronize()
    new = [c.signature for c in WATCH.compiles[before:]]
    assert not new, f"{len(new)} kernels compiled after the warm-up: {new[:3]}"
