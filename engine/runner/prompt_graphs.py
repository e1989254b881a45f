"""CUDA graphs for the target's prefill of whole prompts (fresh ones, and those the prefix cache partly held,
computed again from position 0), so that a prompt costs its device time instead of one host launch per kernel.

A prompt is padded at its end to a length bucket; under causal attention no real token sees the padding, whose
K/V go to the trash slot. The graph returns the last real token's logits and every token's features. Several
fresh prompts (up to MAX_PROMPTS) replay one graph each, one after another; more run eagerly as one batch. On CPU
the same static path runs eagerly: that is what the CPU tests compare with the dynamic path.

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
from .buckets import bucket
from .capture import capture_on_padding
from .staging import Layout, Staging
from .target_runner import TargetRunner

PROMPT_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # padding wastes < 1.5x
MAX_PROMPTS = 4  # fresh prompts prefilled one graph each; a larger batch runs eagerly at once


@lru_cache(maxsize=None)
def prompt_layout(length: int, w: int) -> Layout:
    """A prompt padded to `length` tokens over a block table of width w."""
    return Layout(ids=length, slots=length, last=1, block_table=w)


def layer_weights(config: ModelConfig) -> int:
    """Weights of one decoder layer's projections: what a prefill token multiplies per layer."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return h * (2 * q + 2 * kv) + 3 * h * config.intermediate_size


class PromptGraphs:
    def __init__(self, runner: TargetRunner, cache: Tensor, block_size: int, trash_slot: int,
                 max_model_len: int, capture_layers: tuple[int, ...] = (), capture: bool | None = None,
                 max_work: float = KernelConfig.prompt_graph_work) -> None:
        self.runner, self.cache, self.block_size, self.trash = runner, cache, block_size, trash_slot
        self.max_work = max_work  # padded tokens x one layer's weights
        self.capture_layers, self.device = capture_layers, cache.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        top = bucket(max_model_len, PROMPT_BUCKETS) or PROMPT_BUCKETS[-1]
        self.lengths = tuple(n for n in PROMPT_BUCKETS if n <= top)
        self.staging = Staging(prompt_layout(top, -(-top // block_size)).size, torch.int64, self.device)
        self.layer_weights = layer_weights(runner.model.config)
        self._runners: dict[int, Callable[[], tuple[Tensor, Tensor | None]]] = {}
        self._pool = None

    def takes(self, starts: list[int], lens: list[int]) -> bool:
        """Whether run() takes these sequences: fresh prompts, few enough, each within the largest bucket, their
        padded tokens launch-bound (`max_work`)."""
        if not 0 < len(lens) <= MAX_PROMPTS or any(starts) or max(lens) > self.lengths[-1]:
            return False
        return sum(bucket(n, self.lengths) for n in lens) * self.layer_weights <= self.max_work

    @property
    def num_recorded(self) -> int:
        """CUDA graphs recorded so far (0 when not capturing)."""
        return len(self._runners) if self.capture else 0

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Record now, on padding, the graph of every bucket one prompt takes; -> how many (0 when not capturing)."""
        lengths = [n for n in self.lengths if self.capture and self.takes([0], [n]) and n not in self._runners]
        for n in lengths:
            self._runners[n] = self._build(n)
        return len(lengths)

    @torch.inference_mode()
    def run(self, block_tables: list[list[int]], prompts: list[list[int]], skip: list[int] | None = None
            ) -> tuple[Tensor, list[Tensor | None]]:
        """Each prompt at positions 0.. of its blocks -> logits [R, 1, V] fp32 of its last token, and per prompt
        its features [len - skip, F] (owned copies) past its first `skip` tokens, as TargetSide.run(...,
        last_only=True) returns them."""
        logits, feats = [], []
        for blocks, ids, first in zip(block_tables, prompts, skip or [0] * len(prompts)):
            n = len(ids)
            length = bucket(n, self.lengths)
            w = -(-length // self.block_size)
            table = blocks[:w] + [0] * (w - min(len(blocks), w))  # past the prompt: never attended
            pad = length - n
            self.staging.upload(prompt_layout(length, w).pack(
                ids=ids + [0] * pad, slots=slots_of(blocks, 0, n, self.block_size) + [self.trash] * pad, last=[n - 1],
                block_table=table))
            if length not in self._runners:
                self._runners[length] = self._build(length)
            row, f = self._runners[length]()
            logits.append(row.clone() if len(prompts) > 1 else row)
            feats.append(f[first:n].clone() if f is not None else None)
        return (torch.cat(logits) if len(logits) > 1 else logits[0])[:, None], feats

    def _build(self, length: int) -> Callable[[], tuple[Tensor, Tensor | None]]:
        w = -(-length // self.block_size)
        layout = prompt_layout(length, w)
        v = layout.views(self.staging.dev)
        ids, last = v["ids"], v["last"]
        positions = torch.arange(length, device=self.device)
        meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, length], device=self.device),
                                 seq_lens=torch.tensor([length], device=self.device), slot_mapping=v["slots"],
                                 block_table=v["block_table"].view(1, w), max_query_len=length,
                                 max_seq_len=length, causal=True, all_slots_valid=True, prompt_lens=(length,))

        def forward() -> tuple[Tensor, Tensor | None]:
            hidden, feats = self.runner.forward(ids, positions, meta, self.cache, capture_layers=self.capture_layers)
            return self.runner.compute_logits(hidden.index_select(0, last)), feats  # [1, V], [length, F]
        if not self.capture:
            return forward
        replay, self._pool, self.capture = capture_on_padding(
            forward, self._pool, [self.staging.dev[:layout.size]],
            lambda: self.staging.upload(layout.pack(ids=[0] * length, slots=[self.trash] * length, last=[0],
                                                    block_table=[0] * w)),
            f" for a prompt of {length} tokens")
        return replay
