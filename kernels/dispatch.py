"""When model code takes the Triton kernels instead of their PyTorch references."""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor


def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # a finder that refuses it
        return False


HAVE_TRITON = _have_triton()  # an optional extra (`dspark-serve[triton]`); CPU torch comes without it
# The 1 < M <= 64 NVFP4 GEMV decodes with the inline PTX of e2m1_prmt.py on sm_90+ (1.7-2.4x the integer decode on
# an H200, bench/RESULTS.md); DSPARK_GEMV_PRMT=0 turns it off
GEMV_PRMT = os.environ.get("DSPARK_GEMV_PRMT", "1") == "1"
# M <= 16 NVFP4 GEMVs on sm_90+ take the register-fed mma.sync kernel of w4a16_gemv_mma.py where K % 128 == 0 and
# N % 16 == 0; DSPARK_GEMV_MMA=0 turns it off
GEMV_MMA = os.environ.get("DSPARK_GEMV_MMA", "1") == "1"
# An NVFP4 draft's q/k/v and gate/up run as one stacked GEMV each (models/nvfp4_linear.NVFP4Stack, a weight_scale_2
# per row) at 2-16 rows on that kernel; DSPARK_NVFP4_STACK=0 runs them one by one
NVFP4_STACK = os.environ.get("DSPARK_NVFP4_STACK", "1") == "1"
# The target's batch-1 decode row runs the Triton dense GEMV of gemv_bf16.py instead of cuBLAS (8B plain step on an
# H200: 4.52 instead of 4.82 ms, bench/RESULTS.md); DSPARK_DENSE_GEMV=0 turns it off
DENSE_GEMV = os.environ.get("DSPARK_DENSE_GEMV", "1") == "1"
# Up to this many rows (<= 16) take it; 8-row verify measured no faster through it than through cuBLAS
DENSE_GEMV_ROWS = int(os.environ.get("DSPARK_DENSE_GEMV_ROWS", "1"))
# Rows of bf16 activations from DENSE_MMA_MIN_ROWS to 16 (verify's 1 + 7, batch-8 decode) take the register-fed mma
# GEMV of gemv_bf16_mma.py on sm_90 (K % 32 == 0, N % 16 == 0), gate/up with its SwiGLU epilogue, instead of cuBLAS
# (8B verify 1 + 7 on an H200: 4.65 instead of 5.16 ms; plain batch 8: 4.80 instead of 5.30 ms, bench/RESULTS.md);
# DSPARK_DENSE_MMA=0 turns it off
DENSE_MMA = os.environ.get("DSPARK_DENSE_MMA", "1") == "1"
DENSE_MMA_MIN_ROWS = int(os.environ.get("DSPARK_DENSE_MMA_MIN_ROWS", "2"))
# The fused layers keep a tile-major copy of their bf16 projections (gemv_bf16_mma.tile_major: twice their memory)
# for those rows, read in 512-byte runs (demo-shape verify graph on an H200: 766 instead of 827 us; 8B verify 1 + 7:
# 4.50 instead of 4.62 ms, bench/RESULTS.md), by default when the copies take at most DENSE_TILED_MAX_FRACTION of
# the GPU's memory (models/layers.keep_tile_major); DSPARK_DENSE_TILED=1 always, =0 never
DENSE_TILED = os.environ.get("DSPARK_DENSE_TILED", "auto")
if DENSE_TILED not in ("0", "1", "auto"):
    raise ValueError(f"DSPARK_DENSE_TILED must be 0, 1 or auto, got {DENSE_TILED!r}")
DENSE_TILED_MAX_FRACTION = 0.02
# The target's lm_head takes `linear` (the GEMVs above) instead of cuBLAS (8B lm_head alone: 278 / 285 instead of
# 296 / 299 us at 1 / 8 rows); DSPARK_LM_HEAD_GEMV=0 turns it off
LM_HEAD_GEMV = os.environ.get("DSPARK_LM_HEAD_GEMV", "1") == "1"
# The one-row GEMV applies the decoder layer's RMSNorm (and residual add) before q/k/v and gate/up itself, instead
# of a separate norm launch (gemv_bf16.norm_linear); DSPARK_NORM_GEMV=0 turns it off
NORM_GEMV = os.environ.get("DSPARK_NORM_GEMV", "1") == "1"
# That GEMV computes SwiGLU in the gate/up projection's epilogue (no silu_mul launch); DSPARK_GEMV_SWIGLU=0 turns
# it off
GEMV_SWIGLU = os.environ.get("DSPARK_GEMV_SWIGLU", "1") == "1"
# The decode step's Triton kernels launch with programmatic dependent launch on sm_90+ (kernels/pdl.py; 8B plain
# step on H200s, with the SwiGLU epilogue: 4.19-4.29 instead of 4.50-4.56 ms, bench/RESULTS.md); DSPARK_PDL=0
# turns it off
PDL = os.environ.get("DSPARK_PDL", "1") == "1"

# Fresh prompts longer than 16 tokens attend with one causal SDPA (attention.prompt_attention) instead of the paged
# reference's ~20 ops per layer; DSPARK_PROMPT_SDPA=0 turns it off
PROMPT_SDPA = os.environ.get("DSPARK_PROMPT_SDPA", "1") == "1"


def use_triton(t: Tensor) -> bool:
    """Inference on bf16/fp32 CUDA tensors takes the Triton kernels unless DSPARK_TRITON=0 or Triton is missing;
    CPU tensors take them only with DSPARK_TRITON=1 under TRITON_INTERPRET=1 (the tests). Autograd always takes
    the references (the kernels have no backward)."""
    mode = os.environ.get("DSPARK_TRITON", "auto")
    if mode == "0" or not HAVE_TRITON or torch.is_grad_enabled() or t.dtype not in (torch.bfloat16, torch.float32):
        return False
    return t.is_cuda or (mode == "1" and os.environ.get("TRITON_INTERPRET") == "1")
