"""The DSpark training recipe: the block forward matches inference, the loss matches its formula, a tiny run learns."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.quantize import quantize_checkpoint
from dspark_serve.models.random_init import save_target, tiny_pair
from dspark_serve.models.target_loader import load_target
from dspark_serve.train.anchors import build_blocks, pack, sample_anchors
from dspark_serve.train.block_forward import block_forward
from dspark_serve.train.cli import main as train_main
from dspark_serve.train.data import CHAT_TEMPLATE, load_prompts
from dspark_serve.models.draft_saver import save_draft
from dspark_serve.train.draft_init import (build_target_layer_ids, default_mask_token_id, new_draft, resume_draft,
                                           used_vocab_size)
from dspark_serve.train.loss import dspark_loss
from dspark_serve.train.trainer import TrainConfig, lr_at


def _inference_block(draft, feats, anchor, ids):
    """The serving path: context K/V for positions < anchor, then one non-causal block pass."""
    bs = ids.shape[0]
    cache = draft.allocate_kv_cache(4, 16)
    pos = torch.arange(anchor)
    draft.write_context(feats[:anchor], pos, pos, cache)
    qpos = torch.arange(anchor, anchor + bs)
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, bs]), seq_lens=torch.tensor([anchor + bs]),
                             slot_mapping=qpos, block_table=torch.arange(4)[None], max_query_len=bs,
                             max_seq_len=anchor + bs, causal=False)
    return draft.block_hidden(ids, qpos, meta, cache)


def test_block_forward_matches_inference_path():
    _, draft = tiny_pair(0, vocab=256, block_size=4, dtype=torch.float32)
    torch.manual_seed(1)
    lens = [20, 13]
    feats = [torch.randn(n, len(draft.config.target_layer_ids) * 64) for n in lens]
    anchors = torch.tensor([5, 11, 17, 1, 9])  # three blocks in sequence 0, two in sequence 1
    seq = torch.tensor([0, 0, 0, 1, 1])
    ids = torch.randint(0, 255, (5, 4))
    ids[:, 1:] = draft.config.mask_token_id
    hidden = block_forward(draft, torch.cat(feats), torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]),
                           torch.cat([torch.arange(n) for n in lens]), ids, seq, anchors)  # [5, 4, 64]
    for j in range(5):
        ref = _inference_block(draft, feats[int(seq[j])], int(anchors[j]), ids[j])
        torch.testing.assert_close(hidden[j], ref, atol=1e-5, rtol=1e-5)


def test_block_forward_per_sequence_matches_the_dense_mask():
    """Padded per-sequence attention == the dense [N * B, T + N * B] mask, values and gradients; sequences of
    different lengths, one without blocks, grouped-query heads."""
    from dspark_serve.train.block_forward_ref import block_forward_dense
    _, draft = tiny_pair(2, vocab=256, block_size=3, dtype=torch.float64)
    draft = draft.double()
    g = torch.Generator().manual_seed(5)
    lens = [9, 17, 4, 12]
    feats = torch.randn(sum(lens), len(draft.config.target_layer_ids) * 64, generator=g, dtype=torch.float64)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    anchors = torch.tensor([1, 4, 8, 0, 3, 10, 16, 2, 5, 11])
    bseq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 3, 3, 3])  # sequence 2 has no block
    ids = torch.randint(0, 255, (10, 3), generator=g)
    outs = []
    for fn in (block_forward, block_forward_dense):
        draft.zero_grad()
        h = fn(draft, feats, seq, pos, ids, bseq, anchors)
        (h * torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)).sum().backward()
        outs.append((h.detach(), draft.fc.weight.grad.clone(), draft.layers[0].self_attn.q_proj.weight.grad.clone()))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert outs[0][1].abs().sum() > 0


def test_loss_matches_formula():
    torch.manual_seed(0)
    n, b, v = 2, 4, 6
    draft_logits = torch.randn(n, b, v, requires_grad=True)
    d = draft_logits.detach()
    target_logits = torch.randn(n, b, v)
    conf = torch.randn(n, b, requires_grad=True)
    labels = torch.randint(0, v, (n, b))
    eval_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    parts = dspark_loss(draft_logits, target_logits, labels, eval_mask, conf)

    num_ce = num_tv = num_conf = den = 0.0
    for i in range(n):
        for k in range(b):
            w = math.exp(-k / 4.0) * float(eval_mask[i, k])
            pd, pt = d[i, k].softmax(-1), target_logits[i, k].softmax(-1)
            l1 = float((pd - pt).abs().sum())
            c_star = min(max(1 - l1 / 2, 0.0), 1.0)
            x = float(conf[i, k].detach())
            bce = -(c_star * math.log(1 / (1 + math.exp(-x))) + (1 - c_star) * math.log(1 - 1 / (1 + math.exp(-x))))
            num_ce += w * float(-d[i, k].log_softmax(-1)[labels[i, k]])
            num_tv += w * l1
            num_conf += w * bce
            den += w
    ce, tv, cf = num_ce / den, num_tv / den, num_conf / den
    for got, want in ((parts.ce, ce), (parts.tv, tv), (parts.conf, cf), (parts.total, 0.1 * ce + 0.9 * tv + cf)):
        assert got.item() == pytest.approx(want, rel=1e-5)

    # masked positions carry no supervision
    other = labels.clone()
    other[0, 3], other[1, 1:] = (labels[0, 3] + 1) % v, (labels[1, 1:] + 1) % v
    assert dspark_loss(draft_logits, target_logits, other, eval_mask, conf).total.item() == pytest.approx(
        parts.total.item(), rel=1e-6)
    # c* is detached: the confidence loss sends no gradient into the draft logits
    parts.conf.backward()
    assert draft_logits.grad is None or not draft_logits.grad.any()
    assert conf.grad is not None and conf.grad.any()


def test_blocks_anchor_first_and_eval_mask():
    ids = torch.arange(100, 112)
    mask = torch.tensor([False] * 4 + [True] * 8)  # response = positions 4..11
    anchors = sample_anchors(mask, 100)
    assert anchors.tolist() == list(range(4, 11))
    packed = pack([(torch.arange(50, 53), torch.tensor([False, True, True])), (ids, mask)])
    blocks = build_blocks(packed, [torch.tensor([1]), torch.tensor([4, 9])], block_size=3, mask_token_id=7)
    assert blocks.ids.tolist() == [[51, 7, 7], [104, 7, 7], [109, 7, 7]]
    assert blocks.labels.tolist() == [[52, 0, 0], [105, 106, 107], [110, 111, 0]]
    assert blocks.eval_mask.tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert blocks.prev_ids.tolist() == [[51, 52, 0], [104, 105, 106], [109, 110, 111]]
    assert blocks.target_index[1].tolist() == [3 + 4, 3 + 5, 3 + 6]  # packed index of a + k


def test_draft_defaults():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(24, 2) == (1, 21)
    assert build_target_layer_ids(4, 2) == (1, 1) and build_target_layer_ids(4, 1) == (2,)
    assert default_mask_token_id(151936, 151665) == 151669
    assert default_mask_token_id(512, 300) == 300 and default_mask_token_id(512, None) == 511

    class PaddedVocab:  # a GGUF-converted tokenizer: ids 5.. are "[PAD<id>]"
        def get_vocab_size(self, with_added_tokens: bool = True) -> int:
            return 8

        def id_to_token(self, i: int) -> str:
            return f"[PAD{i}]" if i >= 5 else f"t{i}"

    assert used_vocab_size(PaddedVocab()) == 5


def test_prompt_formats(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def add(a, b): return a + b", "hello world"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"]))
    (tmp_path / "a.txt").write_text("first prompt\nline two\n\nsecond prompt\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "hello"}) + "\n")
    (tmp_path / "c.ids").write_text("1 2 3\n4,5\n")
    got = load_prompts([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], tok)
    assert got == [tok.encode(t).ids for t in ("first prompt\nline two", "second prompt", "hello")]
    assert load_prompts([str(tmp_path / "b.jsonl")], tok, chat=True) == [tok.encode(CHAT_TEMPLATE.format("hello")).ids]
    assert load_prompts([str(tmp_path / "c.ids")], None, "ids") == [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="must be in"):
        load_prompts([str(tmp_path / "c.ids")], None, "ids", vocab_size=4)


def _mean_tau(outputs) -> float:
    return statistics.mean(o.stats["tau"] for o in outputs)


def test_train_draft_tiny_run_learns_and_stays_lossless(tmp_path):
    target, _ = tiny_pair(0, vocab=256, agree=0.1, dtype=torch.float32)  # mostly a bigram: learnable quickly
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)  # peaked next-token distributions
    target_dir = save_target(target, tmp_path / "target")
    rng = random.Random(0)
    data = tmp_path / "prompts.ids"
    data.write_text("\n".join(" ".join(str(rng.randrange(250)) for _ in range(rng.randint(4, 12))) for _ in range(16)))
    out = tmp_path / "draft"
    rc = train_main(["--target", str(target_dir), "--data", str(data), "--data-format", "ids", "--out", str(out),
                     "--response-len", "32", "--draft-layers", "1", "--block-size", "4", "--markov-rank", "64",
                     "--steps", "120", "--batch-size", "4", "--num-anchors", "16", "--lr", "1e-2",
                     "--log-every", "40", "--device", "cpu", "--no-shared-copies"])
    assert rc == 0
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert statistics.mean(losses[-10:]) < 0.7 * statistics.mean(losses[:10])
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["prompt_tokens"] == len(r["prompt_ids"]) for r in rows)

    tgt = load_target(target_dir)
    draft = load_draft(out, target=tgt)
    prompts = [r["prompt_ids"] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM(tgt, None, device="cpu").generate(prompts, params)
    spec = LLM(tgt, draft, device="cpu").generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    cfg = draft.config
    untrained = new_draft(tgt, 1, cfg.block_size, cfg.markov_rank, cfg.target_layer_ids, cfg.mask_token_id).eval()
    base = LLM(tgt, untrained, device="cpu").generate(prompts, params)
    assert [o.token_ids for o in base] == [o.token_ids for o in plain]
    assert _mean_tau(spec) > _mean_tau(base) + 0.5


def test_regenerate_only_then_train_from_responses(tmp_path, capsys):
    target, _ = tiny_pair(0, vocab=256, agree=0.1, dtype=torch.float32)
    target_dir = save_target(target, tmp_path / "target")
    rng = random.Random(1)
    data = tmp_path / "prompts.ids"
    prompts = [[rng.randrange(250) for _ in range(rng.randint(4, 12))] for _ in range(16)]
    data.write_text("\n".join(" ".join(map(str, p)) for p in prompts))
    regen = tmp_path / "regen"
    common = ["--target", str(target_dir), "--data-format", "ids", "--device", "cpu", "--response-len", "12"]
    # a deadline already past: only the first round (8 x --gen-batch prompts) runs
    assert train_main(common + ["--data", str(data), "--out", str(regen), "--regenerate-only", "--gen-batch", "1",
                                "--max-regen-minutes", "0"]) == 0
    rows = [json.loads(line) for line in (regen / "prompts.jsonl").read_text().splitlines()]
    assert [r["prompt_ids"] for r in rows] == prompts[:8]
    assert not (regen / "model.safetensors").exists()
    plain = LLM(load_target(target_dir), None, device="cpu").generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=12))
    assert [r["response_ids"] for r in rows] == [list(o.token_ids) for o in plain]

    out = tmp_path / "draft"
    capsys.readouterr()
    rs = str(regen / "prompts.jsonl")
    assert train_main(common + ["--responses", rs, "--responses", rs, "--out", str(out), "--draft-layers", "1",
                                "--block-size", "4", "--markov-rank", "16", "--steps", "3", "--batch-size", "2",
                                "--num-anchors", "4", "--no-shared-copies", "--save-every-minutes", "0"]) == 0
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 3
    err = capsys.readouterr().err
    assert f"train-draft: 16 prompts with responses from {rs}, {rs}" in err  # --responses concatenates files
    assert [f"step {i}: wrote {out}" in err for i in range(3)] == [True] * 3  # a checkpoint after every step
    load_draft(out, target=load_target(target_dir))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: needs 'prompt_ids' and 'response_ids'"):
        train_main(common + ["--responses", str(bad), "--out", str(out)])
    bad.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [999]}) + "\n")
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        train_main(common + ["--responses", str(bad), "--out", str(out)])
    with pytest.raises(SystemExit):
        train_main(common + ["--out", str(out)])  # neither --data nor --responses


def _responses_run(tmp_path, seed: int, num: int, prompt_len: int, response_len: tuple[int, int]) -> list[str]:
    """A tiny saved target and `num` random prompt/response rows -> train-draft arguments for a 1-layer draft."""
    target, _ = tiny_pair(0, vocab=256, agree=0.1, dtype=torch.float32)
    target_dir = save_target(target, tmp_path / "target")
    rng = random.Random(seed)
    rows = [{"prompt_ids": [rng.randrange(250) for _ in range(prompt_len)],
             "response_ids": [rng.randrange(250) for _ in range(rng.randint(*response_len))]} for _ in range(num)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--target", str(target_dir), "--device", "cpu", "--data-format", "ids", "--responses", str(data),
            "--draft-layers", "1", "--block-size", "4", "--markov-rank", "16", "--batch-size", "2",
            "--num-anchors", "4", "--no-shared-copies"]


def test_paused_and_resumed_run_equals_one_run(tmp_path, capsys):
    """--stop-after-steps then --resume: the same weights, log and schedule as one uninterrupted run."""
    from safetensors.torch import load_file
    common = _responses_run(tmp_path, seed=2, num=6, prompt_len=5, response_len=(6, 14)) + ["--steps", "6"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_main(common + ["--out", str(one)]) == 0
    assert train_main(common + ["--out", str(two), "--stop-after-steps", "3"]) == 0
    assert "train: pausing at step 3" in capsys.readouterr().err
    assert len((two / "train_log.jsonl").read_text().splitlines()) == 3
    with pytest.raises(SystemExit):
        train_main(common + ["--out", str(two), "--resume", str(one)])  # no resume.pt there
    assert (two / "resume.pt").is_file()
    assert train_main(common + ["--out", str(two), "--resume", str(two)]) == 0
    assert "train: resuming at step 3" in capsys.readouterr().err
    assert not (two / "resume.pt").exists()  # finished: nothing left to resume
    logs = [[json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()] for d in (one, two)]
    assert [r["step"] for r in logs[1]] == list(range(6))
    assert [(r["lr"], r["loss"]) for r in logs[0]] == [(r["lr"], r["loss"]) for r in logs[1]]
    a, b = (load_file(d / "model.safetensors") for d in (one, two))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_held_out_sequences_are_reported_and_never_trained_on(tmp_path, capsys):
    """--val-sequences: a seeded split, val_* records every --val-every steps and at the end; the held-out loss
    does not depend on what the training batches were, only on the weights."""
    from dspark_serve.train.trainer import split_validation
    keep, held = split_validation(10, 3, seed=0)
    assert len(held) == 3 and sorted(keep + held) == list(range(10)) and split_validation(10, 3, 0) == (keep, held)
    with pytest.raises(ValueError, match=r"--val-sequences must be in \[0, 9\]"):
        split_validation(10, 10, 0)
    out = tmp_path / "d"
    args = _responses_run(tmp_path, seed=3, num=8, prompt_len=4, response_len=(8, 14)) + [
        "--steps", "4", "--lr", "3e-3", "--val-sequences", "2", "--val-every", "2", "--out", str(out)]
    assert train_main(args) == 0
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [1, 3, 3]  # every 2 steps, then at the end
    assert val[1]["val_loss"] == pytest.approx(val[2]["val_loss"], rel=1e-6)  # same weights, same anchors
    assert val[2]["val_loss"] < val[0]["val_loss"]
    assert len([r for r in recs if "loss" in r]) == 4
    assert "held-out (2 sequences)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--val-sequences"):
        train_main(args + ["--val-sequences", "8"])  # all 8 held out: nothing left to train on


def test_resume_draft_leaves_the_targets_shared_modules_alone(tmp_path):
    """A bf16 target with a draft continued in fp32: the draft's embedding / lm_head stay the target's, in bf16."""
    target, draft = tiny_pair(0, vocab=256, agree=0.1, dtype=torch.bfloat16)
    save_draft(draft, tmp_path / "d", "deepspec", with_shared=False)
    resumed = resume_draft(tmp_path / "d", target)
    assert resumed.lm_head is target.lm_head and resumed.embed_tokens is target.model.embed_tokens
    assert target.lm_head.weight.dtype == target.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not target.lm_head.weight.requires_grad
    trainable = [p for p in resumed.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    ids = torch.tensor([1, 2, 3])
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 3]), seq_lens=torch.tensor([3]),
                             slot_mapping=torch.arange(3), block_table=torch.tensor([[0]]), max_query_len=3,
                             max_seq_len=3)
    hidden, _ = target(ids, torch.arange(3), meta, target.allocate_kv_cache(1, 8))
    assert target.compute_logits(hidden).shape == (3, 256)  # the target still runs in its own dtype


def test_lr_schedule_steps_and_time_boxed():
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[55] == pytest.approx(0.5) and lrs[99] < 1e-3
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    boxed = TrainConfig(lr=1.0, warmup_ratio=0.1, max_minutes=1.0)
    # 10 000 nominal steps, but the clock says the run is half over: the decay follows the clock
    assert lr_at(50, 10_000, boxed, elapsed_s=33.0) == pytest.approx(0.5)
    assert lr_at(51, 10_000, boxed, elapsed_s=60.0) == pytest.approx(0.0)
    assert lr_at(0, 10_000, boxed, elapsed_s=0.0) < 0.01  # warming up


def test_init_draft_continues_training_from_dense_and_nvfp4_checkpoints(tmp_path):
    target, _ = tiny_pair(0, vocab=256, agree=0.1, dtype=torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    target_dir = save_target(target, tmp_path / "target")
    rng = random.Random(2)
    data = tmp_path / "prompts.ids"
    data.write_text("\n".join(" ".join(str(rng.randrange(250)) for _ in range(8)) for _ in range(8)))
    common = ["--target", str(target_dir), "--data", str(data), "--data-format", "ids", "--device", "cpu",
              "--response-len", "24", "--batch-size", "4", "--num-anchors", "16", "--lr", "1e-2",
              "--no-shared-copies"]
    first = tmp_path / "first"
    assert train_main(common + ["--out", str(first), "--draft-layers", "1", "--block-size", "4",
                                "--markov-rank", "16", "--steps", "60"]) == 0

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "train_log.jsonl").read_text().splitlines()]
    quantized = tmp_path / "first-nvfp4"
    quantize_checkpoint(first, quantized, include=("fc", "layers.*_proj"))
    for init in (first, quantized):
        more = tmp_path / f"more-{init.name}"
        assert train_main(common + ["--out", str(more), "--init-draft", str(init), "--steps", "5"]) == 0
        # it starts where the first run ended, far below a fresh draft's first loss
        assert losses(more)[0] < 0.8 * losses(first)[0]
        assert abs(losses(more)[0] - statistics.mean(losses(first)[-5:])) < 0.25 * losses(first)[0]
        cfg = load_draft(more, target=load_target(target_dir)).config
        assert (cfg.block_size, cfg.markov_rank, cfg.layers.num_layers) == (4, 16, 1)
