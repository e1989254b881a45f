"""CUDA graphs for the target's decode and verify steps.

Every step of a bucket has the same shapes: `batch` rows of `query_len` tokens each over `context` key slots.
Short rows and missing requests are padded; padded tokens write their K/V to a reserved trash slot and their
outputs are dropped. The step's metadata (ids, positions, slots, sequence lengths, block table) travels in one
int64 buffer with one host-to-device copy, then the bucket's graph replays. On CPU the same static path runs
eagerly: that is what the CPU tests compare with the dynamic path.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.models.qwen import QwenForCausalLM

from .kv_cache import slots_of
from .rejection import verify_greedy


@dataclass(frozen=True)
class GraphBuckets:
    batch: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    context: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # key slots attended per row


MAX_GRAPH_TOKENS = 512  # each graph keeps its own [tokens, vocab] fp32 logits: larger steps run eagerly
WARM_CONTEXT = 4096  # at start every batch bucket is recorded up to this context; longer contexts: batch 1 only
# (the rest on first use), so a 32k-context model does not hold 8 contexts x 9 batches of logits


class Staging:
    """A pinned host buffer and its device twin: `upload(values)` is one non-blocking copy, and waits first until
    the previous copy has left the host buffer (so a step never overwrites data still in flight)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(n, dtype=dtype, pin_memory=cuda)
        self._host_np = self.host.numpy()  # the same pinned memory: a list lands there without a temporary tensor
        self.dev = torch.zeros(n, dtype=dtype, device=device)
        self._copied = torch.cuda.Event() if cuda else None
        self._stream = torch.cuda.current_stream(device) if cuda else None  # the steps' stream

    def upload(self, values: list) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        n = len(values)
        self._host_np[:n] = values
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record(self._stream)


def _bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= n), None)


class TargetGraphs:
    """Static-shape decode/verify for a target and its paged cache; `capture` records CUDA graphs lazily."""

    def __init__(self, model: QwenForCausalLM, cache: Tensor, block_size: int, trash_slot: int,
                 query_lens: tuple[int, ...], max_model_len: int, capture_layers: tuple[int, ...] = (),
                 buckets: GraphBuckets = GraphBuckets(), capture: bool | None = None) -> None:
        self.model, self.cache, self.block_size, self.trash = model, cache, block_size, trash_slot
        self.capture_layers, self.query_lens = capture_layers, tuple(sorted(set(query_lens)))
        self.device = cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        top = -(-max_model_len // block_size) * block_size
        self.buckets = GraphBuckets(buckets.batch, tuple(c for c in buckets.context if c < top) + (top,))
        b, q = max(self.buckets.batch), max(self.query_lens)
        self.staging = Staging(3 * b * q + 2 * b + b * (top // block_size), torch.int64, self.device)
        self.dev = self.staging.dev
        self._runners: dict[tuple[int, int, int], Callable[[], tuple[Tensor, Tensor | None, Tensor]]] = {}
        self._pool = None

    def shape_for(self, starts: list[int], lens: list[int]) -> tuple[int, int, int] | None:
        """(query_len, batch, context) bucket of a step, or None when it fits none (a prefill, say)."""
        q = _bucket(max(lens), self.query_lens)
        b = _bucket(len(lens), self.buckets.batch)
        if q is None or b is None or b * q > MAX_GRAPH_TOKENS:
            return None
        c = _bucket(max(starts) + q, self.buckets.context)
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
            self.dev[:b * q].view(b, q)[:len(tokens), 1:1 + k].copy_(drafts[:, :k])
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
        top = _bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        shapes = [(q, b, c) for b in self.buckets.batch if b <= top for q in self.query_lens
                  for c in self.buckets.context if b == 1 or c <= WARM_CONTEXT
                  if self.capture and b * q <= MAX_GRAPH_TOKENS and (q, b, c) not in self._runners]
        for shape in shapes:
            self._runners[shape] = self._build(*shape)
        return len(shapes)

    def _layout(self, block_tables: list[list[int]], starts: list[int], tokens: list[list[int]], q: int, b: int,
                c: int) -> list[int]:
        """[ids b*q | positions b*q | slots b*q | seq_lens b | drafts to verify b | block table b*(c/block_size)],
        padded."""
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
        return ids + pos + slots + seq + drafts + table

    def _build(self, q: int, b: int, c: int) -> Callable[[], tuple[Tensor, Tensor | None, Tensor]]:
        w, n = c // self.block_size, b * q
        d = self.dev
        ids, pos, slots, num_drafts = d[:n], d[n:2 * n], d[2 * n:3 * n], d[3 * n + b:3 * n + 2 * b]
        meta = AttentionMetadata(cu_seqlens_q=torch.arange(b + 1, device=self.device) * q,
                                 seq_lens=d[3 * n:3 * n + b], slot_mapping=slots,
                                 block_table=d[3 * n + 2 * b:3 * n + 2 * b + b * w].view(b, w), max_query_len=q,
                                 max_seq_len=c, causal=True, all_slots_valid=True)

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            hidden, feats = self.model(ids, pos, meta, self.cache, capture_layers=self.capture_layers)
            logits = self.model.compute_logits(hidden)
            greedy = verify_greedy(ids.view(b, q)[:, 1:], num_drafts, logits.view(b, q, -1))
            return logits, feats, torch.cat([greedy.num_accepted[:, None], greedy.output_tokens], 1)
        if not self.capture:
            return forward
        replay, self._pool, self.capture = capture_on_padding(
            forward, self._pool, [self.dev[:3 * n + 2 * b + b * w]],
            lambda: self.staging.upload(self._layout([], [], [], q, b, c)), "")
        return replay


def capture_on_padding(forward: Callable[[], object], pool: object, inputs: list[Tensor], pad: Callable[[], None],
                       what: str) -> tuple[Callable[[], object], object, bool]:
    """capture() while the static `inputs` hold padding only (pad() stages it), so the warm-up and captured runs
    write K/V to the trash slot alone; this step's inputs are put back after. -> (replay, pool, whether captured):
    a failed capture warns and returns forward itself, so this shape and later ones keep serving eagerly."""
    step = [t.clone() for t in inputs]
    pad()
    try:
        replay, pool = capture(forward, pool)
        ok = True
    except RuntimeError as e:
        warnings.warn(f"CUDA graph capture failed{what}, running eagerly from now on: {e}")
        replay, ok = forward, False
    for t, saved in zip(inputs, step):
        t.copy_(saved)
    return replay, pool, ok


def capture(forward: Callable[[], object], pool: object = None) -> tuple[Callable[[], object], object]:
    """Record forward() as a CUDA graph (after two warm-up runs on a side stream); -> (replay, memory pool).
    replay() returns the captured outputs, refreshed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> object:
        graph.replay()
        return out
    replay.forward = forward  # keeps alive what the graph reads and forward's closure owns (the metadata tensors)
    return replay, graph.pool()
