"""The dense bf16 GEMV on CUDA: against an fp64 reference at the 8B's projection shapes, inside a CUDA graph, and
inside the target's fused MLP and o projection (DSPARK_DENSE_GEMV)."""

import pytest
import torch

from dspark_serve.kernels import dispatch
from dspark_serve.kernels.gemv_bf16 import gemv
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


def test_fused_mlp_and_o_proj_take_it(monkeypatch):
    from dspark_serve.models.config import ModelConfig
    from dspark_serve.models.layers import AttentionProjections
    mlp = MLP(512, 1536).to(DEV, torch.bfloat16)
    mlp.fuse()
    x = torch.randn(7, 512, device=DEV).bfloat16()
    cfg = ModelConfig(arch="qwen3", vocab_size=256, hidden_size=512, intermediate_size=1536, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position=512,
                      tie_word_embeddings=False, dtype=torch.bfloat16)
    attn = AttentionProjections(cfg).to(DEV, torch.bfloat16)
    o = torch.randn(7, 512, device=DEV).bfloat16()
    monkeypatch.setattr(dispatch, "DENSE_MMA", False)                   # (7 rows would take the mma GEMV)
    monkeypatch.setattr(dispatch, "DENSE_GEMV", False)
    mlp_off, o_off = mlp.forward_fused(x), attn.output(o)
    monkeypatch.setattr(dispatch, "DENSE_GEMV", True)
    from dspark_serve.kernels import gemv_bf16
    calls = []
    monkeypatch.setattr(gemv_bf16, "gemv", lambda x, *a, **kw: calls.append(x.shape) or gemv(x, *a, **kw))
    mlp_on, o_on = mlp.forward_fused(x), attn.output(o)
    assert calls == []                                                  # 7 rows: cuBLAS
    mlp.forward_fused(x[:1]), attn.output(o[:1])
    assert calls == [(1, 512), (1, 1536), (1, 512)]                     # gate/up, down (after silu_mul), o
    assert _rel(mlp.forward_fused(x[:1]), mlp_off[:1].double()) <= 1e-2
    assert torch.equal(mlp_on, mlp_off) and torch.equal(o_on, o_off)


@pytest.mark.parametrize("i,k", [(12288, 4096), (4864, 896)])
def test_swiglu_epilogue_is_silu_mul_of_the_gemv(i, k):
    """The gate/up GEMV with the SwiGLU epilogue gives silu_mul's bits at the 8B and 0.5B MLP shapes."""
    from dspark_serve.kernels.fused_ops import silu_mul
    w = (torch.randn(2 * i, k, device=DEV) * 0.05).bfloat16()
    x = torch.randn(1, k, device=DEV).bfloat16()
    assert torch.equal(gemv(x, w, swiglu=True), silu_mul(gemv(x, w)))

