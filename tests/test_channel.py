"""The step channel carries DraftInput / DraftProposal exactly: a remote draft proposes what a local one does."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from dspark_serve.actors.channel import DraftEnd, VerifierEnd, free_port
from dspark_serve.engine.draft_side import DraftSide
from dspark_serve.engine.drafter import DraftInput, DraftProposal, Drafter
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.models.random_init import tiny_pair

SPEC = {"dspark_draft_topk": 8}


def _side(agree: float | None = None, spec: dict = SPEC) -> DraftSide:
    _, draft = tiny_pair(seed=6, block_size=5, dtype=torch.float32, agree=agree)
    return DraftSide(draft, 64, 8, SpeculativeConfig.from_json(spec), 256)


def _draft_process(port: int, static: bool, agree: float | None = None, spec: dict = SPEC) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    side = _side(agree, spec)
    if static:  # the path a GPU draft actor takes (CUDA graphs there; eager here)
        side.use_static_shapes(max_model_len=64)
    end = DraftEnd("127.0.0.1", port, "gloo", torch.device("cpu"), side.model.config.context_dim, torch.float32)
    end.serve(side.propose)
    end.close()


def _inputs(step: int) -> DraftInput:
    g = torch.Generator().manual_seed(step)
    reqs, ctx = 3, [5, 2, 0] if step else [9, 4, 6]
    start = [0, 0, 0] if step == 0 else [9, 4, 6]
    return DraftInput(anchors=torch.randint(0, 250, (reqs,), generator=g),
                      anchor_pos=torch.tensor([s + c for s, c in zip(start, ctx)]),
                      ctx_start=torch.tensor(start), ctx_len=torch.tensor(ctx),
                      features=torch.randn(sum(ctx), 128, generator=g),
                      block_table=torch.arange(12).view(3, 4), temperature=torch.tensor([0.0, 0.8, 1.3]),
                      seeds=torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("static", [False, True])
def test_remote_draft_proposes_what_a_local_draft_does(static):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_draft_process, args=(port, static))
    proc.start()
    end = VerifierEnd("127.0.0.1", port, "gloo", torch.device("cpu"), 128, torch.float32, 256)
    local = _side()
    # the static path pads the batch (other matmul shapes): equal tokens, floats to rounding
    same = torch.equal if not static else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    try:
        for step in range(3):
            remote_out, local_out = end.propose(_inputs(step)), local.propose(_inputs(step))
            assert torch.equal(remote_out.tokens, local_out.tokens)
            assert same(remote_out.confidence_logits, local_out.confidence_logits)
            assert remote_out.cand_ids.shape == (3, 5, 8) and remote_out.probs is None
            assert same(remote_out.dense_probs(256), local_out.dense_probs(256))
            assert remote_out.transfer_ms > 0
    finally:
        end.stop()
        end.close()
        proc.join(30)
    assert proc.exitcode == 0


def _echo(inp: DraftInput, kind: str) -> DraftProposal:
    """A proposal computed from every field of `inp` (the draft's side of the round-trip test)."""
    r, n, v = inp.anchors.shape[0], 5, 256
    base = inp.anchors + inp.anchor_pos + 2 * inp.ctx_start + 3 * inp.ctx_len + inp.seeds + inp.block_table.sum(1)
    tokens = (base[:, None] + torch.arange(n)) % v  # [R, N]
    feat = inp.features.double().sum().item() if inp.features is not None else 0.0
    conf = feat * torch.arange(1, r + 1, dtype=torch.float32)[:, None] + torch.arange(n)  # [R, N]
    logits = inp.temperature[:, None, None] * torch.arange(v)[None, None] / v + torch.arange(n)[None, :, None]
    if kind == "dense":
        return DraftProposal(tokens, torch.softmax(logits, -1), conf)
    if kind == "topk":
        probs, ids = torch.softmax(logits, -1).topk(8, -1)
        return DraftProposal(tokens, None, conf, cand_ids=ids, cand_probs=probs)
    return DraftProposal(tokens, None, None)


def _echo_process(port: int, kind: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    end = DraftEnd("127.0.0.1", port, "gloo", torch.device("cpu"), 128, torch.float32)
    end.serve(lambda inp: _echo(inp, kind))
    end.close()


@pytest.mark.parametrize("kind", ["dense", "topk", "greedy"])
def test_channel_round_trips_messages_past_its_capacity(kind):
    """Fields, features and q past the message capacity (and the draft's first host read) arrive exactly."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = free_port("127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_echo_process, args=(port, kind))
    proc.start()
    end = VerifierEnd("127.0.0.1", port, "gloo", torch.device("cpu"), 128, torch.float32, 256)
    g = torch.Generator().manual_seed(0)
    try:
        for reqs, rows, width in [(1, 0, 2), (300, 200, 4), (2, 3, 1), (40, 9, 300)]:  # small, large, small, wide
            ctx = torch.full((reqs,), rows // reqs) + (torch.arange(reqs) < rows % reqs)
            inp = DraftInput(anchors=torch.randint(0, 250, (reqs,), generator=g), anchor_pos=torch.arange(reqs) + 50,
                             ctx_start=torch.arange(reqs), ctx_len=ctx,
                             features=torch.randn(rows, 128, generator=g) if rows else None,
                             block_table=torch.randint(0, 999, (reqs, width), generator=g),
                             temperature=torch.rand(reqs, generator=g), seeds=torch.randint(0, 2**40, (reqs,)))
            got, want = end.propose(inp), _echo(inp, kind)
            assert torch.equal(got.tokens, want.tokens)
            for name in ("probs", "confidence_logits", "cand_ids", "cand_probs"):
                a, b = getattr(got, name), getattr(want, name)
                assert (a is None and b is None) or torch.equal(a, b), (name, reqs)
    finally:
        end.stop()
        end.close()
        proc.join(30)
    assert proc.exitcode == 0


@pytest.mark.parametrize("ahead", [False, True])
def test_engine_with_a_remote_draft_equals_the_local_one(ahead, monkeypatch):
    """The engine over the channel (RemoteDraft) gives the in-process engine's tokens and acceptance, greedy and
    seeded sampling, with and without drafting and launching ahead (what a GPU verifier does)."""
    from dspark_serve.actors.remote_draft import RemoteDraft
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.engine.core.pipeline import ChainingDrafter, StepPipeline
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    port = free_port("127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_draft_process, args=(port, False, 0.002, {}))
    proc.start()
    end = VerifierEnd("127.0.0.1", port, "gloo", torch.device("cpu"), 128, torch.float32, 256)
    target, draft = tiny_pair(seed=6, block_size=5, dtype=torch.float32, agree=0.002)
    taken = []
    drafted = StepPipeline.take_drafted
    monkeypatch.setattr(StepPipeline, "take_drafted", lambda *a: taken.append(drafted(*a)) or taken[-1])
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [30, 31, 32, 33, 34, 35, 36]]
    params = [SamplingParams(temperature=t, max_tokens=14, seed=i, ignore_eos=True) for i, t in enumerate((0, .8, 1))]
    try:
        remote = RemoteDraft(end, draft.config.num_speculative_tokens, draft.config.query_len, 64, 8)
        assert isinstance(remote, Drafter) and not isinstance(remote, ChainingDrafter)
        spec = {"enable_adaptive_verification": False}  # every capped draft verified by both engines
        llm = LLM(target, None, spec, device="cpu", block_size=8, num_kv_blocks=64, draft_side=remote,
                  capture_layers=draft.config.target_layer_ids)
        local = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=64)
        for engine in (llm, local):
            engine.executor.pipeline.draft_ahead = engine.executor.pipeline.step_ahead = ahead
        got = llm.generate(prompts, params)
        remote_hits = sum(p is not None for p in taken)  # steps that took the remote draft asked for ahead
        want = local.generate(prompts, params)
    finally:
        end.stop()
        end.close()
        proc.join(30)
    assert proc.exitcode == 0
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.stats["accepted_per_step"] == b.stats["accepted_per_step"]
    assert sum(o.stats["accepted"] for o in got) > 0
    assert (remote_hits > 0) == ahead


def test_the_wire_layout_is_declared_by_name():
    """The header words and a request's row sit where the names put them: [op, num_reqs, num_ctx, width, 0.., total]
    and [anchor, anchor_pos, ctx_start, ctx_len, seed, temperature bits, block table..]; rows read back exactly."""
    from dspark_serve.actors.channel import REQUEST_HEADER, fields, header, pack_rows, unpack_rows
    head = header(REQUEST_HEADER, op=1, num_reqs=2, num_ctx=3, width=4)
    assert head.tolist() == [1, 2, 3, 4, 0, 0, 0, 0] and fields(REQUEST_HEADER, head.tolist())["width"] == 4
    inp = DraftInput(anchors=torch.tensor([5, 6]), anchor_pos=torch.tensor([7, 8]), ctx_start=torch.tensor([1, 2]),
                     ctx_len=torch.tensor([3, 4]), features=None, block_table=torch.tensor([[9, 10], [11, 0]]),
                     temperature=torch.tensor([0.0, 0.75]), seeds=torch.tensor([12, 13]))
    rows = pack_rows(inp)
    assert rows[:, :5].tolist() == [[5, 7, 1, 3, 12], [6, 8, 2, 4, 13]] and rows[:, 6:].tolist() == [[9, 10], [11, 0]]
    back = unpack_rows(rows, None)
    for name in ("anchors", "anchor_pos", "ctx_start", "ctx_len", "seeds", "block_table", "temperature"):
        assert torch.equal(getattr(back, name), getattr(inp, name)), name
