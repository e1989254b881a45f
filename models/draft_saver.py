"""Write a DSparkDraft in each supported checkpoint format: DeepSpec, z-lab DFlash, speculators, vLLM names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from .dspark import DSparkDraft

FORMATS = ("deepspec", "dflash", "speculators", "vllm")


def _heads(cfg) -> dict[str, Any]:
    return {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.enable_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov, "logit_scale": cfg.logit_scale}


def draft_config_json(model: DSparkDraft, fmt: str) -> dict[str, Any]:
    cfg = model.config
    layers = cfg.layers.to_hf()
    if fmt in ("deepspec", "vllm"):
        return {**layers, "architectures": ["Qwen3DSparkModel"], "block_size": cfg.block_size,
                "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
                "dspark_bonus_anchor": not cfg.anchor_first, **_heads(cfg)}
    if fmt == "dflash":
        return {**layers, "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
                "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id,
                                  "sample_from_anchor": cfg.anchor_first},
                "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
                **_heads(cfg)}
    if fmt == "speculators":
        return {"speculators_model_type": "dspark" if cfg.has_markov else "dflash",
                "architectures": ["DSparkSpeculator"], "transformer_layer_config": layers,
                "block_size": cfg.block_size, "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
                "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": cfg.target_hidden_size, "sample_from_anchor": cfg.anchor_first, **_heads(cfg)}
    raise ValueError(f"unknown draft format {fmt!r}; expected one of {FORMATS}")


def draft_tensors(model: DSparkDraft, fmt: str, with_shared: bool = True) -> dict[str, Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    reduced = model.config.draft_vocab_size != model.embed_tokens.weight.shape[0]
    if not with_shared or fmt == "dflash":  # z-lab ships neither embedding nor (a full-vocab) lm_head
        drop = ("embed_tokens.weight",) if reduced else ("embed_tokens.weight", "lm_head.weight")
        state = {k: v for k, v in state.items() if k not in drop}
    if reduced:
        state["d2t"] = model.d2t.cpu()
        if fmt == "speculators":
            t2d = torch.zeros(model.embed_tokens.weight.shape[0], dtype=torch.bool)
            t2d[torch.arange(len(model.d2t)) + model.d2t.cpu()] = True
            state["t2d"] = t2d
    return _vllm_names(state) if fmt == "vllm" else state


def _vllm_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            stem = name.removesuffix("q_proj.weight")
            t = torch.cat([state[stem + f"{p}_proj.weight"] for p in "qkv"])
            name = stem + "qkv_proj.weight"
        elif name.endswith("mlp.gate_proj.weight"):
            stem = name.removesuffix("gate_proj.weight")
            t = torch.cat([state[stem + "gate_proj.weight"], state[stem + "up_proj.weight"]])
            name = stem + "gate_up_proj.weight"
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            continue
        name = "draft_id_to_target_id" if name == "d2t" else name
        out[name if name.startswith("lm_head") else "model." + name] = t
    return out


def save_draft(model: DSparkDraft, path: str | Path, fmt: str = "deepspec", with_shared: bool = True) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft_config_json(model, fmt), indent=2))
    save_file(draft_tensors(model, fmt, with_shared), str(path / "model.safetensors"))
    return path
