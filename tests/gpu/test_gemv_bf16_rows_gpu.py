"""The CUDA-core GEMV for 2-8 rows (kernels/gemv_bf16_rows.py) on a GPU at the 0.5B target's shapes: vs fp64 with a
bias, its SwiGLU epilogue bit for bit, CUDA graphs, and the `linear` routing (small weights only)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from dspark_serve.kernels import dispatch
    from dspark_serve.kernels import gemv_bf16_rows as gr
    from dspark_serve.kernels.fused_ops import silu_mul
    from dspark_serve.kernels.gemv_bf16 import linear, linear_silu_mul

DEV = "cuda"
SHAPES = [(1152, 896), (896, 896), (896, 4864), (9728, 896)]      # Qwen2.5-0.5B qkv, o, down, gate/up
CONFIGS = [None, gr.RowsGemvConfig(8, 128), gr.RowsGemvConfig(32, 32, num_warps=8), gr.RowsGemvConfig(16, 64, 8)]


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_matches_fp64_with_bias(m, n, k, cfg):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T + b.double()
    got = gr.gemv_rows(x, w, b, config=cfg)
    assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-2
    assert ((got.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all()


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_swiglu_bit_for_bit(m, cfg):
    x = torch.randn(m, 896, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(9728, 896, device=DEV, dtype=torch.bfloat16) * 0.05
    assert torch.equal(gr.gemv_rows(x, w, config=cfg, swiglu=True), silu_mul(gr.gemv_rows(x, w, config=cfg)))


def test_cuda_graph_and_routing():
    x = torch.randn(8, 896, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(1152, 896, device=DEV, dtype=torch.bfloat16)
    want = gr.gemv_rows(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gr.gemv_rows(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gr.gemv_rows(x, w)) and not torch.equal(out, want)
    if dispatch.DENSE_GEMV and dispatch.GEMV_ROWS_CORES:
        assert torch.equal(linear(x, w), gr.gemv_rows(x, w))
        wg = torch.randn(9728, 896, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(linear_silu_mul(x, wg), gr.gemv_rows(x, wg, swiglu=True))
    big = torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)
    assert not gr.rows_ok(torch.randn(8, 4096, device=DEV, dtype=torch.bfloat16), big)   # 8B o: the mma GEMV
    assert not gr.rows_ok(x[:1], w) and not gr.rows_ok(torch.randn(9, 896, device=DEV, dtype=torch.bfloat16), w)
