"""Build a Qwen3/Qwen2 target from an HF checkpoint directory (config.json + safetensors, single or sharded)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .config import ModelConfig
from .qwen import QwenForCausalLM
from .weights import assign, read_state_dict

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_target(path: str | Path, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu") -> QwenForCausalLM:
    cfg = ModelConfig.from_dir(path)
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    with torch.device("meta"):
        model = QwenForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    state = {k: v for k, v in read_state_dict(path).items() if not k.endswith(_IGNORED_SUFFIXES)}
    optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    assign(model, state, where=str(path), optional=optional, dtype=cfg.dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.reset()
    return model.to(device).eval()
