"""CUDA graphs for the draft's step: the context K/V write, the block pass and the Markov walk.

A bucket fixes the batch and the number of context slots attended; missing requests are padded (their block
K/V goes to the draft cache's trash slot, their proposals are dropped). The context write takes up to
`batch * (query_len + 1)` new rows (a decode step brings at most the accepted drafts plus the anchor), copied
into a static feature buffer and padded with rows bound for the trash slot; a larger one (the first step after
a prefill) is written eagerly before the graph. Greedy-only and sampling steps are separate graphs (a sampling
step also returns q). `propose_chained` stages a step whose anchors and positions the previous verify's accept
sets on the device (engine/core/pipeline.py). On CPU the static path runs eagerly.
"""

from __future__ import annotations

from dataclasses import fields, replace
from functools import lru_cache
from typing import Callable, Protocol

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.models.dspark import DSparkDraft

from ..drafter import DraftProposal
from ..kv_cache import slots_of
from ..rejection import PACKED_ACCEPTED, PACKED_TOKENS
from .buckets import WARM_CONTEXT, GraphBuckets, bucket
from .capture import capture_on_padding, device_ms
from .draft_runner import DraftRunner
from .staging import Layout, Staging


@lru_cache(maxsize=None)
def draft_layout(b: int, ql: int, cr: int, w: int) -> Layout:
    """A draft step's inputs: b rows, query blocks of ql tokens, cr context rows each, block tables of width w."""
    return Layout(anchors=b, anchor_pos=b, seeds=b, seq_lens=b, positions=b * ql, slots=b * ql,
                  context_positions=b * cr, context_slots=b * cr, block_table=b * w)


class GraphedDraft(Protocol):
    """What the graphs read of the draft they record (engine/draft_side.py's DraftSide): its model, the runner of
    its context write and block pass, its cache, the block shape, and the Markov walk that turns the block's hidden
    states into a proposal."""

    model: DSparkDraft
    runner: DraftRunner
    cache: Tensor  # [num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]
    block_size: int
    device: torch.device
    num_speculative_tokens: int

    @property
    def query_len(self) -> int: ...

    def markov_walk(self, hidden: Tensor, base: Tensor, anchor: Tensor, temperature: Tensor, seeds: Tensor,
                    anchor_pos: Tensor, need_q: bool) -> DraftProposal: ...


class DraftGraphs:
    def __init__(self, side: GraphedDraft, trash_slot: int, max_model_len: int, buckets: GraphBuckets = GraphBuckets(),
                 capture_graphs: bool | None = None) -> None:
        self.side, self.trash = side, trash_slot
        self.bs, self.ql = side.block_size, side.query_len
        self.device = side.device
        self.capture = self.device.type == "cuda" if capture_graphs is None else capture_graphs
        top = -(-(max_model_len + self.ql) // self.bs) * self.bs
        self.buckets = GraphBuckets(buckets.batch, tuple(c for c in buckets.context if c < top) + (top,))
        b = max(self.buckets.batch)
        self.cr = self.ql + 1  # context rows per request a graph writes
        self.ints = Staging(draft_layout(b, self.ql, self.cr, top // self.bs).size, torch.int64, self.device)
        m = side.model
        self.feats = torch.zeros(b * self.cr, m.config.context_dim, dtype=m.hidden_norm.weight.dtype,
                                 device=self.device)
        self.temps = Staging(b, torch.float32, self.device)  # per-row temperature, 0 on padded rows
        self.dev = self.ints.dev
        self._runners: dict[tuple[int, int, bool], Callable[[], DraftProposal]] = {}
        self._views: dict[tuple[int, int], dict[str, Tensor]] = {}  # (batch, context) bucket -> its staged fields
        self._pool = None

    def fits_context(self, rows: int, shape: tuple[int, int]) -> bool:
        return rows <= shape[0] * self.cr

    def shape_for(self, anchor_pos: list[int]) -> tuple[int, int] | None:
        b = bucket(len(anchor_pos), self.buckets.batch)
        c = bucket(max(anchor_pos) + self.ql, self.buckets.context)
        return None if b is None or c is None else (b, c)

    @torch.inference_mode()
    def propose(self, anchors: list[int], anchor_pos: list[int], tables: list[list[int]], temperature: Tensor,
                seeds: list[int], need_q: bool, shape: tuple[int, int], features: Tensor | None = None,
                context: tuple[list[list[int]], list[int], list[int]] = ([], [], [])) -> DraftProposal:
        """The proposal for len(anchors) requests; its tensors are valid until the next propose. `features`
        [sum(lens), F] are the new context rows of (block tables, starts, lens) in `context`
        (fits_context(sum(lens), shape) must hold)."""
        b, c = shape
        if features is not None:
            self.feats[:features.shape[0]].copy_(features, non_blocking=True)
        self.ints.upload(self._layout(anchors, anchor_pos, tables, seeds, b, c, context))
        if need_q:  # greedy-only graphs never read the temperatures
            self.temps.upload(temperature.tolist() + [0.0] * (b - len(anchors)))
        return self._run(b, c, need_q, len(anchors))

    @torch.inference_mode()
    def propose_chained(self, packed: Tensor, anchor_pos: list[int], tables: list[list[int]], temperature: Tensor,
                        seeds: list[int], need_q: bool, shape: tuple[int, int], feats: Tensor) -> DraftProposal:
        """The proposal of the step after a verify still on the device: packed is its accept (rejection.pack_accept),
        read there. Request r's anchor becomes its output token a at anchor_pos[r] + a + 1; its context is that
        verify's feature rows feats[r] ([1 + N, F]) at anchor_pos[r].. (the rows past a land where the new block
        writes first)."""
        b, c = shape
        r, rows = len(anchor_pos), feats.shape[1]
        self.feats[:r * rows].copy_(feats.flatten(0, 1), non_blocking=True)
        context = (tables, list(anchor_pos), [rows] * r)
        self.ints.upload(self._layout([0] * r, anchor_pos, tables, seeds, b, c, context))  # anchors: set below
        if need_q:
            self.temps.upload(temperature.tolist() + [0.0] * (b - r))
        self._advance(packed, r, b, c)
        return self._run(b, c, need_q, r)

    @property
    def num_recorded(self) -> int:
        """CUDA graphs recorded so far (0 when not capturing)."""
        return len(self._runners) if self.capture else 0

    @torch.inference_mode()
    def warm_up(self, max_batch: int = 1) -> int:
        """Record now, on padding, the greedy and the sampling graph of every batch bucket up to max_batch's for
        every context bucket; -> how many were recorded (0 when not capturing)."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        keys = [(b, c, q) for b in self.buckets.batch if b <= top for c in self.buckets.context
                if b == 1 or c <= WARM_CONTEXT for q in (False, True)
                if self.capture and (b, c, q) not in self._runners]
        for key in keys:
            self._runners[key] = self._build(*key)
        return len(keys)

    def replay_costs(self, max_batch: int, reps: int = 3) -> list[tuple[int, float]]:
        """Device milliseconds of each recorded greedy graph at the smallest context, on padding: [(batch, ms)]."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        c = self.buckets.context[0]
        out = []
        for (b, cc, need_q), run in sorted(self._runners.items()):
            if cc == c and not need_q and b <= top:
                self.ints.upload(self._layout([], [], [], [], b, c))
                out.append((b, device_ms(run, reps)))
        return out

    def _run(self, b: int, c: int, need_q: bool, r: int) -> DraftProposal:
        """The bucket's graph (built on first use) on the staged inputs -> the proposal of its first r rows."""
        key = (b, c, need_q)
        if key not in self._runners:
            self._runners[key] = self._build(b, c, need_q)
        out = self._runners[key]()
        return replace(out, **{f.name: getattr(out, f.name)[:r] for f in fields(out)
                               if isinstance(getattr(out, f.name), Tensor)})

    def _advance(self, packed: Tensor, r: int, b: int, c: int) -> None:
        """On the device: the first r rows' anchors, anchor positions, sequence lengths, block positions and slots
        moved past the accepted tokens of `packed` (the layout holds the verify's anchor positions)."""
        ql, w = self.ql, c // self.bs
        v = self._fields(b, c)
        a = packed[:, PACKED_ACCEPTED]
        pos = v["anchor_pos"][:r] + a + 1  # [R]
        block = pos[:, None] + torch.arange(ql, device=self.dev.device)  # [R, ql]
        table = v["block_table"].view(b, w)[:r]
        v["anchors"][:r] = packed.gather(1, (a + PACKED_TOKENS)[:, None])[:, 0]
        v["anchor_pos"][:r] = pos
        v["seq_lens"][:r] = pos + ql
        v["positions"][:r * ql] = block.flatten()
        slots = table.gather(1, block // self.bs) * self.bs + block % self.bs  # [R, ql]
        v["slots"][:r * ql] = slots.flatten()

    def _fields(self, b: int, c: int) -> dict[str, Tensor]:
        """The bucket's fields of the device staging buffer, by name (views, cut once)."""
        if (b, c) not in self._views:
            self._views[b, c] = draft_layout(b, self.ql, self.cr, c // self.bs).views(self.dev)
        return self._views[b, c]

    def _layout(self, anchors: list[int], anchor_pos: list[int], tables: list[list[int]], seeds: list[int], b: int,
                c: int, context: tuple[list[list[int]], list[int], list[int]] = ([], [], [])) -> list[int]:
        """The step's inputs in draft_layout, padded."""
        bs, ql, w = self.bs, self.ql, c // self.bs
        ctx_pos, ctx_slots = [0] * (b * self.cr), [self.trash] * (b * self.cr)
        i = 0
        for blocks, start, n in zip(*context):
            ctx_pos[i:i + n] = range(start, start + n)
            ctx_slots[i:i + n] = slots_of(blocks, start, n, bs)
            i += n
        pad = b - len(anchors)
        pos, slots, table = [0] * (b * ql), [self.trash] * (b * ql), [0] * (b * w)
        for r, (p0, blocks) in enumerate(zip(anchor_pos, tables)):
            pos[r * ql:(r + 1) * ql] = range(p0, p0 + ql)
            slots[r * ql:(r + 1) * ql] = slots_of(blocks, p0, ql, bs)
            table[r * w:r * w + min(len(blocks), w)] = blocks[:w]
        seq = [p + ql for p in anchor_pos] + [ql] * pad
        return draft_layout(b, ql, self.cr, w).pack(
            anchors=list(anchors) + [0] * pad, anchor_pos=list(anchor_pos) + [0] * pad, seeds=list(seeds) + [0] * pad,
            seq_lens=seq, positions=pos, slots=slots, context_positions=ctx_pos, context_slots=ctx_slots,
            block_table=table)

    def _build(self, b: int, c: int, need_q: bool) -> Callable[[], DraftProposal]:
        side, ql, w = self.side, self.ql, c // self.bs
        m, cfg, n = side.model, side.model.config, side.num_speculative_tokens
        v = self._fields(b, c)
        anchors, anchor_pos, seeds = v["anchors"], v["anchor_pos"], v["seeds"]
        ctx_pos, ctx_slots = v["context_positions"], v["context_slots"]
        feats = self.feats[:b * self.cr]
        meta = AttentionMetadata(cu_seqlens_q=torch.arange(b + 1, device=self.device) * ql, seq_lens=v["seq_lens"],
                                 slot_mapping=v["slots"], block_table=v["block_table"].view(b, w), max_query_len=ql,
                                 max_seq_len=c, causal=False, all_slots_valid=True)
        temperature, first = self.temps.dev[:b], 0 if cfg.anchor_first else 1

        def forward() -> DraftProposal:
            side.runner.write_context(feats, ctx_pos, ctx_slots, side.cache, all_slots_valid=True)  # padding: trash
            ids = torch.full((b, ql), cfg.mask_token_id, dtype=torch.int64, device=self.device)
            ids[:, 0] = anchors
            hidden = side.runner.block_hidden(ids.flatten(), v["positions"], meta, side.cache).view(b, ql, -1)
            hidden = hidden[:, first:first + n]
            return side.markov_walk(hidden, m.head_logits(hidden), anchors, temperature, seeds, anchor_pos, need_q)
        if not self.capture:
            return forward

        def pad() -> None:
            self.ints.upload(self._layout([], [], [], [], b, c))
            self.temps.upload([0.0] * b)
        replay, self._pool, self.capture = capture_on_padding(forward, self._pool, [self.ints.dev, self.temps.dev],
                                                              pad, " for the draft")
        return replay
