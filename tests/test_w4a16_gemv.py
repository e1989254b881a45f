"""W4A16 GEMV (M <= 64) vs w4a16_gemm_ref under the Triton CPU interpreter (small shapes).

Reruns itself in a child process with TRITON_INTERPRET=1 (see tests/test_kernels_nvfp4.py for why). The interpreter
truncates fp32 -> bf16 stores instead of rounding, so bf16 outputs are compared to within one bf16 ulp.
"""


import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_gemv_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels import nvfp4_ref
    from dspark_serve.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref
    from dspark_serve.kernels.w4a16_gemv import GemvConfig, e2m1_value, w4a16_gemv, words_config
    from dspark_serve.kernels.w4a16_gemv_words import e2m1_subnormal, spread_signs

    import triton
    import triton.language as tl

    def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n)[:, None]   # fp8 subnormal .. large scales
        w[0, :16] = 0.0
        return w

    def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
        return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))

    def _close(got: torch.Tensor, x: torch.Tensor, packed, scale, scale_2) -> None:
        """One bf16 rounding of the reference, plus another fp32 summation order's error, which is relative to
        sum |x * w| (it dominates where the output cancels)."""
        ref = w4a16_gemm_ref(x, packed, scale, scale_2).float()
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        slack = 2 ** -18 * (x.float().abs() @ nvfp4_ref.dequantize(packed, scale, scale_2).abs().T)
        assert ((got.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6 + slack).all()

    @triton.jit
    def _decode_kernel(code_ptr, out_ptr):
        c = tl.load(code_ptr + tl.arange(0, 16))
        tl.store(out_ptr + tl.arange(0, 16), e2m1_value(c))

    def test_e2m1_value_all_codes():
        codes = torch.arange(16, dtype=torch.int32)
        out = torch.empty(16)
        _decode_kernel[(1,)](codes, out)
        mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        assert out.tolist() == mags + [-v for v in mags]
        assert out[8].item() == 0.0

    @triton.jit
    def _words_decode_kernel(q_ptr, out_ptr):
        q = tl.load(q_ptr + tl.arange(0, 16))[:, None]                          # [16, 1] words
        za, zb = spread_signs(q)
        w = e2m1_subnormal(za, zb, tl.arange(0, 8)[None, :])                    # [16, 8]
        tl.store(out_ptr + tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :], w)

    def test_e2m1_subnormal_all_codes_all_positions():
        codes = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16     # word w, code i: (w + i) % 16
        words = (codes << (4 * torch.arange(8))).sum(1).to(torch.int64)
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        out = torch.empty(16, 8)
        _words_decode_kernel[(1,)](words, out)
        assert torch.equal(out.double() * 2.0 ** 126, nvfp4_ref.e2m1_decode(codes.to(torch.uint8)).double())

    @pytest.mark.parametrize("m", [1, 3, 8, 16])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("bn,bk,split", [(8, 64, 1), (4, 128, 3), (16, 64, 8)])
    def test_gemv_words_matches_ref(m, dtype, bn, bk, split):
        n, k = 70, 464                                                  # ragged N; K % 32 == 16
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=7))
        x = _x(m, k).to(dtype)
        cfg = GemvConfig(bn, bk, split, num_warps=2, words=True)
        for _ in range(2):                                              # the split-K workspace is left zeroed
            _close(w4a16_gemv(x, packed, scale, scale_2, config=cfg), x, packed, scale, scale_2)

    def test_words_config_fills_waves():
        assert words_config(4096, 4096, 16, 1024, 4).split_k == 4       # 256 tiles -> 4 steps of 1024
        assert words_config(151936, 4096, 16, 1024, 4).split_k == 1

    @pytest.mark.parametrize("m,n,k", [(1, 64, 256), (1, 37, 1056), (2, 40, 160), (7, 80, 512), (16, 48, 96),
                                       (16, 33, 1024), (5, 16, 32), (21, 40, 256), (56, 24, 160)])
    def test_gemv_default_config_matches_ref(m, n, k):
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=m + n))
        x = _x(m, k).to(torch.bfloat16)
        _close(w4a16_gemv(x, packed, scale, scale_2), x, packed, scale, scale_2)
        _close(w4a16_gemm(x, packed, scale, scale_2), x, packed, scale, scale_2)  # the GEMM sends M <= 64 here

    @pytest.mark.parametrize("m,cfg", [
        (1, GemvConfig(8, 64, split_k=3)), (1, GemvConfig(32, 128, split_k=2, use_dot=True)),
        (3, GemvConfig(16, 32, split_k=4, use_dot=True)), (16, GemvConfig(64, 128, use_dot=True)),
        (1, GemvConfig(16, 1024)), (1, GemvConfig(8, 64, split_k=3, join=False)),
        (1, GemvConfig(16, 512, join=False)), (7, GemvConfig(64, 128, use_dot=True, prmt=True)),
        (16, GemvConfig(32, 32, split_k=4, use_dot=True)), (5, GemvConfig(16, 64, split_k=2, use_dot=True, prmt=True)),
        (33, GemvConfig(32, 64, split_k=2, use_dot=True)), (64, GemvConfig(16, 128, use_dot=True, prmt=True))])
    def test_gemv_configs_match_ref(m, cfg):
        n, k = 70, 480                                                  # ragged N and K tails
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=3))
        x = _x(m, k).to(torch.bfloat16)
        _close(w4a16_gemv(x, packed, scale, scale_2, config=cfg), x, packed, scale, scale_2)

    def test_gemv_rejects_scale_bf16_of_another_shape():
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(32, 256, seed=4))
        x = _x(7, 256).to(torch.bfloat16)
        with pytest.raises(ValueError, match="scale_bf16 must have weight_scale's shape"):
            w4a16_gemv(x, packed, scale, scale_2, GemvConfig(64, 128, use_dot=True, prmt=True),
                       scale_bf16=scale.to(torch.bfloat16).T.contiguous())

    def test_gemv_fp32_and_strided_x():
        n, k = 24, 128
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=5))
        x = _x(k, 4).T                                                  # non-contiguous fp32 [4, K]
        _close(w4a16_gemv(x, packed, scale, scale_2), x, packed, scale, scale_2)

    def test_gemv_rejects_large_m():
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(16, 32))
        with pytest.raises(ValueError, match="M <= 64"):
            w4a16_gemv(torch.randn(65, 32), packed, scale, scale_2)
        with pytest.raises(ValueError, match="words kernel handles M <= 16"):
            w4a16_gemv(torch.randn(17, 32), packed, scale, scale_2, config=GemvConfig(8, 64, words=True))
        with pytest.raises(ValueError):
            w4a16_gemv(torch.randn(1, 32), packed, scale, scale_2, config=GemvConfig(8, 96, words=True))
