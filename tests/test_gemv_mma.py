"""The register-fed mma GEMV (kernels/w4a16_gemv_mma.py) without a GPU: its inline PTX run by the emulator of
e2m1_prmt (every code in every position, every fp8 scale), and the kernel compiled for sm_90 (ptxas checks the PTX;
the SASS has no shared memory and the expected mma count). tests/gpu/test_gemv_mma_gpu.py runs it on an H200."""

import pytest
import torch

from bench_scripts import load_bench
from dspark_serve.kernels import e2m1_prmt, nvfp4_ref
from dspark_serve.kernels import w4a16_gemv as g
from dspark_serve.kernels import w4a16_gemv_mma as mma

sass_loop = load_bench("sass_loop")
CODES = nvfp4_ref.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
FP8 = [b for b in range(0x7F)]                                        # every non-negative e4m3 but NaN


def _bf16(bits: int) -> float:
    return float(torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


def _fp8(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def test_scales_every_fp8_value():
    """Two fp8 block scales -> bf16x2 (s * 2**64, twice), exact down to the fp8 subnormals."""
    for lo in FP8:
        hi = (lo * 29 + 5) % 0x7F
        a, b = e2m1_prmt.emulate(mma.SCALES.value, [lo | hi << 8], 2)
        for reg, byte in ((a, lo), (b, hi)):
            assert _bf16(reg) == _bf16(reg >> 16) == _fp8(byte) * 2.0 ** 64, (hex(byte), hex(reg))


@pytest.mark.parametrize("scale", [0x7E, 0x38, 0x08, 0x01, 0x05, 0x00])     # 448, 1, 2**-6, fp8 subnormals, 0
def test_decode_every_code_in_every_position(scale):
    """DECODE of a word and of the word >> 8 (arithmetic, as the kernel shifts it) -> codes (0, 4), (1, 5), (2, 6),
    (3, 7) as bf16x2, each exactly code * scale * 2**-62."""
    s2 = e2m1_prmt.emulate(mma.SCALES.value, [scale], 2)[0]
    s = _fp8(scale)
    for pos in range(8):
        for code in range(16):
            word = (0x9E3779B9 * (code + 16 * pos + 1)) & 0xFFFFFFFF
            word = word & ~(0xF << 4 * pos) | code << 4 * pos
            signed = word - (1 << 32) if word >> 31 else word
            p04, p15 = e2m1_prmt.emulate(mma.DECODE.value, [word, s2], 2)
            p26, p37 = e2m1_prmt.emulate(mma.DECODE.value, [(signed >> 8) & 0xFFFFFFFF, s2], 2)
            order = {0: (p04, 0), 4: (p04, 16), 1: (p15, 0), 5: (p15, 16), 2: (p26, 0), 6: (p26, 16), 3: (p37, 0),
                     7: (p37, 16)}
            for i, (reg, shift) in order.items():
                c = (word >> 4 * i) & 15
                got, want = _bf16(reg >> shift), CODES[c] * s * 2.0 ** -62
                assert got == want and (c != 8 or (reg >> shift) & 0x8000), (pos, code, i, got, want)


def test_pair_x_matches_the_decode_order():
    regs = [0x11110000 + i for i in range(4)]                         # x[2j] low half, x[2j + 1] high half
    halves = [r >> s & 0xFFFF for r in regs for s in (0, 16)]       # x0..x7
    got = e2m1_prmt.emulate(mma.PAIR_X.value, regs, 4)
    assert got == [halves[i] | halves[i + 4] << 16 for i in range(4)]


@pytest.mark.parametrize("m,n,k,split,fetch,unroll,rows", [(1, 96, 512, 1, 0, 1, 0), (7, 64, 1024, 4, 128, 1, 0),
                                                           (9, 4096, 256, 1, 256, 1, 0), (16, 160, 384, 2, 0, 1, 0),
                                                           (8, 4096, 1024, 2, 128, 2, 0), (1, 96, 512, 1, 0, 2, 0),
                                                           (7, 1280, 1024, 4, 128, 1, 1), (7, 1280, 1024, 1, 0, 2, 1),
                                                           (1, 4096, 1024, 1, 128, 2, 2), (9, 96, 512, 1, 0, 1, 2)])
def test_mma_kernel_compiles_without_shared_memory(m, n, k, split, fetch, unroll, rows):
    """rows: 1 weight_scale_2 per output row (stacked q/k/v or gate/up); 2 the L1 hints (a scalar scale)."""
    x, packed = torch.randn(m, k).bfloat16(), torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    (fn, args, kw), = sass_loop.record_launches(mma, ("_gemv_mma_kernel",), lambda: mma.gemv_mma(
        x, packed, scale, torch.ones(n) if rows == 1 else torch.ones(()), split_k=split, l2_fetch=fetch,
        unroll=unroll, l1_hints=rows == 2))
    assert kw["TWO_B"] == (m > 8) and kw["ATOMIC"] == (split > 1) and kw["UNROLL"] == unroll
    assert kw["ROW_SCALE"] == (rows == 1) and kw["L1_HINTS"] == (rows == 2)
    kernel = sass_loop.compile_sm90(fn, args, kw)
    ptx = kernel.asm["ptx"]
    assert ("L1::no_allocate" in ptx and "L1::evict_last" in ptx) == (rows == 2)
    assert kernel.metadata.shared <= 16                               # split-K: the counter's broadcast only
    prof = sass_loop.profile("mma", kernel, 16 * 16 * kw["TILES"] * kw["WARPS"] * unroll, kw["WARPS"])
    want = 8 * kw["TILES"] * (2 if m > 8 else 1) * unroll                # per chunk: 2 per word column and B
    assert kernel.asm["sass"].count("HMMA") == want and prof.by_class["mma"] >= want - 1   # (one may sit at the top)
    assert prof.by_class["shared"] == 0 and prof.per_word < 32
    assert "LDL" not in kernel.asm["sass"]                            # no spills


def test_configs_and_bad_shapes():
    cfg = g.mma_config(151936, 4096)
    assert cfg.mma and cfg.split_k == 1 and cfg.block_n == 128 and cfg.l2_ahead == 0
    lm_head = g.default_gemv_config(1, 151936, 4096, mma_ok=True)
    assert (lm_head.block_n, lm_head.num_warps, lm_head.split_k, lm_head.l2_fetch, lm_head.unroll) == (64, 4, 1, 128, 2)
    assert lm_head.l1_hints and not g.default_gemv_config(8, 151936, 4096, mma_ok=True).l1_hints
    fc = g.default_gemv_config(8, 4096, 20480, mma_ok=True)
    assert (fc.block_n, fc.num_warps, fc.split_k, fc.l2_fetch, fc.unroll) == (128, 4, 16, 128, 2)
    assert g.default_gemv_config(8, 4096, 4096, mma_ok=True).unroll == 1                  # q/o
    assert g.default_gemv_config(1, 4096, 20480, mma_ok=True).unroll == 1
    lm_head = g.default_gemv_config(8, 151936, 4096, mma_ok=True)
    assert (lm_head.block_n, lm_head.num_warps, lm_head.split_k, lm_head.l2_fetch) == (256, 8, 2, 128)
    assert g.mma_config(4096, 20480).split_k == 16 and g.mma_config(1024, 256).split_k == 2   # 8 warps per SM
    assert g.default_gemv_config(7, 4096, 4096, mma_ok=True).mma
    assert not g.default_gemv_config(7, 4096, 4096).mma and not g.default_gemv_config(7, 4096, 4100, mma_ok=True).mma
    assert not g.default_gemv_config(17, 4096, 4096, mma_ok=True).mma
    with pytest.raises(ValueError, match="M <= 16"):
        mma.gemv_mma(torch.randn(17, 256).bfloat16(), torch.zeros(64, 128, dtype=torch.uint8),
                     torch.ones(64, 16).to(torch.float8_e4m3fn), torch.ones(()))
    x = torch.randn(3, 256).bfloat16()
    packed, scale = torch.zeros(64, 128, dtype=torch.uint8), torch.ones(64, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="sm_90"):
        g.w4a16_gemv(x, packed, scale, torch.ones(()), g.mma_config(64, 256))
    with pytest.raises(ValueError, match="mma kernel needs"):
        g.w4a16_gemv(x, packed, scale, torch.ones(()), g.GemvConfig(48, 128, mma=True))
    with pytest.raises(ValueError, match="one per row"):
        mma.gemv_mma(x, packed, scale, torch.ones(3))
    with pytest.raises(ValueError, match="unroll must be 1 or 2"):                    # 3 chunks, 2 per step
        mma.gemv_mma(torch.randn(3, 384).bfloat16(), torch.zeros(64, 192, dtype=torch.uint8),
                     torch.ones(64, 24).to(torch.float8_e4m3fn), torch.ones(()), unroll=2)
    with pytest.raises(ValueError, match="l1_hints go with l2_fetch 0 or 128"):
        mma.gemv_mma(x, packed, scale, torch.ones(()), l2_fetch=256, l1_hints=True)
    assert g.mma_config(4096, 20480, unroll=2).split_k == 16 and g.mma_config(1024, 256, unroll=2).split_k == 1
