"""Gathered Markov bias: logits[b, index[b, j]] = values[b, j] + scale * dot(W2[index[b, j]], e[b]).

Only the k candidate rows of W2 [V, r] are read (NVFP4 or bf16); every other logit is left as the caller
filled it (-inf). One program per (request, block of candidates), fp32 math.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .nvfp4_triton import e2m1_times, fp8e4m3_to_f32
from .nvfp4_ref import check_packed, dequantize as _dequantize_ref

_BLOCK_J = 32   # candidates per program


@triton.jit
def _gathered_bias_nvfp4_kernel(e_ptr, packed_ptr, scale_ptr, scale_2_ptr, values_ptr, index_ptr, logits_ptr,
                                TOPK, stride_e, stride_v, stride_i, stride_l, alpha,
                                R: tl.constexpr, BLOCK_J: tl.constexpr):
    b, pj = tl.program_id(0), tl.program_id(1)
    j = pj * BLOCK_J + tl.arange(0, BLOCK_J)                                   # [BJ]
    jmask = j < TOPK
    idx = tl.load(index_ptr + b * stride_i + j, mask=jmask, other=0).to(tl.int64)
    row = idx[:, None]                                                         # [BJ, 1]
    pair = tl.arange(0, R // 2)[None, :]                                       # [1, R/2]
    m2 = jmask[:, None]
    byte = tl.load(packed_ptr + row * (R // 2) + pair, mask=m2, other=0).to(tl.int32)        # [BJ, R/2]
    s = fp8e4m3_to_f32(tl.load(scale_ptr + row * (R // 16) + pair // 8, mask=m2, other=0))  # [BJ, R/2]
    e_even = tl.load(e_ptr + b * stride_e + 2 * pair).to(tl.float32)                        # [1, R/2]
    e_odd = tl.load(e_ptr + b * stride_e + 2 * pair + 1).to(tl.float32)
    prod = e2m1_times(byte & 0xF, s) * e_even + e2m1_times(byte >> 4, s) * e_odd
    dot = tl.sum(prod, axis=1) * tl.load(scale_2_ptr)                                       # [BJ]
    val = tl.load(values_ptr + b * stride_v + j, mask=jmask, other=0.0).to(tl.float32)
    tl.store(logits_ptr + b * stride_l + idx, (val + alpha * dot).to(logits_ptr.dtype.element_ty), mask=jmask)


@triton.jit
def _gathered_bias_dense_kernel(e_ptr, w_ptr, values_ptr, index_ptr, logits_ptr,
                                TOPK, stride_e, stride_w, stride_v, stride_i, stride_l, alpha,
                                R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    b, pj = tl.program_id(0), tl.program_id(1)
    j = pj * BLOCK_J + tl.arange(0, BLOCK_J)                                   # [BJ]
    jmask = j < TOPK
    idx = tl.load(index_ptr + b * stride_i + j, mask=jmask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    w = tl.load(w_ptr + idx[:, None] * stride_w + r[None, :], mask=jmask[:, None] & (r[None, :] < R),
                other=0.0).to(tl.float32)                                      # [BJ, BR]
    e = tl.load(e_ptr + b * stride_e + r, mask=r < R, other=0.0).to(tl.float32)
    dot = tl.sum(w * e[None, :], axis=1)
    val = tl.load(values_ptr + b * stride_v + j, mask=jmask, other=0.0).to(tl.float32)
    tl.store(logits_ptr + b * stride_l + idx, (val + alpha * dot).to(logits_ptr.dtype.element_ty), mask=jmask)


def _check(markov_embed: Tensor, values: Tensor, index: Tensor, logits: Tensor, vocab: int, rank: int) -> None:
    bsz, topk = index.shape
    if tuple(markov_embed.shape) != (bsz, rank):
        raise ValueError(f"markov_embed must be [{bsz}, {rank}], got {tuple(markov_embed.shape)}")
    if tuple(values.shape) != (bsz, topk) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"values must be [{bsz}, {topk}] and index int, got {tuple(values.shape)} {index.dtype}")
    if tuple(logits.shape) != (bsz, vocab) or logits.stride(1) != 1:
        raise ValueError(f"logits must be a contiguous-row [{bsz}, {vocab}] buffer, got {tuple(logits.shape)}")


def gathered_bias(markov_embed: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                  values: Tensor, index: Tensor, logits: Tensor, scale: float) -> Tensor:
    """NVFP4 W2: e [B, r], packed [V, r/2], weight_scale [V, r/16], values/index [B, k] -> logits [B, V] in place."""
    vocab, rank = check_packed(packed, weight_scale, weight_scale_2)
    _check(markov_embed, values, index, logits, vocab, rank)
    if rank & (rank - 1) or rank < 16:
        raise ValueError(f"the NVFP4 gathered bias needs a power-of-two rank >= 16 (group size 16), got {rank}")
    e, values, index = markov_embed.contiguous(), values.contiguous(), index.contiguous()
    grid = (index.shape[0], triton.cdiv(index.shape[1], _BLOCK_J))
    _gathered_bias_nvfp4_kernel[grid](e, packed, weight_scale.view(torch.uint8), weight_scale_2.float().reshape(1),
                                      values, index, logits, index.shape[1], e.stride(0), values.stride(0),
                                      index.stride(0), logits.stride(0), float(scale), R=rank, BLOCK_J=_BLOCK_J)
    return logits


def gathered_bias_dense(markov_embed: Tensor, weight: Tensor, values: Tensor, index: Tensor, logits: Tensor,
                        scale: float) -> Tensor:
    """bf16 W2 [V, r]: the same operation as `gathered_bias`, reading dense rows."""
    vocab, rank = weight.shape
    _check(markov_embed, values, index, logits, vocab, rank)
    e, values, index, weight = (t.contiguous() for t in (markov_embed, values, index, weight))
    grid = (index.shape[0], triton.cdiv(index.shape[1], _BLOCK_J))
    _gathered_bias_dense_kernel[grid](e, weight, values, index, logits, index.shape[1], e.stride(0), weight.stride(0),
                                      values.stride(0), index.stride(0), logits.stride(0), float(scale),
                                      R=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_J=_BLOCK_J)
    return logits


def gathered_bias_dense_ref(markov_embed: Tensor, weight: Tensor, values: Tensor, index: Tensor, logits: Tensor,
                            scale: float) -> Tensor:
    """Reference: gather rows, fp32 batched dot, scatter."""
    w = weight[index].float()                                                  # [B, k, r]
    corr = values.float() + scale * torch.einsum("bkr,br->bk", w, markov_embed.float())
    return logits.scatter_(1, index.long(), corr.to(logits.dtype))


def gathered_bias_ref(markov_embed: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                      values: Tensor, index: Tensor, logits: Tensor, scale: float) -> Tensor:
    """Reference: dequantize the gathered rows only, then as `gathered_bias_dense_ref`."""
    flat = index.reshape(-1).long()
    w = _dequantize_ref(packed[flat], weight_scale[flat], weight_scale_2).view(*index.shape, -1)   # [B, k, r]
    corr = values.float() + scale * torch.einsum("bkr,br->bk", w, markov_embed.float())
    return logits.scatter_(1, index.long(), corr.to(logits.dtype))
