"""Load a DFlash/DSpark draft from any supported format into DSparkDraft, sharing the target's embed/lm_head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from .config import CheckpointError
from .draft_config import DraftConfig
from .dspark import DSparkDraft
from .qwen import QwenForCausalLM
from .weights import assign, read_state_dict

_VLLM_RENAMES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_DROPPED = ("t2d", "mask_embedding")


def canonical_names(state: dict[str, Tensor], cfg: DraftConfig) -> dict[str, Tensor]:
    """vLLM-style names (`model.` prefix, stacked qkv/gate_up, renames) -> DeepSpec names."""
    out: dict[str, Tensor] = {}
    lc = cfg.layers
    for name, t in state.items():
        name = name.removeprefix("model.")
        for old, new in _VLLM_RENAMES:
            name = name.replace(old, new) if name.startswith(old) else name
        if name == "draft_id_to_target_id":
            name = "d2t"
        if name.split(".")[0] in _DROPPED:
            continue
        if ".qkv_proj." in name:
            for part, chunk in zip(("q", "k", "v"), t.split([lc.q_size, lc.kv_size, lc.kv_size])):
                out[name.replace("qkv_proj", f"{part}_proj")] = chunk
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def load_draft(path: str | Path, target: QwenForCausalLM | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> DSparkDraft:
    """Every tensor is loaded or shared with `target`; nothing is left at its random init."""
    where = str(path)
    cfg = DraftConfig.from_dir(path)
    state = canonical_names(read_state_dict(path), cfg)
    d2t = state.pop("d2t", None)
    target_vocab = target.config.vocab_size if target is not None else cfg.layers.vocab_size
    _check_vocab(cfg, state, d2t, target_vocab, where)
    input_vocab = state["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in state else target_vocab
    with torch.device("meta"):
        model = DSparkDraft(cfg, input_vocab=input_vocab)
    model = model.to_empty(device="cpu")
    model.rotary.reset()
    shared = ("embed_tokens.weight", "lm_head.weight") if target is not None else ()
    assign(model, state, where, optional=shared, dtype=dtype or cfg.layers.dtype)
    model.d2t = d2t.to(torch.int64) if d2t is not None else torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if target is not None:
        _share(model, target, state)
    return model.to(device).eval()


def _check_vocab(cfg: DraftConfig, state: dict[str, Tensor], d2t: Tensor | None, target_vocab: int,
                 where: str) -> None:
    if cfg.draft_vocab_size < target_vocab:
        if "lm_head.weight" not in state:
            raise CheckpointError(f"{where}: reduced draft vocab ({cfg.draft_vocab_size} < target {target_vocab}) "
                                  "needs lm_head.weight in the checkpoint")
        if d2t is None:
            raise CheckpointError(f"{where}: reduced draft vocab ({cfg.draft_vocab_size} < target {target_vocab}) "
                                  "needs d2t (draft_id_to_target_id) in the checkpoint")
    if d2t is not None and tuple(d2t.shape) != (cfg.draft_vocab_size,):
        raise CheckpointError(f"{where}: tensor d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)")
    w1 = state.get("markov_head.markov_w1.weight")
    input_vocab = w1.shape[0] if w1 is not None else cfg.layers.vocab_size
    if input_vocab > target_vocab and "embed_tokens.weight" not in state:
        raise CheckpointError(f"{where}: draft input vocab {input_vocab} is larger than the target's {target_vocab} "
                              "and the checkpoint has no embed_tokens.weight")


def _share(model: DSparkDraft, target: QwenForCausalLM, state: dict[str, Tensor]) -> None:
    """Alias the target's embedding / lm_head when the draft omits them or holds bitwise-equal copies."""
    pairs = (("embed_tokens", target.model.embed_tokens), ("lm_head", target.lm_head))
    for name, theirs in pairs:
        ours: nn.Module = getattr(model, name)
        mine = state.get(f"{name}.weight")
        if mine is None or (mine.shape == theirs.weight.shape and torch.equal(mine.to(theirs.weight.dtype),
                                                                             theirs.weight.detach().cpu())):
            if ours.weight.shape != theirs.weight.shape:
                raise CheckpointError(f"{name}: target's shape {tuple(theirs.weight.shape)} cannot stand in for the "
                                      f"draft's {tuple(ours.weight.shape)}")
            setattr(model, name, theirs)
