"""Automatic prefix caching: full blocks shared by the hash of everything before their end, in the target's cache
and the draft's context cache; reference-counted, evicted least recently used; outputs the same with and without
it (greedy and seeded, speculative and plain, under preemption and aborts mid-prefill)."""

from __future__ import annotations

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine.block_hash import block_hashes
from dspark_serve.engine.core.block_pool import BlockPool
from dspark_serve.engine.llm import LLM
from dspark_serve.models.demo import demo_target_dir
from dspark_serve.engine.sampling_params import SamplingParams

SYSTEM = [(7 * i + 3) % 250 for i in range(300)]  # a shared system prompt, many blocks long


def test_block_pool_shares_counts_and_evicts_least_recently_freed():
    pool = BlockPool(4, 2)
    h = block_hashes([1, 2, 3, 4, 5, 6], 2)
    assert len(h) == 3 and h == block_hashes([1, 2, 3, 4, 5, 6, 7], 2)  # chained; a partial block has none
    assert block_hashes([9, 2, 3, 4], 2)[1] != h[1]  # a block's hash covers everything before it
    a = pool.allocate_blocks(2)
    pool.register(a[0], h[0])
    pool.register(a[1], h[1])
    assert pool.cached_prefix(h) == a and pool.cached_prefix(block_hashes([9, 2, 3, 4], 2)) == []
    pool.take(a[:1])  # a second request holds the first block
    pool.free(a)
    assert pool.num_free == 3 and pool.cached_prefix(h) == a  # one still held; the other cached, evictable
    pool.free(a[:1])
    assert pool.num_free == 4
    b = pool.allocate_blocks(3)  # two free blocks first, then the least recently freed cached one (a[1])
    assert a[1] in b and a[0] not in b and pool.cached_prefix(h) == a[:1]
    with pytest.raises(MemoryError):
        pool.allocate_blocks(2)


def _llm(target, draft, caching: bool, **kw) -> LLM:
    spec = {"enable_adaptive_verification": False} if draft is not None else None  # every draft: stats compared
    return LLM(target, draft, spec, device="cpu", block_size=8, enable_prefix_caching=caching, **kw)


@pytest.mark.parametrize("with_draft", [True, False])
def test_outputs_equal_with_and_without_the_cache(with_draft):
    target, draft = build_pair(seed=5, agree=0.01, block_size=5, dtype=torch.float32)
    draft = draft if with_draft else None
    g = torch.Generator().manual_seed(3)
    prompts = [SYSTEM + torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    prompts.append(prompts[1] + [4, 4, 4])  # a later turn: the earlier one's prompt and then some
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for caching in (False, True):
        llm = _llm(target, draft, caching, num_kv_blocks=400, max_num_seqs=3)
        first = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]  # one after another: later ones hit
        batch = llm.generate(prompts, params)  # all at once, the cache warm
        outs[caching] = (first, batch, llm)
    for a, b in zip(outs[False][0] + outs[False][1], outs[True][0] + outs[True][1]):
        assert a.token_ids == b.token_ids
        assert a.stats["accepted_per_step"] == b.stats["accepted_per_step"]  # the cached draft context is right
    cached = [o.stats["cached_tokens"] for o in outs[True][0]]
    assert cached[0] == 0 and all(c >= len(SYSTEM) // 8 * 8 for c in cached[1:]), cached
    assert cached[4] >= len(prompts[1]) // 8 * 8  # the later turn finds the earlier turn's blocks
    assert all(o.stats["cached_tokens"] == 0 for o in outs[False][0])
    kv = outs[True][2].kv
    assert kv.hits > 0 and kv.queries > kv.hits


def test_a_cached_prompt_continues_through_the_prompt_graphs_with_the_same_outputs(monkeypatch):
    """On the static path the rest of a prompt whose prefix the cache gave runs through a prompt graph over the
    cached keys (an eager prefill would cost a host launch per kernel); tokens and the draft's context are those of
    the uncached run."""
    from dspark_serve.engine.runner.prompt_graphs import PromptGraphs

    starts = []
    run = PromptGraphs.run
    monkeypatch.setattr(PromptGraphs, "run", lambda self, tables, tokens, at=None: (
        starts.append(list(at or [])), run(self, tables, tokens, at))[1])
    target, draft = build_pair(seed=5, agree=0.01, block_size=5, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [SYSTEM + torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = _llm(target, draft, caching, num_kv_blocks=400, max_num_seqs=3, enforce_eager=False)
        outs[caching] = [llm.generate([p], params)[0] for p in prompts]
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    assert [o.stats["cached_tokens"] for o in outs[True]][1:] == [len(SYSTEM) // 8 * 8] * 2
    assert [s for s in starts if any(s)] == [[len(SYSTEM) // 8 * 8]] * 2  # the two cached prompts' rest


def test_a_second_request_with_the_same_system_prompt_is_mostly_cached():
    target, draft = build_pair(seed=6, agree=0.01, block_size=5, dtype=torch.float32)
    llm = _llm(target, draft, True, num_kv_blocks=400)
    system = [(11 * i + 5) % 250 for i in range(700)]
    for question in ([1, 2, 3], [9, 8, 7, 6]):
        out = llm.generate([system + question], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.stats["cached_tokens"] >= 0.9 * (len(system) + 4), out.stats["cached_tokens"]


def test_eviction_under_memory_pressure_and_preemption_keep_outputs():
    """A cache too small for every prompt: old prefixes are evicted (least recently used first), requests are
    preempted and recomputed, and every output still equals the uncached engine's."""
    target, draft = build_pair(seed=7, agree=0.01, block_size=5, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 250, (60,), generator=g).tolist() for _ in range(6)]
    prompts += [p + [1, 2] for p in prompts[:3]]  # revisits: some still cached, some evicted
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = _llm(target, draft, caching, num_kv_blocks=40, max_num_seqs=4)  # 320 slots for 9 x 92
        outs[caching] = llm.generate(prompts, params), llm.scheduler.num_preemptions, llm.kv
    for a, b in zip(outs[False][0], outs[True][0]):
        assert a.token_ids == b.token_ids
    assert outs[True][1] > 0  # preemptions happened
    kv = outs[True][2]
    assert kv.target.num_cached < 40 and kv.all_free()


def test_abort_mid_prefill_leaves_only_computed_blocks_cached():
    target, draft = build_pair(seed=8, agree=0.01, block_size=5, dtype=torch.float32)
    llm = _llm(target, draft, True, num_kv_blocks=400, max_num_batched_tokens=64)
    long = SYSTEM + list(range(100))
    rid = llm.add_request(long, SamplingParams(temperature=0.0, max_tokens=4))
    llm.step()  # one 64-token chunk computed
    llm.abort(rid)
    llm.step()
    assert llm.kv.target.num_cached == 64 // 8 and llm.kv.all_free()
    out = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=4))[0]
    ref = _llm(target, draft, False, num_kv_blocks=400).generate([long], SamplingParams(temperature=0.0,
                                                                                       max_tokens=4))[0]
    assert out.token_ids == ref.token_ids and out.stats["cached_tokens"] == 0  # the draft had none of it


@pytest.mark.slow
@pytest.mark.skipif(not (demo_target_dir() / ".dspark-converted").is_file(), reason="the demo target is not fetched")
def test_the_demo_pairs_second_request_with_a_700_token_system_prompt_is_cached():
    from dspark_serve.models.demo import DEMO_DRAFTER

    llm = LLM(demo_target_dir(), DEMO_DRAFTER, device="cpu", dtype=torch.float32, num_kv_blocks=256)
    system = "You are a careful Python reviewer. " + " ".join(f"Rule {i}: keep functions short." for i in range(120))
    outs = []
    for question in ("Review: def f(x): return x", "Review: def g(): pass"):
        chat = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        outs.append(llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=2))[0])
    prompt = len(outs[1].prompt_ids)
    assert prompt >= 700 and outs[1].stats["cached_tokens"] >= 0.9 * prompt, (prompt, outs[1].stats["cached_tokens"])
