"""NVFP4 (ModelOpt format) quantize / dequantize: Triton on CUDA (or the interpreter on request), the reference
otherwise. The Triton module is imported only when it runs, so CPU-only installs need no triton."""

import torch
from torch import Tensor

from . import nvfp4_ref


def quantize(w: Tensor, use_triton: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """w [N, K] (K % 16 == 0) -> (packed uint8 [N, K/2], weight_scale fp8 [N, K/16], weight_scale_2 fp32 []).

    use_triton: None = Triton on CUDA tensors, reference on CPU; True on CPU needs TRITON_INTERPRET=1.
    """
    if not (w.is_cuda if use_triton is None else use_triton):
        return nvfp4_ref.quantize(w)
    from . import nvfp4_triton

    return nvfp4_triton.quantize(w)


def dequantize(packed: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
               dtype: torch.dtype = torch.float32, use_triton: bool | None = None) -> Tensor:
    """(packed uint8 [N, K/2], weight_scale fp8 [N, K/16], weight_scale_2 fp32) -> w [N, K] in dtype."""
    if not (packed.is_cuda if use_triton is None else use_triton):
        return nvfp4_ref.dequantize(packed, weight_scale, weight_scale_2, dtype)
    from . import nvfp4_triton

    return nvfp4_triton.dequantize(packed, weight_scale, weight_scale_2, dtype)
