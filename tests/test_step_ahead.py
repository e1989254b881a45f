"""Launching the next step ahead (its verify and accept queued before the host's bookkeeping of this one)
changes no output: greedy and seeded sampling, continuous batching with admissions, stop tokens, length limits,
aborts and plain decoding; it frees every block; it is really used, and skipped when n needs the confidences."""

import pytest
from engine_pairs import build_pair, random_prompts

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.core.pipeline import StepPipeline


def _params(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=12 + 3 * i, seed=i,
                           stop_token_ids=(7,) if i % 3 == 0 else ()) for i in range(count)]


@pytest.fixture
def taken(monkeypatch):
    """Per spec_step call: how many of its requests took a row launched ahead."""
    counts: list[tuple[int, int, int]] = []  # (rows taken, requests, rows launched ahead)
    take = StepPipeline.take_launched

    def counting(pipeline, reqs):
        launched, rows = take(pipeline, reqs)
        counts.append((len(rows), len(reqs), len(launched.reqs) if launched is not None else 0))
        return launched, rows
    monkeypatch.setattr(StepPipeline, "take_launched", counting)
    return counts


def _llm(target, draft, spec, static, ahead):
    # every capped draft verified: sampled outputs are compared, and the policy's budget may differ between a step
    # launched ahead (sized a step earlier) and one launched late (the policy: test_spec_policy.py)
    spec = {"enable_adaptive_verification": False, **spec} if draft is not None else spec
    llm = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4,
              enforce_eager=not static)
    llm.executor.pipeline.step_ahead = ahead
    if llm.draft is not None:
        llm.executor.pipeline.draft_ahead = ahead
    return llm


def _generate_both(target, draft, spec, static, prompts, params, taken) -> dict:
    """Outputs without and with launching ahead (`taken` then holds the second run's counts); every block freed."""
    outs = {}
    for ahead in (False, True):
        llm = _llm(target, draft, spec, static, ahead)
        taken.clear()
        outs[ahead] = llm.generate(prompts, params)
        assert llm.kv.target.num_free == 256
        assert llm.draft is None or llm.kv.draft.num_free == 256
    return outs


def _same(a, b):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert a.stats["accepted_per_step"] == b.stats["accepted_per_step"]


@pytest.mark.parametrize("spec", [{}, {"dspark_draft_topk": 8}])
@pytest.mark.parametrize("static", [False, True])
def test_step_ahead_changes_no_output(spec, static, taken):
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    # 14 prompts through 4 slots: admissions between steps
    outs = _generate_both(target, draft, spec, static, random_prompts(3, 14), _params(14), taken)
    for a, b in zip(outs[False], outs[True]):
        _same(a, b)
    rows = sum(t[0] for t in taken)
    total = sum(t[1] for t in taken)
    assert rows > total // 2, (rows, total)  # most rows came from the step launched ahead
    assert any(0 < k < n for k, n, _ in taken)  # a batch that changed kept the rows it could (and launched the rest)


def test_plain_decoding_ahead(taken):
    target, _ = build_pair(seed=5, agree=0.005, block_size=5)
    outs = _generate_both(target, None, None, True, random_prompts(4, 9), _params(9), taken)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert sum(t[0] for t in taken) > sum(t[1] for t in taken) // 2


def test_abort_between_steps(taken):
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts = random_prompts(6, 3)
    finals = {}
    for ahead in (False, True):
        llm = _llm(target, draft, {}, True, ahead)
        ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts]
        for _ in range(3):
            llm.step()
        assert llm.abort(ids[1])
        out = {}
        while llm.has_unfinished():
            out.update({o.request_id: o for o in llm.step() if o.finished})
        assert out.pop(ids[1]).finish_reason == "abort"
        finals[ahead] = [out[ids[0]], out[ids[2]]]
        assert llm.kv.target.num_free == 256 and llm.kv.draft.num_free == 256
    for a, b in zip(finals[False], finals[True]):
        _same(a, b)
    assert any(k == n < launched for k, n, launched in taken)  # the aborted request's row was dropped


def test_ahead_when_n_reads_confidences(taken):
    """With the confidence threshold, n depends on this step's confidences; the split runs in the verify graph, so
    steps are still launched ahead, and change no output."""
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    outs = _generate_both(target, draft, {"dspark_confidence_threshold": 0.5}, True, random_prompts(3, 6), _params(6),
                          taken)
    for a, b in zip(outs[False], outs[True]):
        _same(a, b)
    assert sum(t[0] for t in taken) > sum(t[1] for t in taken) // 2


class _DraftBehindAChannel:
    """The Drafter that actors/remote_draft.RemoteDraft is on a CPU verifier (no drafting ahead, no chaining),
    over a local DraftSide."""

    def __init__(self, side) -> None:
        self.side = side
        self.num_speculative_tokens, self.query_len = side.num_speculative_tokens, side.query_len
        self.num_blocks, self.device, self.has_confidence = side.num_blocks, side.device, side.has_confidence

    def propose(self, inp):
        return self.side.propose(inp)


def test_a_draft_that_cannot_draft_ahead(taken):
    """A remote draft proposes only when asked: the steps that draft are not launched ahead, plain-only ones are."""
    target, draft = build_pair(seed=11, agree=0.005, block_size=5)
    prompts, params = random_prompts(5, 6), _params(6)
    outs = {}
    for ahead in (False, True):
        local = _llm(target, draft, {}, True, False)
        remote = LLM(target, None, device="cpu", block_size=8, num_kv_blocks=256, max_num_seqs=4,
                     enforce_eager=False, draft_side=_DraftBehindAChannel(local.draft),
                     capture_layers=draft.config.target_layer_ids)
        assert not remote.executor.pipeline.draft_ahead  # on a CPU device
        remote.executor.pipeline.step_ahead = ahead
        taken.clear()
        ids = [remote.add_request(p, sp, num_speculative_tokens=0 if i % 2 else None)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        finals = {}
        while remote.has_unfinished():
            finals.update({o.request_id: o for o in remote.step() if o.finished})
        outs[ahead] = [finals[i] for i in ids]
        assert remote.kv.target.num_free == 256 and local.kv.draft.num_free == 256
    for a, b in zip(outs[False], outs[True]):
        _same(a, b)
    assert any(k > 0 for k, _, _ in taken)  # batches of plain-only requests were launched ahead
