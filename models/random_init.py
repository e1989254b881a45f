"""Tiny random checkpoints written in the real formats: the demo's and the tests' stand-ins for real weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .draft_config import DraftConfig
from .draft_saver import save_draft
from .dspark import DSparkDraft
from .qwen import QwenForCausalLM


def tiny_target_config(vocab_size: int = 512, num_layers: int = 4) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position=4096, tie_word_embeddings=False, dtype=torch.float32)


def save_target(model: QwenForCausalLM, path: str | Path) -> Path:
    """config.json (transformers 5.x spelling) + model.safetensors with HF names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    return path


def random_pair(path: str | Path, seed: int = 0, block_size: int = 4, vocab: int = 512,
                agree: float | None = None) -> tuple[Path, Path]:
    """tiny_pair written as checkpoints: an HF-format target and a DeepSpec-format draft under `path`."""
    target, draft = tiny_pair(seed, vocab=vocab, block_size=block_size, agree=agree, dtype=torch.float32)
    root = Path(path)
    return save_target(target, root / "target"), save_draft(draft, root / "draft", "deepspec")


def _randomize(module: torch.nn.Module, std: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.normal_(1.0, 0.1)


def tiny_pair(seed: int = 0, *, vocab: int = 256, block_size: int = 4, draft_vocab: int | None = None,
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
    dcfg = DraftConfig(layers=replace(tcfg, num_layers=1), format="deepspec",
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
