"""NVFP4 Triton kernels vs their references under the Triton CPU interpreter (small shapes).

Triton picks the interpreter when a kernel is *decorated* (module import), so a process that imported the
kernels without TRITON_INTERPRET=1 cannot switch: the tests then rerun this file in a child process with it set.
Interpreter caveats: bf16 tl.dot multiplies raw bits (the GEMM wrapper upcasts to fp32 on CPU tensors), and
fp32->bf16 stores truncate instead of rounding, so bf16 outputs are compared to within one bf16 ulp.
"""


import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_kernels_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels import nvfp4, nvfp4_ref
    from dspark_serve.kernels.w4a16_gemm import GemmConfig, w4a16_gemm, w4a16_gemm_ref

    def _bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(n, k, generator=g) * torch.logspace(-5, 3, n)[:, None]   # spans fp8 subnormal scales
        w[0, :16] = 0.0                                                          # an all-zero block
        return w

    @pytest.mark.parametrize("shape", [(1, 16), (16, 128), (37, 48), (64, 272)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_quantize_byte_exact(shape, dtype):
        w = _weight(*shape).to(dtype)
        got, ref = nvfp4.quantize(w, use_triton=True), nvfp4_ref.quantize(w)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))

    @pytest.mark.parametrize("shape", [(16, 128), (37, 48)])
    def test_dequantize_matches_ref(shape):
        packed, scale, scale_2 = nvfp4_ref.quantize(_weight(*shape))
        for dtype in (torch.float32, torch.float16):
            got = nvfp4.dequantize(packed, scale, scale_2, dtype, use_triton=True)
            assert torch.equal(got, nvfp4_ref.dequantize(packed, scale, scale_2, dtype))
        got = nvfp4.dequantize(packed, scale, scale_2, torch.bfloat16, use_triton=True).float()
        ref = nvfp4_ref.dequantize(packed, scale, scale_2, torch.float32)
        torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=0)

    def test_decode_bytes_in_kernel():
        packed = torch.tensor([[0x22, 0xAA, 0x31, 0, 0, 0, 0, 0]], dtype=torch.uint8)
        w = nvfp4.dequantize(packed, torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(1.0), use_triton=True)
        assert w[0, :6].tolist() == [1.0, 1.0, -1.0, -1.0, 0.5, 1.5]

    @pytest.mark.parametrize("m,n,k,cfg", [
        (1, 64, 256, None), (7, 80, 160, None), (16, 64, 512, GemmConfig(16, 32, 128, split_k=2)),
        (33, 48, 96, GemmConfig(32, 16, 32)), (5, 40, 1024, GemmConfig(16, 32, 64, split_k=4)),
        (128, 32, 64, None)])
    def test_w4a16_gemm_matches_ref(m, n, k, cfg):
        packed, scale, scale_2 = nvfp4_ref.quantize(torch.randn(n, k))
        x = torch.randn(m, k).to(torch.bfloat16)
        got = w4a16_gemm(x, packed, scale, scale_2, config=cfg)
        ref = w4a16_gemm_ref(x, packed, scale, scale_2)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
