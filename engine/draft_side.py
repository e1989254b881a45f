"""The draft's half of a step: write new context K/V, run the block in one pass, walk the Markov head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_serve.kernels.config import KernelConfig, use_triton
from dspark_serve.kernels.markov_walk_ref import markov_walk_ref
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.token_map import load_token_map, restrict_draft_vocab

from .runner.draft_graphs import DraftGraphs
from .runner.draft_runner import DraftRunner
from .drafter import DraftInput, DraftProposal
from .grammar_draft import FORCED_LOGIT, DraftMasks, forced_rows, keep, masked, with_forced
from .kv_cache import batch_metadata, positions_of
from .sampling import DRAFT_SALT, keyed_gumbel, keyed_gumbel_at
from .spec_config import SpeculativeConfig


def _walk_fn(t: Tensor):
    """The top-k Markov walk: the Triton kernel on the fast path, else its reference."""
    if use_triton(t):
        from dspark_serve.kernels.markov_walk import markov_walk
        return markov_walk
    return markov_walk_ref


class DraftSide:
    """Owns the draft model, its paged context K/V cache and block pool."""

    def __init__(self, model: DSparkDraft, num_blocks: int, block_size: int, spec: SpeculativeConfig,
                 target_vocab: int, kernels: KernelConfig | None = None) -> None:
        spec.validate(block_limit=model.config.num_speculative_tokens)
        if spec.dspark_token_map is not None:
            restrict_draft_vocab(model, load_token_map(spec.dspark_token_map, target_vocab), target_vocab)
        cfg = model.config
        self.model, self.spec, self.block_size, self.target_vocab = model, spec, block_size, target_vocab
        self.num_speculative_tokens = spec.num_speculative_tokens or cfg.num_speculative_tokens
        self.device = model.fc.weight.device
        self.runner = DraftRunner(model, kernels, spec.dspark_quantize_lm_head)  # prepared for its device
        self.cache = model.allocate_kv_cache(num_blocks + 1, block_size)  # + a trash block for padded rows
        self.num_blocks = num_blocks  # the verifier's KVCacheManager hands out their ids
        self.graphs: DraftGraphs | None = None
        self._scatter_cols = torch.arange(cfg.draft_vocab_size, device=self.device) + model.d2t.to(self.device)
        self._w2_nvfp4 = model.markov_head is not None and isinstance(model.markov_head.markov_w2, NVFP4Linear)
        self._reduced_vocab = bool(model.d2t.any())

    def use_static_shapes(self, max_model_len: int, capture: bool | None = None) -> None:
        """Block pass + Markov walk with static shapes (CUDA graphs on CUDA) for steps that fit a bucket."""
        self.graphs = DraftGraphs(self, self.num_blocks * self.block_size, max_model_len,
                                  capture_graphs=capture)

    def warm_up(self, max_batch: int = 1) -> int:
        """Compile every config of the block's attention, record the graphs (greedy and sampling, every context
        bucket) of every batch bucket up to max_batch now; -> how many graphs."""
        if self.device.type == "cuda":
            from dspark_serve.kernels.paged_attention_triton import warm_up as warm_attention
            c = self.model.config.layers
            warm_attention(self.cache[0, 0], self.cache[0, 1], c.num_heads, self.cache.dtype, causal=False)
            self.warm_context_writes()
        return self.graphs.warm_up(max_batch) if self.graphs is not None else 0

    CONTEXT_WRITE_ROWS = (1, 2, 9, 16, 17, 32, 63, 64, 65, 128, 200)  # each row-count class its own kernel or spec

    @torch.inference_mode()
    def warm_context_writes(self) -> None:
        """A step's context write takes any number of new rows, and its GEMV / GEMM picks a kernel, a config and
        Triton's specialisation of M (1, a multiple of 16, other) by that number: run one write of each class now,
        to no cache slot, so that no step compiles one."""
        width = self.model.config.context_dim
        for t in self.CONTEXT_WRITE_ROWS:
            rows = torch.zeros(t, width, device=self.device, dtype=self.cache.dtype)
            nowhere = torch.full((t,), -1, dtype=torch.int64, device=self.device)
            self.runner.write_context(rows, torch.zeros(t, dtype=torch.int64, device=self.device), nowhere,
                                      self.cache)

    @property
    def query_len(self) -> int:
        return self.model.config.query_len

    @property
    def has_confidence(self) -> bool:
        return self.model.confidence_head is not None

    @property
    def can_chain(self) -> bool:
        """With static shapes a draft can be queued behind a verify on the device (engine/core/pipeline.py)."""
        return self.graphs is not None

    @torch.inference_mode()
    def propose(self, inp: DraftInput) -> DraftProposal:
        """Write the new context K/V, run the block, walk the Markov head; rows with temperature 0 draft by argmax."""
        m, cfg, n, dev = self.model, self.model.config, self.num_speculative_tokens, self.device
        tables = inp.block_table.tolist()
        starts, lens = inp.ctx_start.tolist(), inp.ctx_len.tolist()
        q_len, num_reqs = self.query_len, len(tables)
        anchor_pos = inp.anchor_pos.tolist()
        need_q = self.spec.draft_sample_method != "greedy" and bool((inp.temperature >= 1e-5).any())  # host data
        masks = DraftMasks(inp.grammars, self.target_vocab, dev) if inp.grammars is not None else None
        masks = masks or None  # constrained rows walk eagerly, masked by their grammars
        shape = self.graphs.shape_for(anchor_pos) if self.graphs is not None and masks is None else None
        todo = [i for i, k in enumerate(lens) if k > 0]
        context = ([tables[i] for i in todo], [starts[i] for i in todo], [lens[i] for i in todo])
        if todo and (shape is None or not self.graphs.fits_context(sum(lens), shape)):
            self._write_context(inp.features, *context)
            context = ([], [], [])
        if shape is not None:  # the context write (when it fits the bucket), block pass and walk in one graph
            return self.graphs.propose(inp.anchors.tolist(), anchor_pos, tables, inp.temperature.cpu(),
                                       inp.seeds.tolist(), need_q, shape, inp.features if context[0] else None,
                                       context)
        ids = torch.full((num_reqs, q_len), cfg.mask_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = inp.anchors.to(dev)
        meta = batch_metadata(tables, anchor_pos, [q_len] * num_reqs, self.block_size, dev, causal=False)
        hidden = self.runner.block_hidden(ids.flatten(), positions_of(anchor_pos, [q_len] * num_reqs, dev), meta,
                                self.cache).view(num_reqs, q_len, -1)
        first = 0 if cfg.anchor_first else 1
        hidden = hidden[:, first:first + n]  # [R, N, H]: row k drafts position anchor_pos + 1 + k
        try:
            return self.markov_walk(hidden, m.head_logits(hidden), ids[:, 0], inp.temperature.to(dev),
                                    inp.seeds.to(dev), inp.anchor_pos.to(dev), need_q, masks)
        finally:
            if masks is not None:
                masks.close()

    def propose_chained(self, packed: Tensor, anchor_pos: list[int], tables: list[list[int]],
                        temperature: list[float], seeds: list[int], feats: Tensor) -> DraftProposal | None:
        """DraftGraphs.propose_chained, when a bucket takes the step at its furthest (every draft accepted)."""
        g = self.graphs
        n = feats.shape[1] - 1
        shape = g.shape_for([p + n + 1 for p in anchor_pos]) if g is not None else None
        if shape is None or not g.fits_context(len(anchor_pos) * (n + 1), shape):
            return None
        temps = torch.tensor(temperature, dtype=torch.float32)
        need_q = self.spec.draft_sample_method != "greedy" and bool((temps >= 1e-5).any())
        return g.propose_chained(packed, anchor_pos, tables, temps, seeds, need_q, shape, feats)

    @torch.inference_mode()
    def write_context(self, inp: DraftInput) -> None:
        """Only the context K/V of the input's new rows (no block, no proposal): a finished prompt's context, so
        the prefix cache holds it whether or not the request ever drafts."""
        todo = [i for i, k in enumerate(inp.ctx_len.tolist()) if k > 0]
        if not todo or inp.features is None:
            return
        tables, starts, lens = inp.block_table.tolist(), inp.ctx_start.tolist(), inp.ctx_len.tolist()
        self._write_context(inp.features, [tables[i] for i in todo], [starts[i] for i in todo],
                            [lens[i] for i in todo])

    def _write_context(self, features: Tensor, tables: list[list[int]], starts: list[int], lens: list[int]) -> None:
        """Eagerly: context K/V of lens[i] new rows at positions starts[i].. (features [sum(lens), F])."""
        meta = batch_metadata(tables, starts, lens, self.block_size, self.device)
        pos = positions_of(starts, lens, self.device)
        self.runner.write_context(features.to(self.device), pos, meta.slot_mapping, self.cache, meta.all_slots_valid)

    def markov_walk(self, hidden: Tensor, head: Tensor, anchor: Tensor, temperature: Tensor, seeds: Tensor,
                    anchor_pos: Tensor, need_q: bool, masks: DraftMasks | None = None) -> DraftProposal:
        """head: the lm_head's output [R, N, V_draft] (DSparkDraft.head_logits). need_q: some row samples (then q is
        returned for every row; greedy rows get one-hot q). masks: the constrained rows' grammars (each step is
        masked by them; q is the masked distribution)."""
        m = self.model
        topk = self.spec.dspark_draft_topk
        # a greedy constrained batch walks the whole vocabulary, masked: the unmasked top-k may hold nothing the
        # grammar allows (sampled batches keep the candidates, whose q stays [R, N, K])
        if m.markov_head is not None and 0 < topk < head.shape[-1] and (masks is None or need_q):
            return self._topk_walk(hidden, head, anchor, temperature, seeds, anchor_pos, need_q, topk, masks)
        base = m.scaled(head)  # [R, N, V_draft] fp32
        n = base.shape[1]
        greedy = (temperature < 1e-5) | (self.spec.draft_sample_method == "greedy")  # [R]
        temp = torch.where(temperature < 1e-5, 1.0, temperature)[:, None]  # [R, 1]
        prev, tokens, probs, conf = anchor, [], [], []
        for k in range(n):
            embed = m.markov_embed(prev) if m.markov_head is not None else None  # [R, r]
            logits = base[:, k] + m.markov_bias(embed) if embed is not None else base[:, k]  # [R, V_draft]
            allow = masks.allowed(k, prev) if masks is not None else None  # [R, V_target]
            sayable = allow[:, self._scatter_cols] if allow is not None else None  # [R, V_draft]
            if allow is not None:
                logits = masked(logits, sayable)
            if m.confidence_head is not None:
                c = m.confidence_logit(hidden[:, k], embed)  # [R]
                conf.append(c if allow is None else with_forced(c, allow, sayable))
            if need_q:
                noise = keyed_gumbel(seeds, (anchor_pos + 1 + k)[:, None], logits.shape[-1], DRAFT_SALT)[:, 0]
                draft_ids = torch.where(greedy, logits.argmax(-1), (logits / temp + noise).argmax(-1))  # [R]
            else:  # every row greedy
                draft_ids = logits.argmax(-1)
            prev = m.to_target_ids(draft_ids)
            tokens.append(prev)
            if need_q:
                onehot = torch.zeros_like(logits).scatter_(-1, draft_ids[:, None], 1.0)  # no device check: capturable
                q = torch.where(greedy[:, None], onehot, torch.softmax(logits / temp, -1))
                probs.append(self._to_target_vocab(q))
        stack = lambda xs: torch.stack(xs, 1) if xs else None  # noqa: E731
        return DraftProposal(torch.stack(tokens, 1), stack(probs), stack(conf))

    def _topk_walk(self, hidden: Tensor, head: Tensor, anchor: Tensor, temperature: Tensor, seeds: Tensor,
                   anchor_pos: Tensor, need_q: bool, topk: int, masks: DraftMasks | None = None) -> DraftProposal:
        """dspark_draft_topk: candidates from the base logits once per position, then the walk over them (one
        Triton launch on the fast path). hidden [R, N, H], head [R, N, V_draft]; q lives on the candidates."""
        m, (num, n, _) = self.model, head.shape
        if m.config.logit_scale > 0:  # the order of U is the head's: rank the head's own dtype, scale only the K
            values, cand = head.topk(topk, dim=-1)  # [R, N, K]
            values = m.scaled(values)
        else:
            values, cand = m.scaled(head).topk(topk, dim=-1)
        w2 = m.markov_head.markov_w2
        if self._w2_nvfp4:  # dequantize the candidates' rows only
            from dspark_serve.kernels import nvfp4
            flat = cand.reshape(-1)
            rows = nvfp4.dequantize(w2.weight[flat], w2.weight_scale[flat], w2.weight_scale_2)
        else:
            rows = w2.weight[cand.reshape(-1)]
        rows = rows.view(num, n, topk, -1)  # [R, N, K, r]
        conf_base = conf_w = None
        if m.confidence_head is not None:
            proj, h = m.confidence_head.proj, hidden.shape[-1]
            conf_base = F.linear(hidden.float(), proj.weight[:, :h].float(), proj.bias.float())[..., 0]  # [R, N]
            if m.config.confidence_head_with_markov:
                conf_w = proj.weight[0, h:].float()  # [r]
        greedy = (temperature < 1e-5) | (self.spec.draft_sample_method == "greedy")  # [R]
        temp = torch.where(temperature < 1e-5, 1.0, temperature)  # [R]
        noise = None
        if need_q:
            positions = anchor_pos[:, None] + 1 + torch.arange(n, device=head.device)  # [R, N]
            noise = keyed_gumbel_at(seeds, positions, cand, DRAFT_SALT)  # [R, N, K]
        d2t = m.d2t if self._reduced_vocab else None
        w1 = m.markov_head.markov_w1.weight
        args = (values, cand, rows, w1, anchor, m.config.logit_scale, d2t, conf_base, conf_w, noise, temp, ~greedy)
        if masks is None:
            tokens, logits, conf = _walk_fn(values)(*args)
        else:  # the reference walk, each step's candidates masked by the grammars
            cand_target = cand + m.d2t.to(cand.device)[cand] if d2t is not None else cand
            forced = []

            def allow(k: int, prev: Tensor) -> Tensor:
                full = masks.allowed(k, prev)  # [R, V_target]
                ok = full.gather(1, cand_target[:, k])  # [R, K]
                forced.append(forced_rows(full, ok))
                return keep(ok)

            tokens, logits, conf = markov_walk_ref(*args, allow=allow)  # logits -inf where refused: q is masked
            if conf is not None:
                conf = torch.where(torch.stack(forced, 1), FORCED_LOGIT, conf)
        if not need_q:
            return DraftProposal(tokens, None, conf)
        cand_ids = m.to_target_ids(cand) if d2t is not None else cand
        drafted = (cand_ids == tokens[..., None]).float()  # [R, N, K] one-hot for greedy rows
        q = torch.where(greedy[:, None, None], drafted, torch.softmax(logits / temp[:, None, None], -1))
        return DraftProposal(tokens, None, conf, cand_ids=cand_ids, cand_probs=q)

    def _to_target_vocab(self, q: Tensor) -> Tensor:
        """[R, V_draft] -> [R, V_target] (identity for a full vocab)."""
        if q.shape[-1] == self.target_vocab:
            return q
        out = q.new_zeros(q.shape[0], self.target_vocab)
        return out.index_copy_(1, self._scatter_cols, q)
