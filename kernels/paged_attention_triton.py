"""Paged attention for decode / verify / draft-block steps in one Triton kernel (flash-decoding style).

Same semantics as `attention.paged_attention` (the reference). One program per (request, kv head, row tile, key
split): its rows are the request's query tokens times the G query heads sharing that kv head, row r = i * G + g
(query i, head kv_head * G + g), padded to a power of two >= 16, so GQA groups that are not powers of two (Qwen2.5's
7) cost only padding. The program walks its keys in BLOCK_N tiles, gathering cache slots through the block table,
with fp32 online softmax (exp2) and tl.dot for QK^T and PV; under causal attention it stops at its last query's
position, and a tile past its request's query walks none. Key 0 is always visible, as in the reference (padded rows,
and the capture-time padding with seq_len < query_len, stay finite). Queries of any length: decode, verify and draft
blocks, and the rest of a prompt after its cached start.

Long contexts with too few programs split each request's keys into SPLIT even chunks; partial outputs and their
log-sum-exps go to fp32 scratch and a second small kernel combines them. No host syncs, every size comes from
tensor shapes and meta's Python ints: CUDA-graph capturable.
"""

import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .attention import AttentionMetadata
from .pdl import pdl_prologue

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int          # rows (query tokens x group heads) per program; a power of two >= 16
    block_n: int = 64     # keys per step; a power of two >= 16
    num_splits: int = 1   # key chunks per request (> 1: scratch + combine kernel)
    num_warps: int = 4
    num_stages: int = 2


def default_attention_config(num_reqs: int, num_kv_heads: int, group: int, head_dim: int, max_query_len: int,
                             max_seq_len: int, num_sms: int = 132) -> AttentionConfig:
    """Row tile <= 64, 32-key tiles, 4 warps; keys split in powers of two up to 16 (>= 1 tile each) while there
    are at most 4 programs per SM. Measured on the H200 (`bench/bench_attention.py`, bench/RESULTS.md): at batch 1
    splitting to 8-16 chunks beats 1-4 by 1.5-2.3x; D = 128 with 64 keys and 4 warps spills (offline sm_90
    compile), 32 keys do not."""
    rows = max_query_len * group
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_n, warps = 32, 4
    programs = num_reqs * num_kv_heads * triton.cdiv(rows, block_m)
    tiles = triton.cdiv(max_seq_len, block_n)
    split = 1
    while split < 16 and 2 * split <= tiles and programs * 2 * split <= 4 * num_sms:
        split *= 2
    return AttentionConfig(block_m, block_n, split, num_warps=warps)


# Runtime ints that vary with the batch. Triton would otherwise specialise each on being 1 or a multiple of 16 and
# compile a new kernel (hundreds of ms, every stream stalled) the first time a batch's value changes class.
_VARYING = ["stride_bt", "W", "stride_ls", "max_seq_len", "m_tiles"]
# Per-request scalars a graph may read from anywhere in its staging buffer: their alignment is not specialised on
# either (where this Triton can say so), so a graph whose fields sit differently compiles nothing new.
_ANY_ALIGNMENT = {"do_not_specialize_on_alignment": ["cu_ptr", "seq_ptr", "bt_ptr"]} \
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters else {}


@triton.jit(do_not_specialize=_VARYING, **_ANY_ALIGNMENT)
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, seq_ptr, bt_ptr, out_ptr, lse_ptr,
                            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, W,
                            stride_os, stride_ot, stride_oh, stride_ls, stride_lt, max_seq_len, qk_scale, m_tiles,
                            G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    b, pid1, sid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h, mt = pid1 // m_tiles, pid1 % m_tiles  # runtime ints: a prompt's length does not compile a new kernel
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    seq_len = tl.load(seq_ptr + b)
    key_hi = tl.minimum(seq_len, max_seq_len)                                  # the reference sees < max_seq_len
    n_keys = tl.maximum(key_hi, 1)                                             # key 0 is always visible

    r = mt * BLOCK_M + tl.arange(0, BLOCK_M)                                   # [BM] row = i * G + g
    i = r // G
    row_ok = i < q_len
    tok = q_start + i                                                          # [BM] flat token
    head = h * G + r % G                                                       # [BM] query head
    q_pos = seq_len - q_len + i                                                # [BM] position of query i
    d = tl.arange(0, D)[None, :]                                               # [1, D]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d, mask=row_ok[:, None],
                other=0.0)                                                     # [BM, D]
    # The CPU interpreter's bf16 tl.dot is wrong, and fp32 on a GPU must not drop to tf32: dot in fp32 (ieee).
    if DOT_F32:
        q = q.to(tl.float32)

    if SPLIT == 1:
        lo, hi = 0, n_keys
    else:
        chunk = tl.cdiv(tl.cdiv(n_keys, SPLIT), BLOCK_N) * BLOCK_N
        lo = sid * chunk
        hi = tl.minimum(lo + chunk, n_keys)
    i_last = tl.minimum(q_len - 1, (mt * BLOCK_M + BLOCK_M - 1) // G)       # the tile's last query
    if CAUSAL:                                                                 # no later key is visible to it
        hi = tl.minimum(hi, tl.maximum(seq_len - q_len + i_last + 1, 1))
    hi = tl.where((mt * BLOCK_M) // G < q_len, hi, lo)                         # a tile past the query: no keys

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)                                      # [BN] key positions
        kmask = p < hi
        blk = tl.load(bt_ptr + b * stride_bt + tl.minimum(p // BS, W - 1), mask=kmask, other=0)
        slot = (blk * BS + p % BS)[:, None]                                    # [BN, 1] int64 cache slot
        k = tl.load(k_ptr + slot * stride_ks + h * stride_kh + d, mask=kmask[:, None], other=0.0)   # [BN, D]
        v = tl.load(v_ptr + slot * stride_vs + h * stride_vh + d, mask=kmask[:, None], other=0.0)   # [BN, D]
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * qk_scale                                                       # [BM, BN] log2 units
        vis = p[None, :] < key_hi
        if CAUSAL:
            vis = vis & (p[None, :] <= q_pos[:, None])
        vis = (vis | (p[None, :] == 0)) & kmask[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                  # rows with no key yet in a split
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(s - m_safe[:, None])                                      # [BM, BN]
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if DOT_F32:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    optr = out_ptr + sid * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh + d
    tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if SPLIT > 1:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + sid * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["stride_ls"])
def _combine_kernel(part_ptr, lse_ptr, out_ptr, stride_ps, stride_pt, stride_ls, stride_lt, stride_ot,
                    H: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr,
                    PDL: tl.constexpr):
    """part [S, T, H, D] fp32 normalised per split, lse [S, T, H] (log2) -> out [T, H, D]; one program per (t, h)."""
    pdl_prologue(PDL)
    t, hd = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, SPLIT_PAD)
    lse = tl.load(lse_ptr + sp * stride_ls + t * stride_lt + hd, mask=sp < SPLIT, other=float("-inf"))   # [S]
    w = tl.exp2(lse - tl.max(lse, axis=0))                                     # empty splits weigh 0
    d = tl.arange(0, D)[None, :]
    part = tl.load(part_ptr + sp[:, None] * stride_ps + t * stride_pt + hd * D + d, mask=(sp < SPLIT)[:, None],
                   other=0.0)                                                  # [S, D]
    o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t * stride_ot + hd * D + tl.arange(0, D), o.to(out_ptr.dtype.element_ty))


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"need q [T, H, D] and caches [blocks, block_size, KV, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _, h, d = q.shape
    _, bs, kv, dk = k_cache.shape
    if d != dk or d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 shared by q and the cache, got {d} and {dk}")
    if h % kv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kv}")
    if bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two, got {bs}")
    if meta.max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {meta.max_query_len}")
    for c in (k_cache, v_cache):
        if c.stride(3) != 1 or c.stride(0) != bs * c.stride(1):
            raise ValueError("the cache's (block, offset) dims must flatten to slots and head_dim be contiguous")


def paged_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                           config: AttentionConfig | None = None) -> Tensor:
    """q [T, H, D] over the cached keys of each sequence -> [T, H, D] in q's dtype (see `paged_attention`).

    T must equal cu_seqlens_q[-1]; a CPU tensor needs TRITON_INTERPRET=1.
    """
    _check(q, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group, num_reqs = num_heads // num_kv, meta.seq_lens.shape[0]
    cfg = config or default_attention_config(num_reqs, num_kv, group, head_dim, meta.max_query_len,
                                             meta.max_seq_len)
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1) or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1) \
            or cfg.num_splits < 1:
        raise ValueError(f"bad AttentionConfig {cfg}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)   # [T, H, D]
    if num_tokens == 0 or num_reqs == 0:
        return out
    m_tiles = triton.cdiv(meta.max_query_len * group, cfg.block_m)
    split = cfg.num_splits
    if split > 1:
        part = torch.empty(split, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(split, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        dst, lse_strides = part, (lse.stride(0), lse.stride(1))
    else:
        dst, lse, lse_strides = out, out, (0, 0)                              # lse unused
    bt = meta.block_table
    grid = (num_reqs, num_kv * m_tiles, split)
    on, opts = pdl.launch(q)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, bt, dst, lse,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        bt.stride(0), bt.shape[1], dst.stride(0) if split > 1 else 0, dst.stride(-3), dst.stride(-2), *lse_strides,
        meta.max_seq_len, float(scale) * _LOG2E, m_tiles,
        G=group, BS=block_size, D=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=split,
        CAUSAL=bool(meta.causal), DOT_F32=not q.is_cuda or q.dtype == torch.float32, PDL=on,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts)
    if split > 1:
        _combine_kernel[(num_tokens, num_heads)](part, lse, out, part.stride(0), part.stride(1), lse.stride(0),
                                                 lse.stride(1), out.stride(0), H=num_heads, D=head_dim, SPLIT=split,
                                                 SPLIT_PAD=triton.next_power_of_2(split), PDL=on, **opts)
    return out


def warm_up(k_cache: Tensor, v_cache: Tensor, num_heads: int, dtype: torch.dtype, causal: bool = True) -> int:
    """Compile now every (row tile, key split) that default_attention_config can choose for these caches: with the
    kernel's varying ints unspecialised, a batch met while serving then compiles nothing. Runs over block 0 (reads
    only); -> the configs run."""
    group, head_dim = num_heads // k_cache.shape[2], k_cache.shape[3]
    dev, n = k_cache.device, 0
    for block_m in (16, 32, 64):
        q_len = max(1, block_m // (2 * group) + 1)  # rows in (block_m / 2, block_m], as the config would pick
        q = torch.zeros(q_len, num_heads, head_dim, dtype=dtype, device=dev)
        meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, q_len], device=dev),
                                 seq_lens=torch.tensor([q_len], device=dev),
                                 slot_mapping=torch.zeros(q_len, dtype=torch.int64, device=dev),
                                 block_table=torch.zeros(1, 1, dtype=torch.int64, device=dev),
                                 max_query_len=q_len, max_seq_len=q_len, causal=causal)
        for split in (1, 2, 4, 8, 16):
            paged_attention_triton(q, k_cache, v_cache, meta, 1.0, AttentionConfig(block_m, 32, split))
            n += 1
    return n
