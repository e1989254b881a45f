"""Fused RMSNorm / q-k norm + RoPE / SwiGLU kernels vs the PyTorch modules of models/layers.py, under the Triton CPU
interpreter (reruns itself with TRITON_INTERPRET=1, see tests/interpreter.py).

bf16 outputs must be bitwise equal (the kernels round every torch intermediate to bf16); the allowance is one ulp
for rows whose mean of squares sums in another order. fp32 outputs differ from torch's only in reduction order and
exp, within 2e-6 relative.
"""

import pytest
import torch
import torch.nn.functional as F

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_fused_ops_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels.fused_ops import qk_norm_rotary, rms_norm, silu_mul
    from dspark_serve.models.layers import RMSNorm, Rotary

    from fused_checks import EPS, bf16_ulps, check_cache_write, check_qk_norm_rotary, seeded_norm

    BF16, FP32 = torch.bfloat16, torch.float32

    def _match(got: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1) -> None:
        assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
        if got.dtype == BF16:
            assert bf16_ulps(got, ref) <= max_ulps
        else:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-7)

    def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
        return seeded_norm(dim, dtype, seed)

    @pytest.mark.parametrize("t,n", [(1, 64), (5, 1000), (3, 4096), (2, 8192)])
    @pytest.mark.parametrize("dtype,w_dtype", [(FP32, FP32), (BF16, BF16), (BF16, FP32)])
    def test_rms_norm(t, n, dtype, w_dtype):
        x = (3 * torch.randn(t, n)).to(dtype)
        m = _norm(n, w_dtype, seed=n)
        _match(rms_norm(x, m.weight.data, EPS), m(x))

    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_rms_norm_residual_strided(dtype):
        t, n = 6, 1536
        big = torch.randn(t, 2 * n).to(dtype)
        x, residual = big[:, n:], (10 * torch.randn(t, n)).to(dtype)      # x has row stride 2N
        m = _norm(n, dtype, seed=1)
        out, new_res = rms_norm(x, m.weight.data, EPS, residual=residual)
        assert torch.equal(new_res, x + residual)
        _match(out, m(x + residual))

    @pytest.mark.parametrize("h,kv,d", [(14, 2, 64), (4, 2, 128)])
    @pytest.mark.parametrize("qk_norm", [True, False])                 # Qwen3, Qwen2
    @pytest.mark.parametrize("dtype", [FP32, BF16])
    @pytest.mark.parametrize("fused", [True, False])                   # q, k sliced from one qkv output or not
    def test_qk_norm_rotary(h, kv, d, qk_norm, dtype, fused):
        t = 5
        g = torch.Generator().manual_seed(h * d)
        if fused:
            qkv = (2 * torch.randn(t, (h + 2 * kv) * d, generator=g)).to(dtype)
            q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kv) * d].view(t, kv, d)
        else:
            q, k = (2 * torch.randn(t, h, d, generator=g)).to(dtype), (2 * torch.randn(t, kv, d, generator=g)).to(dtype)
        cos, sin = Rotary(d, 1e6).cos_sin(torch.tensor([0, 1, 17, 300, 4095]), dtype)
        check_qk_norm_rotary(q, k, cos, sin, qk_norm, _match)

    @pytest.mark.parametrize("h,kv,d", [(14, 2, 64), (4, 2, 128)])
    @pytest.mark.parametrize("qk_norm", [True, False])
    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_qk_norm_rotary_writes_the_cache(h, kv, d, qk_norm, dtype):
        check_cache_write(h, kv, d, qk_norm, dtype)

    def test_qk_norm_rotary_fp32_weights_promote():
        t, h, kv, d = 2, 4, 2, 64
        q, k = torch.randn(t, h, d).to(BF16), torch.randn(t, kv, d).to(BF16)
        cos, sin = Rotary(d, 1e4).cos_sin(torch.tensor([3, 9]), BF16)
        qn, kn = _norm(d, FP32, 4), _norm(d, FP32, 5)                 # q_norm(q) is fp32, so is the rotary
        got_q, got_k = qk_norm_rotary(q, k, cos, sin, qn.weight.data, kn.weight.data, EPS)
        _match(got_q, Rotary.apply(qn(q), cos, sin))
        _match(got_k, Rotary.apply(kn(k), cos, sin))

    @pytest.mark.parametrize("t,inter", [(1, 64), (4, 3000), (3, 1)])
    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_silu_mul(t, inter, dtype):
        gu = (4 * torch.randn(t, 2 * inter)).to(dtype)
        _match(silu_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:])

    def test_silu_mul_strided_rows():
        big = (4 * torch.randn(3, 500)).to(BF16)
        gu = big[:, 100:400]                                           # [3, 2 * 150], row stride 500
        _match(silu_mul(gu), F.silu(gu[:, :150]) * gu[:, 150:])

    def test_bf16_exact_on_typical_inputs():
        """Beyond the one-ulp allowance: on these inputs every bf16 output is bitwise torch's."""
        x, gu = torch.randn(4, 2048).to(BF16), torch.randn(4, 2 * 1024).to(BF16)
        m = _norm(2048, BF16, 6)
        assert torch.equal(rms_norm(x, m.weight.data, EPS), m(x))
        assert torch.equal(silu_mul(gu), F.silu(gu[:, :1024]) * gu[:, 1024:])

    def test_empty_and_bad_inputs():
        w = torch.ones(8)
        assert rms_norm(torch.empty(0, 8), w, EPS).shape == (0, 8)
        assert silu_mul(torch.empty(0, 16)).shape == (0, 8)
        with pytest.raises(ValueError):
            rms_norm(torch.randn(2, 8).to(torch.float16), w, EPS)
        with pytest.raises(ValueError):
            rms_norm(torch.randn(8, 2).T, w[:2], EPS)                  # column stride != 1
        with pytest.raises(ValueError):
            silu_mul(torch.randn(2, 7))
        q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
        cos = sin = torch.ones(1, 1, 8)
        with pytest.raises(ValueError):
            qk_norm_rotary(q, k, cos, sin, torch.ones(8), None, EPS)
