"""The DSpark draft: four checkpoint formats load to identical outputs, and a naive loop implementation agrees."""

import math

import pytest
import torch
from drafts import MASK_ID, VOCAB, draft_config, random_draft, tiny_target
from paging import metadata

from dspark_serve.models.draft_config import DraftConfig
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.draft_saver import FORMATS, save_draft

pytest.importorskip("transformers")
BLOCK, PER_SEQ = 4, 8


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


def _draft_outputs(draft, feats, block_ids, prev):
    """Context of P tokens, one block at positions P.. ; returns (block logits, markov bias, confidence logits)."""
    P, Q = feats.shape[0], len(block_ids)
    cache = draft.allocate_kv_cache(PER_SEQ, BLOCK)
    ctx_meta = metadata([0], [P], BLOCK, PER_SEQ)
    with torch.no_grad():
        draft.write_context(feats, torch.arange(P), ctx_meta.slot_mapping, cache)
        meta = metadata([P], [Q], BLOCK, PER_SEQ, causal=False)
        h = draft.block_hidden(torch.tensor(block_ids), torch.arange(P, P + Q), meta, cache)
        e = draft.markov_embed(prev)
        return draft.base_logits(h), draft.markov_bias(e), draft.confidence_logit(h, e), h


def _inputs(cfg, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(P, cfg.context_dim, generator=g)
    block = [int(torch.randint(0, VOCAB - 1, (1,), generator=g))] + [MASK_ID] * (cfg.block_size - 1)
    prev = torch.randint(0, VOCAB, (cfg.block_size,), generator=g)
    return feats, block, prev


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_four_formats_load_to_identical_outputs(target, tmp_path, reduced):
    cfg = draft_config(draft_vocab=64 if reduced else VOCAB)
    draft = random_draft(cfg, target)
    ref = _draft_outputs(draft, *_inputs(cfg))
    for fmt in FORMATS:
        loaded = load_draft(save_draft(draft, tmp_path / fmt, fmt), target=target)
        assert loaded.config.format == ("deepspec" if fmt == "vllm" else fmt)
        assert loaded.config.anchor_first and loaded.config.num_speculative_tokens == 4
        for ours, theirs in zip(_draft_outputs(loaded, *_inputs(cfg)), ref):
            assert torch.equal(ours, theirs), fmt
        assert torch.equal(loaded.d2t, draft.d2t)
        if not reduced:  # shared with the target rather than copied
            assert loaded.lm_head is target.lm_head and loaded.embed_tokens is target.model.embed_tokens
    if reduced:
        ids = torch.tensor([0, 1, 63])
        assert loaded.to_target_ids(ids).tolist() == [0, 2, 126]


def _rms(x, w, eps=1e-6):
    return [w[i] * x[i] / math.sqrt(sum(v * v for v in x) / len(x) + eps) for i in range(len(x))]


def _mv(W, x):
    return [sum(W[r][c] * x[c] for c in range(len(x))) for r in range(len(W))]


def _rope(x, pos, theta=10000.0):
    d = len(x)
    out = list(x)
    for i in range(d // 2):
        a = pos / theta ** (2 * i / d)
        out[i] = x[i] * math.cos(a) - x[i + d // 2] * math.sin(a)
        out[i + d // 2] = x[i + d // 2] * math.cos(a) + x[i] * math.sin(a)
    return out


def _naive_block_hidden(draft, feats, block_ids):
    """dspark.md 2.3 written as plain loops: context rows see no input_layernorm, attention is non-causal."""
    c = draft.config.layers
    T = lambda t: t.detach().double().tolist()  # noqa: E731
    P, D, H, KV = len(feats), c.head_dim, c.num_heads, c.num_kv_heads
    ctx = [_rms(_mv(T(draft.fc.weight), f), T(draft.hidden_norm.weight)) for f in T(feats)]
    xs = [T(draft.embed_tokens.weight)[t] for t in block_ids]
    for layer in draft.layers:
        a = layer.self_attn
        Wq, Wk, Wv, Wo = T(a.q_proj.weight), T(a.k_proj.weight), T(a.v_proj.weight), T(a.o_proj.weight)
        qn, kn = T(a.q_norm.weight), T(a.k_norm.weight)
        hs = [_rms(x, T(layer.input_layernorm.weight)) for x in xs]
        rows = [(r, i) for i, r in enumerate(ctx)] + [(h, P + j) for j, h in enumerate(hs)]
        keys = [[_rope(_rms(_mv(Wk, r)[g * D:(g + 1) * D], kn), pos) for g in range(KV)] for r, pos in rows]
        vals = [[_mv(Wv, r)[g * D:(g + 1) * D] for g in range(KV)] for r, _ in rows]
        new = []
        for j, h in enumerate(hs):
            q = _mv(Wq, h)
            heads = []
            for hh in range(H):
                g = hh // (H // KV)
                qh = _rope(_rms(q[hh * D:(hh + 1) * D], qn), P + j)
                s = [sum(qa * kb for qa, kb in zip(qh, k[g])) / math.sqrt(D) for k in keys]
                m = max(s)
                p = [math.exp(v - m) for v in s]
                heads += [sum(p[i] * vals[i][g][d] for i in range(len(p))) / sum(p) for d in range(D)]
            x = [xv + ov for xv, ov in zip(xs[j], _mv(Wo, heads))]
            hn = _rms(x, T(layer.post_attention_layernorm.weight))
            gate, up = _mv(T(layer.mlp.gate_proj.weight), hn), _mv(T(layer.mlp.up_proj.weight), hn)
            act = [gv / (1 + math.exp(-gv)) * uv for gv, uv in zip(gate, up)]
            new.append([xv + mv for xv, mv in zip(x, _mv(T(layer.mlp.down_proj.weight), act))])
        xs = new
    return torch.tensor([_rms(x, T(draft.norm.weight)) for x in xs], dtype=torch.float64)


def test_naive_loop_implementation_agrees(target):
    cfg = draft_config()
    draft = random_draft(cfg, target, seed=3)
    feats, block, prev = _inputs(cfg, P=5, seed=4)
    logits, bias, conf, h = _draft_outputs(draft, feats, block, prev)
    naive_h = _naive_block_hidden(draft, feats, block)
    assert torch.allclose(h.double(), naive_h, rtol=1e-5, atol=1e-5), (h.double() - naive_h).abs().max()
    W = draft.lm_head.weight.double()
    assert torch.allclose(logits.double(), naive_h @ W.T, atol=1e-4)
    W1, W2 = draft.markov_head.markov_w1.weight.double(), draft.markov_head.markov_w2.weight.double()
    for k in range(len(prev)):
        e = W1[prev[k]]
        naive_bias = [sum(W2[v, r] * e[r] for r in range(len(e))) for v in range(W2.shape[0])]
        assert torch.allclose(bias[k].double(), torch.stack(naive_bias), atol=1e-5)
        w, b = draft.confidence_head.proj.weight.double()[0], draft.confidence_head.proj.bias.double()[0]
        z = sum(w[i] * v for i, v in enumerate(naive_h[k].tolist() + e.tolist())) + b
        assert abs(conf[k].item() - z.item()) < 1e-4


def test_block_layouts_from_each_format():
    base = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6}
    deepspec = DraftConfig.from_hf({**base, "target_layer_ids": [1, 2], "block_size": 7, "markov_rank": 8})
    assert (deepspec.anchor_first, deepspec.num_speculative_tokens, deepspec.mask_token_id) == (True, 7, 151669)
    zlab = DraftConfig.from_hf({**base, "block_size": 16, "dflash_config": {"target_layer_ids": [1, 2],
                                                                             "mask_token_id": 151669}})
    assert (zlab.anchor_first, zlab.num_speculative_tokens, zlab.has_markov) == (False, 15, False)
    spec = DraftConfig.from_hf({"transformer_layer_config": base, "aux_hidden_state_layer_ids": [1, 2],
                                "speculators_model_type": "dspark", "markov_rank": 8, "draft_vocab_size": 100})
    assert (spec.anchor_first, spec.block_size, spec.draft_vocab_size) == (True, 8, 100)


def test_stacked_context_kv_equals_per_layer(target):
    """The runner's one GEMM over every layer's [Wk; Wv] writes the K/V the model's per-layer projections do."""
    from dspark_serve.engine.runner.draft_runner import DraftRunner

    cfg = draft_config()
    draft = random_draft(cfg, target, seed=5)
    feats = torch.randn(9, cfg.context_dim)
    meta = metadata([0], [9], BLOCK, PER_SEQ)
    caches = [draft.allocate_kv_cache(PER_SEQ, BLOCK) for _ in range(2)]
    with torch.no_grad():
        DraftRunner(draft).write_context(feats, torch.arange(9), meta.slot_mapping, caches[0])
        draft.write_context(feats, torch.arange(9), meta.slot_mapping, caches[1])
    assert caches[0].abs().sum() > 0 and torch.allclose(caches[0], caches[1], atol=1e-6)
