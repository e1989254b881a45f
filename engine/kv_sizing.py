"""How many KV blocks fit in a share of a GPU's memory, beside the weights already loaded and a reserve for the
CUDA graphs and the step's working memory. Pure arithmetic; the engine reads the device."""

from __future__ import annotations

from .runner.buckets import PACKED_WARM_TOKENS, PROMPT_BUCKETS, WARM_CONTEXT, GraphBuckets, packed_rows, token_buckets

WORKSPACE_BYTES = 1 << 30  # activations, prefill temporaries, the allocator's slack
TILED_SHARE = 0.02  # tile-major copies the runner may add (they are kept when within 2 % of the GPU)


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """One block of one model's paged cache: K and V of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


def graph_reserve_bytes(vocab_size: int, num_drafts: int, max_batch: int, hidden_size: int = 0,
                        feature_size: int = 0, buckets: GraphBuckets = GraphBuckets()) -> int:
    """The verify graphs' memory: the fp32 logits of the largest step (each graph's logits live only while it
    runs, in one pool the graphs share) and what every recorded graph keeps (its rows' hidden states and features,
    bf16, and its accept) for the warm-up's set of shapes."""
    top = next((b for b in buckets.batch if b >= max_batch), buckets.batch[-1])
    width = 1 + num_drafts
    kept = 0
    for c in buckets.context:
        for b in buckets.batch:
            if b <= top and (b == 1 or c <= WARM_CONTEXT):
                kept += len(token_buckets(b, num_drafts)) * b * width * (2 * (hidden_size + feature_size) + 8 * 2)
    return top * width * vocab_size * 4 + kept


def packed_reserve_bytes(max_batch: int, hidden_size: int, feature_size: int,
                         buckets: GraphBuckets = GraphBuckets()) -> int:
    """What the packed prompt graphs recorded at start keep (runner/prompt_graphs.py): each its rows' last hidden
    states and its tokens' features, bf16."""
    contexts = sum(1 for c in buckets.context if c <= WARM_CONTEXT)
    return contexts * sum(2 * (b * hidden_size + t * feature_size) for b in packed_rows(max_batch)
                          for t in PROMPT_BUCKETS if t <= PACKED_WARM_TOKENS)


def kv_blocks_for_memory(total_bytes: int, used_bytes: int, utilization: float, per_block_bytes: int,
                         reserve_bytes: int) -> int:
    """Blocks that fit in `utilization` of the device's memory beside what is in use and the reserve; ValueError
    when none do."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = utilization * total_bytes - used_bytes - reserve_bytes - TILED_SHARE * total_bytes - WORKSPACE_BYTES
    blocks = int(budget // per_block_bytes)
    if blocks < 1:
        raise ValueError(f"no KV cache fits in {utilization:.2f} of the GPU's {total_bytes / 2**30:.1f} GiB: the "
                         f"weights take {used_bytes / 2**30:.1f} GiB and the graphs and working memory "
                         f"{(reserve_bytes + WORKSPACE_BYTES + TILED_SHARE * total_bytes) / 2**30:.1f} GiB; raise "
                         f"gpu_memory_utilization or lower max_num_seqs")
    return blocks
