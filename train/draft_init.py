"""A fresh DSpark draft for a target: DeepSpec-style config, target layer ids, frozen copies of embed/lm_head."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from dspark_serve.models.draft_config import QWEN3_MASK_TOKEN_ID, DraftConfig
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.qwen import QwenForCausalLM

INIT_STD = 0.02


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default, clipped below the final layer (its HF output is normed; DeepSpec forbids it)."""
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return tuple(min(max(i, 0), num_target_layers - 2) for i in ids)


def default_mask_token_id(vocab_size: int, used_tokens: int | None) -> int:
    """The first unused id (Qwen3's 151669 when it is unused, so Qwen drafts agree); the last id otherwise."""
    if used_tokens is None or used_tokens >= vocab_size:
        return vocab_size - 1
    return QWEN3_MASK_TOKEN_ID if used_tokens <= QWEN3_MASK_TOKEN_ID < vocab_size else used_tokens


def used_vocab_size(tokenizer: Tokenizer) -> int:
    """1 + the highest id the tokenizer really uses (GGUF conversions pad the vocab with `[PAD<id>]` tokens)."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    while n > 0 and tokenizer.id_to_token(n - 1) in (None, f"[PAD{n - 1}]"):
        n -= 1
    return n


def new_draft(target: QwenForCausalLM, num_layers: int = 2, block_size: int = 7, markov_rank: int = 64,
              target_layer_ids: tuple[int, ...] | None = None, mask_token_id: int | None = None,
              confidence: bool = True, seed: int = 0, intermediate_size: int | None = None) -> DSparkDraft:
    """fp32 draft on the target's device; trainable parts N(0, 0.02) (markov_w2 and confidence start at 0)."""
    tcfg = target.config
    ids = target_layer_ids or build_target_layer_ids(tcfg.num_layers, num_layers)
    bad = [i for i in ids if not -1 <= i <= tcfg.num_layers - 2]
    if bad:
        raise ValueError(f"target_layer_ids must be in [-1, {tcfg.num_layers - 2}] (not the final layer), got {bad}")
    layers = replace(tcfg, arch="qwen3", num_layers=num_layers, tie_word_embeddings=False, attention_bias=False,
                     intermediate_size=intermediate_size or tcfg.intermediate_size)  # a narrower MLP keeps it small
    cfg = DraftConfig(layers=layers, format="deepspec", block_size=block_size, target_layer_ids=tuple(ids),
                      mask_token_id=tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                      anchor_first=True, target_hidden_size=tcfg.hidden_size, draft_vocab_size=tcfg.vocab_size,
                      markov_rank=markov_rank, enable_confidence_head=confidence)
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg).float()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, INIT_STD)
            elif name.endswith("bias"):
                p.zero_()
        if draft.markov_head is not None:
            draft.markov_head.markov_w2.weight.zero_()
        if draft.confidence_head is not None:
            draft.confidence_head.proj.weight.zero_()
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    freeze_shared(draft)
    return draft.to(target.lm_head.weight.device)


def resume_draft(path: str | Path, target: QwenForCausalLM) -> DSparkDraft:
    """An fp32, trainable draft from a checkpoint (any supported format; NVFP4 layers come back dequantized)."""
    device = target.lm_head.weight.device
    draft = load_draft(path, target=target, dtype=torch.float32, device=device)
    if not draft.config.anchor_first:
        raise ValueError(f"{path}: training continues anchor-first drafts only (DeepSpec layout)")
    for name, mod in list(draft.named_modules()):
        if isinstance(mod, NVFP4Linear):
            dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device=device)
            with torch.no_grad():
                dense.weight.copy_(mod.dequantized_weight(torch.float32))
                if mod.bias is not None:
                    dense.bias.copy_(mod.bias.float())
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent) if parent else draft, child, dense)
    freeze_shared(draft)  # the shared embedding / lm_head stay the target's, in its dtype
    return draft


def freeze_shared(draft: DSparkDraft) -> list[nn.Parameter]:
    """Freeze embed_tokens and lm_head; return the trainable parameters."""
    for p in (*draft.embed_tokens.parameters(), *draft.lm_head.parameters()):
        p.requires_grad_(False)
    return [p for p in draft.parameters() if p.requires_grad]
