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


class TargetHeads(torch.nn.Module):
    """Only the target's embedding and lm_head: what a draft on another device shares with the target."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.config = cfg
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)


def load_target_heads(path: str | Path, dtype: torch.dtype | None = None) -> TargetHeads:
    """Read just embed_tokens / lm_head from a target checkpoint (a tied model reuses the embedding)."""
    from safetensors import safe_open

    from .config import CheckpointError
    from .weights import checkpoint_files

    cfg = ModelConfig.from_dir(path)
    found: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in fh.keys():
                    found[name] = fh.get_tensor(name).to(dtype or cfg.dtype)
    embed = found.get("model.embed_tokens.weight")
    head = found.get("lm_head.weight", embed if cfg.tie_word_embeddings else None)
    if embed is None or head is None:
        raise CheckpointError(f"{path}: missing tensors {[n for n in ('model.embed_tokens.weight', 'lm_head.weight') if n not in found]}")
    return TargetHeads(cfg, embed, head)
