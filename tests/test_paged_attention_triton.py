"""Triton paged attention vs the PyTorch reference `paged_attention` under the CPU interpreter (fp32, small shapes).

Reruns itself in a child process with TRITON_INTERPRET=1 (see tests/interpreter.py).
"""

import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_paged_attention_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels.attention import AttentionMetadata, paged_attention
    from dspark_serve.kernels.paged_attention_triton import AttentionConfig, paged_attention_triton

    def _case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, causal=True, dtype=torch.float32, seed=0):
        """Random q [T, H, D], caches, and metadata with a shuffled (non-contiguous) block table."""
        g = torch.Generator().manual_seed(seed)
        width = max(-(-s // block_size) for s in seq_lens) + 1               # one spare column
        num_blocks = len(seq_lens) * width + 3
        perm = torch.randperm(num_blocks, generator=g)
        table = perm[:len(seq_lens) * width].view(len(seq_lens), width).clone()
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
        cu = torch.tensor([0] + q_lens).cumsum(0)
        meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens), slot_mapping=torch.zeros(0),
                                 block_table=table, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                                 causal=causal)
        return q, k_cache, v_cache, meta

    def _check(q, k_cache, v_cache, meta, config=None, rtol=1e-4):
        scale = q.shape[-1] ** -0.5
        ref = paged_attention(q, k_cache, v_cache, meta, scale)
        got = paged_attention_triton(q, k_cache, v_cache, meta, scale, config)
        assert got.shape == ref.shape and got.dtype == q.dtype
        torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol)

    @pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (4, 2, 128), (14, 2, 64)])
    def test_decode(heads, kv_heads, head_dim):
        # seq_len below one key tile, not a multiple of block_size, and across many shuffled blocks
        _check(*_case([1, 1, 1], [5, 37, 150], heads, kv_heads, head_dim, block_size=8))

    @pytest.mark.parametrize("q_len,heads,kv_heads,head_dim", [(8, 4, 2, 64), (16, 14, 2, 64), (16, 2, 1, 128)])
    def test_verify_causal(q_len, heads, kv_heads, head_dim):
        _check(*_case([q_len, q_len], [q_len, 75], heads, kv_heads, head_dim, block_size=16))

    @pytest.mark.parametrize("q_len", [7, 8])
    def test_draft_block_non_causal(q_len):
        _check(*_case([q_len, q_len, q_len], [q_len, 20, 90], 14, 2, 64, block_size=8, causal=False))

    def test_mixed_query_lengths():
        _check(*_case([3, 1, 8], [3, 70, 21], 14, 2, 64, block_size=16))

    def test_capture_padding_seq_shorter_than_query():
        # graph padding rows: seq_len 1 with 4 query tokens, only key 0 is visible (as in the reference)
        _check(*_case([4, 4], [1, 30], 4, 2, 64, block_size=8))

    @pytest.mark.parametrize("causal", [True, False])
    @pytest.mark.parametrize("cfg", [AttentionConfig(16, 16, num_splits=3), AttentionConfig(32, 32, num_splits=4)])
    def test_key_split(cfg, causal):
        # 260 keys over 33 shuffled blocks; short requests leave some splits empty
        _check(*_case([2, 5, 1], [2, 260, 9], 14, 2, 64, block_size=8, causal=causal), config=cfg)

    def test_row_tiles_and_default_split():
        # 16 x 7 rows in two 64-row tiles; the default config splits this long single request
        q, k, v, meta = _case([16], [700], 14, 2, 64, block_size=16)
        assert meta.max_seq_len == 700
        _check(q, k, v, meta, AttentionConfig(64, 64, num_splits=1))
        _check(q, k, v, meta)

    def test_strided_query():
        q, k, v, meta = _case([2, 3], [10, 40], 4, 2, 64, block_size=8)
        qkv = torch.cat([q, torch.randn_like(q)], dim=1)                     # q as a view with head stride 2 * H
        _check(qkv[:, :4], k, v, meta)

    def test_bf16_runs_in_fp32_under_interpreter():
        # the interpreter truncates fp32 -> bf16 stores: compare to within a couple of bf16 ulps
        q, k, v, meta = _case([1, 8], [13, 50], 14, 2, 64, block_size=16, dtype=torch.bfloat16)
        scale = 64 ** -0.5
        ref = paged_attention(q.float(), k.float(), v.float(), meta, scale)
        got = paged_attention_triton(q, k, v, meta, scale)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -6, atol=2 ** -7)

    @pytest.mark.parametrize("cfg", [None, AttentionConfig(32, 16, num_splits=1), AttentionConfig(16, 32, num_splits=3)])
    def test_prompt_chunks_after_a_cached_start(cfg):
        # the rest of a prompt over its cached keys (40 and 3 cached, one fresh), beside a decode row: causal tiles
        # stop at their last query's position, tiles past a short query walk no keys
        _check(*_case([37, 20, 1, 24], [77, 23, 90, 24], 14, 2, 64, block_size=8), config=cfg)

    def test_capture_padding_of_a_long_query():
        # a prompt graph replayed on padding: seq_len below the query length, only key 0 visible
        _check(*_case([40, 33], [2, 60], 4, 2, 64, block_size=8))

    def test_rejects_unsupported_shapes():
        q, k, v, meta = _case([2], [20], 4, 3, 64, block_size=8)
        with pytest.raises(ValueError):
            paged_attention_triton(q, k, v, meta, 0.125)
