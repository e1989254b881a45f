"""CUDA graphs for the target's decode and verify steps.

Every step of a bucket has the same shapes: `batch` rows of `query_len` tokens each over `context` key slots.
Short rows and missing requests are padded; padded tokens write their K/V to a reserved trash slot and their
outputs are dropped. The step's metadata (ids, positions, slots, sequence lengths, drafts to verify, block table)
travels in one int64 buffer (`step_layout`) with one host-to-device copy, then the bucket's graph replays. On CPU
the same static path runs eagerly: that is what the CPU tests compare with the dynamic path.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata

from ..kv_cache import slots_of
from ..rejection import verify_greedy
from .buckets import MAX_GRAPH_TOKENS, WARM_CONTEXT, GraphBuckets, bucket
from .capture import capture_on_padding, device_ms
from .staging import Layout, Staging
from .target_runner import TargetRunner


@lru_cache(maxsize=None)
def step_layout(q: int, b: int, w: int) -> Layout:
    """A (query_len q, batch b, block-table width w) step's inputs."""
    return Layout(ids=b * q, positions=b * q, slots=b * q, seq_lens=b, num_drafts=b, block_table=b * w)


class TargetGraphs:
    """Static-shape decode/verify for a target and its paged cache; `capture` records CUDA graphs lazily."""

    def __init__(self, runner: TargetRunner, cache: Tensor, block_size: int, trash_slot: int,
                 query_lens: tuple[int, ...], max_model_len: int, capture_layers: tuple[int, ...] = (),
                 buckets: GraphBuckets = GraphBuckets(), capture: bool | None = None) -> None:
        self.runner, self.cache, self.block_size, self.trash = runner, cache, block_size, trash_slot
        self.capture_layers, self.query_lens = capture_layers, tuple(sorted(set(query_lens)))
        self.device = cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        top = -(-max_model_len // block_size) * block_size
        self.buckets = GraphBuckets(buckets.batch, tuple(c for c in buckets.context if c < top) + (top,))
        b, q = max(self.buckets.batch), max(self.query_lens)
        self.staging = Staging(step_layout(q, b, top // block_size).size, torch.int64, self.device)
        self.dev = self.staging.dev
        self._runners: dict[tuple[int, int, int], Callable[[], tuple[Tensor, Tensor | None, Tensor]]] = {}
        self._pool = None

    def shape_for(self, starts: list[int], lens: list[int]) -> tuple[int, int, int] | None:
        """(query_len, batch, context) bucket of a step, or None when it fits none (a prefill, say)."""
        q = bucket(max(lens), self.query_lens)
        b = bucket(len(lens), self.buckets.batch)
        if q is None or b is None or b * q > MAX_GRAPH_TOKENS:
            return None
        c = bucket(max(starts) + q, self.buckets.context)
        return None if c is None else (q, b, c)

    @torch.inference_mode()
    def run(self, block_tables: list[list[int]], starts: list[int], tokens: list[list[int]],
            shape: tuple[int, int, int], drafts: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """-> logits [R, q, V] fp32 (rows past len(tokens[r]) are padding; valid until the next run), features
        [R, q, F] (an owned copy) and greedy verification of tokens[r][1:] in the graph: [R, 1 + q] int64, the
        accepted count then the output tokens (rejection.verify_greedy, -1 padded). With `drafts` [R, N] on the
        device, tokens[r][1:] are placeholders and the drafts are copied in on the device, so they never visit
        the host."""
        q, b, c = shape
        self.staging.upload(self._layout(block_tables, starts, tokens, q, b, c))
        if drafts is not None and q > 1:
            k = min(q - 1, drafts.shape[1])
            step_layout(q, b, c // self.block_size).view(self.dev, "ids").view(b, q)[:len(tokens), 1:1 + k].copy_(
                drafts[:, :k])
        if shape not in self._runners:
            self._runners[shape] = self._build(q, b, c)
        logits, feats, accept = self._runners[shape]()
        r = len(tokens)
        return logits.view(b, q, -1)[:r], feats.view(b, q, -1)[:r].clone() if feats is not None else None, \
            accept[:r].clone()

    @property
    def num_recorded(self) -> int:
        """CUDA graphs recorded so far (0 when not capturing)."""
        return len(self._runners) if self.capture else 0

    @torch.inference_mode()
    def warm_up(self, max_batch: int = 1) -> int:
        """Record now, on padding, the graphs of every batch bucket up to max_batch's for every query length and
        context bucket, so that no request waits for one; -> how many were recorded (0 when not capturing)."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        shapes = [(q, b, c) for b in self.buckets.batch if b <= top for q in self.query_lens
                  for c in self.buckets.context if b == 1 or c <= WARM_CONTEXT
                  if self.capture and b * q <= MAX_GRAPH_TOKENS and (q, b, c) not in self._runners]
        for shape in shapes:
            self._runners[shape] = self._build(*shape)
        return len(shapes)

    def replay_costs(self, max_batch: int, reps: int = 3) -> dict[int, list[tuple[int, float]]]:
        """Device milliseconds of each recorded graph at the smallest context, on padding, by batch bucket:
        {batch: [(tokens, ms), ...]}."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        c = self.buckets.context[0]
        out: dict[int, list[tuple[int, float]]] = {}
        for (q, b, cc), run in sorted(self._runners.items()):
            if cc == c and b <= top:
                self.staging.upload(self._layout([], [], [], q, b, c))
                out.setdefault(b, []).append((b * q, device_ms(run, reps)))
        return out

    def _layout(self, block_tables: list[list[int]], starts: list[int], tokens: list[list[int]], q: int, b: int,
                c: int) -> list[int]:
        """The step's inputs in step_layout, padded."""
        bs, w = self.block_size, c // self.block_size
        ids, pos, slots, seq, table = [0] * (b * q), [0] * (b * q), [self.trash] * (b * q), [1] * b, [0] * (b * w)
        drafts = [0] * b
        for r, (blocks, start, toks) in enumerate(zip(block_tables, starts, tokens)):
            n, o = len(toks), r * q
            ids[o:o + n] = toks
            pos[o:o + q] = range(start, start + q)
            slots[o:o + n] = slots_of(blocks, start, n, bs)
            seq[r], drafts[r] = start + q, n - 1
            table[r * w:r * w + min(len(blocks), w)] = blocks[:w]
        return step_layout(q, b, w).pack(ids=ids, positions=pos, slots=slots, seq_lens=seq, num_drafts=drafts,
                                         block_table=table)

    def _build(self, q: int, b: int, c: int) -> Callable[[], tuple[Tensor, Tensor | None, Tensor]]:
        w = c // self.block_size
        layout = step_layout(q, b, w)
        v = layout.views(self.dev)
        ids = v["ids"]
        meta = AttentionMetadata(cu_seqlens_q=torch.arange(b + 1, device=self.device) * q,
                                 seq_lens=v["seq_lens"], slot_mapping=v["slots"],
                                 block_table=v["block_table"].view(b, w), max_query_len=q,
                                 max_seq_len=c, causal=True, all_slots_valid=True)

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            hidden, feats = self.runner.forward(ids, v["positions"], meta, self.cache,
                                                capture_layers=self.capture_layers)
            logits = self.runner.compute_logits(hidden)
            greedy = verify_greedy(ids.view(b, q)[:, 1:], v["num_drafts"], logits.view(b, q, -1))
            return logits, feats, torch.cat([greedy.num_accepted[:, None], greedy.output_tokens], 1)
        if not self.capture:
            return forward
        replay, self._pool, self.capture = capture_on_padding(
            forward, self._pool, [self.dev[:layout.size]],
            lambda: self.staging.upload(self._layout([], [], [], q, b, c)), "")
        return replay
