"""Sizing the KV cache from a share of GPU memory: the arithmetic, and that CPUs keep num_kv_blocks."""

import pytest

from dspark_serve.engine.runner.buckets import GraphBuckets
from dspark_serve.engine.kv_sizing import (TILED_SHARE, WORKSPACE_BYTES, block_bytes, graph_reserve_bytes,
                                           kv_blocks_for_memory, packed_reserve_bytes)

GiB = 1 << 30


def test_block_bytes_is_k_and_v_of_every_layer():
    assert block_bytes(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype_bytes=2) == \
        2 * 24 * 2 * 64 * 16 * 2


def test_graph_reserve_is_the_largest_steps_logits_and_what_each_graph_keeps():
    buckets = GraphBuckets(batch=(1, 2, 4, 8), context=(256, 8192))  # 8192 is past WARM_CONTEXT: batch 1 only
    logits = 4 * 8 * 1000 * 4  # max_batch 3 -> bucket 4, rows of 1 + 7 positions, fp32
    per_row = 8 * (2 * (64 + 96) + 16)  # 8 positions: hidden + features bf16, the accept
    graphs = {1: 4, 2: 4, 4: 4}  # token sizes 1, 2, 4, 8 per row
    kept = sum(n * b * per_row for b, n in graphs.items()) + graphs[1] * per_row  # 8192: batch 1 only
    assert graph_reserve_bytes(1000, 7, 3, 64, 96, buckets) == logits + kept


def test_packed_prompt_graphs_reserve_what_each_keeps():
    buckets = GraphBuckets(context=(256, 512, 8192))  # 8192 is past WARM_CONTEXT: not recorded at start
    tokens = 32 + 48 + 64 + 96 + 128 + 192 + 256 + 384 + 512 + 768 + 1024  # length buckets up to 1024
    per_rows = {b: 2 * (11 * b * 64 + tokens * 96) for b in (4, 16, 64)}  # bf16 last hidden and features
    assert packed_reserve_bytes(20, 64, 96, buckets) == 2 * (per_rows[4] + per_rows[16] + per_rows[64])
    assert packed_reserve_bytes(4, 64, 96, buckets) == 2 * per_rows[4]
    assert packed_reserve_bytes(1, 64, 96, buckets) == 0  # one request a step: nothing to pack


def test_blocks_fill_the_share_left_after_weights_and_reserve():
    per_block = 3 << 20
    got = kv_blocks_for_memory(100 * GiB, 20 * GiB, 0.9, per_block, 5 * GiB)
    assert got == int((90 * GiB - 20 * GiB - 5 * GiB - TILED_SHARE * 100 * GiB - WORKSPACE_BYTES) // per_block)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        kv_blocks_for_memory(100 * GiB, 0, 1.5, per_block, 0)
    with pytest.raises(ValueError, match="no KV cache fits"):
        kv_blocks_for_memory(100 * GiB, 85 * GiB, 0.9, per_block, 5 * GiB)


def test_a_cpu_engine_keeps_its_block_count():
    from engine_pairs import build_pair

    from dspark_serve.engine.llm import LLM

    target, draft = build_pair(seed=1, agree=0.01, block_size=4)
    llm = LLM(target, draft, device="cpu", block_size=8, gpu_memory_utilization=0.5)
    assert llm.kv.target.num_blocks == 2048
    assert LLM(target, draft, device="cpu", block_size=8, num_kv_blocks=64).kv.target.num_blocks == 64
