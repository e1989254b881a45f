"""The shapes CUDA graphs are recorded for: batch and context buckets, and the limits on them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphBuckets:
    batch: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    context: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # key slots attended per row


PROMPT_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # prompt tokens; padding < 1.5x
PACKED_ROWS = (4, 16, 64, 256)  # rows of a packed prompt graph: padding rows cost a program each that exits at once
PACKED_WARM_TOKENS = 1024  # packed prompt graphs recorded at start: up to this many tokens
WARM_CONTEXT = 4096  # at start every batch bucket is recorded up to this context; longer contexts: batch 1 only
# (the rest on first use), so a 32k-context model does not hold 8 contexts x 9 batches of logits


def packed_rows(max_batch: int) -> list[int]:
    """The row buckets of the packed prompt graphs recorded at start for steps of up to max_batch requests (none
    for one request a step: nothing to pack)."""
    top = bucket(max_batch, PACKED_ROWS) or PACKED_ROWS[-1]
    return [b for b in PACKED_ROWS if b <= top] if max_batch > 1 else []


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None."""
    return next((s for s in sizes if s >= n), None)


def token_buckets(b: int, num_drafts: int) -> list[int]:
    """The token sizes of a verify step of batch bucket b: b rows times 1, 2, 4 and 1 + num_drafts tokens each (a
    step pads up to the next)."""
    per_row = sorted({q for q in (1, 2, 4) if q <= 1 + num_drafts} | {1 + num_drafts})
    return [b * q for q in per_row]
