"""W4A16 GEMV (M <= 16) vs w4a16_gemm_ref under the Triton CPU interpreter (small shapes).

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
    from dspark_serve.kernels.w4a16_gemv import GemvConfig, e2m1_value, w4a16_gemv

    import triton
    import triton.language as tl

    def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n)[:, None]   # fp8 subnormal .. large scales
        w[0, :16] = 0.0
        return w

    def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-6)

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

    @pytest.mark.parametrize("m,n,k", [(1, 64, 256), (1, 37, 1056), (2, 40, 160), (7, 80, 512), (16, 48, 96),
                                       (16, 33, 1024), (5, 16, 32)])
    def test_gemv_default_config_matches_ref(m, n, k):
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=m + n))
        x = torch.randn(m, k).to(torch.bfloat16)
        ref = w4a16_gemm_ref(x, packed, scale, scale_2)
        _close(w4a16_gemv(x, packed, scale, scale_2), ref)
        _close(w4a16_gemm(x, packed, scale, scale_2), ref)          # the GEMM dispatches M <= 16 here

    @pytest.mark.parametrize("m,cfg", [
        (1, GemvConfig(8, 64, split_k=3)), (1, GemvConfig(32, 128, split_k=2, use_dot=True)),
        (3, GemvConfig(16, 32, split_k=4, use_dot=True)), (16, GemvConfig(64, 128, use_dot=True)),
        (1, GemvConfig(16, 1024)), (1, GemvConfig(8, 64, split_k=3, join=False)),
        (1, GemvConfig(16, 512, join=False))])
    def test_gemv_configs_match_ref(m, cfg):
        n, k = 70, 480                                                  # ragged N and K tails
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=3))
        x = torch.randn(m, k).to(torch.bfloat16)
        _close(w4a16_gemv(x, packed, scale, scale_2, config=cfg), w4a16_gemm_ref(x, packed, scale, scale_2))

    def test_gemv_fp32_and_strided_x():
        n, k = 24, 128
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(n, k, seed=5))
        x = torch.randn(k, 4).T                                         # non-contiguous fp32 [4, K]
        _close(w4a16_gemv(x, packed, scale, scale_2), w4a16_gemm_ref(x, packed, scale, scale_2))

    def test_gemv_rejects_large_m():
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(16, 32))
        with pytest.raises(ValueError):
            w4a16_gemv(torch.randn(17, 32), packed, scale, scale_2)
