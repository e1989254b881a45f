"""The register-fed mma dense GEMV (kernels/gemv_bf16_mma.py) on an sm_90 GPU: exact per K slot, vs fp64 with bias,
the SwiGLU epilogue bit for bit, CUDA graphs, the `linear` routing."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability() < (9, 0),
                                                  reason="needs an sm_90 GPU")]

if torch.cuda.is_available():
    from dspark_serve.kernels import dispatch
    from dspark_serve.kernels.fused_ops import silu_mul
    from dspark_serve.kernels.gemv_bf16 import linear, linear_silu_mul
    from dspark_serve.kernels.gemv_bf16_mma import MmaDenseConfig, default_mma_dense_config, gemv_mma_dense

DEV = "cuda"
# tiles, warps, vec, l2_fetch
CONFIGS = [(1, 1, 1, 0), (2, 2, 2, 0), (1, 4, 2, 128), (4, 8, 1, 256), (1, 8, 4, 0), (2, 4, 4, 128), (4, 2, 2, 0)]


@pytest.mark.parametrize("n,k", [(48, 256), (1040, 384)])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_every_k_slot_is_exact(n, k, cfg):
    """One-hot rows of x read single weights: out[m, n] == w[n, k_m] for every K, so every lane's K slots and
    rows are where the mma expects them (K 384 with 8 warps: K slices past the end)."""
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    for k0 in range(0, k, 16):
        x = torch.zeros(16, k, device=DEV, dtype=torch.bfloat16)
        x[torch.arange(16), k0 + torch.arange(16)] = 1.0
        got = gemv_mma_dense(x, w, config=MmaDenseConfig(*cfg))
        assert torch.equal(got, w[:, k0:k0 + 16].T), f"K {k0}..{k0 + 15}"


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("cfg", CONFIGS + [None])
def test_matches_fp64_with_bias(m, cfg):
    n, k = 1152, 896
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    ref = F.linear(x.double(), w.double(), b.double())
    got = gemv_mma_dense(x, w, b, config=MmaDenseConfig(*cfg) if cfg else None).double()
    err = (got - ref).abs()
    assert (err <= 2 ** -8 * ref.abs() + 1e-6).all(), f"max err {err.max().item():.3g}"   # one bf16 rounding


@pytest.mark.parametrize("m", [1, 8, 13])
def test_swiglu_epilogue_is_silu_mul_bit_for_bit(m):
    inter, k = 4864, 896
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device=DEV, dtype=torch.bfloat16) * 0.05
    cfg = default_mma_dense_config(m, 2 * inter, k)
    fused = gemv_mma_dense(x, w, config=cfg, swiglu=True)
    assert fused.shape == (m, inter)
    assert torch.equal(fused, silu_mul(gemv_mma_dense(x, w, config=cfg)))
    ref = silu_mul(F.linear(x.double(), w.double()).bfloat16())
    assert (fused.float() - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max()


def test_cuda_graph_and_unaligned_x():
    n, k = 4096, 1024
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    base = torch.randn(8 * k + 8, device=DEV, dtype=torch.bfloat16)
    x = base[8:].view(8, k)                                           # 16-byte aligned view
    odd = base[1:8 * k + 1].view(8, k)                                # 2-byte offset: copied first
    assert torch.equal(gemv_mma_dense(odd, w), gemv_mma_dense(odd.clone(), w))
    want = gemv_mma_dense(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv_mma_dense(x, w)                                          # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv_mma_dense(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, want) and torch.equal(out, gemv_mma_dense(x, w))


def test_linear_routes_verify_rows(monkeypatch):
    w = torch.randn(2048, 512, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(8, 512, device=DEV, dtype=torch.bfloat16)
    monkeypatch.setattr(dispatch, "DENSE_MMA", True)
    assert torch.equal(linear(x, w), gemv_mma_dense(x, w))
    assert torch.equal(linear_silu_mul(x, w), gemv_mma_dense(x, w, swiglu=True))
    monkeypatch.setattr(dispatch, "DENSE_MMA", False)
    assert torch.equal(linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        gemv_mma_dense(x, w[:, :500])
