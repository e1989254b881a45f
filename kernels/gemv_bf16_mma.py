"""Dense GEMV on register-fed tensor cores: bf16 x [M, K] (M <= 16) @ bf16 w [N, K]^T (+ bias) -> bf16 [M, N], sm_90.

The bf16 sibling of w4a16_gemv_mma.py, for the target's verify rows (1 + 7 tokens): no shared memory in the K loop,
no decode. Lane (g, t) of a warp (g = lane // 4, t = lane % 4) owns weight rows g and g + 8 of each of its TILES
16-row tiles and, per chunk of 32 * VEC K, the 16-byte vectors at K 8t + 32v (v < VEC) of each: one load instruction
of the warp reads 64 contiguous bytes of 8 rows. The sum over K does not care which K a slot holds, so each vector
(words w0..w3, 2 bf16 each) feeds two `mma.sync.m16n8k16` as it is, x (8 rows = the B operand's 8 columns) loaded for
the same K:

    mma 1: a0 = row g w0, a1 = row g+8 w0, a2 = row g w1, a3 = row g+8 w1, b0 = x w0, b1 = x w1
    mma 2: the same with w2, w3                          (a second pair per vector for x rows 8..15)

The warps of a program split K (warp w walks the w-th of WARPS K slices) and their accumulators are summed once at
the end. The next chunk's weights and x are loaded while the tensor cores work on this one, the first chunk's
weights before `pdl_wait` (weights are constants). Epilogue: + bias, one bf16 rounding. With SWIGLU a tile's rows g
are gate rows and its rows g + 8 the matching up rows (I rows on), so a lane holds gate and up of the same (m, n) and
writes silu_mul's value with its roundings: the MLP needs no silu_mul launch.

Tile-major weights (`tile_major`; engine/runner/fused_layers.keep_tile_major decides when a copy is kept next to
the row-major weight) put each tile's chunk, 16 rows x 128 K, into 4 contiguous KB in the order the lanes read it, so
one load instruction of a warp reads 512 contiguous bytes instead of 64 bytes of 8 rows; the registers, and so the
results, are the same.
CUDA sm_90 only (inline PTX); the reference is gemv_bf16.gemv_ref.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from . import pdl
from .fused_ops import _round
from .pdl import _sm90, pdl_trigger, pdl_wait
from .w4a16_gemv_mma import _load4, _load_words, _mma


@dataclass(frozen=True)
class MmaDenseConfig:
    tiles: int = 1        # 16-row tiles per program (1, 2 or 4)
    warps: int = 4        # warps per program, each a K slice
    vec: int = 4          # 16-byte vectors per row and lane per chunk (1, 2 or 4): K 32 * vec per chunk
    l2_fetch: int = 0     # 0, 128 or 256: the L2::128B / 256B hint on the weight loads


def default_mma_dense_config(m: int, n: int, k: int) -> MmaDenseConfig:
    """From the H200 sweep at M = 8 and 16 (bench/bench_dense_gemv.py --mma-sweep, bench/RESULTS.md): the longest
    chunks K allows; vocab-sized N one warp per tile over all of K (with the L2::128B hint), the 8B gate/up two
    tiles and two K slices per program, the 8B qkv two tiles and four slices (the 0.5B gate/up, 7 chunks: one tile,
    two slices), few rows (o, down) eight K slices."""
    tiles = n // 16                                                    # swiglu: 8 gate + 8 up rows a tile
    vec = 4 if k % 128 == 0 else 2 if k % 64 == 0 else 1
    chunks = k // (32 * vec)
    if tiles >= 4096:
        return MmaDenseConfig(1, 1, vec, 128)
    if tiles >= 1024:
        return MmaDenseConfig(2, 2, vec)
    if tiles >= 384:
        return MmaDenseConfig(2, 4, vec) if chunks >= 16 else MmaDenseConfig(1, 2, vec)
    return MmaDenseConfig(1, 8, vec)


TILE_BLOCK = 16 * 128        # elements of one tile-major block: 16 rows x 128 K


def tile_major(w: Tensor, swiglu: bool = False) -> Tensor:
    """w [N, K] (N % 16 == 0, K % 128 == 0) -> [N / 16, K / 128, 2048]: 16-row tile j, 128-K chunk c, laid out as
    the lanes of gemv_mma_dense read them (half h = rows g / g + 8, vector v, lane g * 4 + t, 8 values of K
    32v + 8t..). swiglu: w is [gate; up] [2I, K] (I % 8 == 0) and tile j's rows are gate rows 8j.. and their up
    rows, as the kernel's SwiGLU epilogue pairs them."""
    if w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % 128:
        raise ValueError(f"tile_major takes [N % 16 == 0, K % 128 == 0] weights, got {tuple(w.shape)}")
    n, k = w.shape
    if swiglu:                                                         # (h, tile, g, chunk, v, t, e)
        t = w.reshape(2, n // 16, 8, k // 128, 4, 4, 8).permute(1, 3, 0, 4, 2, 5, 6)
    else:                                                              # (tile, h, g, chunk, v, t, e)
        t = w.reshape(n // 16, 2, 8, k // 128, 4, 4, 8).permute(0, 3, 1, 4, 2, 5, 6)
    return t.contiguous().reshape(n // 16, k // 128, TILE_BLOCK)


def _shape(w: Tensor) -> tuple[int, int]:
    """[N, K] of a row-major or tile-major weight."""
    return (16 * w.shape[0], 128 * w.shape[1]) if w.dim() == 3 else tuple(w.shape)


def mma_dense_ok(x: Tensor, w: Tensor) -> bool:
    """Whether gemv_mma_dense takes these operands: bf16 CUDA (sm_90+), M <= 16, K % 32 == 0, N % 16 == 0, rows of
    w 16-byte aligned with unit stride; or a contiguous tile-major w."""
    if not (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and w.dim() in (2, 3) and x.dim() == 2):
        return False
    n, k = _shape(w)
    if w.dim() == 3:
        layout_ok = w.shape[2] == TILE_BLOCK and w.is_contiguous()
    else:
        layout_ok = w.stride(1) == 1 and w.stride(0) % 8 == 0
    return (x.shape[0] <= 16 and x.shape[1] == k and k % 32 == 0 and k > 0 and n % 16 == 0 and n > 0
            and layout_ok and w.data_ptr() % 16 == 0
            and _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()))


LOAD4_NC = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _vector(addr, ok, EVEN: tl.constexpr, L2_FETCH: tl.constexpr):
    """16 bytes of weights at addr; EVEN (every lane in range): unpredicated, with the L2 hint if any."""
    if EVEN and L2_FETCH == 0:
        return tl.inline_asm_elementwise(LOAD4_NC, "=r,=r,=r,=r,l", [addr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    elif EVEN:
        return _load_words(addr, ok, L2_FETCH)
    else:
        return _load4(addr, ok)


@triton.jit
def _row_words(addr, ok, EVEN: tl.constexpr, L2_FETCH: tl.constexpr, VEC: tl.constexpr, VS: tl.constexpr = 64):
    """VEC 16-byte vectors at addr (VS bytes apart: 64 in a row, 512 tile-major) -> 4 * VEC words (zeros where
    ok == 0 unless EVEN). x rows take it with EVEN False: always predicated (rows past M)."""
    w = _vector(addr, ok, EVEN, L2_FETCH)
    for v in tl.static_range(1, VEC):
        w = w + _vector(addr + VS * v, ok, EVEN, L2_FETCH)
    return w


@triton.jit
def _tile_words(addr, row_b_bytes, ok, EVEN: tl.constexpr, L2_FETCH: tl.constexpr, VEC: tl.constexpr,
                VS: tl.constexpr):
    return (_row_words(addr, ok, EVEN, L2_FETCH, VEC, VS), _row_words(addr + row_b_bytes, ok, EVEN, L2_FETCH, VEC, VS))


@triton.jit
def _chunk(rows, off, row_b_bytes, ok, EVEN: tl.constexpr, L2_FETCH: tl.constexpr, VEC: tl.constexpr,
           TILES: tl.constexpr, VS: tl.constexpr):
    """One chunk of every tile: rows = each tile's byte address of row g at K 0, off = the chunk's byte offset ->
    per tile (row g words, row g + 8 words)."""
    w = ()
    for j in tl.static_range(TILES):
        w = w + (_tile_words(rows[j] + off, row_b_bytes, ok, EVEN, L2_FETCH, VEC, VS),)
    return w


@triton.jit
def _mma_tiles(w, x, acc, VEC: tl.constexpr, TILES: tl.constexpr):
    out = ()
    for j in tl.static_range(TILES):
        out = out + (_mma_words(w[j][0], w[j][1], x, acc[j], VEC),)
    return out


@triton.jit
def _mma_words(wa, wb, x, acc, VEC: tl.constexpr):
    """acc (4 fp32) += rows (g: wa, g + 8: wb) times x over this chunk's 4 * VEC words."""
    c0, c1, c2, c3 = acc
    for i in tl.static_range(2 * VEC):
        c0, c1, c2, c3 = _mma(wa[2 * i], wb[2 * i], wa[2 * i + 1], wb[2 * i + 1], x[2 * i], x[2 * i + 1],
                              c0, c1, c2, c3)
    return c0, c1, c2, c3


@triton.jit
def _warp_sum(v, WARPS: tl.constexpr):
    """[32 * WARPS] lane values -> [32]: the sum over the warps (the K slices)."""
    if WARPS == 1:
        return v
    return tl.sum(tl.reshape(v, (WARPS, 32)), axis=0)


@triton.jit
def _store_half(acc, first, m_base, b_ptr, out_ptr, M, N, I, stride_om, HAS_BIAS: tl.constexpr,
                SWIGLU: tl.constexpr, WARPS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """A tile's 4 accumulators for x rows m_base..m_base + 7 (c0, c1: row g, x rows 2t, 2t + 1; c2, c3: row g + 8)
    -> out. first: the tile's first output row (SWIGLU: its first gate row; rows g + 8 are the up rows)."""
    lane = tl.arange(0, 32)
    g, t = lane // 4, lane % 4
    n = first + g
    for j in tl.static_range(2):
        m = m_base + 2 * t + j
        lo = _warp_sum(acc[j], WARPS)                                  # row g
        hi = _warp_sum(acc[j + 2], WARPS)                              # row g + 8 (SWIGLU: g's up row)
        if SWIGLU:
            gate = lo.to(tl.bfloat16).to(tl.float32)                   # the gate_up output's rounding
            up = hi.to(tl.bfloat16).to(tl.float32)
            if LIBDEVICE:
                e = libdevice.exp(-gate)
            else:
                e = tl.exp(-gate)
            s = _round(tl.math.div_rn(gate, 1.0 + e), True)            # as fused_ops._silu_mul_kernel
            tl.store(out_ptr + m * stride_om + n, _round(s * up, True).to(tl.bfloat16), mask=(m < M) & (n < I))
        else:
            if HAS_BIAS:
                lo += tl.load(b_ptr + n).to(tl.float32)
                hi += tl.load(b_ptr + n + 8).to(tl.float32)
            tl.store(out_ptr + m * stride_om + n, lo.to(tl.bfloat16), mask=(m < M) & (n < N))
            tl.store(out_ptr + m * stride_om + n + 8, hi.to(tl.bfloat16), mask=(m < M) & (n + 8 < N))


@triton.jit
def _store_tile(lo, hi, first, b_ptr, out_ptr, M, N, I, stride_om, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                TWO_B: tl.constexpr, WARPS: tl.constexpr, LIBDEVICE: tl.constexpr):
    _store_half(lo, first, 0, b_ptr, out_ptr, M, N, I, stride_om, HAS_BIAS, SWIGLU, WARPS, LIBDEVICE)
    if TWO_B:
        _store_half(hi, first, 8, b_ptr, out_ptr, M, N, I, stride_om, HAS_BIAS, SWIGLU, WARPS, LIBDEVICE)


@triton.jit
def _gemv_mma_dense_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, I, stride_xm, stride_wn, stride_om,
                           TILES: tl.constexpr, WARPS: tl.constexpr, VEC: tl.constexpr, TWO_B: tl.constexpr,
                           EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr,
                           L2_FETCH: tl.constexpr, LIBDEVICE: tl.constexpr, TILED: tl.constexpr):
    pdl_trigger(PDL)
    T: tl.constexpr = 32 * WARPS
    CK: tl.constexpr = 32 * VEC                                        # K per chunk
    ROWS: tl.constexpr = 8 if SWIGLU else 16                           # output rows per tile
    pid = tl.program_id(0)
    lane = tl.arange(0, T)                                             # [T]: one value per thread, lane order
    warp, g, t = lane // 32, (lane % 32) // 4, lane % 4
    chunks = K // CK
    per = tl.cdiv(chunks, WARPS)                                       # chunks per warp (its K slice)
    c0 = warp * per                                                    # the warp's first chunk
    n_out = I if SWIGLU else N
    first = pid * (TILES * ROWS)
    w0 = w_ptr.to(tl.int64, bitcast=True)
    k_byte = (c0.to(tl.int64) * CK + 8 * t) * 2                       # this lane's first byte of K (vector 0)
    rows = ()                                                          # per tile: row g's byte address at k_byte
    if TILED:                                                          # (tile, chunk, h, v, lane): CK = 128
        VS: tl.constexpr = 512                                         # bytes from vector v to v + 1
        CB: tl.constexpr = 16 * CK * 2                                 # bytes from a chunk to the next
        row_b = 4 * VS                                                 # half h = 1 (rows g + 8 / up rows)
        for j in tl.static_range(TILES):                               # (a tile past the end reads the last tile)
            tile = tl.minimum(pid * TILES + j, n_out // ROWS - 1).to(tl.int64)
            rows = rows + (w0 + (tile * chunks + c0) * CB + (lane % 32) * 16,)
    else:
        VS: tl.constexpr = 64
        CB: tl.constexpr = CK * 2
        if SWIGLU:
            row_b = I.to(tl.int64) * stride_wn * 2                     # bytes from gate row g to its up row
        else:
            row_b = stride_wn.to(tl.int64) * 16                        # 8 rows on
        for j in tl.static_range(TILES):
            r = (tl.minimum(first + j * ROWS, n_out - ROWS) + g).to(tl.int64)
            rows = rows + (w0 + r * stride_wn * 2 + k_byte,)
    xa = x_ptr.to(tl.int64, bitcast=True) + g.to(tl.int64) * stride_xm * 2 + k_byte
    zero = tl.zeros((T,), tl.float32)
    acc = ()                                                           # per tile: 4 fp32 for x rows 0..7
    for j in tl.static_range(TILES):
        acc = acc + ((zero, zero, zero, zero),)
    acc8 = acc                                                         # x rows 8..15
    ok = (c0 < chunks).to(tl.int32)
    w = _chunk(rows, 0, row_b, ok, EVEN, L2_FETCH, VEC, TILES, VS)     # the first chunk, before the wait
    pdl_wait(PDL)
    x_lo_ok = (g < M).to(tl.int32)
    x_hi_ok = (g + 8 < M).to(tl.int32)
    x = _row_words(xa, x_lo_ok & ok, False, 0, VEC)                    # x rows g (and g + 8) for the same K
    x8 = x
    if TWO_B:
        x8 = _row_words(xa + 16 * stride_xm, x_hi_ok & ok, False, 0, VEC)
    for i in range(per):                                               # load chunk i + 1, multiply chunk i
        ahead = tl.minimum(i + 1, per - 1)                             # (past the slice: its last chunk again)
        nxt = (c0 + ahead < chunks).to(tl.int32)
        w_n = _chunk(rows, ahead.to(tl.int64) * CB, row_b, nxt, EVEN, L2_FETCH, VEC, TILES, VS)
        off = ahead.to(tl.int64) * (CK * 2)                            # x: row-major
        x_n = _row_words(xa + off, x_lo_ok & nxt, False, 0, VEC)
        x8_n = x_n
        if TWO_B:
            x8_n = _row_words(xa + off + 16 * stride_xm, x_hi_ok & nxt, False, 0, VEC)
        acc = _mma_tiles(w, x, acc, VEC, TILES)
        if TWO_B:
            acc8 = _mma_tiles(w, x8, acc8, VEC, TILES)
        w, x, x8 = w_n, x_n, x8_n
    for j in tl.static_range(TILES):
        if first + j * ROWS < n_out:
            _store_tile(acc[j], acc8[j], first + j * ROWS, b_ptr, out_ptr, M, N, I, stride_om, HAS_BIAS, SWIGLU,
                        TWO_B, WARPS, LIBDEVICE)


def gemv_mma_dense(x: Tensor, w: Tensor, bias: Tensor | None = None, config: MmaDenseConfig | None = None,
                   swiglu: bool = False) -> Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> bf16 [M, N] for operands `mma_dense_ok` accepts; swiglu (no bias): w is
    [gate; up] [2I, K] and the result silu_mul(x @ w^T) [M, I] (I % 8 == 0). w may be `tile_major(w, swiglu)`:
    the same result, bit for bit."""
    if not mma_dense_ok(x, w):
        raise ValueError(f"gemv_mma_dense takes bf16 sm_90 CUDA x [M <= 16, K % 32 == 0] and w [N % 16 == 0, K] with "
                         f"16-byte aligned rows (or tile-major), got x {x.dtype} {tuple(x.shape)} on {x.device}, "
                         f"w {w.dtype} {tuple(w.shape)} stride {w.stride()}")
    n, k = _shape(w)
    if bias is not None and (bias.shape != (n,) or swiglu):
        raise ValueError(f"bias must be [{n}] (and no swiglu), got {tuple(bias.shape)}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:        # 16-byte loads of x rows
        x = x.clone(memory_format=torch.contiguous_format)
    return _launch(x, w, bias, config or default_mma_dense_config(x.shape[0], n, k), swiglu)


def _launch(x: Tensor, w: Tensor, bias: Tensor | None, cfg: MmaDenseConfig, swiglu: bool) -> Tensor:
    n, k = _shape(w)
    m = x.shape[0]
    tiled = w.dim() == 3
    if cfg.tiles not in (1, 2, 4) or cfg.vec not in (1, 2, 4) or cfg.warps not in (1, 2, 4, 8) or k % (32 * cfg.vec) \
            or cfg.l2_fetch not in (0, 128, 256) or (tiled and cfg.vec != 4):
        raise ValueError(f"bad MmaDenseConfig {cfg} for K = {k}: tiles and vec 1, 2 or 4 (4 tile-major), warps 1-8, "
                         "K % (32 * vec) == 0")
    inter = n // 2 if swiglu else n
    out = torch.empty(m, inter, device=x.device, dtype=torch.bfloat16)
    if m == 0:
        return out
    rows = 8 if swiglu else 16
    on, opts = pdl.launch(x)
    _gemv_mma_dense_kernel[(triton.cdiv(inter, rows * cfg.tiles),)](
        x, w, bias if bias is not None else w, out, m, n, k, inter, x.stride(0),
        k if tiled else w.stride(0), out.stride(0),                    # (tile-major: the row stride is unused)
        TILES=cfg.tiles, WARPS=cfg.warps, VEC=cfg.vec, TWO_B=m > 8, EVEN=(k // (32 * cfg.vec)) % cfg.warps == 0,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, PDL=on, L2_FETCH=cfg.l2_fetch, LIBDEVICE=True, TILED=tiled,
        num_warps=cfg.warps, num_stages=1, **opts)
    return out
