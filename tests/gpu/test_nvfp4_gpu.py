"""NVFP4 kernels on CUDA: byte-exact quantize, bf16 accuracy vs fp64, CUDA-graph capture/replay."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from dspark_serve.kernels import nvfp4, nvfp4_ref
    from dspark_serve.kernels.w4a16_gemm import GemmConfig, w4a16_gemm
    from dspark_serve.models.nvfp4_linear import NVFP4Linear

DEV = "cuda"


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_scale_2_is_an_exact_division_on_gpu():
    """CUDA divides by a host scalar as x * (1 / s); for this amax that differs from x / s in the last bit."""
    w = torch.zeros(4, 32, device=DEV)
    w[1, 3] = 632.8042602539062
    assert torch.equal(nvfp4.quantize(w)[2].cpu(), nvfp4_ref.quantize(w.cpu())[2])


@pytest.mark.parametrize("shape", [(1, 16), (37, 48), (1024, 4096), (300, 2064)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_byte_exact_on_gpu(shape, dtype):
    w = (torch.randn(*shape, device=DEV) * torch.logspace(-5, 3, shape[0], device=DEV)[:, None]).to(dtype)
    got, ref = nvfp4.quantize(w), nvfp4_ref.quantize(w.cpu())
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(_bytes(a).cpu(), _bytes(b))
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(nvfp4.dequantize(*got, dtype=dt).cpu(), nvfp4_ref.dequantize(*ref, dtype=dt))


@pytest.mark.parametrize("m", [1, 7, 8, 16, 64, 128])
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 12288), (333, 1040)])
def test_w4a16_gemm_vs_fp64(m, n, k):
    packed, scale, scale_2 = nvfp4.quantize(torch.randn(n, k, device=DEV))
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T
    assert _rel(w4a16_gemm(x, packed, scale, scale_2), ref) <= 1e-2
    other = GemmConfig(16, 32, 128, split_k=4) if m <= 16 else GemmConfig(64, 128, 64, num_stages=4)
    assert _rel(w4a16_gemm(x, packed, scale, scale_2, other), ref) <= 1e-2


@pytest.mark.parametrize("m", [1, 7, 16, 56])
@pytest.mark.parametrize("n,k,block_k", [(1024, 4096, 256), (333, 1040, 128), (96, 480, 64)])
def test_gemv_prmt_decode_vs_fp64(m, n, k, block_k):
    """The inline-PTX decode path, on fp8-subnormal to large block scales and all-zero blocks; K tails included."""
    from dspark_serve.kernels.w4a16_gemv import GemvConfig, w4a16_gemv
    w = torch.randn(n, k, device=DEV) * torch.logspace(-6, 2, n, device=DEV)[:, None]
    w[:, :16] = 0.0
    packed, scale, scale_2 = nvfp4.quantize(w)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T
    cfg = GemvConfig(64, block_k, 2, True, num_warps=4, join=False, prmt=True)
    got = w4a16_gemv(x, packed, scale, scale_2, cfg)
    assert _rel(got, ref) <= 1e-2
    plain = w4a16_gemv(x, packed, scale, scale_2, GemvConfig(64, block_k, 2, True, num_warps=4, join=False))
    assert (got.double() - plain.double()).abs().max() <= 2 ** -6 * plain.double().abs().max()


def test_gemv_prmt_reads_scales_as_aligned_pairs():
    """The prmt path reads bf16 block scales as int32 pairs; a caller's scale_bf16 that is only 2-byte aligned or
    strided is copied first, with the same result."""
    from dspark_serve.kernels.w4a16_gemv import GemvConfig, w4a16_gemv
    packed, scale, scale_2 = nvfp4.quantize(torch.randn(256, 1024, device=DEV))
    x = torch.randn(7, 1024, device=DEV).to(torch.bfloat16)
    cfg = GemvConfig(64, 256, 1, True, num_warps=4, join=False, prmt=True)
    want = w4a16_gemv(x, packed, scale, scale_2, cfg, scale_bf16=scale.to(torch.bfloat16))
    buf = torch.empty(scale.numel() + 1, device=DEV, dtype=torch.bfloat16)
    odd = buf[1:].view(scale.shape)
    odd.copy_(scale.to(torch.bfloat16))
    assert odd.data_ptr() % 4 == 2
    assert torch.equal(w4a16_gemv(x, packed, scale, scale_2, cfg, scale_bf16=odd), want)
    wide = torch.zeros(scale.shape[0], 2 * scale.shape[1], device=DEV, dtype=torch.bfloat16)[:, ::2]
    wide.copy_(scale.to(torch.bfloat16))
    assert torch.equal(w4a16_gemv(x, packed, scale, scale_2, cfg, scale_bf16=wide), want)
    ref = x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T
    assert _rel(want, ref) <= 1e-2


def test_cuda_graph_capture_and_replay():
    n, k, m = 4096, 4096, 8
    packed, scale, scale_2 = nvfp4.quantize(torch.randn(n, k, device=DEV))
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    split = GemmConfig(16, 64, 256, split_k=4)

    def step():
        return w4a16_gemm(x, packed, scale, scale_2), w4a16_gemm(x, packed, scale, scale_2, split)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(outs, eager):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_nvfp4_linear_cuda_matches_cpu():
    lin = torch.nn.Linear(512, 96, bias=True)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(5, 512)
    cpu = q(x)
    gpu = q.to(DEV)(x.to(DEV, torch.bfloat16)).float().cpu()
    assert _rel(gpu, cpu.double()) <= 1e-2


def test_kept_dense_copy_on_gpu():
    """M > 64 through the kept bf16 copy equals the per-call dequantize path exactly; M <= 16 still takes the GEMV."""
    q = NVFP4Linear.from_linear(torch.nn.Linear(512, 96)).to(DEV)
    x = torch.randn(80, 512, device=DEV, dtype=torch.bfloat16)
    before, small = q(x), q(x[:3])
    q.keep_dense()
    assert torch.equal(q(x), before) and torch.equal(q(x[:3]), small)
    from dspark_serve.kernels.w4a16_gemm import dense_unit_matmul
    q.keep_dense(min_rows=2)   # M = 3 now takes the copy too
    assert torch.equal(q(x[:3]), dense_unit_matmul(x[:3], q._dense, q.weight_scale_2) + q.bias)


def test_nvfp4_linear_with_prmt_decode(kernel_config):
    """KernelConfig.gemv_prmt's path inside NVFP4Linear (bf16 scales kept) agrees with the integer decode at M <= 16."""
    q = NVFP4Linear.from_linear(torch.nn.Linear(1024, 4096)).to(DEV)
    x = torch.randn(7, 1024, device=DEV, dtype=torch.bfloat16)
    plain = q(x).double()
    kernel_config(gemv_prmt=True)
    q.keep_bf16_scales()
    assert q._scale_bf16.dtype == torch.bfloat16
    assert (q(x).double() - plain).abs().max() <= 2 ** -6 * plain.abs().max()


def test_source_weight_from_min_rows_on_gpu():
    """use_source_from: below min_rows the 4-bit GEMV, from there the original bf16 weight, exactly."""
    lin = torch.nn.Linear(512, 96).to(DEV, torch.bfloat16)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(20, 512, device=DEV, dtype=torch.bfloat16)
    small = q(x[:7])
    q.use_source_from(lin.weight, min_rows=17)
    assert torch.equal(q(x[:7]), small)
    assert torch.equal(q(x), torch.nn.functional.linear(x, lin.weight) + lin.bias)


def test_engine_drafts_with_a_quantized_lm_head_on_gpu():
    """dspark_quantize_lm_head on CUDA: an NVFP4 draft drafts from a 4-bit copy of its bf16 lm_head, in and out
    of CUDA graphs (the bf16 head from 17 rows on); greedy output still equals the fp64 target's."""
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.reference import greedy_generate
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.random_init import tiny_pair
    target, draft = tiny_pair(seed=3, agree=0.002, block_size=6)
    target, draft = target.to(DEV), draft.to(DEV, torch.bfloat16)
    for name, mod in list(draft.named_modules()):
        if isinstance(mod, torch.nn.Linear) and "_proj" in name:
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent), child, NVFP4Linear.from_linear(mod))
    head = draft.lm_head.weight
    prompts = [[1, 2, 3, 4], [10, 20, 30, 40, 50], [7] * 9]
    for eager in (False, True):
        llm = LLM(target, draft, {"dspark_quantize_lm_head": True}, device=DEV, block_size=8, num_kv_blocks=256,
                  enforce_eager=eager)
        assert isinstance(llm.draft.model.lm_head, NVFP4Linear) and llm.draft.model.lm_head._dense is head
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == greedy_generate(target, prompt, 16), (eager, prompt)
