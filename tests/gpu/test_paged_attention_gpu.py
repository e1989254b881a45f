"""Triton paged attention on CUDA: bf16 vs an fp64 reference from the same inputs, CUDA-graph capture and replay."""

import time
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from dspark_serve.kernels.attention import AttentionMetadata, paged_attention
    from dspark_serve.kernels.paged_attention_triton import (AttentionConfig, default_attention_config,
                                                              paged_attention_triton)

DEV = "cuda"


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, causal=True, dtype=torch.bfloat16, width=None,
          seed=0):
    """Random q [T, H, D], caches, metadata with a shuffled block table (`width` columns, padded with block 0)."""
    g = torch.Generator().manual_seed(seed)
    need = max(-(-s // block_size) for s in seq_lens)
    width = width or need
    num_blocks = len(seq_lens) * need + 5
    table = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    table[:, :need] = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * need].view(len(seq_lens), need)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(DEV),
                             seq_lens=torch.tensor(seq_lens, device=DEV), slot_mapping=torch.zeros(0, device=DEV),
                             block_table=table.to(DEV), max_query_len=max(q_lens),
                             max_seq_len=width * block_size, causal=causal)
    return q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), meta


def _ref64(q, k_cache, v_cache, meta, scale):
    return paged_attention(q.double(), k_cache.double(), v_cache.double(), meta, scale)


CASES = {  # (q_lens, seq_lens, heads, kv_heads, head_dim, block_size, causal)
    "decode-qwen3": ([1] * 8, [1, 17, 64, 100, 513, 1000, 2048, 4000], 32, 8, 128, 16, True),
    "decode-qwen25-g7": ([1] * 4, [3, 300, 1025, 3000], 14, 2, 64, 16, True),
    "verify-16": ([16] * 4, [16, 200, 777, 2100], 16, 8, 128, 16, True),
    "verify-8-g7": ([8] * 3, [9, 64, 1500], 14, 2, 64, 8, True),
    "draft-block": ([8] * 4, [8, 40, 333, 1200], 32, 8, 128, 16, False),
    "mixed": ([3, 1, 8, 16], [3, 90, 400, 16], 16, 2, 128, 8, True),
    "long-single": ([1], [16000], 32, 8, 128, 16, True),
    "prompt-after-cache": ([100, 37, 1, 200], [1600, 60, 500, 200], 14, 2, 64, 16, True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_bf16_vs_fp64(name, num_splits):
    q_lens, seq_lens, h, kv, d, bs, causal = CASES[name]
    q, k, v, meta = _case(q_lens, seq_lens, h, kv, d, bs, causal)
    cfg = default_attention_config(len(q_lens), kv, h // kv, d, meta.max_query_len, meta.max_seq_len)
    cfg = cfg if num_splits is None else replace(cfg, num_splits=num_splits)
    got = paged_attention_triton(q, k, v, meta, d ** -0.5, cfg)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert _rel(got, _ref64(q, k, v, meta, d ** -0.5)) <= 1e-2


def test_fp32_uses_ieee_dot():
    q, k, v, meta = _case([1, 4, 16], [5, 300, 1000], 14, 2, 64, 16, dtype=torch.float32)
    got = paged_attention_triton(q, k, v, meta, 0.125)
    assert _rel(got, _ref64(q, k, v, meta, 0.125)) <= 1e-5


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_capture_and_replay(num_splits):
    """Capture on one batch's metadata, replay on new seq_lens / block table / q copied into the same buffers."""
    q_lens, h, kv, d, bs, width = [4] * 6, 14, 2, 64, 16, 128                 # contexts up to 2048 keys
    q, k, v, meta = _case(q_lens, [4, 40, 100, 700, 1500, 2048], h, kv, d, bs, width=width, seed=1)
    cfg = AttentionConfig(32, 64, num_splits)
    g, out = _graph(lambda: paged_attention_triton(q, k, v, meta, d ** -0.5, cfg))
    for seed, seqs in ((2, [2048, 1, 33, 4, 999, 17]), (3, [5, 6, 7, 8, 9, 10])):
        q2, _, _, meta2 = _case(q_lens, seqs, h, kv, d, bs, width=width, seed=seed)
        q.copy_(q2)
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.block_table.copy_(meta2.block_table % k.shape[0])
        g.replay()
        torch.cuda.synchronize()
        assert _rel(out, _ref64(q, k, v, meta, d ** -0.5)) <= 1e-2


def test_graph_replay_faster_than_reference():
    """One decode layer of Qwen3-8B shape, batch 32, 2048-key buckets: the point of the kernel is fewer launches."""
    q, k, v, meta = _case([1] * 32, [1500] * 32, 32, 8, 128, 16, width=128)
    times = {}
    for name, fn in (("reference", paged_attention), ("triton", paged_attention_triton)):
        g, _ = _graph(lambda: fn(q, k, v, meta, 128 ** -0.5))
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 50
    print(f"paged attention graph replay: {times}")
    assert times["triton"] < times["reference"]
