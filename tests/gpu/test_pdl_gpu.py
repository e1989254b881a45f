"""Programmatic dependent launch (kernels/pdl.py) on CUDA: the CUDA-graph engine gives the same tokens with it as
without it, plain and speculative, and its graphs capture (no fallback to eager)."""

import pytest
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.kernels import pdl
from dspark_serve.models.random_init import tiny_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a CUDA device of compute capability >= 9.0")


def test_graphs_same_tokens_with_and_without_pdl(kernel_config):
    target, draft = tiny_pair(seed=5, agree=0.002, block_size=6, dtype=torch.bfloat16)
    target, draft = target.cuda(), draft.cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 17, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts]
    kw = dict(device="cuda", block_size=8, num_kv_blocks=128, max_model_len=256)
    outs = {}
    for on in (True, False):
        kernel_config(pdl=on)
        assert pdl.enabled(torch.empty(1, device="cuda")) == on
        for spec in (False, True):
            llm = LLM(target, draft if spec else None, **kw)
            outs[on, spec] = [o.token_ids for o in llm.generate(prompts, params)]
            assert llm.target.graphs.capture                                 # no fallback to eager
    assert outs[True, False] == outs[False, False] and outs[True, True] == outs[False, True]
