"""SpeculativeConfig: vLLM's `speculative_config` field names, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("dspark", "dflash")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    num_speculative_tokens: int | None = None  # None: the draft's trained block (anchor-first) or block - 1
    dspark_draft_topk: int = 0  # 0: bias the full vocab; k: only the top-k candidates of the base logits
    draft_sample_method: str = "probabilistic"  # or "greedy": argmax drafts even for sampled requests
    dspark_confidence_threshold: float = 0.0  # verify the drafts before the first with c_k < this (DeepSpec); 0 = off
    dspark_survival_threshold: float = 0.0  # verify the drafts whose survival prod_{i<=k} c_i >= this; 0 = off
    enable_adaptive_verification: bool = True  # vLLM's name: each step verifies the drafts worth their cost
    dspark_max_verify_tokens: int = 0  # > 0: at most this many drafts per step, the likeliest first
    dspark_quantize_lm_head: bool = False  # draft logits from a 4-bit (NVFP4) copy of a bf16 lm_head (the target's)
    dspark_token_map: str | None = None  # FR-Spec token map (.pt / .json ids): the draft scores only those tokens
    model: str | None = None  # the draft directory (vLLM's field), may also be given separately

    def validate(self, block_limit: int | None = None) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        n = self.num_speculative_tokens
        if n is not None and (not isinstance(n, int) or n < 1 or (block_limit is not None and n > block_limit)):
            raise ValueError(f"speculative_config.num_speculative_tokens must be in [1, {block_limit}], got {n!r}")
        if not isinstance(self.dspark_draft_topk, int) or self.dspark_draft_topk < 0:
            raise ValueError(f"speculative_config.dspark_draft_topk must be an int >= 0, got {self.dspark_draft_topk!r}")
        if self.draft_sample_method not in ("probabilistic", "greedy"):
            raise ValueError("speculative_config.draft_sample_method must be 'probabilistic' or 'greedy', "
                             f"got {self.draft_sample_method!r}")
        if not 0.0 <= self.dspark_confidence_threshold <= 1.0:
            raise ValueError("speculative_config.dspark_confidence_threshold must be in [0, 1], "
                             f"got {self.dspark_confidence_threshold!r}")
        if not 0.0 <= self.dspark_survival_threshold <= 1.0:
            raise ValueError("speculative_config.dspark_survival_threshold must be in [0, 1], "
                             f"got {self.dspark_survival_threshold!r}")
        if not isinstance(self.dspark_max_verify_tokens, int) or self.dspark_max_verify_tokens < 0:
            raise ValueError("speculative_config.dspark_max_verify_tokens must be an int >= 0, "
                             f"got {self.dspark_max_verify_tokens!r}")
        if not isinstance(self.dspark_quantize_lm_head, bool):
            raise ValueError("speculative_config.dspark_quantize_lm_head must be true or false, "
                             f"got {self.dspark_quantize_lm_head!r}")
        if self.dspark_token_map is not None and (not isinstance(self.dspark_token_map, str)
                                                  or not self.dspark_token_map):
            raise ValueError("speculative_config.dspark_token_map must be the path of a token map file, "
                             f"got {self.dspark_token_map!r}")
        if not isinstance(self.enable_adaptive_verification, bool):
            raise ValueError("speculative_config.enable_adaptive_verification must be true or false, "
                             f"got {self.enable_adaptive_verification!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig:
        if text is None or text == "":
            return cls()
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(known)}")
        cfg = cls(**raw)
        cfg.validate()
        return cfg
