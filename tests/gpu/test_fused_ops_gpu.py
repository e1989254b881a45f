"""Fused RMSNorm / q-k norm + RoPE / SwiGLU kernels on CUDA: bf16 within one ulp of the models/layers.py modules
(RoPE alone bitwise), fp32 close, and capture + replay inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from dspark_serve.kernels.fused_ops import qk_norm_rotary, rms_norm, silu_mul
    from dspark_serve.models.layers import RMSNorm, Rotary

from fused_checks import EPS, bf16_ulps, check_cache_write, check_qk_norm_rotary, seeded_norm

DEV, BF16, FP32 = "cuda", torch.bfloat16, torch.float32


def _match(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == BF16:
        ulps, frac = bf16_ulps(got, ref), (got != ref).float().mean().item()
        print(f"max {ulps} ulp, {frac:.2e} of elements differ")
        # rotary's x*cos + rot(x)*sin can cancel to a few ulps of a tiny result (seen: 2 ulp, 7e-6 of elements)
        assert ulps <= 2 and frac <= 1e-3
    else:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)


def _norm(dim: int, dtype: torch.dtype, seed: int) -> "RMSNorm":
    return seeded_norm(dim, dtype, seed, DEV)


@pytest.mark.parametrize("t,n", [(1, 1024), (7, 4096), (3, 5120), (64, 8192)])
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu(t, n, dtype, with_residual):
    x = (3 * torch.randn(t, n, device=DEV)).to(dtype)
    m = _norm(n, dtype, seed=n)
    if with_residual:
        residual = torch.randn(t, n, device=DEV).to(dtype)
        out, new_res = rms_norm(x, m.weight.data, EPS, residual=residual)
        assert torch.equal(new_res, x + residual)
        _match(out, m(x + residual))
    else:
        _match(rms_norm(x, m.weight.data, EPS), m(x))


@pytest.mark.parametrize("h,kv,d", [(14, 2, 64), (4, 2, 128), (32, 8, 128)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_qk_norm_rotary_gpu(h, kv, d, qk_norm, dtype):
    t = 37
    qkv = (2 * torch.randn(t, (h + 2 * kv) * d, device=DEV)).to(dtype)
    q, k = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kv) * d].view(t, kv, d)
    cos, sin = Rotary(d, 1e6).to(DEV).cos_sin(torch.randint(0, 32768, (t,), device=DEV), dtype)
    check_qk_norm_rotary(q, k, cos, sin, qk_norm, _match)


@pytest.mark.parametrize("h,kv,d", [(14, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_qk_norm_rotary_writes_the_cache_gpu(h, kv, d, qk_norm, dtype):
    check_cache_write(h, kv, d, qk_norm, dtype, DEV)


@pytest.mark.parametrize("t,inter", [(1, 4864), (16, 11008), (300, 3072)])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_silu_mul_gpu(t, inter, dtype):
    gu = (4 * torch.randn(t, 2 * inter, device=DEV)).to(dtype)
    _match(silu_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:])


def test_cuda_graph_capture_replay():
    t, n, h, kv, d, inter = 4, 2048, 16, 8, 128, 6144
    x, res = torch.randn(t, n, device=DEV).to(BF16), torch.randn(t, n, device=DEV).to(BF16)
    qkv = torch.randn(t, (h + 2 * kv) * d, device=DEV).to(BF16)
    gu = torch.randn(t, 2 * inter, device=DEV).to(BF16)
    positions = torch.arange(t, device=DEV)
    rot, norm, qn, kn = Rotary(d, 1e6).to(DEV), _norm(n, BF16, 1), _norm(d, BF16, 2), _norm(d, BF16, 3)

    def step():
        cos, sin = rot.cos_sin(positions, BF16)
        out, new_res = rms_norm(x, norm.weight.data, EPS, residual=res)
        q, k = qk_norm_rotary(qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kv) * d].view(t, kv, d), cos, sin,
                              qn.weight.data, kn.weight.data, EPS)
        return out, new_res, q, k, silu_mul(gu)

    step()                                                             # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        for buf in (x, res, qkv, gu):
            buf.copy_(torch.randn(buf.shape, device=DEV, generator=g))
        positions.copy_(torch.randint(0, 4096, (t,), device=DEV, generator=g))
        graph.replay()
        for got, want in zip(static_out, step()):
            assert torch.equal(got, want)
