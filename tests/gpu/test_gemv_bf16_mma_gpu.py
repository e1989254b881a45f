"""The register-fed mma dense GEMV (kernels/gemv_bf16_mma.py) on an sm_90 GPU: exact per K slot, vs fp64 with bias,
the SwiGLU epilogue bit for bit, CUDA graphs, the `linear` routing."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability() < (9, 0),
                                                  reason="needs an sm_90 GPU")]

if torch.cuda.is_available():
    from dspark_serve.kernels.config import KernelConfig, using
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
    with using(KernelConfig(dense_mma=True)):
        assert torch.equal(linear(x, w), gemv_mma_dense(x, w))
        assert torch.equal(linear_silu_mul(x, w), gemv_mma_dense(x, w, swiglu=True))
    with using(KernelConfig(dense_mma=False)):
        assert torch.equal(linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        gemv_mma_dense(x, w[:, :500])


TILED_CONFIGS = [c for c in CONFIGS if c[2] == 4] + [(4, 4, 4, 0), (2, 8, 4, 0), (1, 1, 4, 128)]


@pytest.mark.parametrize("n,k", [(48, 384), (1152, 896), (4096, 4096)])
@pytest.mark.parametrize("cfg", TILED_CONFIGS)
@pytest.mark.parametrize("m", [1, 8, 13])
def test_tile_major_weights_give_the_same_bits(n, k, cfg, m):
    """The tile-major copy puts the same values into every lane's registers: the same result, bit for bit, with a
    bias, with SwiGLU, K slices past the end (K 384 with 8 warps) and tiles past N included."""
    from dspark_serve.kernels.gemv_bf16_mma import tile_major
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    c = MmaDenseConfig(*cfg)
    t = tile_major(w)
    assert torch.equal(gemv_mma_dense(x, t, b, config=c), gemv_mma_dense(x, w, b, config=c))
    assert torch.equal(gemv_mma_dense(x, tile_major(w, swiglu=True), config=c, swiglu=True),
                       gemv_mma_dense(x, w, config=c, swiglu=True))


def test_fused_layers_keep_a_tile_major_copy():
    """Fused layers with tiled=True keep tile-major copies of qkv, o, gate/up and down; verify rows read them and
    give the row-major GEMV's bits; one row (plain decode) is untouched. The default policy keeps them for a small
    model."""
    from dspark_serve.engine.runner.fused_layers import FusedAttention, FusedMLP, keep_tile_major
    from dspark_serve.models.config import ModelConfig
    from dspark_serve.models.layers import MLP, AttentionProjections
    cfg = ModelConfig(arch="qwen3", vocab_size=256, hidden_size=512, intermediate_size=1536, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position=512,
                      tie_word_embeddings=False, dtype=torch.bfloat16)
    mlp_m, attn_m = MLP(512, 1536).to(DEV, torch.bfloat16), AttentionProjections(cfg).to(DEV, torch.bfloat16)
    assert keep_tile_major(torch.nn.ModuleList([mlp_m, attn_m]), KernelConfig(dense_tiled=None))  # 6 MB
    assert not keep_tile_major(torch.nn.ModuleList([mlp_m, attn_m]), KernelConfig(dense_tiled=False))
    mlp, attn = FusedMLP.of(mlp_m, tiled=False), FusedAttention.of(attn_m, tiled=False)
    assert mlp.tiled == (None, None) and attn.tiled == (None, None)
    x, o = torch.randn(8, 512, device=DEV).bfloat16(), torch.randn(8, 512, device=DEV).bfloat16()
    want_mlp, want_o = mlp.forward(x), attn.output(o)
    mlp2_m, attn2_m = MLP(512, 1536).to(DEV, torch.bfloat16), AttentionProjections(cfg).to(DEV, torch.bfloat16)
    mlp2_m.load_state_dict(mlp_m.state_dict()), attn2_m.load_state_dict(attn_m.state_dict())
    mlp2, attn2 = FusedMLP.of(mlp2_m, tiled=True), FusedAttention.of(attn2_m, tiled=True)
    assert [t.shape for t in mlp2.tiled] == [(1536 // 8, 4, 2048), (512 // 16, 12, 2048)]
    assert [t.shape for t in attn2.tiled] == [(768 // 16, 4, 2048), (512 // 16, 4, 2048)]
    assert torch.equal(mlp2.forward(x), want_mlp) and torch.equal(attn2.output(o), want_o)
    assert torch.equal(mlp2.forward(x[:1]), mlp.forward(x[:1]))
