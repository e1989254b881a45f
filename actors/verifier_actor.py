"""VerifierActor: the target, the scheduler and the step loop; the draft is reached over the step channel.

Control (add, abort, outputs, stats, drain) arrives as Ray calls on a threaded actor; the loop runs in its own
thread and never waits for the gateway: outputs go to an outbox that `wait_outputs` long-polls.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import asdict

import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.request import RequestOutput
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.models.draft_config import DraftConfig

from .channel import VerifierEnd, free_port
from .placement_env import actor_device, node_ip, set_cpu_threads, torch_dtype
from .remote_draft import RemoteDraft


class VerifierActor:
    def __init__(self, cfg) -> None:  # cfg: cluster.config.PairConfig
        self.cfg = cfg
        self.device = actor_device(cfg.device)
        set_cpu_threads(self.device, cfg.cpu_threads)  # this thread: loading, warm-up
        self.dtype = torch_dtype(cfg.dtype)
        self.spec = SpeculativeConfig.from_json(cfg.speculative_config)
        self.draft_cfg = DraftConfig.from_dir(cfg.draft) if cfg.draft else None
        if self.draft_cfg is not None:
            self.spec.validate(block_limit=self.draft_cfg.num_speculative_tokens)
        self.llm: LLM | None = None
        self._outbox: list[dict] = []
        self._cv = threading.Condition()
        self._stop = False
        self._draining = False
        self._error: str | None = None
        self._heartbeat = time.monotonic()
        self._counters = {"requests_finished": 0, "tokens_generated": 0, "steps": 0, "accepted": 0}
        self._thread: threading.Thread | None = None
        if self.draft_cfg is None or cfg.colocate:  # no step channel to wait for
            self._build(None)

    def channel_address(self, host: str | None = None) -> tuple[str, int]:
        host = host or node_ip()
        return host, free_port(host)

    def connect(self, host: str, port: int, backend: str) -> bool:
        """Join the pair's process group (the draft calls its own connect at the same time)."""
        dev = self.device if backend == "nccl" else torch.device("cpu")
        end = VerifierEnd(host, port, backend, dev, self.draft_cfg.context_dim, torch.float32, 0)
        self._build(end)  # the receive dtype and vocab are known once the target is loaded
        end.feature_dtype = self.llm.target.model.lm_head.weight.dtype
        end.target_vocab = self.llm.target.vocab_size
        return True

    def _build(self, end: VerifierEnd | None) -> None:
        c = self.cfg
        remote = None
        if end is not None:
            n = self.spec.num_speculative_tokens or self.draft_cfg.num_speculative_tokens
            remote = RemoteDraft(end, n, self.draft_cfg.query_len, c.num_kv_blocks, c.block_size)
        local = c.draft if c.colocate else None  # co-located: the draft runs in this actor, on its device
        self.llm = LLM(c.target, local, self.spec, dtype=self.dtype, device=str(self.device),
                       block_size=c.block_size, num_kv_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
                       max_model_len=c.max_model_len, draft_side=remote, enforce_eager=c.enforce_eager or None,
                       capture_layers=self.draft_cfg.target_layer_ids if remote is not None else ())

    def start(self) -> bool:
        self._thread = threading.Thread(target=self._loop, name="dspark-step-loop", daemon=True)
        self._thread.start()
        return True

    def _loop(self) -> None:
        set_cpu_threads(self.device, self.cfg.cpu_threads)  # OpenMP's thread count is per calling thread
        while not self._stop:
            with self._cv:
                while not self._stop and not self.llm.has_unfinished():
                    self._heartbeat = time.monotonic()
                    self._cv.wait(0.05)
            if self._stop:
                break
            try:
                outs = self.llm.step()
            except Exception:  # the loop must not die silently: health reports it
                self._error = traceback.format_exc()
                self._stop = True
                break
            self._heartbeat = time.monotonic()
            self._publish(outs)
        if self.llm.draft is not None and isinstance(self.llm.draft, RemoteDraft):
            self.llm.draft.end.stop()
            self.llm.draft.end.close()

    def _publish(self, outs: list[RequestOutput]) -> None:
        with self._cv:
            for o in outs:
                self._outbox.append(asdict(o))
                self._counters["tokens_generated"] += len(o.new_token_ids)
                if o.finished:
                    self._counters["requests_finished"] += 1
                    self._counters["steps"] += o.stats["steps"]
                    self._counters["accepted"] += o.stats["accepted"]
            self._cv.notify_all()

    def add_request(self, request_id: str, prompt: str | list[int], params: dict, num_speculative_tokens: int | None,
                    confidence_threshold: float | None) -> int:
        """Raises ValueError naming the field for bad input; returns the prompt length in tokens."""
        if self._draining:
            raise RuntimeError("draining: not accepting new requests")
        sp = SamplingParams(**params)
        ids = self.llm.encode(prompt)
        self.llm.add_request(ids, sp, request_id=request_id, num_speculative_tokens=num_speculative_tokens,
                             confidence_threshold=confidence_threshold)
        with self._cv:
            self._cv.notify_all()
        return len(ids)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Frees the blocks at once (between steps) and streams a final "abort" output for each."""
        aborted = [r for r in request_ids if self.llm.abort(r)]
        with self._cv:
            self._cv.notify_all()
        return aborted

    def wait_outputs(self, timeout_s: float = 0.1) -> list[dict]:
        with self._cv:
            if not self._outbox:
                self._cv.wait(timeout_s)
            out, self._outbox = self._outbox, []
            return out

    def drain(self) -> bool:
        self._draining = True
        return True

    def health(self, stall_s: float = 30.0) -> dict:
        """ok is False when the loop died or has not completed a step for stall_s seconds."""
        age = time.monotonic() - self._heartbeat
        alive = self._thread is not None and self._thread.is_alive()
        return {"ok": alive and self._error is None and age < stall_s, "error": self._error,
                "heartbeat_age_s": age}

    def stats(self) -> dict:
        s = self.llm.scheduler
        c = self._counters
        draft = self.llm.draft
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "free_target_blocks": self.llm.target.allocator.num_free,
                "total_target_blocks": self.llm.target.allocator.num_blocks,
                "free_draft_blocks": draft.allocator.num_free if draft else 0,
                "total_draft_blocks": draft.allocator.num_blocks if draft else 0,
                "requests_finished": c["requests_finished"], "tokens_generated": c["tokens_generated"],
                "steps": c["steps"], "mean_acceptance_length": (c["accepted"] + c["steps"]) / max(c["steps"], 1),
                "draining": self._draining}

    def model_info(self) -> dict:
        llm = self.llm
        return {"target": self.cfg.target, "draft": self.cfg.draft or "", "method": self.spec.method,
                "vocab_size": llm.target.vocab_size, "max_model_len": llm.max_model_len,
                "num_speculative_tokens": llm.max_speculative_tokens,
                "eos_token_ids": sorted(llm.scheduler.eos_token_ids), "has_tokenizer": llm.tokenizer is not None}

    def shutdown(self) -> bool:
        self._stop = True
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return True
