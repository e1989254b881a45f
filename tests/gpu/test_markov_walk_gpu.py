"""The top-k Markov walk kernel on CUDA against its reference (at the demo drafter's shapes and larger), and inside
a CUDA graph."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from dspark_serve.kernels.markov_walk_ref import markov_walk_ref

if torch.cuda.is_available():
    from dspark_serve.kernels.markov_walk import markov_walk


def _args(num, n, k, rank, vocab, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    values, cand = (torch.randn(num, n, vocab, device="cuda", generator=g) * 3).topk(k, dim=-1)
    w2 = torch.randn(vocab, rank, device="cuda", generator=g).bfloat16()
    w1 = torch.randn(vocab, rank, device="cuda", generator=g).bfloat16()
    anchor = torch.randint(0, vocab, (num,), device="cuda", generator=g)
    conf_base, conf_w = torch.randn(num, n, device="cuda", generator=g), torch.randn(rank, device="cuda", generator=g)
    noise = torch.randn(num, n, k, device="cuda", generator=g)
    temperature = torch.rand(num, device="cuda", generator=g) + 0.3
    sampled = torch.arange(num, device="cuda") % 2 == 1
    return values, cand, w2[cand], w1, anchor, 0.9, None, conf_base, conf_w, noise, temperature, sampled


@pytest.mark.parametrize("num,n,k,rank", [(1, 7, 64, 8), (8, 7, 256, 64), (64, 7, 64, 256)])
def test_kernel_matches_reference(num, n, k, rank):
    args = _args(num, n, k, rank, 151936, seed=num + k)
    got, ref = markov_walk(*args), markov_walk_ref(*args)
    assert got[0].tolist() == ref[0].tolist()
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-4)


def test_capture_and_replay():
    args = _args(4, 7, 64, 8, 151936, seed=1)
    expect = markov_walk(*args)[0].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = markov_walk(*args)
    args[0].add_(0.0)
    graph.replay()
    torch.cuda.synchronize()
    assert out[0].tolist() == expect.tolist()
