"""Tiny random checkpoints written in the real formats: the demo's and the tests' stand-ins for real weights."""

from __future__ import annotations

import json
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


def random_pair(path: str | Path, seed: int = 0, block_size: int = 4, markov_rank: int = 16) -> tuple[Path, Path]:
    """A random tiny Qwen3 target and a DSpark draft over it (DeepSpec format), under `path`/{target,draft}."""
    torch.manual_seed(seed)
    tcfg = tiny_target_config()
    target = QwenForCausalLM(tcfg)
    with torch.no_grad():
        for p in target.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    dcfg = DraftConfig(layers=ModelConfig(**{**tcfg.__dict__, "num_layers": 1}), format="deepspec",
                       block_size=block_size, target_layer_ids=(0, tcfg.num_layers - 2),
                       mask_token_id=tcfg.vocab_size - 1, anchor_first=True, target_hidden_size=tcfg.hidden_size,
                       draft_vocab_size=tcfg.vocab_size, markov_rank=markov_rank, enable_confidence_head=True)
    draft = DSparkDraft(dcfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.fill_(1.0)
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    root = Path(path)
    return save_target(target, root / "target"), save_draft(draft, root / "draft", "deepspec")
