"""DraftConfig: one frozen view of DeepSpec, z-lab DFlash and speculators draft configs (vLLM field names too)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import CheckpointError, ModelConfig, read_json

QWEN3_MASK_TOKEN_ID = 151669


@dataclass(frozen=True)
class DraftConfig:
    layers: ModelConfig  # the draft's own decoder stack (hidden_size = the target's)
    format: str  # "deepspec" | "dflash" | "speculators"
    block_size: int
    target_layer_ids: tuple[int, ...]  # DeepSpec/z-lab convention: output of target layer i (vLLM's id - 1)
    mask_token_id: int
    anchor_first: bool  # [anchor, MASK x (N-1)], N drafts; else fill-in [bonus, MASK x N]
    target_hidden_size: int
    draft_vocab_size: int
    markov_rank: int = 0  # 0: no Markov head (a DFlash draft)
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    logit_scale: float = 1.0

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per step: every query row for anchor-first, all but the bonus row for fill-in."""
        return self.block_size if self.anchor_first else self.block_size - 1

    @property
    def query_len(self) -> int:
        return self.block_size

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def context_dim(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def confidence_in_features(self) -> int:
        return self.layers.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json") -> DraftConfig:
        if "transformer_layer_config" in hf:
            return _from_speculators(hf, where)
        if "dflash_config" in hf:
            return _from_dflash(hf, where)
        if "target_layer_ids" in hf:
            return _from_deepspec(hf, where)
        raise CheckpointError(f"{where}: not a DFlash/DSpark draft config (expected 'target_layer_ids', "
                              "'dflash_config' or 'transformer_layer_config')")

    @classmethod
    def from_dir(cls, path: str | Path) -> DraftConfig:
        return cls.from_hf(read_json(Path(path) / "config.json"), where=str(Path(path) / "config.json"))


def _heads(hf: dict[str, Any], where: str) -> dict[str, Any]:
    head_type = hf.get("markov_head_type", "vanilla")
    rank = int(hf.get("markov_rank", 0) or 0)
    if rank and head_type != "vanilla":
        raise CheckpointError(f"{where}: unsupported markov_head_type {head_type!r} (only 'vanilla' is supported)")
    return dict(markov_rank=rank, enable_confidence_head=bool(hf.get("enable_confidence_head", False)),
                confidence_head_with_markov=bool(hf.get("confidence_head_with_markov", True)) and rank > 0,
                logit_scale=float(hf.get("logit_scale", 1.0)))


def _layer_ids(ids: Any, where: str) -> tuple[int, ...]:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{where}: target_layer_ids must be a non-empty list of ints, got {ids!r}")
    return tuple(ids)


def _from_deepspec(hf: dict[str, Any], where: str) -> DraftConfig:
    layers = ModelConfig.from_hf(hf, where, arch="qwen3")
    return DraftConfig(
        layers=layers, format="deepspec", block_size=int(hf.get("block_size", 7)),
        target_layer_ids=_layer_ids(hf["target_layer_ids"], where),
        mask_token_id=int(hf.get("mask_token_id", QWEN3_MASK_TOKEN_ID)),
        anchor_first=not bool(hf.get("dspark_bonus_anchor", False)),
        target_hidden_size=int(hf.get("target_hidden_size", layers.hidden_size)),
        draft_vocab_size=int(hf.get("draft_vocab_size", layers.vocab_size)), **_heads(hf, where))


def _from_dflash(hf: dict[str, Any], where: str) -> DraftConfig:
    layers = ModelConfig.from_hf(hf, where, arch="qwen3")
    sub = hf["dflash_config"]
    if "target_layer_ids" not in sub:
        raise CheckpointError(f"{where}: dflash_config has no target_layer_ids")
    return DraftConfig(
        layers=layers, format="dflash", block_size=int(hf.get("block_size", 16)),
        target_layer_ids=_layer_ids(sub["target_layer_ids"], where),
        mask_token_id=int(sub.get("mask_token_id", hf.get("mask_token_id", QWEN3_MASK_TOKEN_ID))),
        anchor_first=bool(sub.get("sample_from_anchor", False)),
        target_hidden_size=int(hf.get("target_hidden_size", layers.hidden_size)),
        draft_vocab_size=int(hf.get("draft_vocab_size", layers.vocab_size)), **_heads(hf, where))


def _from_speculators(hf: dict[str, Any], where: str) -> DraftConfig:
    layers = ModelConfig.from_hf(hf["transformer_layer_config"], f"{where}: transformer_layer_config", arch="qwen3")
    ids = hf.get("aux_hidden_state_layer_ids", hf.get("target_layer_ids"))
    is_dspark = hf.get("speculators_model_type") == "dspark" or int(hf.get("markov_rank", 0) or 0) > 0
    return DraftConfig(
        layers=layers, format="speculators", block_size=int(hf.get("block_size", 8)),
        target_layer_ids=_layer_ids(ids, where),
        mask_token_id=int(hf.get("mask_token_id", QWEN3_MASK_TOKEN_ID)),
        anchor_first=bool(hf.get("sample_from_anchor", is_dspark)),
        target_hidden_size=int(hf.get("target_hidden_size", layers.hidden_size)),
        draft_vocab_size=int(hf.get("draft_vocab_size", layers.vocab_size)), **_heads(hf, where))
