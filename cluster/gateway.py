"""The gateway's logic: validate and tokenize off the event loop, admit, stream each step's tokens and text back,
cancel, bound the queue, drain. Talks to the step loop over the request stream; no grpc, no torch."""

from __future__ import annotations

import asyncio
import gc
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from dspark_serve.actors.frames import Abort, Add, Fatal, Output, Rejected, Step
from dspark_serve.actors.request_stream import StreamClient
from dspark_serve.engine.detokenize import TokenText, text_stream
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import chat, convert
from .config import GatewayConfig
from .gateway_request import Chat, GatewayRequest
from .live_sequence import LiveSequence, aborted_final, take
from .metrics import FINISH_NAMES, ServingMetrics
from .prompt_tokens import PromptTokenizer
from .recent_aborts import RecentAborts

PAIR_TIMEOUT_S = 10.0  # a control call the pair does not answer in this long means it is gone
INLINE_CHARS = 2048  # at light load, shorter texts are tokenized on the event loop (< ~0.5 ms), saving a thread hop
UNAVAILABLE = "the model pair is unavailable; the request did not complete"
REUSE_GRACE_S = 1.0  # how long a request waits for an earlier one with its id to end (a cancel not yet torn down)


class GatewayError(Exception):
    """A failure to report as a gRPC status; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)  # both in args, so the error survives pickling (Ray Serve ships it)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return self.message


@dataclass
class _Ended:
    """What generate() counts of a request whose stream ends early: its sequences, once the step loop has them."""

    request_id: str = ""
    num_seqs: int = 0
    num_prompt_tokens: int = 0
    done: set[int] = field(default_factory=set)  # sequences whose final message went out
    added: float = 0.0  # time.monotonic() just before its Adds went to the step loop


class GatewayCore:
    """Owns client requests: their tokenization, committed tokens and text; the step loop runs in the verifier."""

    def __init__(self, verifier: Any, model_info: dict, cfg: GatewayConfig) -> None:
        self.verifier, self.info, self.cfg = verifier, model_info, cfg
        self.live: dict[str, LiveSequence] = {}
        self.keys: dict[tuple[str, str], list[str]] = {}  # (caller, request_id) -> its sequences' keys in live
        self.draining = False
        self.token_text: TokenText | None = None
        self.prompt_tokens: PromptTokenizer | None = None  # encodes prompts, their long pieces cached
        self.conn: StreamClient | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dspark-tokenize")
        self._pump: asyncio.Task | None = None
        self.chat_template: Any = None  # models.chat_template.ChatTemplate: the verifier's, fetched once
        self.served_model_name = cfg.served_model_name or model_info["target"]
        self.metrics: ServingMetrics | None = None  # counts every finished sequence when set
        self.finished: Counter[str] = Counter()  # finished sequences by reason (ServerStats.finished_by_reason)
        self.recent_aborts = RecentAborts(cfg.abort_window_s, cfg.max_recent_aborts)

    async def start(self) -> None:
        await self.attach(self.verifier)
        # What is alive now (the tokenizer's tables, Ray's and grpc's state) leaves the cyclic collector's view:
        # a full collection walking it would stall every stream at once.
        gc.collect()
        gc.freeze()

    async def attach(self, verifier: Any) -> None:
        """Connect to a (new) verifier's request stream; the tokenizer is fetched once."""
        loop = asyncio.get_running_loop()
        self.verifier = verifier
        if self.token_text is None:
            tokenizer_json = await asyncio.wait_for(verifier.tokenizer_json.remote(), PAIR_TIMEOUT_S)
            if tokenizer_json is not None:
                self.token_text = await loop.run_in_executor(self._pool, _token_text, tokenizer_json)
                self.prompt_tokens = PromptTokenizer(self.token_text.tokenizer)
            self.chat_template = await asyncio.wait_for(verifier.chat_template.remote(), PAIR_TIMEOUT_S)
        host, port, secret = await asyncio.wait_for(verifier.stream_address.remote(), PAIR_TIMEOUT_S)
        self.conn = await StreamClient.connect(host, port, secret)
        self._pump = loop.create_task(self._pump_frames(self.conn))

    async def detach(self) -> None:
        """The pair is gone: every open request fails with UNAVAILABLE now, new ones until attach()."""
        conn, self.conn = self.conn, None
        if self._pump is not None:
            self._pump.cancel()
        if conn is not None:
            conn.close()
        self._fail_all(UNAVAILABLE)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self.conn is not None:
            self.conn.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _pump_frames(self, conn: StreamClient) -> None:
        """Route every frame of the step loop to its requests; a lost stream fails them all at once."""
        try:
            while True:
                frame = await conn.recv()
                if isinstance(frame, Step):
                    for out in frame.outputs:
                        self._deliver(out.request_id, out)
                elif isinstance(frame, Rejected):
                    self._deliver(frame.request_id, GatewayError("INVALID_ARGUMENT", frame.message))
                elif isinstance(frame, Fatal):
                    self._fail_all("the model pair failed; the request did not complete")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if conn is self.conn:
                self.conn = None
                conn.close()
            self._fail_all(UNAVAILABLE)

    def _deliver(self, rid: str, item: Any) -> None:
        live = self.live.get(rid)
        if live is not None:
            live.pending.append(item)
            live.wake.set()
            if _ends(item):
                live.urgent.set()

    def _fail_all(self, message: str) -> None:
        for rid in list(self.live):
            self._deliver(rid, GatewayError("UNAVAILABLE", message))

    def _validate(self, req: GatewayRequest) -> tuple[Any, dict, int | None, float | None]:
        convert.check_limits(req, self.cfg)
        info = self.info
        prompt = (chat.render(self.chat_template, req.prompt) if isinstance(req.prompt, Chat)
                  else convert.prompt(req.prompt, info["vocab_size"], info["max_model_len"]))
        if isinstance(prompt, str):
            if self.token_text is None:
                raise ValueError("text input needs a tokenizer next to the target; send token_ids")
            limit = self.cfg.max_prompt_chars or 32 * info["max_model_len"]
            if len(prompt) > limit:
                raise ValueError(f"text is {len(prompt)} characters; the limit is {limit}")
        params = convert.sampling_params(req.sampling, info["max_model_len"], self.cfg.max_n, info["vocab_size"])
        if isinstance(req.prompt, Chat):
            forced = chat.tool_choice_grammar(req.prompt, self.cfg.enable_auto_tool_choice)
            if forced is not None and params.get("structured_outputs") is not None:
                raise ValueError("sampling.structured_outputs and a forced chat.tool_choice both constrain the "
                                 "output; send one")
            params["structured_outputs"] = forced or params.get("structured_outputs")
        if params["stop"] and self.token_text is None:
            raise ValueError("sampling.stop needs a tokenizer next to the target; use stop_token_ids")
        n, threshold = convert.speculative(req.speculative, info["num_speculative_tokens"])
        return prompt, params, n, threshold

    async def _tokenize(self, prompt: str | list[int]) -> list[int]:
        """Text -> ids in worker threads (the tokenizer releases the GIL): a long text stalls no stream, and a
        burst of arrivals is tokenized in parallel."""
        if not isinstance(prompt, str):
            return prompt
        if len(prompt) <= INLINE_CHARS and len(self.live) <= 2:
            ids = _encode(self.prompt_tokens, prompt)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, _encode, self.prompt_tokens, prompt)
        convert.check_prompt_length(len(ids), self.info["max_model_len"])
        return ids

    async def generate(self, req: GatewayRequest, deadline_s: float | None,
                       caller: str) -> AsyncIterator[pb.GenerateResponse]:
        """_generate's messages. Every sequence the step loop was given ends counted by reason, in `finished` and
        `metrics` (with its time to first token and end to end as the gateway saw them): its final message's, else
        "abort" (the client cancelled or left, or its deadline passed) or "error" (the pair failed). Each Complete's
        stats carry the gateway's own times: to the Add (gateway_intake_ms) and to the first chunk."""
        start, first, outputs, ended, reason = time.monotonic(), {}, {}, _Ended(), "abort"
        try:
            async with aclosing(self._generate(req, deadline_s, caller, ended)) as stream:
                async for response in stream:
                    i = response.index
                    if response.HasField("chunk"):
                        first.setdefault(i, time.monotonic() - start)
                        outputs.setdefault(i, []).extend(response.chunk.token_ids)
                    else:
                        ended.done.add(i)
                        stats = response.complete.stats
                        stats.gateway_intake_ms = 1e3 * (ended.added - start)
                        stats.gateway_first_token_ms = 1e3 * first.get(i, 0.0)
                        self._count(response.request_id, i, response.complete, first.get(i), time.monotonic() - start)
                    yield response
        except GatewayError as e:
            reason = "abort" if e.code in ("DEADLINE_EXCEEDED", "CANCELLED") else "error"
            raise
        except Exception:
            reason = "error"
            raise
        finally:
            for i in sorted(set(range(ended.num_seqs)) - ended.done):
                final = pb.GenerateComplete(output_ids=outputs.get(i, []), finish_reason=pb.FINISH_REASON_ABORTED,
                                            num_prompt_tokens=ended.num_prompt_tokens)
                self._count(ended.request_id, i, final, first.get(i), time.monotonic() - start, reason)

    def _count(self, rid: str, index: int, final: pb.GenerateComplete, ttft_s: float | None, e2e_s: float,
               reason: str | None = None) -> None:
        reason = reason or FINISH_NAMES.get(final.finish_reason, "unknown")
        self.finished[reason] += 1
        if self.metrics is not None:
            self.metrics.finished(rid, index, final, ttft_s, e2e_s, reason)

    async def _generate(self, req: GatewayRequest, deadline_s: float | None, caller: str,
                        ended: _Ended) -> AsyncIterator[pb.GenerateResponse]:
        """`caller` (auth.Access) scopes request ids: callers may pick the same id. The step loop knows each
        request by a fresh random key, so an id reused right after a cancel never meets its predecessor there. A
        request whose id the caller aborted before it came (or while its prompt was tokenized) ends at once with
        aborted finals, unseen by the step loop; `ended` learns the sequences the step loop was given."""
        if self.draining:
            raise GatewayError("UNAVAILABLE", "server is draining; retry on another replica")
        try:
            prompt, params, n, threshold = self._validate(req)
        except ValueError as e:
            raise GatewayError("INVALID_ARGUMENT", str(e)) from None
        num_seqs, score_only = params.pop("n", 1), params.pop("score_only")
        if len(self.live) + num_seqs > self.cfg.max_queue:
            raise GatewayError("RESOURCE_EXHAUSTED", f"queue full ({self.cfg.max_queue} requests); retry later")
        rid = req.request_id or secrets.token_hex(16)
        if (caller, rid) in self.keys and not await self._freed(caller, rid):
            raise GatewayError("ALREADY_EXISTS", f"request_id {rid!r} is already running")
        ended.request_id = rid
        if req.request_id and self.recent_aborts.take(caller, rid):
            for i in range(num_seqs):
                yield aborted_final(rid, i, 0)
            return
        if self.conn is None or self.conn.writer.is_closing():
            raise GatewayError("UNAVAILABLE", UNAVAILABLE)
        loop = asyncio.get_running_loop()
        end = None if deadline_s is None else loop.time() + deadline_s
        keys = self.keys[caller, rid] = [secrets.token_hex(16) for _ in range(num_seqs)]
        stop, wake, urgent = params.pop("stop"), asyncio.Event(), asyncio.Event()  # shared by its n sequences
        lives = [self._open(key, stop, params, wake, urgent, score_only) for key in keys]
        done = [False] * num_seqs
        try:
            try:
                ids = await asyncio.wait_for(self._tokenize(prompt), None if end is None else end - loop.time())
            except ValueError as e:
                raise GatewayError("INVALID_ARGUMENT", str(e)) from None
            except asyncio.TimeoutError:
                raise GatewayError("DEADLINE_EXCEEDED", "deadline exceeded while tokenizing the prompt") from None
            for live in lives:
                live.num_prompt_tokens = len(ids)
            self._fill_context(req, params, len(ids))
            if self.conn is None:
                raise GatewayError("UNAVAILABLE", UNAVAILABLE)
            if any(live.aborted for live in lives):
                for i in range(num_seqs):
                    done[i] = True
                    yield aborted_final(rid, i, len(ids))
                return
            ended.added = time.monotonic()  # before the Adds leave: the step loop's clock starts after it
            for i, (key, live) in enumerate(zip(keys, lives)):
                self.conn.send(Add(key, ids, convert.sequence_params(params, i), n, threshold))
                live.sent = True
            ended.num_seqs, ended.num_prompt_tokens = num_seqs, len(ids)
            sent = None  # when the last chunk went out
            while not all(done):
                try:
                    await asyncio.wait_for(wake.wait(), None if end is None else max(0.0, end - loop.time()))
                    if sent is not None:
                        await self._pace(lives, urgent, sent)
                except asyncio.TimeoutError:
                    raise GatewayError("DEADLINE_EXCEEDED", "deadline exceeded; the request was aborted") from None
                wake.clear()
                for i, (key, live) in enumerate(zip(keys, lives)):
                    items, live.pending = live.pending, []
                    if done[i] or not items:
                        continue
                    try:
                        response, final, stopped = take(key, live, items)
                    except GatewayError as e:  # the step loop names the request by its key; the client knows its id
                        raise GatewayError(e.code, e.message.replace(key, rid)) from None
                    if stopped and self.conn is not None:  # a stop string: the step loop ends it (stats come then)
                        self.conn.send(Abort([key]))
                    if final is not None:
                        done[i] = True
                        self.live.pop(key, None)
                    for msg in (response, final):
                        if msg is not None:
                            msg.request_id, msg.index = rid, i
                            sent = loop.time()
                            yield msg
        finally:
            for key in keys:
                self.live.pop(key, None)
            self.keys.pop((caller, rid), None)
            left = [key for key, d, live in zip(keys, done, lives) if not d and live.sent]
            if left and self.conn is not None:  # client gone, deadline, or error: free their blocks
                self.conn.send(Abort(left))

    async def _freed(self, caller: str, rid: str) -> bool:
        """Whether the running request with this id ends within REUSE_GRACE_S: a client that cancels a stream and
        sends its id again at once can reach this before the cancelled stream's teardown has run."""
        end = time.monotonic() + REUSE_GRACE_S
        while (caller, rid) in self.keys and time.monotonic() < end:
            await asyncio.sleep(0.005)
        return (caller, rid) not in self.keys

    def _open(self, key: str, stop: tuple[str, ...], params: dict, wake: asyncio.Event, urgent: asyncio.Event,
              score_only: bool) -> LiveSequence:
        """One sequence's entry in live, with its text options."""
        text = text_stream(self.token_text, stop, params.get("include_stop_str_in_output", False),
                           params.get("min_tokens", 0), params.get("skip_special_tokens", True))
        live = self.live[key] = LiveSequence(text, 0, wake=wake, urgent=urgent, score_only=score_only)
        return live

    async def _pace(self, lives: list[LiveSequence], urgent: asyncio.Event, sent: float) -> None:
        """Hold a stream's next chunk until its share of the message rate allows it, or until its final (or an
        error) comes: a final is never held. With many streams each message carries several steps, and the
        gateway's time per step stays bounded; the outputs that come meanwhile do not wake the stream."""
        loop = asyncio.get_running_loop()
        urgent.clear()
        until = sent + len(self.live) / self.cfg.stream_messages_per_s
        if until - loop.time() <= 1e-4 or any(_ends(x) for live in lives for x in live.pending):
            return
        timer = loop.call_at(until, urgent.set)
        try:
            await urgent.wait()
        finally:
            timer.cancel()

    async def abort(self, ids: list[str], caller: str) -> list[str]:
        """Only the caller's own requests; -> the ids that were running."""
        if len(ids) > self.cfg.max_abort_ids:
            raise GatewayError("INVALID_ARGUMENT", f"request_ids has {len(ids)} ids; the limit is "
                                                   f"{self.cfg.max_abort_ids}")
        self._check_pair()
        known, sent = [], []
        for rid in dict.fromkeys(ids):
            if (caller, rid) not in self.keys:  # not come yet (an Abort can overtake its Generate), or over
                self.recent_aborts.remember(caller, rid)
                continue
            known.append(rid)
            for live in filter(None, map(self.live.get, self.keys[caller, rid])):
                live.aborted = True
            sent += [key for key in self.keys[caller, rid] if key in self.live and self.live[key].sent]
        if sent:
            self.conn.send(Abort(sent))
        return known

    def _check_pair(self) -> None:
        """The request stream ends only when the pair is gone (the pump returns then)."""
        if self.conn is None or self._pump is None or self._pump.done() or self.conn.writer.is_closing():
            raise GatewayError("UNAVAILABLE", UNAVAILABLE)

    async def server_stats(self) -> pb.ServerStats:
        self._check_pair()
        try:
            s = await asyncio.wait_for(self.verifier.stats.remote(), PAIR_TIMEOUT_S)
        except Exception:  # a dead or stalled actor: its error names actors and addresses, so say only that
            raise GatewayError("UNAVAILABLE", UNAVAILABLE) from None
        s["draining"] = s["draining"] or self.draining
        return pb.ServerStats(**s, finished_by_reason=self.finished)

    def model_info(self) -> pb.ModelInfo:
        self._check_pair()
        return pb.ModelInfo(**self.info, served_model_name=self.served_model_name,
                            has_chat_template=self.chat_template is not None)

    def _fill_context(self, req: GatewayRequest, params: dict, num_prompt_tokens: int) -> None:
        """Chat input without max_tokens may fill the context, as OpenAI's chat API does."""
        if isinstance(req.prompt, Chat) and req.sampling.max_tokens is None:
            params["max_tokens"] = self.info["max_model_len"] - num_prompt_tokens

    async def drain(self, timeout_s: float, pair_gone: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Stop admitting, let running requests finish (up to timeout_s), then end the rest: each gets a final
        message with finish_reason ABORTED before the server stops. When `pair_gone()` turns true (the pair is being
        stopped under the server) nothing more is waited for."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end, gone = loop.time() + timeout_s, False
        while self.live and loop.time() < end and not gone:
            await asyncio.sleep(0.05)
            gone = pair_gone is not None and await pair_gone()
        if self.live and self.conn is not None:
            self.conn.send(Abort(list(self.live)))
            end = loop.time() + (1.0 if gone else PAIR_TIMEOUT_S)
            while self.live and loop.time() < end:
                await asyncio.sleep(0.02)
        for key in list(self.live):  # the pair did not end them: they end here
            self._deliver(key, Output(key, [], "abort", convert.NO_STATS))


def _ends(item: Any) -> bool:
    """A step loop's record that ends its sequence: its final output, or an error."""
    return not isinstance(item, Output) or item.finish_reason is not None


def _token_text(tokenizer_json: str) -> TokenText:
    from tokenizers import Tokenizer

    return TokenText(Tokenizer.from_str(tokenizer_json))


def _encode(tokens: PromptTokenizer, prompt: str) -> list[int]:
    # A rendered chat holds its special tokens already.
    return tokens.encode(prompt, add_special_tokens=not isinstance(prompt, chat.ChatText))
