"""The register-fed mma GEMV (kernels/w4a16_gemv_mma.py) on an sm_90 GPU: exact per K slot, vs fp64, split-K,
CUDA graphs."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available()
                                                  or torch.cuda.get_device_capability() < (9, 0),
                                                  reason="needs an sm_90 GPU")]

if torch.cuda.is_available():
    from dspark_serve.kernels import nvfp4
    from dspark_serve.kernels.w4a16_gemv import GemvConfig, mma_config, w4a16_gemv

DEV = "cuda"


def _weights(n: int, k: int):
    """Rows from fp8-subnormal to large block scales, an all-zero block, negative zeros."""
    w = torch.randn(n, k, device=DEV) * torch.logspace(-6, 2, n, device=DEV)[:, None]
    w[:, 16:32] = 0.0
    w[:, 32:48] = -0.0
    return nvfp4.quantize(w)


def _cfg(tiles: int, warps: int, split: int, unroll: int = 1, l1_hints: bool = False) -> "GemvConfig":
    return GemvConfig(16 * tiles * warps, 128, split, num_warps=warps, mma=True, unroll=unroll, l1_hints=l1_hints)


@pytest.mark.parametrize("n,k,cfg", [(48, 256, (1, 1, 1)), (96, 384, (2, 2, 2)), (1024, 640, (2, 4, 4)),
                                     (96, 512, (1, 2, 1, 2)), (1024, 1024, (2, 4, 2, 2)),
                                     (96, 512, (1, 4, 1, 2, True)), (1024, 640, (2, 4, 4, 1, True))])
def test_every_k_slot_is_exact(n, k, cfg):
    """One-hot rows of x read single weights: out[m, n] == bf16(dequant(W)[n, k_m]) for every K, so each lane's
    K slots, codes and block scales are where the mma expects them."""
    packed, scale, scale_2 = _weights(n, k)
    want = nvfp4.dequantize(packed, scale, scale_2, torch.float32).to(torch.bfloat16)     # [N, K]
    for k0 in range(0, k, 16):
        x = torch.zeros(16, k, device=DEV, dtype=torch.bfloat16)
        x[torch.arange(16), k0 + torch.arange(16)] = 1.0
        got = w4a16_gemv(x, packed, scale, scale_2, _cfg(*cfg))
        assert torch.equal(got, want[:, k0:k0 + 16].T), f"K {k0}..{k0 + 15}"


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1024, 4096), (1040, 640), (4096, 12288)])
def test_mma_vs_fp64(m, n, k):
    packed, scale, scale_2 = _weights(n, k)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T
    outs = [w4a16_gemv(x, packed, scale, scale_2, cfg) for cfg in
            (mma_config(n, k), _cfg(1, 4, 1), _cfg(2, 8, 2), _cfg(1, 2, 16), mma_config(n, k, 1, 8, 16, l2_ahead=2),
             mma_config(n, k, 2, 4, 8, l2_fetch=128), mma_config(n, k, 1, 4, 8, l2_fetch=256),
             mma_config(n, k, 1, 4, 8, l2_fetch=128, l1_hints=True))
            + ((mma_config(n, k, 2, 8, 64, l2_fetch=128, unroll=2), mma_config(n, k, 1, 8, 16, unroll=2))
               if k % 256 == 0 else ())]
    for got in outs:
        assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-2
    prmt = w4a16_gemv(x, packed, scale, scale_2, GemvConfig(64, 128, 1, True, num_warps=4, join=False, prmt=True))
    assert (outs[0].double() - prmt.double()).abs().max() <= 2 ** -6 * prmt.double().abs().max()


def test_default_takes_the_mma_kernel_and_unaligned_inputs_are_copied():
    from dspark_serve.kernels import w4a16_gemv as g
    packed, scale, scale_2 = _weights(256, 1024)
    assert g.default_gemv_config(7, 256, 1024, mma_ok=True).mma
    buf = torch.randn(3, 1024 + 8, device=DEV).to(torch.bfloat16)
    x = buf[:, 1:1025]                                                   # 2-byte aligned rows
    want = w4a16_gemv(x.contiguous(), packed, scale, scale_2, _cfg(2, 4, 1))
    assert torch.equal(w4a16_gemv(x, packed, scale, scale_2, _cfg(2, 4, 1)), want)
    with pytest.raises(ValueError, match="mma kernel needs"):
        w4a16_gemv(x[:, :1008], packed[:, :504], scale[:, :63], scale_2, _cfg(2, 4, 1))


def test_split_k_in_a_cuda_graph():
    """The split-K workspace and counters are re-zeroed by the kernel itself, so graph replays stay correct (to the
    order of the fp32 atomic adds: a bf16 ulp)."""
    packed, scale, scale_2 = _weights(4096, 4096)
    x = torch.randn(8, 4096, device=DEV).to(torch.bfloat16)
    ref = x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T
    cfg = _cfg(2, 4, 8)
    want = w4a16_gemv(x, packed, scale, scale_2, cfg).double()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemv(x, packed, scale, scale_2, cfg)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-2
        assert ((out.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("split", [1, 4])
def test_row_scales_of_stacked_layers_are_exact(split):
    """A per-row weight_scale_2 (layers stacked along N): one-hot x reads single weights, each scaled by its own
    layer's scale, exactly; with and without split-K."""
    from dspark_serve.kernels.w4a16_gemv_mma import gemv_mma
    parts = [_weights(n, 512) for n in (96, 32, 32)]
    parts[1] = (parts[1][0], parts[1][1], parts[1][2] * 3.0)               # scales apart by more than rounding
    packed, scale = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    rows = torch.cat([p[2].float().expand(p[0].shape[0]) for p in parts])
    want = torch.cat([nvfp4.dequantize(*p, dtype=torch.float32) for p in parts]).to(torch.bfloat16)   # [N, K]
    for k0 in range(0, 512, 16):
        x = torch.zeros(16, 512, device=DEV, dtype=torch.bfloat16)
        x[torch.arange(16), k0 + torch.arange(16)] = 1.0
        got = gemv_mma(x, packed, scale, rows, 2, 2, split)
        assert torch.equal(got, want[:, k0:k0 + 16].T), f"K {k0}..{k0 + 15}"


@pytest.mark.parametrize("m", [2, 7, 8, 16])
def test_nvfp4_stack_vs_fp64_and_its_layers(m):
    """NVFP4Stack on the mma path: within bf16 rounding of the fp64 reference and of the layers run one by one."""
    from dspark_serve.engine.runner.nvfp4_stack import NVFP4Stack
    from dspark_serve.models.nvfp4_linear import NVFP4Linear
    layers = [NVFP4Linear.from_tensors(*_weights(n, 1024)) for n in (1024, 256, 256)]
    x = torch.randn(m, 1024, device=DEV).to(torch.bfloat16)
    ref = torch.cat([x.double() @ lay.dequantized_weight(torch.float64).T for lay in layers], -1)
    alone = torch.cat([lay(x) for lay in layers], -1).double()
    got = NVFP4Stack(layers)(x).double()
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-2
    assert (got - alone).abs().max() <= 2 ** -7 * alone.abs().max()  # split-K order and one bf16 rounding apart
