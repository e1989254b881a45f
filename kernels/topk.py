"""Exact top-k over a long last dimension in two Triton launches (measured no faster than torch.topk on an H200,
bench/RESULTS.md; removed in the next commit). Each value and its index become one int64 key ordered as the value,
ties to the lower index. Launch 1: program (r, c) keeps the K largest keys of chunk c of row r (`tl.topk`). Launch
2: program r keeps the K largest of its row's S * K keys, sorted, and unpacks them."""

import torch
import triton
import triton.language as tl
from torch import Tensor

MERGE_KEYS = 4096


@triton.jit
def _to_key(v, idx, V):
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)


@triton.jit
def _chunk_topk_kernel(x_ptr, keys_ptr, V, stride_xr, S, CHUNK: tl.constexpr, K: tl.constexpr):
    r, c = tl.program_id(0), tl.program_id(1)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    ok = idx < V
    v = tl.load(x_ptr + r.to(tl.int64) * stride_xr + idx, mask=ok, other=0.0).to(tl.float32)
    key = tl.where(ok, _to_key(v, idx, V), -9223372036854775807 - 1)
    top = tl.topk(key, K)
    tl.store(keys_ptr + (r * S + c).to(tl.int64) * K + tl.arange(0, K), top)


@triton.jit
def _merge_kernel(keys_ptr, val_ptr, idx_ptr, V, n_keys, k, N: tl.constexpr, K: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, N)
    key = tl.load(keys_ptr + r.to(tl.int64) * n_keys + offs, mask=offs < n_keys, other=-9223372036854775807 - 1)
    top = tl.topk(key, K)
    b = (top >> 32).to(tl.int32)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    out = r.to(tl.int64) * k + tl.arange(0, K)
    keep = tl.arange(0, K) < k
    tl.store(val_ptr + out, b.to(tl.float32, bitcast=True), mask=keep)
    tl.store(idx_ptr + out, (V - 1 - top.to(tl.int32)).to(tl.int64), mask=keep)


def chunk_for(k: int, v: int) -> tuple[int, int]:
    K = triton.next_power_of_2(k)
    chunk = max(1024, 4 * K)
    while triton.cdiv(v, chunk) * K > MERGE_KEYS and chunk < triton.next_power_of_2(v):
        chunk *= 2
    return chunk, K


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    r = rows.shape[0]
    chunk, K = chunk_for(k, v)
    s = triton.cdiv(v, chunk)
    values = torch.empty(r, k, device=x.device, dtype=torch.float32)
    indices = torch.empty(r, k, device=x.device, dtype=torch.int64)
    keys = torch.empty(r, s, K, device=x.device, dtype=torch.int64)
    _chunk_topk_kernel[(r, s)](rows, keys, v, rows.stride(0), s, CHUNK=chunk, K=K, num_warps=8 if chunk <= 4096 else 16)
    n = triton.next_power_of_2(s * K)
    _merge_kernel[(r,)](keys, values, indices, v, s * K, k, N=n, K=K, num_warps=8 if n <= 4096 else 16)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)
