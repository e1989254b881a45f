"""CUDA-graph decode/verify on CUDA: captured replays give the eager engine's outputs."""

import pytest
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import tiny_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # fp32: the Triton fast path; fp64: the reference
@pytest.mark.parametrize("with_draft", [True, False])
def test_graph_replay_equals_eager(with_draft, dtype):
    target, draft = tiny_pair(seed=3, agree=0.002, block_size=6, dtype=dtype)
    target, draft = target.cuda(), draft.cuda()
    draft = draft if with_draft else None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 5, 12, 40, 300)]
    kw = dict(device="cuda", block_size=8, num_kv_blocks=256, max_model_len=512)
    spec = {"enable_adaptive_verification": False} if draft is not None else None  # the same drafts verified
    eager, graphs = LLM(target, draft, spec, enforce_eager=True, **kw), LLM(target, draft, spec, **kw)
    assert graphs.target.graphs is not None and graphs.target.graphs.capture
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, max_tokens=8 + 8 * i, seed=i, ignore_eos=True)
                  for i in range(5)]
        want = eager.generate(prompts, params)
        got = graphs.generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(graphs.target.graphs._runners) >= 2  # batch buckets 8 and, as requests finish, smaller ones (4, 2, 1)
    if with_draft:
        assert graphs.draft.graphs.capture and {k[2] for k in graphs.draft.graphs._runners} == {False, True}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_prompt_graphs_equal_eager_prefill(dtype):
    target, draft = tiny_pair(seed=5, agree=0.002, block_size=6, dtype=dtype)
    target, draft = target.cuda(), draft.cuda()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 12, 40, 300)]
    kw = dict(device="cuda", block_size=8, num_kv_blocks=256, max_model_len=512)
    eager, graphs = LLM(target, draft, enforce_eager=True, **kw), LLM(target, draft, warmup=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for p in prompts:  # one at a time: each prefill replays its length bucket's graph, recorded on first use
        assert graphs.generate([p], params)[0].token_ids == eager.generate([p], params)[0].token_ids
    assert graphs.target.prompts.capture and set(graphs.target.prompts._runners) == {(32, 0), (48, 0), (384, 0)}
    # together (the rest of each after its cached blocks): one packed graph of 4 rows, recorded on first use here
    together = graphs.generate(prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in eager.generate(prompts, params)]
    assert any(len(k) == 4 and k[0] == 4 for k in graphs.target.prompts._runners)


def test_warm_up_records_every_batch_bucket():
    target, draft = tiny_pair(seed=6, agree=0.002, block_size=6, dtype=torch.float32)
    target, draft = target.cuda(), draft.cuda()
    kw = dict(device="cuda", block_size=8, num_kv_blocks=256, max_model_len=512, max_num_seqs=4)
    eager, graphs = LLM(target, draft, enforce_eager=True, **kw), LLM(target, draft, **kw)
    recorded = {k: set(v) for k, v in (("target", graphs.target.graphs._runners),
                                       ("prompts", graphs.target.prompts._runners),
                                       ("draft", graphs.draft.graphs._runners))}
    from dspark_serve.engine.runner.buckets import token_buckets

    assert recorded["target"] == {(b, t, c, split) for b in (1, 2, 4) for t in token_buckets(b, 6) for c in (256, 512)
                                  for split in ((False, True) if b > 1 else (False,))}
    lengths = (32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert recorded["prompts"] == {(n, 0) for n in lengths} | {(n, c) for n in lengths if n <= 128 for c in (256, 512)
                                                               if n < c} | {(4, n, c, 1) for n in lengths
                                                                            for c in (256, 512)}  # packed
    assert recorded["draft"] == {(b, c, q) for b in (1, 2, 4) for c in graphs.draft.graphs.buckets.context
                                 for q in (False, True)}
    assert graphs.warm_up() == 0 and graphs.num_cuda_graphs == sum(map(len, recorded.values()))
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 100, 7, 50)]
    assert [o.token_ids for o in graphs.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]
    for p in prompts[:2]:
        assert graphs.generate([p], params)[0].token_ids == eager.generate([p], params)[0].token_ids
    assert {k: set(v) for k, v in (("target", graphs.target.graphs._runners),
                                   ("prompts", graphs.target.prompts._runners),
                                   ("draft", graphs.draft.graphs._runners))} == recorded  # nothing new to record
