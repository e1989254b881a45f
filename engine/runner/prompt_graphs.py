"""CUDA graphs for the target's prefill of prompts, so that a prompt costs its device time instead of one host
launch per kernel: fresh prompts from position 0, and the rest of a prompt whose start is cached already (the
prefix cache's blocks, or the earlier chunks of a long prompt) over its cached keys.

The new tokens are padded at their end to a length bucket; under causal attention no real token sees the padding,
whose K/V go to the trash slot. A prompt with a cached start also has a context bucket (its keys: cached and new),
and its start is an input of the graph. The graph returns the last real token's logits and every new token's
features. Two or more prompts run as one packed graph (KernelConfig.prompt_graph_packed): their new tokens one
after another (varlen rows, each over its own keys), padded at the end to a token bucket, the rows to one of
PACKED_ROWS, so a step's prompts cost one forward of their tokens; the graph returns the rows' last hidden states,
whose logits are computed after it (graphs keep no [rows, vocab] buffer). warm_up records them up to
PACKED_WARM_TOKENS tokens in contexts up to WARM_CONTEXT. Without it, up to KernelConfig.prompt_graph_max_prompts
replay one graph each, one after another, and more run eagerly as one batch. On CPU the same static path runs
eagerly: that is what the CPU tests compare with the dynamic path.

Graphs pay off while the prefill is launch-bound. An eager prefill costs about one host launch time per layer
whatever its length (Qwen3-8B shapes on an H200: 26-28 ms up to 1000 tokens), a graph the device time of its padded
tokens, which grows with tokens x weights per layer. So a batch takes graphs only while its padded tokens times one
layer's weights stay within KernelConfig.prompt_graph_work: at 8B (193 M weights a layer) up to 768 padded tokens,
at the 0.5B demo target (15 M) every batch the buckets take (bench/bench_prefill.py, bench/RESULTS.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from torch import Tensor

from dspark_serve.kernels.attention import AttentionMetadata
from dspark_serve.kernels.config import KernelConfig
from dspark_serve.models.config import ModelConfig

from ..kv_cache import slots_of
from .buckets import (PACKED_ROWS, PACKED_WARM_TOKENS, PROMPT_BUCKETS, WARM_CONTEXT, GraphBuckets, bucket,
                      packed_rows)
from .capture import capture_on_padding
from .staging import Layout, Staging
from .target_runner import TargetRunner

WARM_QUERY = 128  # new tokens after a cached start whose graphs warm_up records


@lru_cache(maxsize=None)
def prompt_layout(length: int, w: int) -> Layout:
    """A prompt padded to `length` tokens over a block table of width w."""
    return Layout(ids=length, slots=length, last=1, block_table=w)


@lru_cache(maxsize=None)
def packed_layout(b: int, t: int, w: int) -> Layout:
    """Up to b prompts' new tokens one after another, padded to t in all, over block tables of width w; with t, b
    and w even, every field the kernels read starts 16-byte aligned, as the tensors of their warm-up do."""
    return Layout(ids=t, positions=t, slots=t, block_table=b * w, seq_lens=b, cu=b + 1, last=b)


@lru_cache(maxsize=None)
def context_layout(length: int, w: int) -> Layout:
    """The rest of a prompt, padded to `length` tokens, after a cached start, over a block table of width w."""
    return Layout(ids=length, slots=length, last=1, start=1, block_table=w)


def layer_weights(config: ModelConfig) -> int:
    """Weights of one decoder layer's projections: what a prefill token multiplies per layer."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return h * (2 * q + 2 * kv) + 3 * h * config.intermediate_size


class PromptGraphs:
    def __init__(self, runner: TargetRunner, cache: Tensor, block_size: int, trash_slot: int,
                 max_model_len: int, capture_layers: tuple[int, ...] = (), capture: bool | None = None,
                 max_work: float = KernelConfig.prompt_graph_work,
                 max_prompts: int = KernelConfig.prompt_graph_max_prompts,
                 packed: bool = KernelConfig.prompt_graph_packed) -> None:
        self.runner, self.cache, self.block_size, self.trash = runner, cache, block_size, trash_slot
        self.max_work = max_work  # padded tokens x one layer's weights
        self.max_prompts, self.packed = max_prompts, packed
        self.capture_layers, self.device = capture_layers, cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.max_model_len = max_model_len
        top = bucket(max_model_len, PROMPT_BUCKETS) or PROMPT_BUCKETS[-1]
        self.lengths = tuple(n for n in PROMPT_BUCKETS if n <= top)
        contexts = GraphBuckets().context
        top_context = bucket(max_model_len, contexts) or contexts[-1]
        self.contexts = tuple(c for c in contexts if c <= top_context)  # keys a prompt with a cached start sees
        self.staging = Staging(max(prompt_layout(top, self._width(top)).size,
                                   context_layout(top, self._width(top_context)).size,
                                   packed_layout(PACKED_ROWS[-1], top, self._width(top_context)).size),
                               torch.int64, self.device)
        self.layer_weights = layer_weights(runner.model.config)
        # (length bucket, context bucket or 0 for a fresh prompt) -> its graph; packed: (rows, tokens, context, 1)
        self._runners: dict[tuple[int, int], Callable[[], tuple[Tensor, Tensor | None]]] = {}
        self._pool = None

    def _width(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def _shape(self, start: int, n: int) -> tuple[int, int] | None:
        """(length bucket, context bucket; 0 for a fresh prompt) of n new tokens at positions start.., or None."""
        length = bucket(n, self.lengths)
        if length is None or start == 0:
            return None if length is None else (length, 0)
        context = bucket(start + length, self.contexts)
        return None if context is None or start + length > self.max_model_len else (length, context)

    def _packed_shape(self, starts: list[int], lens: list[int]) -> tuple[int, int, int] | None:
        """(rows bucket, tokens bucket, context bucket) of prompts run as one packed graph, or None."""
        b, t = bucket(len(lens), PACKED_ROWS), bucket(sum(lens), self.lengths)
        c = bucket(max(s + n for s, n in zip(starts, lens)), self.contexts)
        return None if b is None or t is None or c is None else (b, t, c)

    def _packs(self, lens: list[int]) -> bool:
        return self.packed and len(lens) > 1

    def takes(self, starts: list[int], lens: list[int]) -> bool:
        """Whether run() takes these sequences: within the buckets (each, or packed together), their padded
        tokens launch-bound (`max_work`); unpacked, few enough."""
        if self._packs(lens):
            shape = self._packed_shape(starts, lens)
            return shape is not None and shape[1] * self.layer_weights <= self.max_work
        if not 0 < len(lens) <= self.max_prompts or any(self._shape(s, n) is None for s, n in zip(starts, lens)):
            return False
        return sum(bucket(n, self.lengths) for n in lens) * self.layer_weights <= self.max_work

    @property
    def num_recorded(self) -> int:
        """CUDA graphs recorded so far (0 when not capturing)."""
        return len(self._runners) if self.capture else 0

    @torch.inference_mode()
    def warm_up(self, max_batch: int = 1) -> int:
        """Record now, on padding, the graph of every bucket one fresh prompt takes, and those of up to WARM_QUERY
        new tokens after a cached start in contexts up to WARM_CONTEXT (a chat turn after its cached history); with
        max_batch > 1 and packing, the packed graphs of up to that many rows, PACKED_WARM_TOKENS tokens and contexts
        up to WARM_CONTEXT; -> how many (0 when not capturing). Other shapes record theirs on first use."""
        shapes = [(n, 0) for n in self.lengths if self.takes([0], [n])] + \
            [(n, c) for n in self.lengths if n <= WARM_QUERY and self.takes([0], [n])
             for c in self.contexts if n < c <= WARM_CONTEXT]
        packed = [(b, t, c, 1) for b in (packed_rows(max_batch) if self.packed else []) for t in self.lengths
                  if t <= PACKED_WARM_TOKENS and t * self.layer_weights <= self.max_work
                  for c in self.contexts if c <= WARM_CONTEXT]
        shapes = [k for k in shapes + packed if self.capture and k not in self._runners]
        for k in shapes:
            self._runners[k] = self._build_packed(*k[:3]) if len(k) == 4 else self._build(*k)
        return len(shapes)

    @torch.inference_mode()
    def run(self, block_tables: list[list[int]], tokens: list[list[int]], starts: list[int] | None = None
            ) -> tuple[Tensor, list[Tensor | None]]:
        """Each token list at positions starts[b].. (default 0) of its blocks -> logits [R, 1, V] fp32 of its last
        token, and per sequence its tokens' features [len, F] (owned copies), as TargetSide.run(..., last_only=True)
        returns them."""
        if self._packs([len(t) for t in tokens]):
            return self._run_packed(block_tables, tokens, starts or [0] * len(tokens))
        logits, feats = [], []
        for blocks, ids, start in zip(block_tables, tokens, starts or [0] * len(tokens)):
            n = len(ids)
            length, context = self._shape(start, n)
            w = self._width(context or length)
            table = blocks[:w] + [0] * (w - min(len(blocks), w))  # past the prompt: never attended
            pad = length - n
            values = dict(ids=ids + [0] * pad, slots=slots_of(blocks, start, n, self.block_size) + [self.trash] * pad,
                          last=[n - 1], block_table=table)
            if context:
                self.staging.upload(context_layout(length, w).pack(start=[start], **values))
            else:
                self.staging.upload(prompt_layout(length, w).pack(**values))
            if (length, context) not in self._runners:
                self._runners[length, context] = self._build(length, context)
            row, f = self._runners[length, context]()
            logits.append(row.clone() if len(tokens) > 1 else row)
            feats.append(f[:n].clone() if f is not None else None)
        return (torch.cat(logits) if len(logits) > 1 else logits[0])[:, None], feats

    def _run_packed(self, block_tables: list[list[int]], tokens: list[list[int]], starts: list[int]
                    ) -> tuple[Tensor, list[Tensor | None]]:
        """All prompts through one graph: each row's new tokens at positions starts[r].., then padding bound for the
        trash slot, past the last row (no row's)."""
        lens = [len(t) for t in tokens]
        b, t, c = self._packed_shape(starts, lens)
        w, r = self._width(c), len(tokens)
        ids, pos, slots, cu, seq, last, table = [], [], [], [0], [], [], [0] * (b * w)
        for i, (blocks, toks, s) in enumerate(zip(block_tables, tokens, starts)):
            n = len(toks)
            ids += toks
            pos += range(s, s + n)
            slots += slots_of(blocks, s, n, self.block_size)
            cu.append(cu[-1] + n)
            seq.append(s + n)
            last.append(cu[-1] - 1)
            table[i * w:i * w + min(len(blocks), w)] = blocks[:w]
        pad = t - cu[-1]
        self.staging.upload(packed_layout(b, t, w).pack(
            ids=ids + [0] * pad, positions=pos + [0] * pad, slots=slots + [self.trash] * pad,
            cu=cu + [cu[-1]] * (b - r), seq_lens=seq + [0] * (b - r), last=last + [0] * (b - r), block_table=table))
        key = (b, t, c, 1)
        if key not in self._runners:
            self._runners[key] = self._build_packed(b, t, c)
        last_hidden, f = self._runners[key]()
        logits = self.runner.compute_logits(last_hidden[:r])[:, None]  # [R, 1, V] fp32, its own memory
        return logits, [f[a:a + n].clone() if f is not None else None for a, n in zip(cu, lens)]

    def _build_packed(self, b: int, t: int, c: int) -> Callable[[], tuple[Tensor, Tensor | None]]:
        w = self._width(c)
        layout = packed_layout(b, t, w)
        v = layout.views(self.staging.dev)

        def forward() -> tuple[Tensor, Tensor | None]:
            meta = AttentionMetadata(cu_seqlens_q=v["cu"], seq_lens=v["seq_lens"], slot_mapping=v["slots"],
                                     block_table=v["block_table"].view(b, w), max_query_len=t, max_seq_len=c,
                                     causal=True, all_slots_valid=True)
            hidden, feats = self.runner.forward(v["ids"], v["positions"], meta, self.cache,
                                                capture_layers=self.capture_layers)
            return hidden.index_select(0, v["last"]), feats  # [b, H], [t, F]
        if not self.capture:
            return forward
        pad = dict(ids=[0] * t, positions=[0] * t, slots=[self.trash] * t, cu=[0] * (b + 1), seq_lens=[0] * b,
                   last=[0] * b, block_table=[0] * (b * w))
        return self._record(forward, layout, pad, f" for {b} prompts of {t} tokens in a context of {c}")

    def _record(self, forward: Callable, layout: Layout, pad: dict, label: str) -> Callable:
        """forward as a CUDA graph recorded on `pad` (the layout's padding, bound for the trash slot)."""
        replay, self._pool, self.capture = capture_on_padding(
            forward, self._pool, [self.staging.dev[:layout.size]], lambda: self.staging.upload(layout.pack(**pad)),
            label)
        return replay

    def _build(self, length: int, context: int) -> Callable[[], tuple[Tensor, Tensor | None]]:
        """The forward of `length` new tokens: a fresh prompt (context 0), or after a staged start whose keys,
        cached and new, fit `context`."""
        w = self._width(context or length)
        layout = context_layout(length, w) if context else prompt_layout(length, w)
        v = layout.views(self.staging.dev)
        ids, last = v["ids"], v["last"]
        steps = torch.arange(length, device=self.device)
        cu = torch.tensor([0, length], device=self.device)

        def forward() -> tuple[Tensor, Tensor | None]:
            if context:
                start = v["start"]
                meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=start + length, slot_mapping=v["slots"],
                                         block_table=v["block_table"].view(1, w), max_query_len=length,
                                         max_seq_len=context, causal=True, all_slots_valid=True)
                positions = start + steps
            else:
                meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=cu[1:], slot_mapping=v["slots"],
                                         block_table=v["block_table"].view(1, w), max_query_len=length,
                                         max_seq_len=length, causal=True, all_slots_valid=True,
                                         prompt_lens=(length,))
                positions = steps
            hidden, feats = self.runner.forward(ids, positions, meta, self.cache, capture_layers=self.capture_layers)
            return self.runner.compute_logits(hidden.index_select(0, last)), feats  # [1, V], [length, F]
        if not self.capture:
            return forward
        pad = dict(ids=[0] * length, slots=[self.trash] * length, last=[0], block_table=[0] * w)
        return self._record(forward, layout, dict(start=[0], **pad) if context else pad,
                            f" for a prompt of {length} tokens" + (f" in a context of {context}" if context else ""))
