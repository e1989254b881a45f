"""The target's half of a step: run new tokens of many sequences at once, return logits rows and features."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dspark_serve.kernels.config import KernelConfig
from dspark_serve.models.qwen import QwenForCausalLM

from .draft_split import DraftSlots
from .kv_cache import batch_metadata, positions_of
from .rejection import pack_accept, verify_greedy
from .runner.prompt_graphs import PromptGraphs
from .runner.target_graphs import TargetGraphs
from .runner.target_runner import TargetRunner
from .request import Request


@dataclass(frozen=True)
class Verified:
    """A verify step on the device: every row's greedy accept, the features of its positions, and the logits of
    the rows that need them (sampling, processed logits, logprobs), computed on demand."""

    packed: Tensor  # [R, 2 + W + 1] int64 (rejection.pack_accept)
    feats: Tensor | None  # [R, 1 + W, F]: each row's anchor and drafts (past its length: padding)
    width: int  # W: draft columns
    logits_of: Callable[[list[int]], Tensor]  # rows -> [len(rows), 1 + W, V] fp32


class TargetSide:
    """Owns the target model, its paged KV cache and block pool."""

    def __init__(self, model: QwenForCausalLM, num_blocks: int, block_size: int,
                 capture_layers: tuple[int, ...] = (), kernels: KernelConfig | None = None,
                 deterministic: bool = False) -> None:
        self.model, self.block_size, self.capture_layers = model, block_size, capture_layers
        self.deterministic = deterministic  # rows computed on their own, sampled tokens coupled (EngineConfig's)
        self.device = model.lm_head.weight.device
        self.runner = TargetRunner(model, kernels, deterministic)  # prepared for its device
        self.cache = model.allocate_kv_cache(num_blocks + 1, block_size)  # + a trash block for padded tokens
        self.num_blocks = num_blocks  # the KVCacheManager hands out their ids
        self.graphs: TargetGraphs | None = None
        self.prompts: PromptGraphs | None = None

    def use_static_shapes(self, num_drafts: int, max_model_len: int, survival_floor: float = 0.0,
                          capture: bool | None = None) -> None:
        """Verify steps of up to num_drafts drafts a row (plain decoding: 0) that fit a bucket, and the prefill of a
        few fresh prompts, run with static shapes (as CUDA graphs on CUDA)."""
        trash = self.num_blocks * self.block_size
        self.graphs = TargetGraphs(self.runner, self.cache, self.block_size, trash, num_drafts, max_model_len,
                                   self.capture_layers, survival_floor, capture=capture)
        kernels = self.runner.kernels
        self.prompts = PromptGraphs(self.runner, self.cache, self.block_size, trash, max_model_len,
                                    self.capture_layers, capture, kernels.prompt_graph_work,
                                    kernels.prompt_graph_max_prompts, kernels.prompt_graph_packed) \
            if kernels.prompt_graphs else None

    def warm_up(self, max_batch: int = 1) -> int:
        """Compile every attention config a batch can meet (eager prefill batches and graphs recorded later too),
        record the decode/verify graphs of every batch bucket up to max_batch and the prefill graphs, now; -> how
        many graphs."""
        if self.device.type == "cuda" and not self.deterministic:  # the deterministic mode has one config
            from dspark_serve.kernels.paged_attention_triton import warm_up as warm_attention
            c = self.model.config
            warm_attention(self.cache[0, 0], self.cache[0, 1], c.num_heads, self.cache.dtype)
        graphs = self.graphs.warm_up(max_batch) if self.graphs is not None else 0
        return graphs + (self.prompts.warm_up(max_batch) if self.prompts is not None else 0)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.inference_mode()
    def verify(self, reqs: list[Request], slots: DraftSlots, drafts: Tensor | None, conf: Tensor | None,
               anchors: list[int] | None = None, computed: list[int] | None = None) -> Verified:
        """Each request's anchor (`anchors` overrides r.anchor) and a prefix of its drafts (drafts [R, N] int64 on
        the device or None, conf [R, N] the drafter's c_k or None), as `slots` bound them, at positions
        num_computed.. (`computed` overrides): on the static path the split and the greedy accept run in the graph
        and nothing waits for the device; otherwise the split reads the confidences on the host."""
        starts = [r.num_computed for r in reqs] if computed is None else computed
        anchors = [r.anchor for r in reqs] if anchors is None else anchors
        g = self.graphs
        shape = g.shape_for(len(reqs), len(reqs) + slots.budget, max(starts)) if g is not None else None
        if shape is not None:
            out = g.verify([r.target_blocks for r in reqs], starts, anchors, slots.caps, slots.pinned, slots.budget,
                           slots.ratios, slots.thresholds, drafts, conf, shape, slots.known_lengths())
            hidden = out.hidden
            return Verified(out.packed, out.feats, g.n,
                            lambda rows: self.runner.compute_logits(hidden[rows].flatten(0, 1)).view(
                                len(rows), hidden.shape[1], -1))
        n = slots.split_on_host(conf)
        rows = drafts.tolist() if drafts is not None else [[] for _ in reqs]
        logits, feats = self.run(reqs, [[a] + d[:k] for a, d, k in zip(anchors, rows, n)], last_only=False,
                                 starts=starts)  # [R, 1 + W, V]
        width = logits.shape[1] - 1
        d = drafts[:, :width] if drafts is not None else torch.zeros(len(reqs), 0, dtype=torch.int64,
                                                                    device=self.device)
        num = torch.tensor(n, dtype=torch.int64, device=self.device)
        packed = pack_accept(num, verify_greedy(d, num, logits))
        padded = None
        if feats[0] is not None:
            padded = feats[0].new_zeros(len(reqs), width + 1, feats[0].shape[-1])
            for i, f in enumerate(feats):
                padded[i, :f.shape[0]] = f
        return Verified(packed, padded, width, lambda rows: logits[rows])

    @torch.inference_mode()
    def run(self, reqs: list[Request], tokens: list[list[int]], last_only: bool,
            starts: list[int] | None = None) -> tuple[Tensor, list[Tensor | None]]:
        """Write `tokens[b]` at positions starts[b].. (default: num_computed) of reqs[b]; with last_only, prompts
        the prompt graphs take (fresh or after a cached start) run through them: a graph costs the device time of
        the new tokens, an eager prefill one host launch per kernel.

        Returns logits [R, Q, V] fp32 (Q = 1 with last_only, else the longest token list; rows past len(tokens[b])
        are padding: zeros here, arbitrary on the static path, never to be read) and per request the captured
        features [len(tokens[b]), len(capture) * hidden] (or None).
        Does not advance num_computed: the scheduler commits what was accepted.
        """
        starts = [r.num_computed for r in reqs] if starts is None else starts
        lens = [len(t) for t in tokens]
        if last_only and self.prompts is not None and self.prompts.takes(starts, lens):
            return self.prompts.run([r.target_blocks for r in reqs], tokens, starts)
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
