"""Frozen model configs, built once from an HF `config.json` (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded as given; the message names the problem."""


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: config file not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def rope_theta_of(hf: dict[str, Any], where: str = "config.json") -> float:
    """rope_theta from 4.x (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`); only plain RoPE."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise CheckpointError(f"{where}: unsupported rope type {rope_type!r} (only 'default' RoPE is supported)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{where}: missing rope_theta (neither 'rope_theta' nor 'rope_parameters.rope_theta')")
    return float(theta)


def dtype_of(hf: dict[str, Any], default: torch.dtype = torch.bfloat16) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype")
    return _DTYPES.get(str(name), default)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-stack shape shared by the Qwen3/Qwen2 target and the DFlash/DSpark draft layers."""

    arch: str  # "qwen3" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    attention_bias: bool = False  # Qwen3's optional q/k/v/o bias; Qwen2 always has q/k/v bias

    @property
    def has_o_bias(self) -> bool:
        return self.arch == "qwen3" and self.attention_bias

    @property
    def has_qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def has_qkv_bias(self) -> bool:
        return self.arch == "qwen2" or self.attention_bias

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "config.json", arch: str | None = None) -> ModelConfig:
        if arch is None:
            archs = hf.get("architectures") or []
            model_type = hf.get("model_type", "")
            if "Qwen2ForCausalLM" in archs or model_type == "qwen2":
                arch = "qwen2"
            elif "Qwen3ForCausalLM" in archs or model_type == "qwen3":
                arch = "qwen3"
            else:
                raise CheckpointError(
                    f"{where}: unsupported architecture {archs or model_type!r}; expected one of {SUPPORTED_ARCHS}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise CheckpointError(f"{where}: missing required fields {missing}")
        if hf.get("use_sliding_window"):
            raise CheckpointError(f"{where}: use_sliding_window=true is not supported (full attention only)")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(hf, where),
            max_position=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype_of(hf),
            attention_bias=bool(hf.get("attention_bias", False)) and arch == "qwen3",
        )

    def to_hf(self) -> dict[str, Any]:
        """The transformers 5.x spelling of this config (round-trips through from_hf)."""
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        return {
            "architectures": ["Qwen3ForCausalLM" if self.arch == "qwen3" else "Qwen2ForCausalLM"],
            "model_type": self.arch, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "hidden_act": "silu", "dtype": names[self.dtype],
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(read_json(Path(path) / "config.json"), where=str(Path(path) / "config.json"))
