"""VerifierActor: the target, the scheduler and the step loop; the draft is in this actor (co-located) or reached
over the step channel.

The step loop runs in its own thread and owns the request stream to the gateways (actors/request_stream.py): it
takes adds and aborts between steps and writes one frame of outputs per step to each gateway with sequences in
it (a sequence's outputs go to the gateway that added it), so no Ray call sits on the request path. Ray calls are
the control plane: bring-up, health, stats, shutdown.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.request import RequestStats, StepOutput
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.draft_config import DraftConfig

from .channel import VerifierEnd, free_port
from .frames import Abort, Add, Fatal, Inbound, Output, Rejected, Step
from .grammar_adds import COMPILE_POLL_S, GrammarAdds
from .placement_env import actor_device, node_ip, set_cpu_threads
from .remote_draft import RemoteDraft
from .request_stream import StreamServer

if TYPE_CHECKING:  # the annotation only: actors do not import the cluster layer
    from .pair_config import PairConfig

IDLE_POLL_S = 0.05  # how often an idle loop looks at its stop flag (a frame wakes it at once)


class VerifierActor:
    def __init__(self, cfg: PairConfig) -> None:
        self.cfg = cfg
        self.device = actor_device(cfg.engine.device)
        set_cpu_threads(self.device, cfg.cpu_threads)  # this thread: loading, warm-up
        self.spec = cfg.engine.speculative_config
        self.draft_cfg = DraftConfig.from_dir(cfg.engine.draft) if cfg.engine.draft else None
        if self.draft_cfg is not None:
            self.spec.validate(block_limit=self.draft_cfg.num_speculative_tokens)
        self.llm: LLM | None = None
        self.stream: StreamServer | None = None
        self._stop = False
        self._draining = False
        self._error: str | None = None
        self._heartbeat = time.monotonic()
        self._counters = {"requests_finished": 0, "tokens_generated": 0, "steps": 0, "accepted": 0}
        self._loop_time = {"loop_steps": 0, "loop_step_s": 0.0, "loop_intake_s": 0.0, "loop_publish_s": 0.0}
        self._owner: dict[str, int] = {}  # sequence -> the request-stream connection (gateway) that added it
        self._thread: threading.Thread | None = None
        self._trace_file = None  # serve --step-trace: a JSON line per step
        self._new_draft: RemoteDraft | None = None  # a replacement draft, swapped in between steps
        self._channel_lock = threading.Lock()  # the process-wide torch.distributed group: closed once, re-made once
        self._channel_open = False
        self.grammar_adds = GrammarAdds(lambda rid, ids, params, n, threshold: self.llm.new_request(
            ids, SamplingParams(**params), request_id=rid, num_speculative_tokens=n, confidence_threshold=threshold))
        if self.draft_cfg is None or cfg.colocate:  # no step channel to wait for
            self._build(None)

    def channel_address(self, host: str | None = None) -> tuple[str, int]:
        host = host or node_ip()
        return host, free_port(host)

    def connect(self, host: str, port: int, backend: str) -> bool:
        """Join the pair's process group (the draft calls its own connect at the same time)."""
        end = self._open_channel(host, port, backend)
        self._build(end)  # the receive dtype and vocab are known once the target is loaded
        end.feature_dtype = self.llm.target.model.lm_head.weight.dtype
        end.target_vocab = self.llm.target.vocab_size
        return True

    def attach_draft(self, host: str, port: int, backend: str) -> bool:
        """Join a replacement draft actor's process group; the step loop takes it between two steps. Requests
        already running finish plainly; new ones speculate again."""
        end = self._open_channel(host, port, backend)
        end.feature_dtype = self.llm.target.model.lm_head.weight.dtype
        end.target_vocab = self.llm.target.vocab_size
        n = self.spec.num_speculative_tokens or self.draft_cfg.num_speculative_tokens
        self._new_draft = RemoteDraft(end, n, self.draft_cfg.query_len, self.cfg.engine.kv_blocks,
                                      self.cfg.engine.block_size, self.draft_cfg.enable_confidence_head)
        return True

    def _open_channel(self, host: str, port: int, backend: str) -> VerifierEnd:
        self._close_channel()
        dev = self.device if backend == "nccl" else torch.device("cpu")
        with self._channel_lock:
            end = VerifierEnd(host, port, backend, dev, self.draft_cfg.context_dim, torch.float32, 0,
                              self.cfg.channel_timeout_s)
            self._channel_open = True
        return end

    def _close_channel(self) -> None:
        with self._channel_lock:
            if self._channel_open:
                self._channel_open = False
                try:
                    torch.distributed.destroy_process_group()
                except Exception:  # noqa: BLE001 - a group whose peer is gone may not close cleanly
                    pass

    def _build(self, end: VerifierEnd | None) -> None:
        c = self.cfg.engine
        remote = None
        if end is not None:
            n = self.spec.num_speculative_tokens or self.draft_cfg.num_speculative_tokens
            remote = RemoteDraft(end, n, self.draft_cfg.query_len, c.kv_blocks, c.block_size,
                                 self.draft_cfg.enable_confidence_head)
        # co-located: the draft runs in this actor, on its device; else behind the step channel
        engine = replace(c, device=str(self.device), draft=c.draft if self.cfg.colocate else None)
        self.llm = LLM.from_config(engine, draft_side=remote,
                                   capture_layers=self.draft_cfg.target_layer_ids if remote is not None else ())

    def start(self) -> bool:
        # a step trace that cannot be written fails the start, not the first step
        self._trace_file = open(self.cfg.step_trace, "a", buffering=1) if self.cfg.step_trace else None
        self.stream = StreamServer(self.cfg.channel_host or node_ip())
        self._thread = threading.Thread(target=self._loop, name="dspark-step-loop", daemon=True)
        self._thread.start()
        return True

    def stream_address(self) -> tuple[str, int, bytes]:
        """The request stream's (host, port, secret), for the gateway."""
        return (*self.stream.address, self.stream.secret)

    def _loop(self) -> None:
        set_cpu_threads(self.device, self.cfg.cpu_threads)  # OpenMP's thread count is per calling thread
        trace = self._trace_file
        try:
            t, clock = self._loop_time, time.perf_counter
            while not self._stop:
                busy, t0 = self.llm.has_unfinished(), clock()
                frames, lost = self.stream.poll(0.0 if busy else
                                                COMPILE_POLL_S if self.grammar_adds.pending else IDLE_POLL_S)
                if lost:  # a gateway is gone: so are its sequences
                    self._drop_gateways(set(lost))
                for cid, frame in frames:
                    self._apply(cid, frame)
                for rid, req, error in self.grammar_adds.ready():  # compiled off the loop
                    if error is None:
                        self._add(rid, req)
                    else:
                        self._reject(rid, error)
                self._heartbeat = time.monotonic()
                self._swap_draft()
                if self.llm.has_unfinished():
                    remote = self.llm.draft
                    t1 = clock()
                    outs = self.llm.core.step()
                    t2 = clock()
                    t["loop_steps"] += 1  # counted before the outputs leave: a reader who has them sees the step
                    t["loop_intake_s"] += t1 - t0 if busy else 0.0
                    t["loop_step_s"] += t2 - t1
                    self._publish(outs)
                    t3 = clock()
                    t["loop_publish_s"] += t3 - t2
                    if trace is not None:
                        self._trace(trace, t1 - t0 if busy else 0.0, t2 - t1, t3 - t2,
                                    sum(isinstance(f, Add) for _, f in frames))
                    if remote is not None and self.llm.draft is None:  # the step found the draft gone
                        self._close_channel()
                else:
                    self._keep_channel_alive()
        except Exception:  # the loop must not die silently: health reports it, the gateway fails every stream
            self._error = traceback.format_exc()
            self.stream.broadcast(Fatal("the step loop failed"))
        finally:
            self._stop = True
            if isinstance(self.llm.draft, RemoteDraft):
                try:
                    self.llm.draft.end.stop()
                except (RuntimeError, OSError):
                    pass
            self._close_channel()
            self.stream.close()
            if trace is not None:
                trace.close()

    def _trace(self, out, intake_s: float, step_s: float, publish_s: float, adds: int) -> None:
        """One step's line: t (time.monotonic() at its start, the clock of every process on the node)."""
        s = self.llm.scheduler
        out.write(json.dumps({"t": round(time.monotonic() - step_s - publish_s, 6), "step_ms": round(1e3 * step_s, 3),
                              "intake_ms": round(1e3 * intake_s, 3), "publish_ms": round(1e3 * publish_s, 3),
                              "adds": adds, "running": len(s.running), "waiting": len(s.waiting),
                              **self.llm.core.last_shape._asdict()}) + "\n")

    def _swap_draft(self) -> None:
        new, self._new_draft = self._new_draft, None
        if new is not None:
            self.llm.set_draft(new)

    def _keep_channel_alive(self) -> None:
        draft = self.llm.draft
        if isinstance(draft, RemoteDraft) and time.monotonic() - draft.end.last_used > self.cfg.keepalive_s:
            try:
                draft.end.ping()
            except (RuntimeError, OSError):  # the draft is gone: plain decoding until a new one attaches
                self.llm.set_draft(None)
                self._close_channel()

    def _drop_gateways(self, lost: set[int]) -> None:
        for rid in [rid for rid, cid in self._owner.items() if cid in lost]:
            del self._owner[rid]
            if not self.grammar_adds.cancel(rid):
                self.llm.abort(rid)

    def _reject(self, rid: str, message: str) -> None:
        cid = self._owner.pop(rid, None)
        if cid is not None:
            self.stream.send(cid, Rejected(rid, message))

    def _apply(self, cid: int, frame: Inbound) -> None:
        if isinstance(frame, Add):
            rid, prompt_ids, params, n, threshold = frame
            if rid in self._owner:  # the running one keeps its gateway
                self.stream.send(cid, Rejected(rid, f"request id {rid!r} is already running"))
                return
            self._owner[rid] = cid
            if self._draining:
                self._reject(rid, "draining: not accepting new requests")
                return
            if params.get("structured_outputs") is not None:  # its grammar compiles in a worker thread
                self.grammar_adds.submit(rid, rid, prompt_ids, params, n, threshold)
                return
            try:
                req = self.llm.new_request(prompt_ids, SamplingParams(**params), request_id=rid,
                                           num_speculative_tokens=n, confidence_threshold=threshold)
            except (ValueError, TypeError) as e:
                self._reject(rid, str(e))
                return
            self._add(rid, req)
        elif isinstance(frame, Abort):
            for rid in frame.request_ids:
                if self._owner.get(rid) != cid:  # not this gateway's
                    continue
                if self.grammar_adds.cancel(rid):  # still compiling: it ends here
                    del self._owner[rid]
                    self.stream.send(cid, Step([Output(rid, [], "abort", RequestStats().to_dict())]))
                else:
                    self.llm.abort(rid)

    def _add(self, rid: str, req) -> None:
        try:
            self.llm.core.add(req)
        except ValueError as e:
            self._reject(rid, str(e))

    def _publish(self, outs: list[StepOutput]) -> None:
        c = self._counters
        for o in outs:
            c["tokens_generated"] += len(o.new_token_ids)
            if o.stats is not None:
                c["requests_finished"] += 1
                c["steps"] += o.stats["steps"]
                c["accepted"] += o.stats["accepted"]
        by_gateway: dict[int, list[Output]] = {}
        for o in outs:
            cid = self._owner.get(o.request_id) if o.finish_reason is None else self._owner.pop(o.request_id, None)
            if cid is not None:
                by_gateway.setdefault(cid, []).append(Output(*o))
        for cid, frame in by_gateway.items():
            self.stream.send(cid, Step(frame))

    def drain(self) -> bool:
        self._draining = True
        return True

    def health(self) -> dict:
        """Liveness: ok while the step loop's thread runs and has not failed, however long its current step takes
        (a long prefill is work, not a hang). heartbeat_age_s: since the loop last came round. draft: "local" (in
        this actor), "remote" (over the step channel), "lost" (plain decoding until a new draft actor attaches) or
        "none"."""
        alive = self._thread is not None and self._thread.is_alive()
        return {"ok": alive and self._error is None, "error": self._error,
                "heartbeat_age_s": time.monotonic() - self._heartbeat, "draft": self.draft_state()}

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def draft_state(self) -> str:
        if self.draft_cfg is None:
            return "none"
        draft = self.llm.draft if self.llm is not None else None
        return "lost" if draft is None else ("remote" if isinstance(draft, RemoteDraft) else "local")

    def wait_stopped(self) -> str | None:
        """Returns when the step loop has ended: its error, or None after a clean stop."""
        if self._thread is not None:
            self._thread.join()
        return self._error

    def tokenizer_json(self) -> str | None:
        """The target's tokenizer, for the gateway (which tokenizes and detokenizes off the step loop)."""
        return self.llm.tokenizer.to_str() if self.llm.tokenizer is not None else None

    def chat_template(self):
        """The target's chat template (models.chat_template.ChatTemplate), or the configured file's; None when the
        target has none and no file is configured."""
        from dspark_serve.models.chat_template import ChatTemplateError, load_chat_template

        try:
            return load_chat_template(self.cfg.engine.target, self.cfg.engine.chat_template)
        except ChatTemplateError:
            if self.cfg.engine.chat_template is not None:
                raise
            return None

    def stats(self) -> dict:
        s, kv = self.llm.scheduler, self.llm.kv
        c = self._counters
        draft = kv.draft if self.llm.draft is not None else None
        return {"num_running": len(s.running), "num_waiting": len(s.waiting),
                "free_target_blocks": kv.target.num_free, "total_target_blocks": kv.target.num_blocks,
                "free_draft_blocks": draft.num_free if draft else 0,
                "total_draft_blocks": draft.num_blocks if draft else 0,
                "requests_finished": c["requests_finished"], "tokens_generated": c["tokens_generated"],
                "steps": c["steps"], "mean_acceptance_length": (c["accepted"] + c["steps"]) / max(c["steps"], 1),
                "draining": self._draining, "num_cuda_graphs": self.llm.num_cuda_graphs,
                "num_kernel_compiles": self.llm.num_kernel_compiles,
                "speculating": self.draft_state() in ("local", "remote"), **self._loop_time}

    def model_info(self) -> dict:
        llm = self.llm
        return {"target": self.cfg.engine.target, "draft": self.cfg.engine.draft or "", "method": self.spec.method,
                "vocab_size": llm.target.vocab_size, "max_model_len": llm.max_model_len,
                "num_speculative_tokens": llm.max_speculative_tokens,
                "eos_token_ids": sorted(llm.scheduler.eos_token_ids), "has_tokenizer": llm.tokenizer is not None}

    def shutdown(self) -> bool:
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        return True
