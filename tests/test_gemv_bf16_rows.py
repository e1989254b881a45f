"""The CUDA-core GEMV for 2-8 rows (kernels/gemv_bf16_rows.py) under the Triton CPU interpreter: against F.linear
(ragged N and K tails, a bias, fp32 and bf16), its SwiGLU epilogue bit for bit silu_mul of its own output, bad
input, and what `linear` routes to it. tests/gpu/test_gemv_bf16_rows_gpu.py runs it on an H200."""

import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter
from dspark_serve.kernels import gemv_bf16_rows as gr


@pytest.mark.skipif(INTERPRETED, reason="the child process runs the kernel tests")
def test_under_interpreter():
    rerun_under_interpreter(__file__)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]).to(dtype)
    return x, w, torch.randn(n, generator=g).to(dtype)


def _close(got, ref, x, w):
    slack = 2 ** -18 * (x.float().abs() @ w.float().abs().T)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert ((got.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-6 + slack).all()


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (test_under_interpreter)")
@pytest.mark.parametrize("m,n,k,cfg", [(8, 70, 200, None), (2, 16, 64, None), (5, 33, 96, gr.RowsGemvConfig(8, 32)),
                                       (7, 40, 160, gr.RowsGemvConfig(32, 16, num_warps=2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_linear(m, n, k, cfg, dtype):
    x, w, b = _operands(m, n, k, dtype, seed=m + n)
    _close(gr.gemv_rows(x, w, config=cfg), torch.nn.functional.linear(x, w), x, w)
    _close(gr.gemv_rows(x, w, b, config=cfg), torch.nn.functional.linear(x, w, b), x, w)


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (test_under_interpreter)")
@pytest.mark.parametrize("m,n,k,cfg", [(8, 2 * 40, 160, None), (3, 2 * 21, 200, gr.RowsGemvConfig(8, 64))])
def test_swiglu_epilogue_equals_silu_mul_of_the_gemv(m, n, k, cfg):
    from dspark_serve.kernels.fused_ops import silu_mul
    x, w, _ = _operands(m, n, k, torch.bfloat16, seed=n + k)
    got = gr.gemv_rows(x, w, config=cfg, swiglu=True)
    assert got.shape == (m, n // 2) and torch.equal(got, silu_mul(gr.gemv_rows(x, w, config=cfg)))
    gu = x.double() @ w.double().T
    ref = torch.nn.functional.silu(gu[:, :n // 2]) * gu[:, n // 2:]
    assert ((got.double() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_bad_input_and_routing():
    x, w, b = _operands(4, 16, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \[1..8, K\]"):
        gr.gemv_rows(torch.zeros(9, 64).bfloat16(), w)
    with pytest.raises(ValueError, match="no bias"):
        gr.gemv_rows(x, w, b, swiglu=True)
    with pytest.raises(ValueError, match="bad RowsGemvConfig"):
        gr.gemv_rows(x, w, config=gr.RowsGemvConfig(12, 64))
    assert not gr.rows_ok(x, w)                                            # CPU operands keep F.linear
    big = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    small = torch.empty(1152, 896, dtype=torch.bfloat16, device="meta")
    assert gr.MAX_WEIGHTS > small.numel() and gr.MAX_WEIGHTS <= big.numel()   # 0.5B layers in, 8B o out
