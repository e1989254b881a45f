"""The dense bf16 GEMV on CUDA: against an fp64 reference at the 8B's projection shapes, inside a CUDA graph, and
inside the target's fused MLP and o projection (KernelConfig.dense_gemv)."""

import pytest
import torch

from dspark_serve.kernels.gemv_bf16 import gemv
from dspark_serve.engine.runner.fused_layers import FusedAttention, FusedLayer, FusedMLP
from dspark_serve.models.layers import MLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1152, 896), (333, 1040)])
def test_gemv_vs_fp64(m, n, k):
    w = torch.randn(n, k, device=DEV).bfloat16()
    x = torch.randn(m, k, device=DEV).bfloat16()
    b = torch.randn(n, device=DEV).bfloat16()
    assert _rel(gemv(x, w, b), x.double() @ w.double().T + b.double()) <= 1e-2


def test_gemv_in_cuda_graph():
    w = torch.randn(4096, 4096, device=DEV).bfloat16()
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    want = gemv(x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv(x, w)
    x.copy_(torch.randn(1, 4096, device=DEV).bfloat16())
    want = gemv(x, w)
    g.replay()
    assert torch.equal(out, want)


def test_fused_mlp_and_o_proj_take_it(monkeypatch, kernel_config):
    from dspark_serve.models.config import ModelConfig
    from dspark_serve.models.layers import AttentionProjections
    mlp = FusedMLP.of(MLP(512, 1536).to(DEV, torch.bfloat16), tiled=False)
    x = torch.randn(7, 512, device=DEV).bfloat16()
    cfg = ModelConfig(arch="qwen3", vocab_size=256, hidden_size=512, intermediate_size=1536, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position=512,
                      tie_word_embeddings=False, dtype=torch.bfloat16)
    attn = FusedAttention.of(AttentionProjections(cfg).to(DEV, torch.bfloat16), tiled=False)
    o = torch.randn(7, 512, device=DEV).bfloat16()
    kernel_config(dense_mma=False)                   # (7 rows would take the mma GEMV)
    kernel_config(dense_gemv=False)
    mlp_off, o_off = mlp.forward(x), attn.output(o)
    kernel_config(dense_gemv=True)
    from dspark_serve.kernels import gemv_bf16
    calls = []
    monkeypatch.setattr(gemv_bf16, "gemv", lambda x, *a, **kw: calls.append(x.shape) or gemv(x, *a, **kw))
    mlp_on, o_on = mlp.forward(x), attn.output(o)
    assert calls == []                                                  # 7 rows: cuBLAS
    mlp.forward(x[:1]), attn.output(o[:1])
    assert calls == [(1, 512), (1, 1536), (1, 512)]                     # gate/up, down (after silu_mul), o
    assert _rel(mlp.forward(x[:1]), mlp_off[:1].double()) <= 1e-2
    assert torch.equal(mlp_on, mlp_off) and torch.equal(o_on, o_off)


@pytest.mark.parametrize("i,k", [(12288, 4096), (4864, 896)])
def test_swiglu_epilogue_is_silu_mul_of_the_gemv(i, k):
    """The gate/up GEMV with the SwiGLU epilogue gives silu_mul's bits at the 8B and 0.5B MLP shapes."""
    from dspark_serve.kernels.fused_ops import silu_mul
    w = (torch.randn(2 * i, k, device=DEV) * 0.05).bfloat16()
    x = torch.randn(1, k, device=DEV).bfloat16()
    assert torch.equal(gemv(x, w, swiglu=True), silu_mul(gemv(x, w)))



@pytest.mark.parametrize("hidden,inter,heads,kv,d", [(4096, 12288, 32, 8, 128), (896, 4864, 14, 2, 64)])
def test_decoder_layer_norms_fused_into_the_gemvs(hidden, inter, heads, kv, d, monkeypatch, kernel_config):
    """KernelConfig.norm_gemv: at one row the q/k/v and gate/up GEMVs apply the layer's RMSNorms themselves (4 launches
    fewer); the layer's output and residual match the separate norms' (the residual bit for bit) at the 8B and
    0.5B shapes, with and without a residual coming in; 8 rows keep the separate norms."""
    from dspark_serve.kernels.attention import AttentionMetadata
    from dspark_serve.kernels.fused_ops import rms_norm
    from dspark_serve.models.config import ModelConfig
    from dspark_serve.models.qwen import DecoderLayer
    cfg = ModelConfig(arch="qwen3", vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position=512, tie_word_embeddings=False, dtype=torch.bfloat16)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg).to(DEV, torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() == 2 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    fused = FusedLayer.of(layer, tiled=False)
    from dspark_serve.kernels import gemv_bf16
    norms = []
    monkeypatch.setattr(gemv_bf16, "rms_norm", lambda *a, **kw: norms.append(1) or rms_norm(*a, **kw))
    for rows in (1, 8):
        cache = torch.zeros(2, 4, 16, kv, d, device=DEV, dtype=torch.bfloat16)
        meta = AttentionMetadata(cu_seqlens_q=torch.arange(rows + 1, device=DEV), seq_lens=torch.full(
            (rows,), 5, device=DEV), slot_mapping=torch.arange(rows, device=DEV) + 4, block_table=torch.zeros(
            rows, 4, dtype=torch.int64, device=DEV), max_query_len=1, max_seq_len=64, all_slots_valid=True)
        cos, sin = layer.self_attn.q_norm.weight.new_ones(rows, 1, d), layer.self_attn.q_norm.weight.new_zeros(
            rows, 1, d)
        x = torch.randn(rows, hidden, device=DEV).bfloat16()
        for res in (None, torch.randn(rows, hidden, device=DEV).bfloat16()):
            outs = []
            for on in (False, True):
                kernel_config(norm_gemv=on)
                norms.clear()
                with torch.inference_mode():
                    outs.append(fused.forward(x, res, cos, sin, cache, meta))
                outs[-1] = (*outs[-1], len(norms))
            (y0, r0, n0), (y1, r1, n1) = outs
            assert torch.equal(r1, r0) and _rel(y1, y0.double()) <= 1e-2
            assert (n0, n1) == ((2, 0) if rows == 1 else (2, 2))
