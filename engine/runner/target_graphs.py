"""CUDA graphs for the target's verify step (plain decoding is the same step with no drafts).

A graph fixes the batch `b` (rows), the tokens `t` and the context `c` (key slots attended per row). Each row
verifies a prefix of its drafts, chosen inside the graph: the step's budget of verified drafts goes to the slots
with the highest survivals across the rows (engine/draft_split.py), so rows have different lengths and the step
costs its tokens, not its batch times its longest row. The rows' tokens are laid out one after another (varlen);
tokens past the last row are padding whose K/V go to a reserved trash slot. Greedy verification runs in the graph
too; the graph keeps no logits of its own (they are recomputed for the rows that sample, process logits or ask for
logprobs), so larger steps need no more graph memory than the logits of one step.

The host's inputs (anchors, positions, caps, the budget, block tables) travel in one int64 copy (`verify_layout`)
and the corrections of the confidences in one float copy; the drafts and confidences stay on the device. On CPU
the same static path runs eagerly: that is what the CPU tests compare with the dynamic path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata

from ..draft_split import split_budget
from ..rejection import pack_accept, verify_greedy_ids
from .buckets import WARM_CONTEXT, GraphBuckets, bucket, token_buckets
from .capture import capture_on_padding, device_ms
from .staging import Layout, Staging
from .target_runner import TargetRunner


@lru_cache(maxsize=None)
def verify_layout(b: int, t: int, n: int, w: int) -> Layout:
    """A verify step's host inputs: b rows of at most 1 + n tokens, t in all, over block tables of width w. With
    the split on the device, the rows' caps, pins and the budget; with it on the host (each row's length known),
    the token layout itself: each token's source (its row's anchor, or a draft), position and cache slot, the rows'
    query offsets, lengths and verified drafts, and where each row's positions sit among the tokens."""
    return Layout(anchors=b, starts=b, caps=b, pinned=b, budget=1, src=t, positions=t, slots=t, cu=b + 1,
                  seq_lens=b, num=b, idx=b * (1 + n), block_table=b * w)


@lru_cache(maxsize=None)
def verify_floats(b: int, n: int) -> Layout:
    """Its float inputs: the online correction of each draft slot's confidence, the confidence thresholds."""
    return Layout(ratios=b * n, thresholds=b)


@dataclass(frozen=True)
class StaticVerify:
    """One verify step's outputs, for its first R rows (valid until the next replay, except the copies)."""

    packed: Tensor  # [R, 2 + N + 1] int64: drafts verified, accepted, output tokens (rejection.pack_accept), a copy
    feats: Tensor | None  # [R, 1 + N, F] features of each row's anchor and drafts (past its length: padding), a copy
    hidden: Tensor  # [R, 1 + N, H] final-normed hidden of the same positions


class TargetGraphs:
    """Static-shape verify steps for a target and its paged cache; `capture` records CUDA graphs lazily."""

    def __init__(self, runner: TargetRunner, cache: Tensor, block_size: int, trash_slot: int, num_drafts: int,
                 max_model_len: int, capture_layers: tuple[int, ...] = (), survival_floor: float = 0.0,
                 buckets: GraphBuckets = GraphBuckets(), capture: bool | None = None) -> None:
        self.runner, self.cache, self.block_size, self.trash = runner, cache, block_size, trash_slot
        self.n, self.capture_layers, self.survival_floor = num_drafts, capture_layers, survival_floor
        self.device = cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        top = -(-max_model_len // block_size) * block_size
        self.buckets = GraphBuckets(buckets.batch, tuple(c for c in buckets.context if c < top) + (top,))
        b = max(self.buckets.batch)
        self.ints = Staging(verify_layout(b, b * (1 + num_drafts), num_drafts, top // block_size).size, torch.int64,
                            self.device)
        self.floats = Staging(verify_floats(b, max(num_drafts, 1)).size, torch.float32, self.device)
        self.drafts = torch.zeros(b, max(num_drafts, 1), dtype=torch.int64, device=self.device)
        self.conf = torch.ones(b, max(num_drafts, 1), dtype=torch.float32, device=self.device)
        self._runners: dict[tuple[int, int, int], Callable[[], tuple[Tensor, Tensor | None, Tensor]]] = {}
        self._pool = None

    def token_sizes(self, b: int) -> list[int]:
        return token_buckets(b, self.n)

    def shape_for(self, num_reqs: int, num_tokens: int, max_start: int) -> tuple[int, int, int] | None:
        """(batch, tokens, context) bucket of a step of num_reqs rows and at most num_tokens tokens whose furthest
        row starts at max_start; None when it fits none."""
        b = bucket(num_reqs, self.buckets.batch)
        if b is None:
            return None
        t = bucket(max(num_tokens, b), tuple(self.token_sizes(b)))
        c = bucket(max_start + 1 + self.n, self.buckets.context)
        return None if t is None or c is None else (b, t, c)

    @torch.inference_mode()
    def verify(self, block_tables: list[list[int]], starts: list[int], anchors: list[int], caps: list[int],
               pinned: list[bool], budget: int, ratios: list[list[float]], thresholds: list[float],
               drafts: Tensor | None, conf: Tensor | None, shape: tuple[int, int, int],
               lengths: list[int] | None = None) -> StaticVerify:
        """Each row's anchor (at starts[r]) and a prefix of its drafts (drafts [R, N] on the device, conf [R, N]
        the drafter's c_k or None), at most caps[r] of them and `budget` in all, through the bucket's graph.
        `lengths` (drafts each row verifies, when the host knows them) takes the graph that does not split."""
        b, t, c = shape
        r, n = len(anchors), self.n
        w = c // self.block_size
        self.ints.upload(self._layout(block_tables, starts, anchors, caps, pinned, budget, b, t, w, lengths))
        key = (b, t, c, lengths is None)
        if n and lengths is None:
            self.floats.upload(verify_floats(b, n).pack(
                ratios=[x for row in ratios for x in row] + [1.0] * ((b - r) * n),
                thresholds=list(thresholds) + [0.0] * (b - r)))
            if drafts is not None:
                self.drafts[:r, :n].copy_(drafts[:, :n])
            if conf is not None:
                self.conf[:r, :n].copy_(conf[:, :n])
            else:
                self.conf[:r, :n].fill_(1.0)
        elif n and drafts is not None:
            self.drafts[:r, :n].copy_(drafts[:, :n])
        if key not in self._runners:
            self._runners[key] = self._build(*key)
        packed, feats, hidden = self._runners[key]()
        return StaticVerify(packed[:r].clone(), feats[:r].clone() if feats is not None else None, hidden[:r])

    @property
    def num_recorded(self) -> int:
        """CUDA graphs recorded so far (0 when not capturing)."""
        return len(self._runners) if self.capture else 0

    @torch.inference_mode()
    def warm_up(self, max_batch: int = 1) -> int:
        """Record now, on padding, the graphs of every batch bucket up to max_batch's, for every token size and
        context bucket (above WARM_CONTEXT batch 1 only), so that no request waits for one: with the split on the
        host, and on the device for batches of several rows (one row's split is known on the host); -> how many."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        shapes = [(b, t, c, split) for b in self.buckets.batch if b <= top for t in self.token_sizes(b)
                  for c in self.buckets.context if b == 1 or c <= WARM_CONTEXT
                  for split in ((False, True) if b > 1 and self.n else (False,))
                  if self.capture and (b, t, c, split) not in self._runners]
        for shape in shapes:
            self._runners[shape] = self._build(*shape)
        return len(shapes)

    def replay_costs(self, max_batch: int, reps: int = 3) -> dict[int, list[tuple[int, float]]]:
        """Device milliseconds of each recorded graph at the smallest context, on padding, by batch bucket:
        {batch: [(tokens, ms), ...]}."""
        top = bucket(max_batch, self.buckets.batch) or self.buckets.batch[-1]
        c = self.buckets.context[0]
        out: dict[int, list[tuple[int, float]]] = {}
        for (b, t, cc, split), run in sorted(self._runners.items()):
            if cc == c and b <= top and not split:
                self.stage_padding(b, t, c)
                out.setdefault(b, []).append((t, device_ms(run, reps)))
        return out

    def stage_padding(self, b: int, t: int, c: int) -> None:
        """Stage a step of padding only for graph (b, t, c): a replay then writes the trash slot alone."""
        self.ints.upload(self._layout([], [], [], [], [], 0, b, t, c // self.block_size, []))
        if self.n:
            self.floats.upload(verify_floats(b, self.n).pack(ratios=[1.0] * (b * self.n), thresholds=[0.0] * b))

    def _layout(self, block_tables: list[list[int]], starts: list[int], anchors: list[int], caps: list[int],
                pinned: list[bool], budget: int, b: int, t: int, w: int, lengths: list[int] | None) -> list[int]:
        """The step's host inputs, padded; the token layout only when the rows' lengths are known here."""
        n, bs, pad = self.n, self.block_size, b - len(anchors)
        table = [0] * (b * w)
        for r, blocks in enumerate(block_tables):
            table[r * w:r * w + min(len(blocks), w)] = blocks[:w]
        src, pos, slots, idx = [0] * t, [0] * t, [self.trash] * t, [0] * (b * (1 + n))
        cu, seq, num = [0] * (b + 1), [0] * b, [0] * b
        if lengths is not None:
            o = 0
            for r, (blocks, start, k) in enumerate(zip(block_tables, starts, lengths)):
                src[o] = r  # the anchor, then drafts (after the b anchors in the graph's source buffer)
                src[o + 1:o + 1 + k] = range(b + r * n, b + r * n + k)
                pos[o:o + 1 + k] = range(start, start + 1 + k)
                slots[o:o + 1 + k] = [blocks[p // bs] * bs + p % bs for p in range(start, start + 1 + k)]
                idx[r * (1 + n):(r + 1) * (1 + n)] = [min(o + j, t - 1) for j in range(1 + n)]
                o += 1 + k
                cu[r + 1], seq[r], num[r] = o, start + 1 + k, k
            cu[len(anchors) + 1:] = [o] * (b - len(anchors))
        return verify_layout(b, t, n, w).pack(
            anchors=list(anchors) + [0] * pad, starts=list(starts) + [0] * pad, caps=list(caps) + [-1] * pad,
            pinned=[int(p) for p in pinned] + [0] * pad, budget=[budget], src=src, positions=pos, slots=slots,
            cu=cu, seq_lens=seq, num=num, idx=idx, block_table=table)

    def _build(self, b: int, t: int, c: int, split: bool) -> Callable[[], tuple[Tensor, Tensor | None, Tensor]]:
        n, w = self.n, c // self.block_size
        v = verify_layout(b, t, n, w).views(self.ints.dev)
        f = verify_floats(b, max(n, 1)).views(self.floats.dev) if n else None
        table = v["block_table"].view(b, w)
        drafts, conf = self.drafts[:b, :n], self.conf[:b, :n]
        top = b * (1 + n) - 1  # indices stay in bounds whatever the buffer holds (a replay never reads past it)
        layout = self._device_layout(v, f, table, drafts, conf, b, t, c) if split else \
            lambda: (torch.cat([v["anchors"], drafts.flatten()])[v["src"].clamp(0, top)], v["positions"], v["slots"],
                     v["cu"], v["seq_lens"], v["num"], v["idx"].view(b, 1 + n).clamp(0, t - 1))

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            ids, pos, slots, cu, seq_lens, num, idx = layout()
            meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=seq_lens, slot_mapping=slots, block_table=table,
                                     max_query_len=1 + n, max_seq_len=c, causal=True, all_slots_valid=True)
            hidden, feats = self.runner.forward(ids, pos, meta, self.cache, capture_layers=self.capture_layers)
            target_ids = self.runner.compute_logits(hidden).argmax(-1)  # [t]; the logits die here
            greedy = verify_greedy_ids(drafts if n else ids.new_zeros(b, 0), num, target_ids[idx])
            return pack_accept(num, greedy), feats[idx] if feats is not None else None, hidden[idx]
        if not self.capture:
            return forward
        replay, self._pool, self.capture = capture_on_padding(
            forward, self._pool, [self.ints.dev, self.floats.dev], lambda: self.stage_padding(b, t, c), "")
        return replay

    def _device_layout(self, v: dict, f: dict, table: Tensor, drafts: Tensor, conf: Tensor, b: int, t: int,
                       c: int) -> Callable[[], tuple]:
        """The split of the budget and the token layout it implies, computed on the device."""
        n, bs, dev = self.n, self.block_size, self.device
        col, tok = torch.arange(1 + n, device=dev), torch.arange(t, device=dev)

        def layout() -> tuple:
            caps, live = v["caps"], v["caps"] >= 0  # padding rows have caps -1
            num = split_budget(conf, f["ratios"].view(b, n), caps.clamp(min=0), v["pinned"].bool(), v["budget"][0],
                               f["thresholds"], self.survival_floor)  # [b]
            lens = torch.where(live, 1 + num, 0)  # [b]
            cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])  # [b + 1]
            row = torch.searchsorted(cu[1:], tok, right=True).clamp(max=b - 1)  # [t]
            j = tok - cu[row]
            real = tok < cu[-1]
            ids = torch.where(j > 0, drafts[row, (j - 1).clamp(0, n - 1)], v["anchors"][row])
            pos = torch.where(real, v["starts"][row] + j, 0)
            slots = torch.where(real, table[row, pos // bs] * bs + pos % bs, self.trash)
            idx = (cu[:-1, None] + col).clamp(max=t - 1)  # [b, 1 + n]: each row's positions
            return torch.where(real, ids, 0), pos, slots, cu, v["starts"] + lens, num, idx
        return layout
