"""Programmatic dependent launch (kernels/pdl.py) and the L2 weight prefetch (kernels/l2_prefetch.py) on CUDA: the
CUDA-graph engine gives the same tokens with both on as with both off, and the prefetch runs inside a graph."""

import pytest
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.kernels import dispatch, l2_prefetch, pdl
from dspark_serve.models.random_init import tiny_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA device of compute capability >= 9.0")


def test_prefetch_l2_in_a_graph():
    w = torch.randn(4096, 1000, device="cuda").bfloat16()
    assert l2_prefetch.prefetch_l2(w, 2 ** 40) == w.numel() * 2
    assert l2_prefetch.prefetch_l2(w, 100_000) == 100_000 & ~15
    with pytest.raises(ValueError, match="contiguous CUDA"):
        l2_prefetch.prefetch_l2(w.T, 1024)
    assert l2_prefetch.prefetcher_for(torch.empty(1, 8, device="cuda")) is None   # eager: no prefetch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pf = l2_prefetch.prefetcher_for(torch.empty(1, 8, device="cuda"))
        assert pf is not None
        pf.fetch(w)
        pf.join()
    g.replay()
    torch.cuda.synchronize()


def test_graphs_same_tokens_with_and_without(monkeypatch):
    assert pdl.enabled(torch.empty(1, device="cuda"))
    target, draft = tiny_pair(seed=5, agree=0.002, block_size=6, dtype=torch.bfloat16)
    target, draft = target.cuda(), draft.cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 17, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts]
    kw = dict(device="cuda", block_size=8, num_kv_blocks=128, max_model_len=256)
    fetched = []
    real = l2_prefetch.prefetch_l2
    monkeypatch.setattr(l2_prefetch, "prefetch_l2", lambda t, n: fetched.append(n) or real(t, n))
    outs = {}
    for on in (True, False):
        monkeypatch.setattr(dispatch, "PDL", on)
        monkeypatch.setattr(dispatch, "L2_PREFETCH_MB", 32.0 if on else 0.0)
        for spec in (False, True):
            llm = LLM(target, draft if spec else None, **kw)
            outs[on, spec] = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.target.graphs.capture                                 # no fallback to eager
        if on:
            assert len(fetched) >= 4 * target.config.num_layers - 1         # captured: every projection's gap
            n_on = len(fetched)
    assert len(fetched) == n_on                                              # off: none
    assert outs[True, False] == outs[False, False] and outs[True, True] == outs[False, True]
