"""Test helper: a tiny target (saved by transformers) and a random DSpark draft sharing its embedding/lm_head."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dspark_serve.models.config import ModelConfig
from dspark_serve.models.draft_config import DraftConfig
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.qwen import QwenForCausalLM
from dspark_serve.models.target_loader import load_target

VOCAB, HIDDEN = 160, 64
MASK_ID = VOCAB - 1


def tiny_target(path: Path, seed: int = 0, num_layers: int = 4) -> QwenForCausalLM:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    return load_target(path, dtype=torch.float32)


def draft_config(markov_rank: int = 8, confidence: bool = True, with_markov: bool = True, block_size: int = 4,
                 draft_vocab: int = VOCAB, anchor_first: bool = True, num_layers: int = 2) -> DraftConfig:
    layers = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                         num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position=256, tie_word_embeddings=False, dtype=torch.float32)
    return DraftConfig(layers=layers, format="deepspec", block_size=block_size, target_layer_ids=(0, 2),
                       mask_token_id=MASK_ID, anchor_first=anchor_first, target_hidden_size=HIDDEN,
                       draft_vocab_size=draft_vocab, markov_rank=markov_rank, enable_confidence_head=confidence,
                       confidence_head_with_markov=with_markov and markov_rank > 0)


def random_draft(cfg: DraftConfig, target: QwenForCausalLM, seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg, input_vocab=target.config.vocab_size).float()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if cfg.draft_vocab_size == target.config.vocab_size:
            draft.lm_head.weight.copy_(target.lm_head.weight)
        else:  # a reduced vocab keeps every other target id
            keep = torch.arange(0, target.config.vocab_size, 2)[:cfg.draft_vocab_size]
            draft.lm_head.weight.copy_(target.lm_head.weight[keep])
            draft.d2t = keep - torch.arange(cfg.draft_vocab_size)
    return draft


def with_format(cfg: DraftConfig, fmt: str) -> DraftConfig:
    return replace(cfg, format=fmt)
