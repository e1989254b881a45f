"""NVFP4Linear: a Linear whose weight is stored as ModelOpt W4A16 NVFP4 (packed uint8 + fp8 block scales).

Forward runs the fused Triton W4A16 GEMM on CUDA and the dequantize + matmul reference on CPU.
"""


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_serve.kernels import nvfp4
from dspark_serve.kernels.nvfp4_ref import GROUP_SIZE, check_packed



class NVFP4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(f"NVFP4Linear needs in_features % 16 == 0, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // GROUP_SIZE,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.zeros((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_tensors(cls, packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                     bias: Tensor | None = None) -> "NVFP4Linear":
        n, k = check_packed(packed, weight_scale, weight_scale_2)
        layer = cls(k, n, bias=bias is not None, device=packed.device,
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
        layer.weight.copy_(packed)
        layer.weight_scale.copy_(weight_scale)
        layer.weight_scale_2.copy_(weight_scale_2.reshape(()))
        if bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NVFP4Linear":
        packed, scale, scale_2 = nvfp4.quantize(linear.weight.detach())
        return cls.from_tensors(packed, scale, scale_2, None if linear.bias is None else linear.bias.detach())

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return nvfp4.dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)   # [N, K]

    def keep_dense(self, on: bool = True, min_rows: int = 17) -> None:
        """Keep the bf16 temporary of the M > 64 path (code x fp8 scale, exact in bf16) instead of dequantizing it
        every call, and use it from `min_rows` rows on (the same result as that path, 2 bytes more per weight).
        Call again after changing the NVFP4 tensors."""
        self._dense = nvfp4.dequantize(self.weight, self.weight_scale, torch.ones_like(self.weight_scale_2),
                                       torch.bfloat16) if on else None
        self._dense_scale, self._dense_min_rows = self.weight_scale_2, min_rows

    def use_source_from(self, weight: Tensor, min_rows: int = 17) -> None:
        """From `min_rows` rows on, multiply by `weight` [N, K] (the bf16 weight this layer was quantized from,
        shared, not copied) instead: where the 4-bit GEMV no longer wins, the original costs what a copy would and
        is exact. Results then depend on the row count (4-bit below min_rows, the original from there)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"source weight {tuple(weight.shape)} != ({self.out_features}, {self.in_features})")
        self._dense, self._dense_scale, self._dense_min_rows = weight, None, min_rows

    def keep_bf16_scales(self) -> None:
        """Keep weight_scale as bf16 (exact), which the GEMV's inline-PTX decode reads (KernelConfig.gemv_prmt),
        instead of converting it every call. Call again after changing the NVFP4 tensors."""
        self._scale_bf16 = self.weight_scale.to(torch.bfloat16)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        if x.is_cuda:
            from dspark_serve.kernels.w4a16_gemm import dense_unit_matmul, w4a16_gemm
            x2 = x.reshape(-1, self.in_features)
            dense = getattr(self, "_dense", None)
            if dense is not None and x2.shape[0] >= self._dense_min_rows:
                out = dense_unit_matmul(x2, dense, self._dense_scale) if self._dense_scale is not None \
                    else F.linear(x2, dense)
            else:
                out = w4a16_gemm(x2, self.weight, self.weight_scale, self.weight_scale_2,
                                 scale_bf16=getattr(self, "_scale_bf16", None))
            out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self._cpu_weight(x.dtype), self.bias)

    def _cpu_weight(self, dtype: torch.dtype) -> Tensor:
        """The dequantized weight, kept while the NVFP4 buffers are unchanged (tensor version counters; buffers
        made under inference_mode have none, and are keyed by their storage only)."""
        version = lambda t: -1 if t.is_inference() else t._version  # noqa: E731
        key = (dtype, self.weight.device, version(self.weight), version(self.weight_scale),
               version(self.weight_scale_2), self.weight.data_ptr())
        if getattr(self, "_cached_key", None) != key:
            self._cached, self._cached_key = self.dequantized_weight(dtype), key
        return self._cached

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4 (group 16)"


