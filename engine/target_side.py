"""The target's half of a step: run new tokens of many sequences at once, return logits rows and features."""

from __future__ import annotations

import torch
from torch import Tensor

from dspark_serve.kernels.config import KernelConfig
from dspark_serve.models.qwen import QwenForCausalLM

from .kv_cache import batch_metadata, positions_of
from .runner.prompt_graphs import PromptGraphs
from .runner.target_graphs import TargetGraphs
from .runner.target_runner import TargetRunner
from .request import Request


class TargetSide:
    """Owns the target model, its paged KV cache and block pool."""

    def __init__(self, model: QwenForCausalLM, num_blocks: int, block_size: int,
                 capture_layers: tuple[int, ...] = (), kernels: KernelConfig | None = None) -> None:
        self.model, self.block_size, self.capture_layers = model, block_size, capture_layers
        self.device = model.lm_head.weight.device
        self.runner = TargetRunner(model, kernels)  # prepared for its device
        self.cache = model.allocate_kv_cache(num_blocks + 1, block_size)  # + a trash block for padded tokens
        self.num_blocks = num_blocks  # the KVCacheManager hands out their ids
        self.graphs: TargetGraphs | None = None
        self.prompts: PromptGraphs | None = None

    def use_static_shapes(self, query_lens: tuple[int, ...], max_model_len: int, capture: bool | None = None) -> None:
        """Decode/verify steps that fit a bucket, and the prefill of a few fresh prompts, run with static shapes (as
        CUDA graphs on CUDA)."""
        trash = self.num_blocks * self.block_size
        self.graphs = TargetGraphs(self.runner, self.cache, self.block_size, trash, query_lens, max_model_len,
                                   self.capture_layers, capture=capture)
        kernels = self.runner.kernels
        self.prompts = PromptGraphs(self.runner, self.cache, self.block_size, trash, max_model_len,
                                    self.capture_layers, capture, kernels.prompt_graph_work) \
            if kernels.prompt_graphs else None

    def warm_up(self, max_batch: int = 1) -> int:
        """Record the decode/verify graphs of every batch bucket up to max_batch, and the prefill graphs, now;
        -> how many."""
        graphs = self.graphs.warm_up(max_batch) if self.graphs is not None else 0
        return graphs + (self.prompts.warm_up() if self.prompts is not None else 0)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def verify(self, reqs: list[Request], drafts: Tensor | None, n: list[int], anchors: list[int] | None = None,
               computed: list[int] | None = None) -> tuple[Tensor, list[Tensor | None], Tensor | None]:
        """Each request's anchor (`anchors` overrides r.anchor) plus its first n[b] drafts (drafts [R, N] int64 on
        the device, or None): run()'s outputs, and on the static path their greedy verification, computed in the
        graph ([R, 1 + q]: accepted count, output tokens; else None). On the static path the drafts stay on the
        device; otherwise they are read to the host first. `computed` overrides the requests' num_computed."""
        starts, lens = [r.num_computed for r in reqs] if computed is None else computed, [1 + k for k in n]
        anchors = [r.anchor for r in reqs] if anchors is None else anchors
        shape = self.graphs.shape_for(starts, lens) if self.graphs is not None else None
        if shape is None:
            rows = drafts.tolist() if drafts is not None else [[] for _ in reqs]
            return *self.run(reqs, [[a] + d[:k] for a, d, k in zip(anchors, rows, n)], last_only=False,
                             starts=starts), None
        return self._run_static(reqs, starts, [[a] + [0] * k for a, k in zip(anchors, n)], shape, drafts)

    def _run_static(self, reqs: list[Request], starts: list[int], tokens: list[list[int]], shape: tuple[int, int, int],
                    drafts: Tensor | None = None) -> tuple[Tensor, list[Tensor | None], Tensor]:
        """run()'s outputs from the bucket's graph and its greedy verification (drafts: see TargetGraphs.run)."""
        lens = [len(t) for t in tokens]
        logits, feats, accept = self.graphs.run([r.target_blocks for r in reqs], starts, tokens, shape, drafts=drafts)
        per_req = [f[:k] for f, k in zip(feats, lens)] if feats is not None else [None] * len(reqs)
        return logits[:, :max(lens)], per_req, accept

    @torch.inference_mode()
    def run(self, reqs: list[Request], tokens: list[list[int]], last_only: bool,
            starts: list[int] | None = None) -> tuple[Tensor, list[Tensor | None]]:
        """Write `tokens[b]` at positions starts[b].. (default: num_computed) of reqs[b].

        Returns logits [R, Q, V] fp32 (Q = 1 with last_only, else the longest token list; rows past len(tokens[b])
        are padding: zeros here, arbitrary on the static path, never to be read) and per request the captured
        features [len(tokens[b]), len(capture) * hidden] (or None).
        Does not advance num_computed: the scheduler commits what was accepted.
        """
        starts = [r.num_computed for r in reqs] if starts is None else starts
        lens = [len(t) for t in tokens]
        if last_only and self.prompts is not None and self.prompts.takes(starts, lens):
            return self.prompts.run([r.target_blocks for r in reqs], tokens)
        shape = self.graphs.shape_for(starts, lens) if self.graphs is not None and not last_only else None
        if shape is not None:
            return self._run_static(reqs, starts, tokens, shape)[:2]
        meta = batch_metadata([r.target_blocks for r in reqs], starts, lens, self.block_size, self.device)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=self.device)
        hidden, feats = self.runner.forward(ids, positions_of(starts, lens, self.device), meta, self.cache,
                                            capture_layers=self.capture_layers)
        cu = meta.cu_seqlens_q
        if last_only:
            logits = self.runner.compute_logits(hidden[cu[1:] - 1])[:, None]  # [R, 1, V]
        else:
            width = max(lens)
            req = torch.repeat_interleave(torch.arange(len(reqs), device=self.device), cu[1:] - cu[:-1])
            off = torch.arange(ids.shape[0], device=self.device) - cu[req]
            logits = hidden.new_zeros(len(reqs), width, self.vocab_size, dtype=torch.float32)
            logits[req, off] = self.runner.compute_logits(hidden)
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        per_req = [feats[a:b] if feats is not None else None for a, b in zip(offsets, offsets[1:])]
        return logits, per_req
