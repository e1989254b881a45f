"""FR-Spec token maps (models/token_map.py, speculative_config.dspark_token_map): the draft scores only the map's
tokens, verification keeps the target's outputs, and bad files get a clear error."""

from __future__ import annotations

import json

import pytest
from paging import pool
import torch

from dspark_serve.engine.draft_side import DraftSide
from dspark_serve.engine.drafter import DraftInput
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.models.config import CheckpointError
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.random_init import tiny_pair
from dspark_serve.models.token_map import load_token_map, main, restrict_draft_vocab

VOCAB = 256


def _map(tmp_path, ids, name="map.pt"):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(ids))
    else:
        torch.save(torch.tensor(ids) if ids else torch.zeros(0, dtype=torch.int64), path)
    return str(path)


def test_load_token_map_reads_pt_and_json(tmp_path):
    for name in ("m.pt", "m.json"):
        ids = load_token_map(_map(tmp_path, [9, 3, 200, 0], name), VOCAB)
        assert ids.tolist() == [0, 3, 9, 200] and ids.dtype == torch.int64


@pytest.mark.parametrize("content, match", [
    ([3, 3, 5], "1 duplicate ids"),
    ([1, 256], r"ids must be in \[0, 256\), got \[256\]"),
    ([-1, 4], r"got \[-1\]"),
    ([], "no token ids"),
    ([[1, 2], [3, 4]], "1-D integer tensor"),
    ([0.5, 2.0], "1-D integer tensor"),
])
def test_load_token_map_refuses_bad_maps(tmp_path, content, match):
    with pytest.raises(CheckpointError, match=match):
        load_token_map(_map(tmp_path, content), VOCAB)


def test_load_token_map_refuses_missing_and_unreadable_files(tmp_path):
    with pytest.raises(CheckpointError, match="file not found"):
        load_token_map(tmp_path / "nope.pt", VOCAB)
    (tmp_path / "junk.pt").write_bytes(b"not a tensor")
    with pytest.raises(CheckpointError, match="not a torch tensor file"):
        load_token_map(tmp_path / "junk.pt", VOCAB)
    (tmp_path / "bad.json").write_text('{"ids": [1]}')
    with pytest.raises(CheckpointError, match="JSON list of token ids"):
        load_token_map(tmp_path / "bad.json", VOCAB)
    (tmp_path / "cut.json").write_text('[1, 2,')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_token_map(tmp_path / "cut.json", VOCAB)


def _propose(side: DraftSide, ctx: int = 30, temperature: float = 0.0):
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(ctx, side.model.config.context_dim, generator=g, dtype=torch.float32)
    table = pool(side).allocate(ctx + 16)
    return side.propose(DraftInput(anchors=torch.tensor([17]), anchor_pos=torch.tensor([ctx]),
                                   ctx_start=torch.zeros(1, dtype=torch.int64), ctx_len=torch.tensor([ctx]),
                                   features=feats, block_table=torch.tensor([table]),
                                   temperature=torch.tensor([temperature]), seeds=torch.tensor([4])))


def test_restricted_draft_scores_only_the_map():
    _, draft = tiny_pair(seed=1, dtype=torch.float32)
    _, full = tiny_pair(seed=1, dtype=torch.float32)
    side_full = DraftSide(full, 32, 8, SpeculativeConfig(), VOCAB)
    want = _propose(side_full).tokens[0]  # greedy over the whole vocabulary (full-vocab Markov walk)
    others = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:60]
    ids = torch.cat([want, others]).unique()
    full_head = draft.lm_head
    restrict_draft_vocab(draft, ids, VOCAB)
    assert draft.config.draft_vocab_size == ids.numel() and draft.lm_head is not full_head
    assert torch.equal(draft.to_target_ids(torch.arange(ids.numel())), ids)
    h = torch.randn(3, draft.config.layers.hidden_size)
    torch.testing.assert_close(draft.base_logits(h), full.base_logits(h)[:, ids])  # the same rows, in map order
    side = DraftSide(draft, 32, 8, SpeculativeConfig(), VOCAB)
    assert torch.equal(_propose(side).tokens[0], want)  # the full argmax tokens are in the map: unchanged
    sampled = _propose(side, temperature=1.0)
    assert set(sampled.tokens[0].tolist()) <= set(ids.tolist())
    q = sampled.probs[0]  # [N, V_target]: q vanishes outside the map
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert q[:, outside].abs().max() == 0 and torch.allclose(q.sum(-1), torch.ones(q.shape[0]))


def test_restricting_an_nvfp4_markov_head_keeps_its_rows():
    _, draft = tiny_pair(seed=2, dtype=torch.float32)
    draft.markov_head.markov_w2 = NVFP4Linear.from_linear(draft.markov_head.markov_w2)
    before = draft.markov_head.markov_w2.dequantized_weight()
    ids = torch.tensor([1, 5, 77, 200, 255])
    restrict_draft_vocab(draft, ids, VOCAB)
    w2 = draft.markov_head.markov_w2
    assert isinstance(w2, NVFP4Linear) and torch.equal(w2.dequantized_weight(), before[ids])
    restrict_draft_vocab(draft, ids, VOCAB)  # the same map again: nothing to do
    with pytest.raises(CheckpointError, match="its own reduced vocabulary of 5"):
        restrict_draft_vocab(draft, torch.tensor([1, 2]), VOCAB)


@pytest.mark.parametrize("topk", [0, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_with_a_token_map_matches_plain_decoding(tmp_path, topk, temperature):
    target, draft = tiny_pair(seed=4, agree=0.01, block_size=5, dtype=torch.float64)
    path = _map(tmp_path, sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:96].tolist()))
    kw = dict(device="cpu", block_size=8, num_kv_blocks=128, max_model_len=256)
    spec = LLM(target, draft, {"dspark_token_map": path, "dspark_draft_topk": topk}, **kw)
    plain = LLM(target, None, **kw)
    assert spec.draft.model.config.draft_vocab_size == 96 and target.lm_head.weight.shape[0] == VOCAB
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 11, 30)]
    params = [SamplingParams(temperature=temperature, max_tokens=24, seed=i, ignore_eos=True) for i in range(3)]
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    steps = sum(o.stats["steps"] for o in got)
    assert steps < sum(len(o.token_ids) for o in got)  # some drafts were accepted
    if temperature == 0.0:  # greedy: the target's tokens exactly
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_token_map_cli_ranks_response_tokens(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 50}))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_ids": [1], "response_ids": r}) for r in ([7, 7, 7, 3], [3, 9])))
    out = tmp_path / "map.pt"
    assert main(["--target", str(target), "--data", str(data), "--size", "5", "--out", str(out)]) == 0
    assert torch.load(out).tolist() == [7, 3, 9, 0, 1]  # by count, then unseen ids from the lowest
    assert "3 distinct in 6 counted tokens, 100.00 % of them in the map" in capsys.readouterr().out
    assert main(["--target", str(target), "--data", str(data), "--size", "51", "--out", str(out)]) == 2
    assert "--size must be in [1, 50]" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    assert main(["--target", str(target), "--data", str(tmp_path / "bad.jsonl"), "--size", "5", "--out", str(out)]) \
        == 2
    assert "bad.jsonl:1: expected 'response_ids'" in capsys.readouterr().err
    (tmp_path / "text.txt").write_text("some prose")
    assert main(["--target", str(target), "--data", str(tmp_path / "text.txt"), "--size", "5", "--out", str(out)]) \
        == 2
    assert "no tokenizer.json" in capsys.readouterr().err  # text needs the target's tokenizer
    (target / "config.json").write_text("{}")
    assert main(["--target", str(target), "--data", str(data), "--out", str(out)]) == 2
    assert "config.json: no vocab_size" in capsys.readouterr().err


def test_spec_config_refuses_a_non_path_token_map():
    with pytest.raises(ValueError, match="dspark_token_map must be the path of a token map file"):
        SpeculativeConfig.from_json({"dspark_token_map": 3})


def test_the_demo_drafter_ships_a_token_map_for_gpus_and_cpu_fp32():
    from pathlib import Path

    from dspark_serve.cluster.commands.demo import (CPU_SPEC_CONFIG, GPU_SPEC_CONFIG, cpu_fp32_spec_config,
                                                    gpu_spec_config)
    from dspark_serve.models.demo import DEMO_DRAFTER, DEMO_TOKEN_MAP

    ids = load_token_map(DEMO_TOKEN_MAP, 151936)
    assert ids.numel() == 32768 and ids[0] == 0  # ids 0.. are common BPE pieces: all of them made the map
    for choose, base in ((cpu_fp32_spec_config, CPU_SPEC_CONFIG), (gpu_spec_config, GPU_SPEC_CONFIG)):
        cfg = SpeculativeConfig.from_json(choose(DEMO_DRAFTER))
        assert cfg.dspark_token_map == str(DEMO_TOKEN_MAP) and cfg.dspark_draft_topk == 64
        assert choose(Path("/elsewhere/drafter")) == base  # another drafter: no map
    assert SpeculativeConfig.from_json(cpu_fp32_spec_config(DEMO_DRAFTER)).dspark_survival_threshold == 0.3
