"""The engine on CUDA: greedy speculative output equals plain greedy, seeded sampling equals the CPU run."""

import pytest
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.reference import greedy_generate
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import tiny_pair

OFF = {"enable_adaptive_verification": False}  # every capped draft verified, as a plain comparison needs
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("spec", [{}, {"dspark_draft_topk": 8}, {"dspark_confidence_threshold": 0.05}])
def test_greedy_equals_plain_on_cuda(spec):
    target, draft = tiny_pair(seed=3, agree=0.002, block_size=6)
    target, draft = target.cuda(), draft.cuda()
    llm = LLM(target, draft, spec, device="cuda", block_size=8, num_kv_blocks=512)
    prompts = _prompts(16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_generate(target, p, 24)
    if "dspark_draft_topk" not in spec:  # the constructed draft's base logits are flat: top-k picks blindly
        assert sum(o.stats["tau"] for o in outs) / len(outs) > 2.0


def test_seeded_sampling_matches_cpu():
    outs = {}
    for dev in ("cpu", "cuda"):
        target, draft = tiny_pair(seed=3, agree=0.002, block_size=6)
        # the policy off: a step launched ahead (CUDA) is sized a step earlier than one launched late (CPU)
        llm = LLM(target.to(dev), draft.to(dev), OFF, device=dev, block_size=8, num_kv_blocks=256)
        outs[dev] = [o.token_ids for o in llm.generate(_prompts(4), SamplingParams(temperature=0.8, seed=7,
                                                                                    max_tokens=16))]
    # fp64 models: the keyed noise is bit-identical, so tokens agree unless a Gumbel race is within rounding
    same = sum(a == b for a, b in zip(outs["cpu"], outs["cuda"]))
    assert same >= 3, outs


def test_chained_draft_on_cuda_changes_no_output(monkeypatch):
    """The draft chained behind the verify launched ahead (the CUDA default): the same tokens and acceptance as
    without it, greedy and seeded sampling, in CUDA graphs; and it is really taken."""
    from dspark_serve.engine.core.pipeline import StepPipeline
    taken = []
    take = StepPipeline.take_chained
    monkeypatch.setattr(StepPipeline, "take_chained", lambda *a: taken.append(take(*a)) or taken[-1])
    target, draft = tiny_pair(seed=3, agree=0.002, block_size=6)
    with torch.no_grad():
        draft.norm.weight.fill_(1.0)  # the block's hidden (the verify's features in its context) reaches the logits
    target, draft = target.cuda(), draft.cuda()
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=20) for i in range(len(prompts))]
    outs = {}
    for chain in (False, True):
        llm = LLM(target, draft, OFF, device="cuda", block_size=8, num_kv_blocks=512, max_num_seqs=2)
        assert llm.executor.pipeline.chain_ahead and llm.draft.can_chain
        llm.executor.pipeline.chain_ahead = chain
        taken.clear()
        outs[chain] = llm.generate(prompts, params)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    assert sum(p is not None for p in taken) > len(taken) // 2
