"""Building blocks shared by the target and the draft: RMSNorm, neox RoPE, SwiGLU MLP, Qwen attention projections."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .nvfp4_linear import NVFP4Linear, NVFP4Stack
from .views import concat_as_views

if TYPE_CHECKING:
    from dspark_serve.kernels.gemv_bf16 import Norm


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
    _gate_up: Tensor | None = None  # set by fuse()
    _gate_up_q4: NVFP4Stack | None = None  # set by fuse() for NVFP4 gate/up
    _tiled: tuple[Tensor | None, Tensor | None] = (None, None)  # set by fuse(): tile-major gate/up and down

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x: Tensor) -> Tensor:
        """forward() with one gate/up GEMM (after fuse()) and the Triton silu*mul (one row: in the GEMV's epilogue)."""
        from dspark_serve.kernels.fused_ops import silu_mul
        from dspark_serve.kernels.gemv_bf16 import linear_silu_mul

        if self._gate_up is not None:
            return self._down(linear_silu_mul(x, self._gate_up, self._tiled[0]))
        gate_up = self._gate_up_q4(x) if self._gate_up_q4 is not None else \
            torch.cat((self.gate_proj(x), self.up_proj(x)), -1)
        return self._down(silu_mul(gate_up))  # [T, I]

    def forward_normed(self, x: Tensor, norm: "Norm") -> tuple[Tensor, Tensor]:
        """forward_fused(RMSNorm(x [+ residual])) (norm: gemv_bf16.Norm) and the new residual; the one-row gate/up
        GEMV applies the norm itself."""
        from dspark_serve.kernels.gemv_bf16 import apply_norm, norm_linear_silu_mul

        if self._gate_up is not None:
            h, residual = norm_linear_silu_mul(x, norm, self._gate_up, self._tiled[0])
            return self._down(h), residual
        h, residual = apply_norm(x, norm)
        return self.forward_fused(h), residual

    def _down(self, h: Tensor) -> Tensor:
        from dspark_serve.kernels.gemv_bf16 import linear

        down = self.down_proj
        return linear(h, down.weight, down.bias, self._tiled[1]) if type(down) is nn.Linear else down(h)

    def fuse(self, tiled: bool = False) -> None:
        """One [2I, hidden] weight for gate and up; their parameters become views into it (inference only). NVFP4
        gate and up become one NVFP4Stack. `tiled`: also keep tile-major copies (_tiled_copy)."""
        if self._gate_up is None and type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear:
            self._gate_up = concat_as_views([self.gate_proj.weight, self.up_proj.weight])
            down = self.down_proj.weight if type(self.down_proj) is nn.Linear else None
            if tiled:
                self._tiled = (_tiled_copy(self._gate_up, swiglu=True), _tiled_copy(down))
        elif self._gate_up_q4 is None and _all_nvfp4(self.gate_proj, self.up_proj):
            self._gate_up_q4 = NVFP4Stack([self.gate_proj, self.up_proj])


class AttentionProjections(nn.Module):
    """q/k/v/o projections and the per-head q/k norms (Qwen3) or qkv biases (Qwen2), named as in HF."""

    _qkv: tuple[Tensor, Tensor | None] | None = None  # set by fuse()
    _qkv_q4: NVFP4Stack | None = None  # set by fuse() for NVFP4 q/k/v
    _tiled: tuple[Tensor | None, Tensor | None] = (None, None)  # set by fuse(): tile-major qkv and o

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

    def fuse(self, tiled: bool = False) -> None:
        """One [q + 2 kv, hidden] weight (and bias) for q/k/v; their parameters become views into it (inference).
        NVFP4 q/k/v become one NVFP4Stack. `tiled`: also keep tile-major copies (_tiled_copy)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if self._qkv is None and all(type(p) is nn.Linear for p in projs):
            bias = concat_as_views([p.bias for p in projs]) if self.q_proj.bias is not None else None
            self._qkv = (concat_as_views([p.weight for p in projs]), bias)
            o = self.o_proj.weight if type(self.o_proj) is nn.Linear else None
            if tiled:
                self._tiled = (_tiled_copy(self._qkv[0]), _tiled_copy(o))
        elif self._qkv_q4 is None and _all_nvfp4(*projs):
            self._qkv_q4 = NVFP4Stack(list(projs))

    def qkv_fused(self, x: Tensor, norm: "Norm", cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
        """query() and key_value() of RMSNorm(x [+ residual]) (norm: gemv_bf16.Norm, the input norm) with one GEMM
        (after fuse(); the one-row GEMV applies the norm itself) and one Triton launch for the q/k norms, RoPE and
        the k/v write into the cache slots (attention.store_kv) -> (q [T, H, D], the new residual)."""
        from dspark_serve.kernels.fused_ops import qk_norm_rotary
        from dspark_serve.kernels.gemv_bf16 import apply_norm, norm_linear

        t, d = x.shape[0], self.head_dim
        if self._qkv is not None:
            qkv, residual = norm_linear(x, norm, *self._qkv, self._tiled[0])  # [T, (H + 2 KV) * D]
        else:
            x, residual = apply_norm(x, norm)
            qkv = self._qkv_q4(x) if self._qkv_q4 is not None else \
                torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1)
        q = qkv[:, :self.num_heads * d].view(t, self.num_heads, d)
        k = qkv[:, self.num_heads * d:(self.num_heads + self.num_kv_heads) * d].view(t, self.num_kv_heads, d)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * d:].view(t, self.num_kv_heads, d)
        qw = self.q_norm.weight if self.q_norm is not None else None
        kw = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        return qk_norm_rotary(q, k, cos, sin, qw, kw, eps, (v, k_cache, v_cache, slot_mapping))[0], residual

    def output(self, o: Tensor) -> Tensor:
        """o_proj of the attention output [T, H * D], through the dense GEMV path of the fused layers."""
        from dspark_serve.kernels.gemv_bf16 import linear

        p = self.o_proj
        return linear(o, p.weight, p.bias, self._tiled[1]) if type(p) is nn.Linear else p(o)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)  # [T, KV, D]
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return Rotary.apply(k, cos, sin), v


def keep_tile_major(layers: nn.ModuleList) -> bool:
    """Whether the layers' fuse() keeps tile-major copies of their bf16 projections: KernelConfig.dense_tiled, by
    default when the copies take at most its dense_tiled_max_fraction of the GPU's memory."""
    from dspark_serve.kernels.config import active
    cfg = active()
    if cfg.dense_tiled is not None:
        return cfg.dense_tiled
    ws = [m.weight for m in layers.modules() if type(m) is nn.Linear and m.weight.is_cuda
          and m.weight.dtype == torch.bfloat16]
    return bool(ws) and sum(w.numel() * 2 for w in ws) <= \
        cfg.dense_tiled_max_fraction * torch.cuda.get_device_properties(ws[0].device).total_memory


def _tiled_copy(w: Tensor | None, swiglu: bool = False) -> Tensor | None:
    """A tile-major copy of a bf16 weight on an sm_90 GPU that the mma GEMV can take (gemv_bf16_mma), for its
    2-16-row GEMVs; None otherwise (no memory spent where the kernel cannot run)."""
    if not (w is not None and w.is_cuda and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[0] % 16 == 0 and w.shape[1] % 128 == 0):
        return None
    from dspark_serve.kernels.gemv_bf16_mma import tile_major
    from dspark_serve.kernels.pdl import _sm90
    if not _sm90(w.device.index if w.device.index is not None else torch.cuda.current_device()):
        return None
    with torch.no_grad():
        return tile_major(w.detach(), swiglu)


def _all_nvfp4(*layers: nn.Module) -> bool:
    return all(isinstance(m, NVFP4Linear) for m in layers)
