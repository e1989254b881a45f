"""The deterministic mode on CUDA: the batch-invariant matmul's rows bit-equal at every M and lane on the
tensor cores, close to cuBLAS; the invariant target runner's row, K/V and logits bit-equal alone and among 7 to 64
rows, and a prompt's prefill equal to decoding it token by token; a row's coupled sampled tokens equal its own alone."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864), (9728, 896), (8192, 896)])
@pytest.mark.parametrize("programs,block_n", [(0, 32), (128, 32), (128, 16), (256, 16)])
def test_rows_bit_equal_at_every_m(n, k, programs, block_n):
    from dspark_serve.kernels.matmul_invariant import config_for, matmul_invariant

    cfg = config_for(n, k, programs, block_n)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(512, k, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=g, device=DEV, dtype=torch.bfloat16) / k ** 0.5
    b = torch.randn(n, generator=g, device=DEV, dtype=torch.bfloat16)
    full = matmul_invariant(x, w, b, config=cfg)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert ((full.float() - ref).norm() / ref.norm()).item() < 1e-2
    for m in (1, 7, 8, 16, 64, 200):
        for start in (0, 3, 512 - m):
            assert torch.equal(matmul_invariant(x[start:start + m], w, b, config=cfg), full[start:start + m]), \
                (m, start)


def test_invariant_runner_rows_and_prefill():
    from engine_pairs import build_pair
    from test_row_invariance import check_prefill_equals_decoding, check_row_invariance

    from dspark_serve.engine.runner.target_runner import TargetRunner
    from dspark_serve.kernels.config import KernelConfig

    target, _ = build_pair(seed=11, dtype=torch.bfloat16)
    target = target.to(DEV)
    runner = TargetRunner(target, KernelConfig.for_device(torch.device(DEV)), deterministic=True)
    assert runner.invariant and runner.layers is not None
    check_row_invariance(runner, target, DEV)
    check_prefill_equals_decoding(runner, target, DEV)


def test_coupled_tokens_of_a_row_do_not_depend_on_the_rows_beside_it():
    """Sampled rows without filters are drawn several at a time on the GPU: each row's tokens equal its own alone."""
    from dspark_serve.engine.rejection import coupled_tokens

    g = torch.Generator(device=DEV).manual_seed(3)
    r, n, v = 13, 8, 151936
    logits = torch.randn(r, n, v, generator=g, device=DEV) * 3
    greedy = torch.arange(r, device=DEV) % 4 == 0
    temp = torch.rand(r, generator=g, device=DEV) + 0.5
    top_k = torch.where(torch.arange(r, device=DEV) % 5 == 1, 20, 0)
    seeds = torch.arange(r, device=DEV) * 7919
    pos = torch.arange(n, device=DEV)[None].repeat(r, 1) + 30
    filtered = [i for i in range(r) if top_k[i] > 0]
    ones, zeros = torch.ones(r, device=DEV), torch.zeros(r, device=DEV)
    together = coupled_tokens(logits, greedy, temp, top_k, ones, zeros, seeds, pos, filtered)
    for i in range(r):
        one = slice(i, i + 1)
        alone = coupled_tokens(logits[one], greedy[one], temp[one], top_k[one], ones[one], zeros[one], seeds[one],
                               pos[one], [0] if i in filtered else [])
        assert torch.equal(alone[0], together[i]), i
