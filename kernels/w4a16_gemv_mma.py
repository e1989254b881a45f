"""W4A16 GEMV on register-fed tensor cores: bf16 x [M, K] (M <= 16) @ NVFP4 [N, K]^T -> bf16 [M, N], sm_90.

No shared memory: every lane loads its own weight words and feeds them to `mma.sync.m16n8k16` as the A operand
(16 weight rows x 16 K), x being the B operand (8 columns = 8 rows of x; a second mma for rows 8..15). The sum
over K does not care which K a slot holds, so a lane puts its own words into its A slots and loads x for the
same K. Lane (g, t) of a warp (g = lane // 4, t = lane % 4) owns weight rows g and g + 8 of a 16-row tile and,
per 128-K chunk, the words 4t..4t+3 of each (one 16-byte load per row; the quad reads 64 contiguous bytes).
A word's codes (i, i + 4) form one bf16x2 register, so its 8 codes fill the A slots of two mmas:

    mma 1: a0 = row g (c0, c4), a1 = row g+8 (c0, c4), a2 = row g (c1, c5), a3 = row g+8 (c1, c5), b = x (0, 4), (1, 5)
    mma 2: the same with codes / x (2, 6) and (3, 7)

Decode, 17 instructions per word (inline PTX): a bit select moves each sign 9 bits above its magnitude, then a shift
and a mask per pair of codes put each code under bf16's exponent LSBs / mantissa MSB and its sign bit, which is
E2M1 * 2**-126 (0.5 a subnormal); `mul.rn.bf16x2` by the block scale * 2**64 makes it exact and normal (<= 6
significant bits). The fp32 accumulators get 2**62 * weight_scale_2 at the end.

A warp covers TILES 16-row tiles (x loaded and paired once for all of them) and prefetches the next step's words
and scales while the tensor cores work on this one; a step is UNROLL consecutive chunks (2: each quad reads 128
contiguous bytes of a row per step; lm_head at M = 1 from 114 to 106 us). L2_FETCH = 128 / 256 puts the L2::128B /
256B hint on the weight loads (L2 fetches that many bytes around each 64-byte read of a quad: lm_head at M = 1 from
134 to 114 us), L2_AHEAD prefetches the chunk that many steps ahead into L2 (bench/RESULTS.md). Split-K adds fp32
partials into the zeroed workspace of `w4a16_gemv_words`; the last program of an N block writes bf16 and re-zeroes
it.

Every memory access is inline PTX on tensors of one value per thread, so Triton never changes their layout: the
lane that computes a value is the lane the mma reads it from. CUDA only (sm_90: `mul.rn.bf16x2`).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .w4a16_gemv_words import _workspace

CHUNK_K = tl.constexpr(128)   # logical K per lane step: 4 words per lane, 16 per quad

DECODE = tl.constexpr("""{
.reg .b32 z, t;
shl.b32 t, $2, 6;
lop3.b32 z, $2, t, 0x00770077, 0xE4;
shl.b32 t, z, 6;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, $3;
shl.b32 t, z, 2;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $3;
}""")
# In: $2 = word (code i in bits 4i..4i+3), $3 = bf16x2 (scale * 2**64, twice). Out: $0 = codes (0, 4), $1 = codes
# (1, 5), each times the scale. z (a bit select: the word where 0x00770077 is set, the word << 6 elsewhere) holds
# the magnitudes of codes 0, 1, 4, 5 with their signs 9 bits above them (bits 9, 13, 25, 29; the other bits are
# masked off later); the word shifted right by 8 gives codes (2, 6), (3, 7) the same way.

PAIR_X = tl.constexpr("""{
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
}""")
# In: 8 bf16 of x (K 0..7 of a word) as 4 registers. Out: the B pairs (0, 4), (1, 5), (2, 6), (3, 7).

SCALES = tl.constexpr("{\n.reg .b32 a;\n.reg .f32 f;\n" + "".join(f"""shl.b32 a, $2, {shift};
and.b32 a, a, 0x07F00000;
mov.b32 f, a;
mul.rn.f32 f, f, 0f7B800000;
mul.rn.f32 f, f, 0f5F800000;
cvt.rn.bf16x2.f32 {out}, f, f;
""" for shift, out in ((20, "$0"), (12, "$1"))) + "}")
# In: two fp8 e4m3 scales (low, high byte; sign ignored: scales are >= 0). Out: each as bf16x2 (s * 2**64, twice):
# bits << 20 read as fp32 are s * 2**-120, exact also for subnormal s.

MMA = tl.constexpr(("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
       "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"))


def _predicated_load4(hint: str) -> str:
    """16 bytes at $4 into $0..$3 where $5 != 0, zeros elsewhere; hint: a cache qualifier such as .L1::evict_last."""
    return ("{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n" + "".join(f"mov.b32 ${i}, 0;\n" for i in range(4))
            + f"@p ld.global.nc{hint}.v4.b32 {{$0, $1, $2, $3}}, [$4];\n}}")


LOAD4 = tl.constexpr(_predicated_load4(""))
LOAD4_EVICT_LAST = tl.constexpr(_predicated_load4(".L1::evict_last"))
LOAD4_NO_L1 = tl.constexpr("ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];")
LOAD4_NO_L1_L2_128 = tl.constexpr("ld.global.nc.L1::no_allocate.L2::128B.v4.b32 {$0, $1, $2, $3}, [$4];")
# L1_HINTS: weights (read once) bypass L1 and x (read by every warp) stays there
LOAD4_L2_128 = tl.constexpr("ld.global.nc.L2::128B.v4.b32 {$0, $1, $2, $3}, [$4];")
LOAD4_L2_256 = tl.constexpr("ld.global.nc.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];")
# Weight loads that ask L2 to fetch the 128 / 256 aligned bytes around them from DRAM (a quad reads 64 per row).
LOAD_U16 = tl.constexpr("ld.global.nc.u16 $0, [$1];")
RED = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; @p red.global.add.f32 [$2], $1; }")
LOAD_CG = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0f00000000; @p ld.global.cg.f32 $0, [$1]; }")
STORE_BF16 = tl.constexpr(("{ .reg .pred p; .reg .b16 h; setp.ne.b32 p, $3, 0; cvt.rn.bf16.f32 h, $1; mov.b32 $0, 0; "
              "@p st.global.b16 [$2], h; }"))
PREFETCH_L2 = tl.constexpr("mov.b32 $0, 0; prefetch.global.L2 [$1];")
STORE_ZERO = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p st.global.b32 [$1], 0; }")
# The stores' $0 is a dummy output (an inline-asm op must have one).


@triton.jit
def _load4(addr, ok):
    """16 bytes at addr (int64 byte address per lane) as 4 int32; zeros where ok == 0."""
    return tl.inline_asm_elementwise(LOAD4, "=r,=r,=r,=r,l,r", [addr, ok],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _load_scales(addr):
    """Two fp8 block scales (2 bytes at addr) -> two bf16x2 registers (scale * 2**64, twice)."""
    raw = tl.inline_asm_elementwise(LOAD_U16, "=h,l", [addr], dtype=tl.int16, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(SCALES, "=r,=r,r", [raw.to(tl.int32) & 0xFFFF], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _decode(q, s):
    """word q, scale pair s -> bf16x2 codes (0, 4), (1, 5), (2, 6), (3, 7), each times the scale."""
    p04, p15 = tl.inline_asm_elementwise(DECODE, "=r,=r,r,r", [q, s], dtype=(tl.int32, tl.int32), is_pure=True,
                                         pack=1)
    p26, p37 = tl.inline_asm_elementwise(DECODE, "=r,=r,r,r", [q >> 8, s], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    return p04, p15, p26, p37


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _decode_word(qa, qb, sa, sb):
    """One word column of rows g (qa) and g + 8 (qb) with their scale pairs -> the A registers of its two mmas."""
    a04, a15, a26, a37 = _decode(qa, sa)
    b04, b15, b26, b37 = _decode(qb, sb)
    return a04, b04, a15, b15, a26, b26, a37, b37


@triton.jit
def _decode_tile(w, sc):
    """A 16-row tile's chunk: w = 8 words (row g: 0..3, row g + 8: 4..7), sc = scale pairs (row g: 0, 1; row g + 8:
    2, 3; a pair per two words) -> per word the 8 A registers of its two mmas."""
    return (_decode_word(w[0], w[4], sc[0], sc[2]), _decode_word(w[1], w[5], sc[0], sc[2]),
            _decode_word(w[2], w[6], sc[1], sc[3]), _decode_word(w[3], w[7], sc[1], sc[3]))


@triton.jit
def _mma_tile(A, x, acc, TWO_B: tl.constexpr):
    """The decoded tile A times x = B pairs (16 per 8 rows of x: 4 per word), acc = 8 fp32 (4 used without TWO_B)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = acc
    for i in tl.static_range(4):
        a = A[i]
        c0, c1, c2, c3 = _mma(a[0], a[1], a[2], a[3], x[4 * i], x[4 * i + 1], c0, c1, c2, c3)
        c0, c1, c2, c3 = _mma(a[4], a[5], a[6], a[7], x[4 * i + 2], x[4 * i + 3], c0, c1, c2, c3)
        if TWO_B:
            c4, c5, c6, c7 = _mma(a[0], a[1], a[2], a[3], x[16 + 4 * i], x[17 + 4 * i], c4, c5, c6, c7)
            c4, c5, c6, c7 = _mma(a[4], a[5], a[6], a[7], x[18 + 4 * i], x[19 + 4 * i], c4, c5, c6, c7)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _x_block(xa, stride_xm, g, M, TWO_B: tl.constexpr, L1_HINTS: tl.constexpr):
    """B pairs of x rows g (and 8 + g with TWO_B) for this lane's chunk; rows past M read as zeros."""
    x = _load_x(xa, (g < M).to(tl.int32), L1_HINTS)
    if TWO_B:
        x = x + _load_x(xa + 16 * stride_xm, (g + 8 < M).to(tl.int32), L1_HINTS)
    return x


@triton.jit
def _load_words(addr, ones, L2_FETCH: tl.constexpr, L1_HINTS: tl.constexpr = False):
    if L1_HINTS and L2_FETCH == 128:
        return tl.inline_asm_elementwise(LOAD4_NO_L1_L2_128, "=r,=r,=r,=r,l", [addr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    elif L1_HINTS and L2_FETCH == 0:
        return tl.inline_asm_elementwise(LOAD4_NO_L1, "=r,=r,=r,=r,l", [addr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    elif L2_FETCH == 256:
        return tl.inline_asm_elementwise(LOAD4_L2_256, "=r,=r,=r,=r,l", [addr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    elif L2_FETCH == 128:
        return tl.inline_asm_elementwise(LOAD4_L2_128, "=r,=r,=r,=r,l", [addr],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        return _load4(addr, ones)


@triton.jit
def _load_tile(q_addr, s_addr, q_row_bytes, s_row_bytes, ones, L2_FETCH: tl.constexpr, L1_HINTS: tl.constexpr):
    """A tile's chunk at byte addresses q_addr (row g's 4 words) and s_addr (its 2 scales); row g + 8 is 8 rows on
    -> (8 words, 4 scale pairs)."""
    a0, a1, a2, a3 = _load_words(q_addr, ones, L2_FETCH, L1_HINTS)
    b0, b1, b2, b3 = _load_words(q_addr + 8 * q_row_bytes, ones, L2_FETCH, L1_HINTS)
    sa0, sa1 = _load_scales(s_addr)
    sb0, sb1 = _load_scales(s_addr + 8 * s_row_bytes)
    return (a0, a1, a2, a3, b0, b1, b2, b3), (sa0, sa1, sb0, sb1)


@triton.jit
def _load_chunks(q_addr, s_addr, q_row_bytes, s_row_bytes, ones, L2_FETCH: tl.constexpr, UNROLL: tl.constexpr,
                 L1_HINTS: tl.constexpr):
    """UNROLL consecutive chunks of a tile (each 64 bytes of words and 8 of scales on) -> a tuple of _load_tile's."""
    t = ()
    for u in tl.static_range(UNROLL):
        t = t + (_load_tile(q_addr + 64 * u, s_addr + 8 * u, q_row_bytes, s_row_bytes, ones, L2_FETCH, L1_HINTS),)
    return t


@triton.jit
def _x_pairs(addr, ok, L1_HINTS: tl.constexpr):
    """8 bf16 of x at addr -> the B pairs (0, 4), (1, 5), (2, 6), (3, 7); zeros where ok == 0."""
    if L1_HINTS:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(LOAD4_EVICT_LAST, "=r,=r,=r,=r,l,r", [addr, ok],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
    else:
        r0, r1, r2, r3 = _load4(addr, ok)
    return tl.inline_asm_elementwise(PAIR_X, "=r,=r,=r,=r,r,r,r,r", [r0, r1, r2, r3],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _load_x(addr, ok, L1_HINTS: tl.constexpr):
    """32 bf16 of one x row at addr (this lane's 4 words of K) -> 16 B pairs, zeros where ok == 0."""
    return (_x_pairs(addr, ok, L1_HINTS) + _x_pairs(addr + 16, ok, L1_HINTS) + _x_pairs(addr + 32, ok, L1_HINTS)
            + _x_pairs(addr + 48, ok, L1_HINTS))


@triton.jit
def _tile_out(acc, rows, t, out_addr, work_addr, M, N, stride_om, scale, scale_2_ptr, LAST: tl.constexpr,
              ATOMIC: tl.constexpr, TWO_B: tl.constexpr, ROW_SCALE: tl.constexpr):
    """A tile's accumulators -> bf16 out[m, n] (ATOMIC == 0), workspace partials (ATOMIC, not LAST) or, for the last
    split (LAST), the workspace's sums -> out, the workspace re-zeroed. acc i: n = rows + 8 * ((i // 2) % 2),
    m = 2t + i % 2 + 8 * (i // 4). ROW_SCALE: weight_scale_2 is per output row (stacked layers), read here."""
    for i in tl.static_range(8 if TWO_B else 4):
        m = 2 * t + (i % 2) + 8 * (i // 4)
        n = rows + 8 * ((i // 2) % 2)
        ok = ((m < M) & (n < N)).to(tl.int32)
        if ROW_SCALE and not LAST:
            scale = tl.load(scale_2_ptr + tl.minimum(n, N - 1)) * 4.611686018427388e18
        v = acc[i] * scale
        if not ATOMIC:
            tl.inline_asm_elementwise(STORE_BF16, "=r,f,l,r", [v, out_addr + (m.to(tl.int64) * stride_om + n) * 2, ok],
                                      dtype=tl.int32, is_pure=False, pack=1)
        elif not LAST:
            tl.inline_asm_elementwise(RED, "=r,f,l,r", [v, work_addr + (m.to(tl.int64) * N + n) * 4, ok],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            w_addr = work_addr + (m.to(tl.int64) * N + n) * 4
            total = tl.inline_asm_elementwise(LOAD_CG, "=f,l,r", [w_addr, ok], dtype=tl.float32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(STORE_BF16, "=r,f,l,r", [total, out_addr + (m.to(tl.int64) * stride_om + n) * 2,
                                      ok], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(STORE_ZERO, "=r,l,r", [w_addr, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tiles_out(acc_a, acc_b, rows, t, o0, w0, M, N, stride_om, scale, scale_2_ptr, LAST: tl.constexpr,
               ATOMIC: tl.constexpr, TWO_B: tl.constexpr, TILES: tl.constexpr, ROW_SCALE: tl.constexpr):
    _tile_out(acc_a, rows, t, o0, w0, M, N, stride_om, scale, scale_2_ptr, LAST, ATOMIC, TWO_B, ROW_SCALE)
    if TILES == 2:
        _tile_out(acc_b, rows + 16, t, o0, w0, M, N, stride_om, scale, scale_2_ptr, LAST, ATOMIC, TWO_B, ROW_SCALE)


@triton.jit(do_not_specialize=["CHUNKS_PER_SPLIT", "SPLIT_K"])
def _gemv_mma_kernel(x_ptr, q_ptr, scale_ptr, scale_2_ptr, out_ptr, work_ptr, count_ptr, M, N, K, stride_xm,
                     stride_om, CHUNKS_PER_SPLIT, SPLIT_K, TILES: tl.constexpr, WARPS: tl.constexpr,
                     TWO_B: tl.constexpr, ATOMIC: tl.constexpr, L2_AHEAD: tl.constexpr,
                     L2_FETCH: tl.constexpr, UNROLL: tl.constexpr, ROW_SCALE: tl.constexpr,
                     L1_HINTS: tl.constexpr):
    T: tl.constexpr = 32 * WARPS
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    lane = tl.arange(0, T)                                             # [T]: one value per thread, lane order
    warp, g, t = lane // 32, (lane % 32) // 4, lane % 4
    tile = (pid_n * WARPS + warp) * (16 * TILES)                       # the warp's first row
    rows = tile + g
    c_lo = pid_k * CHUNKS_PER_SPLIT
    c_hi = tl.minimum(c_lo + CHUNKS_PER_SPLIT, K // CHUNK_K)
    q_row, s_row = K // 2, K // 16                                     # bytes per weight row / scale row
    q0 = q_ptr.to(tl.int64, bitcast=True)
    s0 = scale_ptr.to(tl.int64, bitcast=True)
    # N % 16 == 0: a tile past N reads the last tile (its results are not stored)
    ra = (tl.minimum(tile, N - 16) + g).to(tl.int64)
    qa = q0 + ra * q_row + 16 * t + 64 * c_lo                          # byte address of word 4t, chunk c_lo
    sa = s0 + ra * s_row + 2 * t + 8 * c_lo
    rb = (tl.minimum(tile + 16, N - 16) + g).to(tl.int64)
    qb = q0 + rb * q_row + 16 * t + 64 * c_lo
    sb = s0 + rb * s_row + 2 * t + 8 * c_lo
    xa = x_ptr.to(tl.int64, bitcast=True) + (g.to(tl.int64) * stride_xm + 128 * c_lo + 32 * t) * 2
    ones = tl.full((T,), 1, tl.int32)
    zero = tl.zeros((T,), tl.float32)
    acc_a = (zero, zero, zero, zero, zero, zero, zero, zero)
    acc_b = (zero, zero, zero, zero, zero, zero, zero, zero)
    wa = _load_chunks(qa, sa, q_row, s_row, ones, L2_FETCH, UNROLL, L1_HINTS)   # per chunk of the step: (words, scales)
    wb = wa
    if TILES == 2:
        wb = _load_chunks(qb, sb, q_row, s_row, ones, L2_FETCH, UNROLL, L1_HINTS)
    for c in range(c_lo, c_hi, UNROLL):
        if L2_AHEAD > 0:                                               # chunk c + L2_AHEAD into L2 (the last one)
            ahead = (tl.minimum(c + L2_AHEAD, c_hi - 1) - c).to(tl.int64) * 64
            tl.inline_asm_elementwise(PREFETCH_L2, "=r,l", [qa + ahead], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(PREFETCH_L2, "=r,l", [qa + ahead + 8 * q_row], dtype=tl.int32, is_pure=False,
                                      pack=1)
            if TILES == 2:
                tl.inline_asm_elementwise(PREFETCH_L2, "=r,l", [qb + ahead], dtype=tl.int32, is_pure=False, pack=1)
                tl.inline_asm_elementwise(PREFETCH_L2, "=r,l", [qb + ahead + 8 * q_row], dtype=tl.int32,
                                          is_pure=False, pack=1)
        step = (c + UNROLL < c_hi).to(tl.int64)                        # prefetch the next step (the last re-reads)
        qa += 64 * UNROLL * step
        sa += 8 * UNROLL * step
        wa_n = _load_chunks(qa, sa, q_row, s_row, ones, L2_FETCH, UNROLL, L1_HINTS)
        wb_n = wa_n
        if TILES == 2:
            qb += 64 * UNROLL * step
            sb += 8 * UNROLL * step
            wb_n = _load_chunks(qb, sb, q_row, s_row, ones, L2_FETCH, UNROLL, L1_HINTS)
        for u in tl.static_range(UNROLL):
            x = _x_block(xa + 256 * u, stride_xm, g, M, TWO_B, L1_HINTS)
            acc_a = _mma_tile(_decode_tile(wa[u][0], wa[u][1]), x, acc_a, TWO_B)
            if TILES == 2:                                             # the same x, a second weight tile
                acc_b = _mma_tile(_decode_tile(wb[u][0], wb[u][1]), x, acc_b, TWO_B)
        xa += 256 * UNROLL
        wa, wb = wa_n, wb_n
    scale = tl.load(scale_2_ptr) * 4.611686018427388e18                # 2**62 undoes 2**-126 * 2**64
    o0 = out_ptr.to(tl.int64, bitcast=True)
    w0 = work_ptr.to(tl.int64, bitcast=True)
    _tiles_out(acc_a, acc_b, rows, t, o0, w0, M, N, stride_om, scale, scale_2_ptr, False, ATOMIC, TWO_B, TILES,
               ROW_SCALE)
    if ATOMIC:
        tl.debug_barrier()                                             # this program's partials all issued
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:   # the block's last split
            _tiles_out(acc_a, acc_b, rows, t, o0, w0, M, N, stride_om, scale, scale_2_ptr, True, ATOMIC, TWO_B, TILES,
                       ROW_SCALE)
            tl.store(count_ptr + pid_n, 0)


def gemv_mma(x: Tensor, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, tiles: int = 2,
             warps: int = 4, split_k: int = 1, l2_ahead: int = 0, l2_fetch: int = 0, unroll: int = 1,
             l1_hints: bool = False) -> Tensor:
    """x [M, K] (M <= 16, bf16, unit stride along K, K % 128 == 0) @ NVFP4 [N, K]^T -> bf16 [M, N] (N >= 16).
    weight_scale_2: a scalar, or one per output row [N] (layers stacked along N). Arguments checked by w4a16_gemv;
    CUDA sm_90 only."""
    m, k = x.shape
    n = packed.shape[0]
    if x.data_ptr() % 16 or x.stride(0) % 8:     # 16-byte loads of x rows
        x = x.clone(memory_format=torch.contiguous_format)
    if packed.data_ptr() % 16 or not packed.is_contiguous():
        packed = packed.clone(memory_format=torch.contiguous_format)
    if weight_scale.data_ptr() % 2 or not weight_scale.is_contiguous():
        weight_scale = weight_scale.clone(memory_format=torch.contiguous_format)
    if m > 16:
        raise ValueError(f"the mma GEMV takes M <= 16 rows of x, got {m}")
    out = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    if m == 0:
        return out
    chunks = k // CHUNK_K.value
    if unroll not in (1, 2) or chunks % unroll:
        raise ValueError(f"unroll must be 1 or 2 and divide the {chunks} 128-K chunks, got {unroll}")
    if l1_hints and l2_fetch not in (0, 128):
        raise ValueError(f"l1_hints go with l2_fetch 0 or 128, got {l2_fetch}")
    per_split = triton.cdiv(triton.cdiv(chunks, split_k), unroll) * unroll   # whole steps per split
    split = triton.cdiv(chunks, per_split)
    blocks = triton.cdiv(n, 16 * tiles * warps)
    work, count = _workspace(x.device, n, blocks) if split > 1 else (out, out)
    row_scale = weight_scale_2.numel() > 1
    if row_scale and weight_scale_2.numel() != n:
        raise ValueError(f"weight_scale_2 must be a scalar or one per row ({n}), got {tuple(weight_scale_2.shape)}")
    _gemv_mma_kernel[(blocks, split)](x, packed, weight_scale.view(torch.uint8),
                                      weight_scale_2.float().reshape(-1).contiguous(),
                                      out, work, count, m, n, k, x.stride(0), out.stride(0), per_split, split,
                                      TILES=tiles, WARPS=warps, TWO_B=m > 8, ATOMIC=split > 1, L2_AHEAD=l2_ahead,
                                      L2_FETCH=l2_fetch, UNROLL=unroll, ROW_SCALE=row_scale, L1_HINTS=l1_hints,
                                      num_warps=warps,
                                      num_stages=1)
    return out
