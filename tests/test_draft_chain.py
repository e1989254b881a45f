"""Chaining the draft behind the verify launched ahead (engine/draft_chain.py; the default on CUDA with graphs)
changes no output: greedy and seeded sampling, top-k drafting, continuous batching with admissions, stop tokens,
length limits and aborts; every block is freed; it is really used, and dropped when the batch changed."""

import pytest
from engine_pairs import build_pair, random_prompts

from dspark_serve.engine.drafter import Drafter
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.core.pipeline import StepPipeline


def _params(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=12 + 3 * i, seed=i,
                           stop_token_ids=(7,) if i % 3 == 0 else ()) for i in range(count)]


@pytest.fixture
def taken(monkeypatch):
    used: list[bool] = []
    take = StepPipeline.take_chained

    def counting(*args):
        out = take(*args)
        used.append(out is not None)
        return out
    monkeypatch.setattr(StepPipeline, "take_chained", counting)
    return used


def _llm(target, draft, spec, chain: bool) -> LLM:
    spec = {"enable_adaptive_verification": False, **spec}  # every capped draft verified (see test_step_ahead.py)
    """Static shapes (run eagerly on CPU), drafting and launching ahead as on CUDA; chaining on or off."""
    llm = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4,
              enforce_eager=False)
    assert isinstance(llm.draft, Drafter) and llm.draft.can_chain
    pipeline = llm.executor.pipeline
    pipeline.step_ahead = pipeline.draft_ahead = True
    pipeline.chain_ahead = chain
    return llm


@pytest.mark.parametrize("spec", [{}, {"dspark_draft_topk": 8}])
def test_chained_draft_changes_no_output(spec, taken):
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts, params = random_prompts(3, 14), _params(14)  # 14 prompts through 4 slots: admissions between steps
    outs = {}
    for chain in (False, True):
        llm = _llm(target, draft, spec, chain)
        taken.clear()
        outs[chain] = llm.generate(prompts, params)
        assert llm.kv.target.num_free == 256 and llm.kv.draft.num_free == 256
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    assert sum(taken) > len(taken) // 2, (sum(taken), len(taken))  # most steps drafted on the chain
    assert not all(taken)  # and batches that changed dropped it


def test_abort_drops_the_chain(taken):
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts = random_prompts(6, 3)
    finals = {}
    for chain in (False, True):
        llm = _llm(target, draft, {}, chain)
        ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts]
        for _ in range(3):
            llm.step()
        assert llm.abort(ids[1])
        out = {}
        while llm.has_unfinished():
            out.update({o.request_id: o for o in llm.step() if o.finished})
        assert out[ids[1]].finish_reason == "abort"
        finals[chain] = [out[ids[0]].token_ids, out[ids[2]].token_ids]
        assert llm.kv.target.num_free == 256 and llm.kv.draft.num_free == 256
    assert finals[False] == finals[True] and any(taken)


def test_chained_proposal_equals_a_fresh_draft(monkeypatch):
    """Each chained proposal (drafted on the device from the verify's accept and features) equals the draft the
    host would launch for the same state: tokens, q on the candidates and confidences. The draft's block output
    is not zeroed here, so its context (the verify's features) matters."""
    import torch

    from dspark_serve.engine.drafter import draft_input
    from dspark_serve.engine.rejection import PACKED_ACCEPTED, PACKED_TOKENS
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    with torch.no_grad():
        draft.norm.weight.fill_(1.0)  # the block's hidden (context included) reaches the logits
    take = StepPipeline.take_chained
    checked = []

    def checking(pipeline, launched, rows, reqs, contexts, computed):
        saved = [(c.length, list(c.pending)) for c in contexts]
        out = take(pipeline, launched, rows, reqs, contexts, computed)
        if out is None:
            return None
        got = {k: v.clone() for k, v in vars(out).items() if isinstance(v, torch.Tensor)}
        done = [(c.length, c.pending) for c in contexts]
        for c, (n, feats) in zip(contexts, saved):
            c.length, c.pending = n, feats
        packed = launched.packed
        anchors = [int(packed[i, PACKED_TOKENS + int(packed[i, PACKED_ACCEPTED])]) for i in range(len(reqs))]
        fresh = llm.draft.propose(draft_input(reqs, contexts, anchors, computed, computed))
        for c, (n, feats) in zip(contexts, done):
            c.length, c.pending = n, feats
        for k, v in got.items():
            assert torch.equal(v, getattr(fresh, k)), k
        checked.append(len(reqs))
        return out
    monkeypatch.setattr(StepPipeline, "take_chained", checking)
    llm = _llm(target, draft, {"dspark_draft_topk": 8}, True)
    outs = llm.generate(random_prompts(5, 6), _params(6))
    assert len(checked) > 10 and max(checked) > 1
    assert sum(o.stats["accepted"] for o in outs) > 0


def test_a_wave_s_tail_keeps_its_chain(taken):
    """Requests admitted together that finish at different steps (their lengths, a stop token) are left out of the
    step launched ahead: the rows that go on keep their launched verify and chained draft step after step, and
    the outputs are those without chaining."""
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts = random_prompts(4, 4)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=6 + 5 * i, seed=i, ignore_eos=True,
                             stop_token_ids=(7,) if i == 2 else ()) for i in range(4)]
    outs, misses = {}, {}
    for chain in (False, True):
        llm = _llm(target, draft, {}, chain)  # four slots: every request admitted at once
        taken.clear()
        outs[chain] = llm.generate(prompts, params)
        misses[chain] = taken.count(False)
        assert llm.kv.target.num_free == 256 and llm.kv.draft.num_free == 256
    assert [(o.token_ids, o.finish_reason) for o in outs[False]] == [(o.token_ids, o.finish_reason)
                                                                    for o in outs[True]]
    assert len({len(o.token_ids) for o in outs[True]}) == 4  # four finishes, at four different steps
    assert misses[True] <= 1 < misses[False], (misses, taken)  # the first decode step only: no finish drops it
