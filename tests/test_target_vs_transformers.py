"""Our Qwen3/Qwen2 against transformers' Qwen3ForCausalLM / Qwen2ForCausalLM on tiny random configs (fp32)."""

import pytest
import torch
from paging import metadata, positions

from dspark_serve.models.target_loader import load_target

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
BLOCK, BLOCKS_PER_SEQ = 4, 16


def _hf_model(arch: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**TINY, tie_word_embeddings=tie, rope_theta=10000.0)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**{k: v for k, v in TINY.items() if k != "head_dim"},
                                       tie_word_embeddings=tie, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random biases and norms so that every weight matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


@pytest.fixture(params=[("qwen3", False), ("qwen3", True), ("qwen2", True), ("qwen2", False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def pair(request, tmp_path):
    hf = _hf_model(*request.param)
    hf.save_pretrained(tmp_path)
    return hf, load_target(tmp_path, dtype=torch.float32)


def _hf_logits(hf, ids: list[int]) -> tuple[torch.Tensor, tuple]:
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), tuple(h[0] for h in out.hidden_states)


def _assert_rel(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> None:
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel <= tol, f"relative error {rel:.2e} > {tol:.0e}"


def _run(model, cache, ids_per_seq, ctx, qlens, capture=()):
    flat = torch.tensor([t for ids, c, q in zip(ids_per_seq, ctx, qlens) for t in ids[c:c + q]])
    meta = metadata(ctx, qlens, BLOCK, BLOCKS_PER_SEQ)
    with torch.no_grad():
        hidden, captured = model(flat, positions(ctx, qlens), meta, cache, capture_layers=capture)
        return model.compute_logits(hidden), captured


def test_prefill_decode_verify_match_transformers(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(1)
    lens = [5, 11, 2]
    seqs = [torch.randint(0, 160, (n + 12,), generator=g).tolist() for n in lens]
    refs = [_hf_logits(hf, s)[0] for s in seqs]
    cache = ours.allocate_kv_cache(len(seqs) * BLOCKS_PER_SEQ, BLOCK)
    # prefill: a batch of different lengths
    logits, _ = _run(ours, cache, seqs, [0, 0, 0], lens)
    _assert_rel(logits, torch.cat([r[:n] for r, n in zip(refs, lens)]))
    # token-by-token decode against the cache
    ctx = list(lens)
    for _ in range(4):
        logits, _ = _run(ours, cache, seqs, ctx, [1, 1, 1])
        _assert_rel(logits, torch.stack([r[c] for r, c in zip(refs, ctx)]))
        ctx = [c + 1 for c in ctx]
    # verify: several query tokens per sequence, different counts
    qlens = [8, 3, 5]
    logits, _ = _run(ours, cache, seqs, ctx, qlens)
    _assert_rel(logits, torch.cat([r[c:c + q] for r, c, q in zip(refs, ctx, qlens)]))


def test_rollback_by_length_overwrites_rejected_tokens(pair):
    """Rejected tokens are forgotten by writing the next step at their positions: no copy, no stale read."""
    hf, ours = pair
    seq = torch.randint(0, 160, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(hf, seq)[0]
    cache = ours.allocate_kv_cache(BLOCKS_PER_SEQ, BLOCK)
    _run(ours, cache, [seq], [0], [6])
    wrong = seq[:6] + [(t + 1) % 160 for t in seq[6:12]]
    _run(ours, cache, [wrong], [6], [6])  # verify 6 drafts, all rejected
    logits, _ = _run(ours, cache, [seq], [6], [6])
    _assert_rel(logits, ref[6:12])


def test_captured_layers_equal_hidden_states(pair):
    hf, ours = pair
    seq = torch.randint(0, 160, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    _, hidden_states = _hf_logits(hf, seq)
    cache = ours.allocate_kv_cache(BLOCKS_PER_SEQ, BLOCK)
    layer_ids = (-1, 0, 2)
    _, captured = _run(ours, cache, [seq], [0], [9], capture=layer_ids)
    assert captured.shape == (9, 3 * 64)
    for j, i in enumerate(layer_ids):
        _assert_rel(captured[:, j * 64:(j + 1) * 64], hidden_states[i + 1])


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    hf = _hf_model("qwen3", False)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    ours = load_target(tmp_path, dtype=torch.float32)
    seq = list(range(3, 40, 3))
    cache = ours.allocate_kv_cache(BLOCKS_PER_SEQ, BLOCK)
    logits, _ = _run(ours, cache, [seq], [0], [len(seq)])
    _assert_rel(logits, _hf_logits(hf, seq)[0])
