"""The in-process API in vLLM's style: LLM(target, draft, speculative_config).generate(prompts, SamplingParams)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dspark_serve.kernels.config import install as install_kernels
from dspark_serve.kernels.jit_watch import WATCH
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.qwen import QwenForCausalLM
from dspark_serve.models.target_loader import load_target
from dspark_serve.models.tokenizer import eos_token_ids as read_eos_token_ids
from dspark_serve.models.tokenizer import load_tokenizer

from .detokenize import TextStream, TokenText, text_stream
from .draft_side import DraftSide
from .engine_config import DEFAULT_NUM_KV_BLOCKS, EngineConfig
from .grammar import Grammars
from .kv_sizing import block_bytes, graph_reserve_bytes, kv_blocks_for_memory, packed_reserve_bytes
from .request import Request, RequestOutput, StepOutput
from .sampling_params import SamplingParams
from .core.cost_probe import probe_costs
from .core.engine_core import EngineCore, draft_shape
from .core.executor import Executor
from .core.kv_manager import KVCacheManager
from .core.policy import SpecPolicy
from .core.scheduler import Scheduler, SchedulerConfig, reserve_slots
from .spec_config import SpeculativeConfig
from .target_side import TargetSide

log = logging.getLogger(__name__)


def context_limit(max_model_len: int | None, max_position: int, kv_tokens: int | None = None) -> int:
    """The model's context limit (or what one sequence can have of the KV cache, when less), or a smaller one asked
    for; a larger one is refused, naming both limits."""
    limit = max_position if kv_tokens is None else min(max_position, kv_tokens)
    if max_model_len is None:
        return limit
    if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
        cache = f", and one sequence's share of the KV cache is {kv_tokens} tokens" if kv_tokens is not None else ""
        raise ValueError(f"max_model_len must be in [2, {limit}] (the target's max_position_embeddings is "
                         f"{max_position}{cache}), got {max_model_len!r}")
    return max_model_len


class LLM:
    def __init__(self, target: str | Path | QwenForCausalLM, draft: str | Path | DSparkDraft | None = None,
                 speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None, *,
                 eos_token_ids: Sequence[int] | None = None, draft_side: Any = None,
                 capture_layers: tuple[int, ...] = (), tokenizer: str | Path | Any = None, **options: Any) -> None:
        """vLLM's call: the target and draft as directories (or the models themselves), `speculative_config` and
        the engine's options by EngineConfig's field names (dtype, device, block_size, num_kv_blocks,
        gpu_memory_utilization, max_num_seqs, max_model_len, enforce_eager, warmup, kernels / kernel_config, ...);
        they become one EngineConfig (`self.config`). The other keywords are from_config's."""
        target_model = target if isinstance(target, QwenForCausalLM) else None
        draft_model = draft if isinstance(draft, DSparkDraft) else None
        tokenizer_dir = tokenizer if isinstance(tokenizer, (str, Path)) else None
        cfg = EngineConfig.from_options({**options, "target": None if target_model is not None else target,
                                         "draft": None if draft_model is not None else draft,
                                         "speculative_config": speculative_config, "tokenizer": tokenizer_dir})
        self._build(cfg, target_model, draft_model, draft_side, capture_layers,
                    None if tokenizer_dir is not None else tokenizer, eos_token_ids)

    @classmethod
    def from_config(cls, cfg: EngineConfig, *, target_model: QwenForCausalLM | None = None,
                    draft_model: DSparkDraft | None = None, draft_side: Any = None,
                    capture_layers: tuple[int, ...] = (), tokenizer: Any = None,
                    eos_token_ids: Sequence[int] | None = None) -> LLM:
        """The engine `cfg` describes, with what is not configuration: the models themselves (in place of
        cfg.target / cfg.draft), `draft_side` (with `capture_layers`: the target layers whose features it takes)
        for a draft living elsewhere, e.g. behind the step channel, a `tokenizers.Tokenizer`, the EOS ids of an
        in-memory target."""
        llm = cls.__new__(cls)
        llm._build(cfg, target_model, draft_model, draft_side, capture_layers, tokenizer, eos_token_ids)
        return llm

    def _build(self, cfg: EngineConfig, target_model: QwenForCausalLM | None, draft_model: DSparkDraft | None,
               draft_side: Any, capture_layers: tuple[int, ...], tokenizer: Any,
               eos_token_ids: Sequence[int] | None) -> None:
        """`max_model_len` (vLLM's name): the longest prompt + output, by default the target's
        max_position_embeddings. `num_kv_blocks` per model (default 2048), or on a GPU `gpu_memory_utilization`
        (vLLM's name): as many blocks as fit in that share of the GPU's memory beside the loaded weights and a
        reserve for the CUDA graphs. `enforce_eager` (vLLM's name; default: True on CPU, False on CUDA): False runs
        decode/verify steps with static shapes, captured as CUDA graphs on CUDA. `warmup`: record the graphs here
        (warm_up()) instead of on the first requests that meet them. The kernel choices (cfg.kernels, else the
        device's defaults) are installed before any model is prepared."""
        cfg.validate()
        if target_model is None and cfg.target is None:
            raise ValueError("give the target: a checkpoint directory (cfg.target) or the model (target_model)")
        self.config = cfg
        spec, device, dtype = cfg.speculative_config, cfg.resolved_device(), cfg.torch_dtype()
        kernels = cfg.kernel_config(device)
        install_kernels(kernels)
        WATCH.install()
        self.tokenizer = None
        if target_model is not None:
            target_model = target_model.to(device)
        else:
            target_model = load_target(cfg.target, dtype=dtype, device=device)
            if (Path(cfg.target) / "tokenizer.json").is_file() or (Path(cfg.target) / "vocab.json").is_file():
                self.tokenizer = load_tokenizer(cfg.target)
            eos_token_ids = eos_token_ids if eos_token_ids is not None else read_eos_token_ids(cfg.target)
        if cfg.tokenizer is not None:
            self.tokenizer = load_tokenizer(cfg.tokenizer)
        if tokenizer is not None:
            self.tokenizer = tokenizer
        if draft_model is None and cfg.draft is not None:
            draft_model = load_draft(cfg.draft, target=target_model, dtype=dtype)
        if draft_model is not None:
            draft_model = draft_model.to(device)
        block_size, max_num_seqs = cfg.block_size, cfg.max_num_seqs
        capture = draft_model.config.target_layer_ids if draft_model is not None else capture_layers
        drafts = draft_model.config.num_speculative_tokens if draft_model is not None else \
            (draft_side.num_speculative_tokens if draft_side is not None else 0)
        num_kv_blocks = self._kv_blocks(cfg.num_kv_blocks, cfg.gpu_memory_utilization, target_model, draft_model,
                                        block_size, max_num_seqs, drafts,
                                        kernels.prompt_graphs and kernels.prompt_graph_packed)
        self.target = TargetSide(target_model, num_kv_blocks, block_size, capture_layers=capture, kernels=kernels,
                                 deterministic=cfg.deterministic)
        draft_side = DraftSide(draft_model, num_kv_blocks, block_size, spec, target_model.config.vocab_size, kernels) \
            if draft_model is not None else draft_side
        self.spec = spec
        self.max_model_len = context_limit(cfg.max_model_len, target_model.config.max_position,
                                           num_kv_blocks * block_size - reserve_slots(draft_shape(draft_side)))
        eager = self.target.device.type != "cuda" if cfg.enforce_eager is None else cfg.enforce_eager
        if not (eager or self.target.runner.row_order):  # rows one at a time run eagerly
            drafts = draft_side.num_speculative_tokens if draft_side is not None else 0
            self.target.use_static_shapes(drafts, self.max_model_len, spec.dspark_survival_threshold)
            if isinstance(draft_side, DraftSide):
                draft_side.use_static_shapes(self.max_model_len)
        self.token_text = TokenText(self.tokenizer) if self.tokenizer is not None else None
        self.grammars = Grammars(self.tokenizer, self.target.vocab_size, tuple(eos_token_ids or ()))  # compiled lazily
        kv = KVCacheManager(num_kv_blocks, block_size, draft_side.num_blocks if draft_side is not None else None,
                            cfg.enable_prefix_caching)
        sched = SchedulerConfig(max_num_seqs, cfg.batched_tokens, tuple(eos_token_ids or ()))
        self._costs = cfg.step_costs
        self.core = EngineCore(Scheduler(sched, kv, draft_shape(draft_side), self._policy(draft_side)),
                               Executor(self.target, draft_side, spec, frozenset(sched.eos_token_ids)),
                               target_model.config.vocab_size,
                               self._policy)
        self._ids = itertools.count()
        # request id -> (prompt ids, its text, its logprobs so far or None)
        self._streams: dict[str, tuple[list[int], TextStream, list[tuple] | None]] = {}
        self._queues: dict[str, asyncio.Queue] = {}  # generate_stream: request id -> its outputs
        self._loop_task: asyncio.Task | None = None
        with WATCH.warming():
            if cfg.warmup:
                self.warm_up()
            if self._costs is None and spec.enable_adaptive_verification and isinstance(draft_side, DraftSide):
                self._costs = probe_costs(self.target, draft_side, max_num_seqs)
                self.core.scheduler.policy = self._policy(draft_side)
        self._compiles_at_start = WATCH.count
        # Everything alive now (models, tokenizer, imported modules) leaves the cyclic collector's view, so that a
        # full collection during decoding does not walk it and stall a step.
        gc.collect()
        gc.freeze()

    def _policy(self, draft: Any) -> SpecPolicy | None:
        """The speculation policy for a draft (None: plain decoding), with the engine's step costs."""
        if draft is None:
            return None
        return SpecPolicy(draft.num_speculative_tokens, draft.has_confidence, self.spec.enable_adaptive_verification,
                          self._costs, self.spec.dspark_max_verify_tokens)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def kv(self) -> KVCacheManager:
        return self.core.scheduler.kv

    @staticmethod
    def _kv_blocks(num_kv_blocks: int | None, utilization: float | None, target: QwenForCausalLM,
                   draft: DSparkDraft | None, block_size: int, max_num_seqs: int, drafts: int, packed: bool) -> int:
        if utilization is None or target.lm_head.weight.device.type != "cuda":
            return DEFAULT_NUM_KV_BLOCKS if num_kv_blocks is None else num_kv_blocks
        c, size = target.config, target.lm_head.weight.element_size()
        per_block = block_bytes(c.num_layers, c.num_kv_heads, c.head_dim, block_size, size)
        if draft is not None:  # in this process: its cache is on this GPU too
            d = draft.config.layers
            per_block += block_bytes(d.num_layers, d.num_kv_heads, d.head_dim, block_size, size)
        free, total = torch.cuda.mem_get_info(target.lm_head.weight.device)
        features = draft.config.context_dim if draft is not None else 0
        reserve = graph_reserve_bytes(c.vocab_size, drafts, max_num_seqs, c.hidden_size, features) + \
            (packed_reserve_bytes(max_num_seqs, c.hidden_size, features) if packed else 0)
        return kv_blocks_for_memory(total, total - free, utilization, per_block, reserve)

    def warm_up(self, max_batch: int | None = None) -> int:
        """Record the CUDA graphs now rather than during the requests that first meet them (every prefill bucket
        one prompt takes; decode, verify and the draft at every context bucket and every batch bucket up to
        max_batch, default max_num_seqs), then run one short generation, plain and speculative, so that nothing
        is compiled on a request's time; -> how many graphs. Off the GPU or with enforce_eager: nothing."""
        t0 = time.perf_counter()
        top = self.core.scheduler.cfg.max_num_seqs if max_batch is None else max_batch
        n = self.target.warm_up(top) + (self.draft.warm_up(top) if isinstance(self.draft, DraftSide) else 0)
        if n:
            prompt = [(7 * i) % min(self.target.vocab_size, 1000) for i in range(96)]
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            for spec in (0, None) if isinstance(self.draft, DraftSide) else (0,):  # a remote draft is not up yet
                self.generate_one(prompt, params, num_speculative_tokens=spec)
            log.info("recorded %d CUDA graphs and ran a warm-up generation in %.1f s", n, time.perf_counter() - t0)
        return n

    @property
    def num_kernel_compiles(self) -> int:
        """Triton kernels compiled in this process since this engine's warm-up (each one stalled its steps)."""
        return WATCH.count - self._compiles_at_start

    @property
    def num_cuda_graphs(self) -> int:
        graphs = (self.target.graphs, self.target.prompts, getattr(self.draft, "graphs", None))
        return sum(g.num_recorded for g in graphs if g is not None)

    def generate_one(self, prompt: str | list[int], params: SamplingParams, **kw: Any) -> RequestOutput:
        """One request to completion (add_request's keywords); other requests in flight keep running."""
        rid = self.add_request(prompt, params, **kw)
        while True:
            for out in self.step():
                if out.request_id == rid and out.finished:
                    return out

    @property
    def draft(self) -> DraftSide | Any:
        """The draft side in use (a DraftSide, or one behind the step channel); None: plain decoding."""
        return self.core.draft

    def set_draft(self, draft: DraftSide | Any) -> None:
        """Swap the draft (None: plain decoding). Requests already queued or running go on plainly."""
        self.core.set_draft(draft)

    @property
    def max_speculative_tokens(self) -> int:
        return self.draft.num_speculative_tokens if self.draft is not None else 0

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer in the target directory; pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, num_speculative_tokens: int | None = None,
                    confidence_threshold: float | None = None) -> str:
        params = params or SamplingParams()
        if params.stop and self.token_text is None:
            raise ValueError("stop strings need a tokenizer in the target directory; use stop_token_ids")
        if params.n != 1:
            raise ValueError(f"n must be 1 here (one request is one sequence; add n requests with seeds seed + i, "
                             f"or ask the server), got {params.n!r}")
        req = self.new_request(prompt, params, request_id=request_id, num_speculative_tokens=num_speculative_tokens,
                               confidence_threshold=confidence_threshold)
        self.core.add(req)
        stream = text_stream(self.token_text, params.stop, params.include_stop_str_in_output, params.min_tokens,
                             params.skip_special_tokens)
        self._streams[req.request_id] = (req.prompt_ids, stream, [] if params.logprobs is not None else None)
        return req.request_id

    def new_request(self, prompt: str | list[int], params: SamplingParams, *, request_id: str | None = None,
                    num_speculative_tokens: int | None = None, confidence_threshold: float | None = None) -> Request:
        """A validated Request (ValueError naming the field) with its grammar compiled (cached); scheduler.add
        queues it. Stop strings are left to whoever processes the outputs."""
        params.validate(max_tokens_limit=self.max_model_len)
        ids = self.encode(prompt)
        vocab = self.target.vocab_size
        if not ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {[t for t in ids if not 0 <= t < vocab][:5]}")
        params.check_token_ids(vocab)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len})")
        n = self.max_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if not 0 <= n <= self.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in [0, {self.max_speculative_tokens}], got {n}")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
        seed = params.seed if params.seed is not None else secrets.randbits(62)  # fresh per request and process
        rid = request_id or f"req-{next(self._ids)}"
        return Request(rid, ids, params, seed, n, confidence_threshold=confidence_threshold,
                       spec_pinned=num_speculative_tokens is not None,
                       grammar=self.grammars.state(params.structured_outputs))

    def abort(self, request_id: str) -> bool:
        """End the request at the next step, whose outputs carry its final one (finish_reason "abort"); False
        when it is not queued or running."""
        return self.core.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step; each output carries the request's new tokens and text."""
        return [o for o in map(self._process, self.core.step()) if o is not None]

    def _process(self, out: StepOutput) -> RequestOutput | None:
        """Text, stop strings and the cumulative view of one request's step output. A stop string ends the
        output at once and aborts the request; its stats arrive with the engine's last output for it."""
        rid, new, reason, stats, logprobs = out[:5]
        entry = self._streams.get(rid)
        if entry is None:
            return None
        _, stream, all_logprobs = entry
        if stream.stopped:  # tokens past a stop string: only the stats of the end are wanted
            if reason is None:
                return None
            reason, new, delta = "stop", [], ""
        else:
            new, delta = stream.push(new)
            if all_logprobs is not None and logprobs:
                all_logprobs.extend(logprobs[:len(new)])
            if stream.stopped:
                if reason is None:
                    self.core.abort(rid)
                    return self._output(rid, entry, new, None, {}, delta)
                reason = "stop"
            elif reason is not None:
                delta += stream.finish()
                reason = "stop" if stream.stopped else reason
        if reason is None:
            return self._output(rid, entry, new, None, {}, delta)
        del self._streams[rid]
        return self._output(rid, entry, new, reason, stats, delta)

    @staticmethod
    def _output(rid: str, entry: tuple, new: list[int], reason: str | None, stats: dict, delta: str) -> RequestOutput:
        prompt_ids, stream, logprobs = entry
        return RequestOutput(rid, prompt_ids, list(stream.token_ids), stream.text, new, reason is not None, reason,
                             stats, delta, list(logprobs) if logprobs is not None else None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def generate(self, prompts: Sequence[str | list[int]] | str, params: SamplingParams | Sequence[SamplingParams]
                 | None = None, progress: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order. `progress(done,
        total)` is called whenever requests finish."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if progress is not None:
                        progress(len(final), len(ids))
        return [final[i] for i in ids]

    async def generate_stream(self, prompt: str | list[int], params: SamplingParams | None = None,
                              **kw: Any) -> AsyncIterator[RequestOutput]:
        """One request's outputs, step by step; steps run in a worker thread shared by all streams."""
        rid = self.add_request(prompt, params, **kw)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _run_loop(self) -> None:
        while self.has_unfinished():
            for out in await asyncio.to_thread(self.step):
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
