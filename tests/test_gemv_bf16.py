"""Dense GEMV (kernels/gemv_bf16.py) vs F.linear under the Triton CPU interpreter (small shapes), and the model
layers that route decode rows through it.

Reruns itself in a child process with TRITON_INTERPRET=1. The interpreter truncates fp32 -> bf16 stores instead of
rounding, so bf16 outputs are compared to within one bf16 ulp plus another summation order's error.
"""

import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_dense_gemv_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels.gemv_bf16 import DenseGemvConfig, default_dense_gemv_config, gemv, gemv_ref

    def _close(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        slack = 2 ** -18 * (x.float().abs() @ w.float().abs().T)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert ((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-6 + slack).all()

    def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]).to(dtype)
        return x, w, torch.randn(n, generator=g).to(dtype)

    @pytest.mark.parametrize("m,n,k", [(1, 70, 480), (1, 16, 512), (3, 40, 160), (8, 70, 256), (16, 33, 96)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_gemv_matches_linear(m, n, k, dtype):
        x, w, b = _operands(m, n, k, dtype, seed=m + n)
        _close(gemv(x, w), gemv_ref(x, w), x, w)
        _close(gemv(x, w, b), gemv_ref(x, w, b), x, w)

    @pytest.mark.parametrize("m,cfg", [(1, DenseGemvConfig(8, 64)), (1, DenseGemvConfig(32, 128, num_warps=8)),
                                       (7, DenseGemvConfig(16, 32)), (16, DenseGemvConfig(64, 64, num_stages=2))])
    def test_gemv_configs_with_ragged_tails(m, cfg):
        x, w, b = _operands(m, 70, 200, torch.bfloat16, seed=3)                      # N and K tails
        _close(gemv(x, w, b, config=cfg), gemv_ref(x, w, b), x, w)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("n,k,cfg", [(2 * 40, 160, None), (2 * 21, 200, DenseGemvConfig(8, 64)),
                                         (2 * 16, 512, DenseGemvConfig(2, 128, num_warps=2))])
    def test_swiglu_epilogue_equals_silu_mul_of_the_gemv(n, k, cfg, dtype):
        """One launch, the same bits as silu_mul after the unfused GEMV (N and K tails included); within rounding
        of the float64 silu(x @ gate^T) * (x @ up^T)."""
        from dspark_serve.kernels.fused_ops import silu_mul
        x, w, _ = _operands(1, n, k, dtype, seed=n + k)
        got = gemv(x, w, config=cfg, swiglu=True)
        assert got.shape == (1, n // 2) and got.dtype == dtype
        assert torch.equal(got, silu_mul(gemv(x, w, config=cfg)))
        gu = x.double() @ w.double().T
        ref = torch.nn.functional.silu(gu[:, :n // 2]) * gu[:, n // 2:]
        assert ((got.double() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-3 * ref.abs().max()).all()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("swiglu", [False, True])
    @pytest.mark.parametrize("with_res,k,cfg", [(True, 480, None), (False, 200, DenseGemvConfig(8, 64)),
                                                (True, 96, DenseGemvConfig(4, 32))])
    def test_fused_norm_equals_rms_norm_then_gemv(dtype, swiglu, with_res, k, cfg):
        """norm=: the GEMV applies RMSNorm(x + residual) itself; the new residual has rms_norm's bits, the
        output the unfused pair's values up to the norm's summation order (K tails and one-chunk K included)."""
        from dspark_serve.kernels.fused_ops import rms_norm
        x, w, _ = _operands(1, 2 * 24, k, dtype, seed=k)
        g = torch.Generator().manual_seed(k + 1)
        res = torch.randn(1, k, generator=g).to(dtype) if with_res else None
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
        got, got_res = gemv(x, w, config=cfg, swiglu=swiglu, norm=(nw, 1e-6, res))
        h, want_res = rms_norm(x, nw, 1e-6, res) if with_res else (rms_norm(x, nw, 1e-6), x)
        want = gemv(h, w, config=cfg, swiglu=swiglu)
        assert torch.equal(got_res, want_res) and (with_res or got_res is x)
        assert got.shape == want.shape and got.dtype == want.dtype
        tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
        assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + tol * want.float().abs().max()).all()

    def test_fused_norm_rejects_bad_input():
        x, w, _ = _operands(2, 16, 64, torch.bfloat16)
        nw = torch.ones(64).bfloat16()
        with pytest.raises(ValueError, match="one row"):
            gemv(x, w, norm=(nw, 1e-6, None))
        with pytest.raises(ValueError, match=r"norm weight must be a contiguous \[64\]"):
            gemv(x[:1], w, norm=(nw[:32], 1e-6, None))
        with pytest.raises(ValueError, match="residual must be"):
            gemv(x[:1], w, norm=(nw, 1e-6, x[:1].float()))

    def test_gemv_rejects_bad_input():
        x, w, b = _operands(2, 16, 64, torch.bfloat16)
        with pytest.raises(ValueError, match="M <= 16"):
            gemv(torch.randn(17, 64).bfloat16(), w)
        with pytest.raises(ValueError, match=r"x must be a float \[M, 64\]"):
            gemv(x[:, :32], w)
        with pytest.raises(ValueError, match="bias must be"):
            gemv(x, w, b[:3])
        with pytest.raises(ValueError, match="bad DenseGemvConfig"):
            gemv(x, w, config=DenseGemvConfig(8, 64))
        assert gemv(x[:0], w).shape == (0, 16)
        with pytest.raises(ValueError, match="swiglu needs one row"):
            gemv(x, w, swiglu=True)
        with pytest.raises(ValueError, match="swiglu needs one row.*a bias"):
            gemv(x[:1], w, b, swiglu=True)
        with pytest.raises(ValueError, match="swiglu needs one row.*N = 15"):
            gemv(x[:1], w[:15], swiglu=True)
        with pytest.raises(ValueError, match="a power of 2 >= 2 for swiglu"):
            gemv(x[:1], w, config=DenseGemvConfig(12, 64), swiglu=True)

    def test_default_configs_are_the_sweep_winners():
        """The H200 sweep's best M = 1 config at each 8B projection (bench/RESULTS.md)."""
        cfg = {s: default_dense_gemv_config(1, n, k) for s, (n, k) in
               {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}.items()}
        assert cfg["qkv"] == DenseGemvConfig(16, 512, 4) and cfg["gate_up"] == DenseGemvConfig(16, 256, 4)
        assert cfg["o"] == cfg["down"] == DenseGemvConfig(16, 1024, 8)
