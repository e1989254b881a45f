"""Test helper: in-memory target/draft pairs, random or built to agree with the target often."""

from __future__ import annotations

from dataclasses import replace

import torch

from dspark_serve.models.config import ModelConfig
from dspark_serve.models.draft_config import DraftConfig
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.qwen import QwenForCausalLM
from dspark_serve.models.random_init import tiny_target_config


def _randomize(module: torch.nn.Module, std: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.normal_(1.0, 0.1)


def build_pair(seed: int = 0, *, vocab: int = 256, block_size: int = 4, draft_vocab: int | None = None,
               markov_rank: int = 16, confidence: bool = True, anchor_first: bool = True,
               agree: float | None = None, dtype: torch.dtype = torch.float64) -> tuple[QwenForCausalLM, DSparkDraft]:
    """agree=x: the target is a bigram model plus context terms scaled by x, and the draft's Markov head is
    exactly that bigram (its block output is zeroed), so drafts are often, not always, right."""
    torch.manual_seed(seed)
    tcfg = replace(tiny_target_config(vocab), dtype=dtype)
    target = QwenForCausalLM(tcfg)
    _randomize(target, 0.2)
    draft_vocab = draft_vocab or vocab
    rank = tcfg.hidden_size if agree is not None else markov_rank
    dcfg = DraftConfig(layers=ModelConfig(**{**tcfg.__dict__, "num_layers": 1}), format="deepspec",
                       block_size=block_size, target_layer_ids=(0, 2), mask_token_id=vocab - 1,
                       anchor_first=anchor_first, target_hidden_size=tcfg.hidden_size, draft_vocab_size=draft_vocab,
                       markov_rank=rank, enable_confidence_head=confidence)
    draft = DSparkDraft(dcfg, input_vocab=vocab)
    _randomize(draft, 0.2)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        if draft_vocab == vocab:
            draft.lm_head.weight.copy_(target.lm_head.weight)
        else:
            keep = torch.randperm(vocab)[:draft_vocab].sort().values
            draft.lm_head.weight.copy_(target.lm_head.weight[keep])
            draft.d2t = keep - torch.arange(draft_vocab)
        if agree is not None:
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.mul_(agree)
                layer.mlp.down_proj.weight.mul_(agree)
            draft.norm.weight.zero_()
            draft.markov_head.markov_w1.weight.copy_(target.model.norm(target.model.embed_tokens.weight))
            draft.markov_head.markov_w2.weight.copy_(target.lm_head.weight)
    return target.to(dtype).eval(), draft.to(dtype).eval()
