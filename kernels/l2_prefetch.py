"""L2 prefetch of the next projection's weights while the small kernels between two projections run.

A batch-1 decode layer alternates weight-streaming GEMVs with latency-bound small kernels (norms, RoPE, attention,
SwiGLU: 18.7 us per 8B layer on an H200, bench/RESULTS.md) during which HBM idles. `L2Prefetcher.fetch(w)` queues,
on a side stream that waits for everything the current stream has queued so far (the GEMV just launched), a
kernel whose threads each issue one `cp.async.bulk.prefetch.L2` of CHUNK bytes over the first `max_bytes` of w.
The next GEMV then finds that part of its weights in L2 (50 MB on an H200). Prefetching has no semantic effect, so
the reference is doing nothing; `join()` makes the current stream wait for the side stream (CUDA-graph capture
needs every side stream joined). Needs sm_90 (the bulk prefetch is a TMA instruction).
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import dispatch

CHUNK = 16384      # bytes per bulk prefetch (a multiple of 16)
LANES = 32         # prefetches per program (one warp)


@triton.jit
def _prefetch_kernel(base, length, n_chunks, CHUNK: tl.constexpr, LANES: tl.constexpr):
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)                                          # [LANES]
    off = tl.minimum(i.to(tl.int64) * CHUNK, length - CHUNK)     # the last chunk ends at the end (overlaps)
    size = tl.full([LANES], CHUNK, tl.int32)
    tl.inline_asm_elementwise("@$3 cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r,b",
                              [base + off, size, i < n_chunks], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: Tensor, max_bytes: int) -> int:
    """Queue a prefetch of t's first max_bytes (t contiguous, on a CUDA device of compute capability >= 9.0) into
    L2 on the current stream -> bytes requested (rounded down to 16-byte granules)."""
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError("prefetch_l2 needs a contiguous CUDA tensor")
    start = t.data_ptr() & ~15
    length = min(t.data_ptr() + t.numel() * t.element_size(), start + max_bytes) - start
    length &= ~15
    if length < 16:
        return 0
    chunk = min(CHUNK, length)
    n_chunks = triton.cdiv(length, chunk)
    _prefetch_kernel[(triton.cdiv(n_chunks, LANES),)](start, length, n_chunks, CHUNK=chunk, LANES=LANES, num_warps=1)
    return length


class L2Prefetcher:
    """One side stream per device; fetch() after a projection's launch, join() before the step ends."""

    def __init__(self, device: torch.device, max_bytes: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.max_bytes = max_bytes
        self.pending = False

    def fetch(self, w: Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(w.device))
        with torch.cuda.stream(self.stream):
            prefetch_l2(w, self.max_bytes)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False


@lru_cache(maxsize=None)
def _prefetcher(device: torch.device, max_bytes: int) -> L2Prefetcher:
    return L2Prefetcher(device, max_bytes)


def prefetcher_for(x: Tensor, max_rows: int = 64) -> L2Prefetcher | None:
    """The device's prefetcher for a memory-bound step being captured into a CUDA graph (x [T, hidden] with
    T <= max_rows rows on sm_90+) when dispatch.L2_PREFETCH_MB > 0, else None. Eager steps skip it (there the
    host, not HBM, sets the pace, and each fetch costs an event and a launch) but create its stream, so that the
    capture after the engine's eager warm-up creates nothing."""
    if dispatch.L2_PREFETCH_MB <= 0 or not x.is_cuda or x.shape[0] > max_rows \
            or torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    pf = _prefetcher(x.device, int(dispatch.L2_PREFETCH_MB * 2 ** 20))
    return pf if torch.cuda.is_current_stream_capturing() else None
