"""The gateway's logic: admit, stream each verify step back, cancel, bound the queue, drain. No grpc, no torch."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import convert


PAIR_TIMEOUT_S = 10.0  # a control call the pair does not answer in this long means it is gone


class GatewayError(Exception):
    """A failure to report as a gRPC status; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)  # both in args, so the error survives pickling (Ray Serve ships it)
        self.code, self.message = code, message

    def __str__(self) -> str:
        return self.message


def _cause(e: BaseException) -> BaseException:
    """The user-level exception inside a Ray task error."""
    return getattr(e, "cause", None) or e


class GatewayCore:
    """Owns client requests and their committed tokens; the step loop itself runs in the verifier actor."""

    def __init__(self, verifier: Any, model_info: dict, max_queue: int, max_request_bytes: int) -> None:
        self.verifier, self.info = verifier, model_info
        self.max_queue, self.max_request_bytes = max_queue, max_request_bytes
        self.streams: dict[str, asyncio.Queue] = {}
        self.committed: dict[str, list[int]] = {}  # prompt + output ids of every live request
        self.draining = False
        self._ids = itertools.count()
        self._pump: asyncio.Task | None = None

    async def start(self) -> None:
        self._pump = asyncio.get_running_loop().create_task(self._pump_outputs())

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

    async def _pump_outputs(self) -> None:
        """One long-poll at a time collects every request's new steps; the loop never waits for it."""
        while True:
            try:
                outs = await asyncio.wait_for(self.verifier.wait_outputs.remote(0.05), PAIR_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the pair is gone or stuck: fail the live streams, keep polling
                for queue in self.streams.values():
                    queue.put_nowait(GatewayError("UNAVAILABLE", f"the model pair is unavailable: {_cause(e)}"))
                await asyncio.sleep(0.5)
                continue
            for out in outs:
                queue = self.streams.get(out["request_id"])
                if queue is not None:
                    queue.put_nowait(out)

    def _validate(self, req: pb.GenerateRequest) -> tuple[Any, dict, int | None, float | None]:
        if req.ByteSize() > self.max_request_bytes:
            raise ValueError(f"request is {req.ByteSize()} bytes; the limit is {self.max_request_bytes}")
        info = self.info
        prompt = convert.prompt(req, info["vocab_size"], info["max_model_len"])
        if isinstance(prompt, str) and not info["has_tokenizer"]:
            raise ValueError("text input needs a tokenizer next to the target; send token_ids")
        params = convert.sampling_params(req.sampling, info["max_model_len"])
        n, threshold = convert.speculative(req, info["num_speculative_tokens"])
        return prompt, params, n, threshold

    async def generate(self, req: pb.GenerateRequest, deadline_s: float | None) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            raise GatewayError("UNAVAILABLE", "server is draining; retry on another replica")
        try:
            prompt, params, n, threshold = self._validate(req)
        except ValueError as e:
            raise GatewayError("INVALID_ARGUMENT", str(e)) from None
        if len(self.streams) >= self.max_queue:
            raise GatewayError("RESOURCE_EXHAUSTED", f"queue full ({self.max_queue} requests); retry later")
        rid = req.request_id or f"gw-{next(self._ids)}"
        if rid in self.streams:
            raise GatewayError("ALREADY_EXISTS", f"request_id {rid!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        try:
            try:
                await self.verifier.add_request.remote(rid, prompt, params, n, threshold)
            except Exception as e:  # noqa: BLE001 - map the actor's error to a status
                cause = _cause(e)
                if isinstance(cause, ValueError):
                    raise GatewayError("INVALID_ARGUMENT", str(cause)) from None
                raise GatewayError("UNAVAILABLE", f"the model pair is unavailable: {cause}") from None
            text = ""
            loop = asyncio.get_running_loop()
            end = None if deadline_s is None else loop.time() + deadline_s
            while not finished:
                timeout = None if end is None else max(0.0, end - loop.time())
                try:
                    out = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise GatewayError("DEADLINE_EXCEEDED", "deadline exceeded; the request was aborted") from None
                if isinstance(out, GatewayError):
                    raise out
                self.committed[rid] = out["prompt_ids"] + out["token_ids"]
                finished = out["finished"]
                delta = out["text"][len(text):] if out["text"].startswith(text) else out["text"]
                text = out["text"]
                yield convert.chunk(out, delta)
                if finished:
                    yield convert.complete(out)
        finally:
            self.streams.pop(rid, None)
            self.committed.pop(rid, None)
            if not finished:  # client gone, deadline, or error: free the sequence's blocks
                self.verifier.abort.remote([rid])

    async def abort(self, ids: list[str]) -> list[str]:
        return await self.verifier.abort.remote(list(ids))

    async def server_stats(self) -> pb.ServerStats:
        s = await self.verifier.stats.remote()
        s["draining"] = s["draining"] or self.draining
        return pb.ServerStats(**s)

    def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(**self.info)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting, let running requests finish (up to timeout_s), then abort the rest."""
        self.draining = True
        try:
            await asyncio.wait_for(self.verifier.drain.remote(), PAIR_TIMEOUT_S)
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            while self.streams and loop.time() < end:
                await asyncio.sleep(0.05)
            if self.streams:
                await asyncio.wait_for(self.verifier.abort.remote(list(self.streams)), PAIR_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a pair that is already gone has nothing left to drain
            pass
