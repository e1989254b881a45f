"""Plain-PyTorch NVFP4 (ModelOpt W4A16) references: the definition the Triton kernels are tested against.

Format: weight uint8 [N, K/2] (element 2j in the low nibble), weight_scale float8_e4m3fn [N, K/16] linear,
weight_scale_2 fp32 scalar = amax(|W|) / (6 * 448); w = e2m1 * fp8 scale * weight_scale_2.
"""

import torch
from torch import Tensor

GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding bounds: a value equal to a bound goes to the even code (0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def check_packed(packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> tuple[int, int]:
    """Validates an NVFP4 triple and returns the logical (N, K)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed weight must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"weight_scale must be float8_e4m3fn [{n}, {k // GROUP_SIZE}] (linear layout, "
                         f"group size 16), got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be a scalar, got shape {tuple(weight_scale_2.shape)}")
    return n, k


def e2m1_codes(x: Tensor) -> Tensor:
    """fp32 values (already divided by their scale) -> 4-bit codes; sign bit set for x < 0, as ModelOpt."""
    a = x.abs()
    bounds = torch.tensor(_BOUNDS, device=x.device)
    mag = torch.searchsorted(bounds, a.contiguous(), right=False)  # bound counts as below ...
    odd = (a == 0.75) | (a == 1.75) | (a == 3.5)                     # ... except at odd bounds
    return ((x < 0).to(torch.uint8) << 3) | (mag + odd.long()).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """4-bit codes (uint8) -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES, device=codes.device)
    mag = lut[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def quantize(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] -> (packed uint8 [N, K/2], weight_scale fp8 [N, K/16], weight_scale_2 fp32 [])."""
    if w.dim() != 2 or w.shape[1] % GROUP_SIZE:
        raise ValueError(f"quantize expects a 2-D weight with K a multiple of 16, got {tuple(w.shape)}")
    n, k = w.shape
    w = w.float()
    amax = w.abs().amax() if w.numel() else torch.zeros((), device=w.device)
    scale_2 = amax / (FP4_MAX * FP8_MAX)                                  # []
    blocks = w.view(n, k // GROUP_SIZE, GROUP_SIZE)                       # [N, K/16, 16]
    s = blocks.abs().amax(-1) / (FP4_MAX * scale_2)                       # [N, K/16]
    s = torch.where((s == 0) | s.isnan(), 1.0, s)
    scale = s.clamp(min=2.0 ** -9, max=FP8_MAX).to(torch.float8_e4m3fn)   # [N, K/16]
    denom = (scale.float() * scale_2)[..., None]                          # [N, K/16, 1]
    q = e2m1_codes(torch.where(denom > 0, blocks / denom, 0.0)).view(n, k)
    packed = (q[:, 1::2] << 4) | q[:, 0::2]                               # [N, K/2]
    return packed, scale, scale_2.to(torch.float32)


def dequantize(packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """(packed [N, K/2], weight_scale [N, K/16], weight_scale_2) -> w [N, K] in dtype."""
    n, k = check_packed(packed, weight_scale, weight_scale_2)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).view(n, k)       # low nibble first
    s = weight_scale.float() * weight_scale_2.float().reshape(())         # [N, K/16]
    w = e2m1_decode(codes).view(n, k // GROUP_SIZE, GROUP_SIZE) * s[..., None]
    return w.view(n, k).to(dtype)
