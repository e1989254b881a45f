"""Building blocks shared by the target and the draft: RMSNorm, neox RoPE, SwiGLU MLP, Qwen attention projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Neox-style RoPE (`rotate_half`), cos/sin computed in fp32 per position."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))

    def reset(self) -> None:
        """Recompute the buffer (after a model was built on the meta device)."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, heads, D]."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections and the per-head q/k norms (Qwen3) or qkv biases (Qwen2), named as in HF."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.has_qkv_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.q_size, bias=bias)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.has_o_bias)
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.head_dim ** -0.5

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)  # [T, H, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        return Rotary.apply(q, cos, sin)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return Rotary.apply(k, cos, sin), v
