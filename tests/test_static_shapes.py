"""Static-shape decode/verify (engine/runner/target_graphs.py) run eagerly on CPU: the same logits and the same
outputs as the dynamic path, with padded batches, padded verify rows, context buckets crossed mid-request, and KV
growth."""

from __future__ import annotations

import sys
import warnings

import pytest
from paging import pool
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.runner.buckets import token_buckets
from dspark_serve.engine.target_side import TargetSide
from dspark_serve.models.random_init import tiny_pair


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lens = [1, 4, 9, 30, 250]  # the last one crosses the 256-slot context bucket while decoding
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("with_draft", [True, False])
def test_static_path_outputs_equal_dynamic_path(temperature, with_draft):
    target, draft = tiny_pair(seed=4, agree=0.01, block_size=6, dtype=torch.float32)
    draft = draft if with_draft else None
    prompts = _prompts()
    params = [SamplingParams(temperature=temperature, max_tokens=40, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(device="cpu", block_size=8, num_kv_blocks=200, max_model_len=512)
    dynamic = LLM(target, draft, enforce_eager=True, **kw)
    static = LLM(target, draft, enforce_eager=False, **kw)
    assert dynamic.target.graphs is None and static.target.graphs is not None
    for batch in (prompts[:3], prompts):  # 3 requests pad to a batch bucket of 4
        want = dynamic.generate(batch, params[:len(batch)])
        got = static.generate(batch, params[:len(batch)])
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    shapes = set(static.target.graphs._runners)
    # both batch buckets; the long prompt's context bucket
    assert {(4, 256), (8, 512)} <= {(b, c) for b, _, c, _ in shapes}, shapes
    if with_draft:
        assert sum(o.stats["accepted"] for o in got) > 0
        assert {(4, 256), (8, 512)} <= {k[:2] for k in static.draft.graphs._runners}


def _requests(side: TargetSide, prompts: list[list[int]]) -> list[Request]:
    """A request per prompt with the target blocks of its prompt and 8 more tokens."""
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(str(i), p, SamplingParams(max_tokens=8), seed=0, num_speculative_tokens=3)
        r.target_blocks = pool(side).allocate(len(p) + 8)
        reqs.append(r)
    return reqs


def _verify(side: TargetSide, reqs: list[Request], rows: list[list[int]], n: int = 3):
    """Verify each row (its anchor, then its drafts, all of them) -> Verified."""
    from dspark_serve.engine.draft_split import DraftSlots

    caps = [len(r) - 1 for r in rows]
    drafts = torch.tensor([r[1:] + [0] * (n - len(r) + 1) for r in rows])
    slots = DraftSlots(caps, [False] * len(rows), sum(caps), [[1.0] * n] * len(rows), [0.0] * len(rows))
    return side.verify(reqs, slots, drafts if n else None, None, [r[0] for r in rows])


def test_static_verify_logits_and_features_match_dynamic():
    target, draft = tiny_pair(seed=2, agree=0.01, block_size=4, dtype=torch.float32)
    layers = draft.config.target_layer_ids
    sides = [TargetSide(target, 64, 8, capture_layers=layers) for _ in range(2)]
    sides[1].use_static_shapes(3, max_model_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 17, 3)]
    outs = []
    for side in sides:
        reqs = _requests(side, prompts)
        side.run(reqs, [r.prompt_ids for r in reqs], last_only=True)  # prefill (prompt graphs in the static one)
        for r in reqs:
            r.num_computed = len(r.prompt_ids)
        outs.append(_verify(side, reqs, [[7, 8, 9], [1], [4, 5, 6, 7]]))  # rows of 3, 1 and 4 tokens (varlen)
    a, b = outs
    assert torch.equal(a.packed, b.packed) and a.packed[:, 0].tolist() == [2, 0, 3]
    la, lb = a.logits_of([0, 1, 2]), b.logits_of([0, 1, 2])
    assert la.shape == lb.shape == (3, 4, target.config.vocab_size)
    for r, n in enumerate([3, 1, 4]):
        assert torch.allclose(la[r, :n], lb[r, :n], atol=1e-5, rtol=1e-5)
        assert torch.allclose(a.feats[r, :n], b.feats[r, :n], atol=1e-5, rtol=1e-5)
    # the verify wrote K/V for real tokens only: both caches agree on every live block, the trash block aside
    live = sides[0].num_blocks
    assert torch.allclose(sides[0].cache[:, :, :live], sides[1].cache[:, :, :live], atol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lens", [[1, 32, 47], [30, 2, 9, 17, 5], [3, 30, 2, 9, 17, 5, 40, 1, 8]])
def test_prompt_graphs_match_dynamic_prefill(lens, packed):
    target, draft = tiny_pair(seed=3, agree=0.01, block_size=4, dtype=torch.float32)
    sides = [TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids) for _ in range(2)]
    sides[1].use_static_shapes(3, max_model_len=128)
    sides[1].prompts.packed = packed
    assert sides[1].prompts.lengths == (32, 48, 64, 96, 128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in lens]
    outs = [side.run(_requests(side, prompts), prompts, last_only=True) for side in sides]
    (la, fa), (lb, fb) = outs
    assert la.shape == lb.shape == (len(lens), 1, target.config.vocab_size)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    for a, b, n in zip(fa, fb, lens):
        assert b.shape == (n, a.shape[1])
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    live = sides[0].num_blocks  # the prompts' K/V, the padding's in the trash block only
    torch.testing.assert_close(sides[1].cache[:, :, :live], sides[0].cache[:, :, :live], atol=1e-5, rtol=1e-5)
    built, graphs = set(sides[1].prompts._runners), sides[1].prompts
    assert graphs.max_prompts == 4
    if packed:  # one graph: rows, tokens and context buckets
        assert built == {({3: 4, 5: 16, 9: 16}[len(lens)], {80: 96, 63: 64, 115: 128}[sum(lens)], 256, 1)}
    else:
        want = {(32 if n <= 32 else 48, 0) for n in lens} if len(lens) <= graphs.max_prompts else set()
        assert built == want  # five or nine prompts run eagerly as one batch


@pytest.mark.parametrize("packed", [True, False])
def test_context_graphs_continue_prompts_after_a_cached_start_as_the_dynamic_prefill_does(packed):
    """The rest of each prompt after a start already in the cache (written by the same eager prefill on both
    sides): its graph (one packed graph, or one each) attends to the cached keys through the block table and writes
    only the new tokens' K/V."""
    target, draft = tiny_pair(seed=3, agree=0.01, block_size=4, dtype=torch.float32)
    sides = [TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids) for _ in range(2)]
    sides[1].use_static_shapes(3, max_model_len=128)
    sides[1].prompts.packed = packed
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (40, 19, 77)]
    starts = [16, 8, 40]
    outs = []
    for side in sides:
        reqs = _requests(side, prompts)
        graphs, side.prompts = side.prompts, None  # the start: the dynamic prefill on both sides
        side.run(reqs, [p[:s] for p, s in zip(prompts, starts)], last_only=True, starts=[0] * 3)
        side.prompts = graphs
        outs.append(side.run(reqs, [p[s:] for p, s in zip(prompts, starts)], last_only=True, starts=starts))
    (la, fa), (lb, fb) = outs
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    for a, b, p, s in zip(fa, fb, prompts, starts):
        assert b.shape == (len(p) - s, a.shape[1])
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    live = sides[0].num_blocks
    torch.testing.assert_close(sides[1].cache[:, :, :live], sides[0].cache[:, :, :live], atol=1e-5, rtol=1e-5)
    want = {(4, 96, 256, 1)} if packed else {(32, 256), (48, 256)}  # 72 new tokens; or 24 and 11: 32, 37: 48
    assert set(sides[1].prompts._runners) == want


@pytest.mark.parametrize("packed", [True, False])
def test_prompt_graphs_leave_compute_bound_prefills_eager(packed):
    target, _ = tiny_pair(seed=3, agree=0.01, block_size=4, dtype=torch.float32)
    side = TargetSide(target, 64, 8)
    side.use_static_shapes(0, max_model_len=128)
    side.prompts.packed = packed
    c = target.config
    w = side.prompts.layer_weights
    assert w == c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim \
        + 3 * c.hidden_size * c.intermediate_size
    side.prompts.max_work = 64 * w  # 64 padded tokens of this model at most
    takes = {tuple(lens): side.prompts.takes([0] * len(lens), lens)
             for lens in ([32], [30, 2], [33], [49], [64], [65], [32, 33], [1, 1, 1])}
    # buckets 32, 32+32, 48, 64, 64, 96, 32+48, 3 x 32; packed, the sums': 32 for [30, 2], 96 for [32, 33], 32 for
    # [1, 1, 1]
    assert takes == {(32,): True, (30, 2): True, (33,): True, (49,): True, (64,): True, (65,): False,
                     (32, 33): False, (1, 1, 1): packed}
    assert side.prompts.takes([0, 4], [5, 5])  # a sequence with a cached start: over its context
    assert not side.prompts.takes([100], [5])  # its padded tokens would pass max_model_len
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 250, (70,), generator=g).tolist()
    eager = TargetSide(target, 64, 8)
    want = eager.run(_requests(eager, [prompt]), [prompt], last_only=True)[0]
    got = side.run(_requests(side, [prompt]), [prompt], last_only=True)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not side.prompts._runners  # 70 tokens (bucket 96) ran eagerly


def _padding_only_capture(caches: list[torch.Tensor], live: int, pools: list):
    """A stand-in for runner.capture.capture on CPU: runs forward once, as the real one's warm-up does, and checks
    that the run left every live cache block alone (the static inputs held padding, bound for the trash block)."""
    def fake(forward, pool):
        before = [c.clone() for c in caches]
        forward()
        for c, b in zip(caches, before):
            assert torch.equal(c[:, :, :live], b[:, :, :live]), "a capture run wrote a live cache block"
        pools.append(pool)
        return forward, len(pools)
    return fake


@pytest.mark.parametrize("fails", [False, True])
def test_capture_runs_on_padding_and_restores_the_step(monkeypatch, fails):
    """The capture path of all three graph kinds (prompt, verify, draft), which only CUDA takes: the capture runs
    see padding only, then the step's own inputs are back, so outputs equal the dynamic path's; a capture that
    fails warns and leaves the static path running eagerly."""
    from dspark_serve.engine.runner import capture as cuda_graphs, target_graphs
    from dspark_serve.engine.draft_side import DraftSide
    from dspark_serve.engine.drafter import DraftInput
    from dspark_serve.engine.spec_config import SpeculativeConfig

    target, draft = tiny_pair(seed=5, agree=0.01, block_size=4, dtype=torch.float32)
    sides = [TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids) for _ in range(2)]
    drafts = [DraftSide(draft, 64, 8, SpeculativeConfig(dspark_draft_topk=8), 256) for _ in range(2)]
    pools: list = []
    if fails:
        def broken(forward, pool):
            raise RuntimeError("capture refused")
        monkeypatch.setattr(cuda_graphs, "capture", broken)
    else:
        monkeypatch.setattr(cuda_graphs, "capture",
                            _padding_only_capture([sides[1].cache, drafts[1].cache], 64, pools))
    sides[1].use_static_shapes(3, max_model_len=128, capture=True)
    drafts[1].use_static_shapes(max_model_len=128, capture=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (9, 20)]
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for side, dside in zip(sides, drafts):
            reqs = _requests(side, prompts)
            prefill = side.run(reqs, prompts, last_only=True)
            for r in reqs:
                r.num_computed = len(r.prompt_ids)
            verify = _verify(side, reqs, [[7, 8, 9, 1], [4, 5]])
            tables = [pool(dside).allocate(n + 16) for n in (9, 20)]
            feats = torch.cat(prefill[1])
            inp = DraftInput(anchors=torch.tensor([3, 9]), anchor_pos=torch.tensor([9, 20]),
                             ctx_start=torch.zeros(2, dtype=torch.int64), ctx_len=torch.tensor([9, 20]),
                             features=feats, block_table=torch.tensor([t + [0] * (8 - len(t)) for t in tables]),
                             temperature=torch.tensor([0.0, 0.8]), seeds=torch.tensor([1, 2]))
            proposal = dside.propose(inp)
            for r, v in zip(reqs, [4, 2]):  # the verified tokens are committed
                r.num_computed += v
            decode = _verify(side, reqs, [[5], [6]])  # a second verify-graph shape: the same pool
            outs.append((prefill, verify, proposal, decode))
    (pa, va, da, ca), (pb, vb, db, cb) = outs
    torch.testing.assert_close(cb.logits_of([0, 1])[:, :1], ca.logits_of([0, 1])[:, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pb[0], pa[0], atol=1e-5, rtol=1e-5)
    lva, lvb = va.logits_of([0, 1]), vb.logits_of([0, 1])
    torch.testing.assert_close(lvb[0, :4], lva[0, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lvb[1, :2], lva[1, :2], atol=1e-5, rtol=1e-5)
    assert torch.equal(va.packed, vb.packed) and torch.equal(ca.packed, cb.packed[:, :3])  # plain: one token
    assert torch.equal(da.tokens, db.tokens)
    torch.testing.assert_close(db.confidence_logits, da.confidence_logits, atol=1e-5, rtol=1e-5)
    failed = [str(w.message) for w in caught if "capture failed" in str(w.message)]
    if fails:  # one warning per kind, then each runs eagerly for good
        assert len(failed) == 3 and not (sides[1].graphs.capture or sides[1].prompts.capture
                                         or drafts[1].graphs.capture)
    else:  # prompt, verify and draft graphs each start a pool; the decode shape shares the verify graph's
        assert not failed and pools == [None, None, None, 2]
        assert sides[1].prompts.capture and sides[1].graphs.capture and drafts[1].graphs.capture


def test_warm_up_records_batch_one_graphs_on_padding(monkeypatch):
    """warm_up() records the batch-1 graphs up front (the engine does at start on CUDA): every prefill bucket one
    prompt takes, decode and verify at every context bucket, the draft's greedy and sampling graphs; on padding,
    so no live cache block changes; the first requests then replay them, with the dynamic path's outputs."""
    from dspark_serve.engine.runner import capture as cuda_graphs, target_graphs
    from dspark_serve.engine.draft_side import DraftSide
    from dspark_serve.engine.drafter import DraftInput
    from dspark_serve.engine.spec_config import SpeculativeConfig

    target, draft = tiny_pair(seed=7, agree=0.01, block_size=4, dtype=torch.float32)
    side, eager = (TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids) for _ in range(2))
    dside, deager = (DraftSide(draft, 64, 8, SpeculativeConfig(dspark_draft_topk=8), 256) for _ in range(2))
    pools: list = []
    monkeypatch.setattr(cuda_graphs, "capture", _padding_only_capture([side.cache, dside.cache], 64, pools))
    side.use_static_shapes(3, max_model_len=300, capture=True)
    dside.use_static_shapes(max_model_len=300, capture=True)
    side.prompts.max_work = 96 * side.prompts.layer_weights  # one prompt of <= 96 tokens
    assert side.warm_up() == 3 * 2 + 4 + 8 and dside.warm_up() == 2 * 2 and len(pools) == 22
    assert set(side.graphs._runners) == {(1, t, c, False) for t in (1, 2, 4) for c in (256, 304)}
    assert set(side.prompts._runners) == {(n, c) for n in (32, 48, 64, 96) for c in (0, 256, 512)}  # fresh: <= 384
    assert set(dside.graphs._runners) == {(1, c, q) for c in dside.graphs.buckets.context for q in (False, True)}
    assert side.warm_up() == 0 and dside.warm_up() == 0  # nothing left to record

    prompt = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    outs = []
    for ts, ds in ((eager, deager), (side, dside)):
        reqs = _requests(ts, [prompt])
        prefill = ts.run(reqs, [prompt], last_only=True)
        reqs[0].num_computed = len(prompt)
        verify = _verify(ts, reqs, [[7, 8, 9, 1]]).logits_of([0])
        table = pool(ds).allocate(40 + 16)
        inp = DraftInput(anchors=torch.tensor([3]), anchor_pos=torch.tensor([40]),
                         ctx_start=torch.zeros(1, dtype=torch.int64), ctx_len=torch.tensor([40]),
                         features=prefill[1][0], block_table=torch.tensor([table]),
                         temperature=torch.tensor([0.8]), seeds=torch.tensor([5]))
        outs.append((prefill[0], verify, ds.propose(inp)))
    assert len(pools) == 22  # the requests replayed what warm-up recorded
    (pa, va, da), (pb, vb, db) = outs
    torch.testing.assert_close(pb, pa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)
    assert torch.equal(da.tokens, db.tokens)
    side.run(_requests(side, [prompt]), [prompt[16:]], last_only=True, starts=[16])  # after a cached start
    assert len(pools) == 22  # recorded at warm-up, on padding


@pytest.mark.parametrize("topk", [0, 8])
def test_static_draft_proposal_matches_dynamic(topk):
    from dspark_serve.engine.draft_side import DraftSide
    from dspark_serve.engine.drafter import DraftInput
    from dspark_serve.engine.spec_config import SpeculativeConfig

    _, draft = tiny_pair(seed=6, agree=0.01, block_size=5, dtype=torch.float32)
    spec = SpeculativeConfig(dspark_draft_topk=topk)
    sides = [DraftSide(draft, 64, 8, spec, 256) for _ in range(2)]
    sides[1].use_static_shapes(max_model_len=256)
    g = torch.Generator().manual_seed(3)
    ctx = [5, 40, 13]  # three requests: a batch bucket of 4, one padded row
    feats = torch.randn(sum(ctx), draft.config.context_dim, generator=g)
    for temps in ([0.0, 0.0, 0.0], [0.0, 0.7, 1.0]):  # the greedy-only graph and the sampling graph
        props = []
        for side in sides:
            tables = [pool(side).allocate(n + 16) for n in ctx]
            inp = DraftInput(anchors=torch.tensor([3, 9, 27]), anchor_pos=torch.tensor(ctx),
                             ctx_start=torch.zeros(3, dtype=torch.int64), ctx_len=torch.tensor(ctx), features=feats,
                             block_table=torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables]),
                             temperature=torch.tensor(temps), seeds=torch.tensor([1, 2, 3]))
            props.append(side.propose(inp))
            for t in tables:
                pool(side).free(t)
        a, b = props
        assert torch.equal(a.tokens, b.tokens) and a.tokens.shape == (3, 5)
        assert torch.allclose(a.confidence_logits, b.confidence_logits, atol=1e-5)
        for name in ("probs", "cand_ids", "cand_probs"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or torch.allclose(x.float(), y.float(), atol=1e-5))
        assert (a.probs is None and a.cand_probs is None) == (max(temps) == 0)
    assert {k[2] for k in sides[1].graphs._runners} == {False, True}


def test_warm_up_records_every_batch_bucket_up_to_a_context(monkeypatch):
    """warm_up(max_batch) records every batch bucket up to max_batch's at contexts up to WARM_CONTEXT, and batch 1
    beyond it (longer contexts' larger batches are recorded on first use)."""
    from dspark_serve.engine.runner import capture as cuda_graphs, target_graphs
    from dspark_serve.engine.draft_side import DraftSide
    from dspark_serve.engine.spec_config import SpeculativeConfig

    target, draft = tiny_pair(seed=7, agree=0.01, block_size=4, dtype=torch.float32)
    side = TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids)
    dside = DraftSide(draft, 64, 8, SpeculativeConfig(dspark_draft_topk=8), 256)
    monkeypatch.setattr(cuda_graphs, "capture", _padding_only_capture([side.cache, dside.cache], 64, []))
    monkeypatch.setattr(target_graphs, "WARM_CONTEXT", 256)
    monkeypatch.setattr(sys.modules["dspark_serve.engine.runner.draft_graphs"], "WARM_CONTEXT", 256)
    side.use_static_shapes(3, max_model_len=600, capture=True)
    dside.use_static_shapes(max_model_len=600, capture=True)
    side.graphs.warm_up(3), dside.graphs.warm_up(3)
    contexts = side.graphs.buckets.context
    assert contexts[0] == 256 and len(contexts) > 1
    assert set(side.graphs._runners) == {(b, t, c, split) for b in (1, 2, 4) for t in token_buckets(b, 3)
                                         for c in contexts if b == 1 or c == 256
                                         for split in ((False, True) if b > 1 else (False,))}
    assert set(dside.graphs._runners) == {(b, c, q) for b in (1, 2, 4) for c in dside.graphs.buckets.context
                                          for q in (False, True) if b == 1 or c == 256}


def test_context_write_warm_up_runs_every_row_count_and_writes_nowhere():
    """DraftSide.warm_context_writes (run at warm-up on CUDA, so no step compiles a context-write kernel) over
    every row count it lists: each write goes to no cache slot."""
    from dspark_serve.engine.draft_side import DraftSide
    from dspark_serve.engine.spec_config import SpeculativeConfig

    _, draft = tiny_pair(seed=2, agree=0.01, block_size=4, dtype=torch.float32)
    side = DraftSide(draft, 64, 8, SpeculativeConfig(dspark_draft_topk=8), 256)
    side.cache.normal_()
    before = side.cache.clone()
    side.warm_context_writes()
    assert max(side.CONTEXT_WRITE_ROWS) > 128 and {1, 16, 17, 64}.issubset(side.CONTEXT_WRITE_ROWS)
    assert torch.equal(side.cache, before)


def test_packed_prompt_graphs_are_recorded_at_start_with_aligned_inputs(monkeypatch):
    """warm_up records the packed graphs of up to max_batch rows (PACKED_ROWS), every length bucket and context up
    to WARM_CONTEXT, each run on padding only; the fields the attention kernel reads start 16-byte aligned, as its
    warm-up's tensors do, so a packed step compiles nothing while serving."""
    from dspark_serve.engine.runner import capture as cuda_graphs
    from dspark_serve.engine.runner.prompt_graphs import PACKED_ROWS, packed_layout

    target, draft = tiny_pair(seed=3, agree=0.01, block_size=4, dtype=torch.float32)
    side = TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids)
    pools: list = []
    monkeypatch.setattr(cuda_graphs, "capture", _padding_only_capture([side.cache], 64, pools))
    side.use_static_shapes(3, max_model_len=128, capture=True)
    graphs = side.prompts
    assert graphs.warm_up(max_batch=20) == len(graphs._runners) == len(pools)
    packed = {k for k in graphs._runners if len(k) == 4}
    assert packed == {(b, t, 256, 1) for b in (4, 16, 64) for t in (32, 48, 64, 96, 128)}
    for b in PACKED_ROWS:
        for t in graphs.lengths:
            layout = packed_layout(b, t, 256 // 8)
            assert all(layout.offsets[f] % 2 == 0 for f in ("ids", "positions", "slots", "block_table", "seq_lens",
                                                               "cu"))  # int64: 16 bytes
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (5, 40, 12)]
    eager = TargetSide(target, 64, 8, capture_layers=draft.config.target_layer_ids)
    want = eager.run(_requests(eager, prompts), prompts, last_only=True)
    got = side.run(_requests(side, prompts), prompts, last_only=True)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert set(graphs._runners) >= packed and len(graphs._runners) == len(pools)  # 57 tokens: (4, 64, 256) recorded
