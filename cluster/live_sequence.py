"""One open sequence at the gateway: the step loop's records its stream has not taken yet, its text, and how those
records become a chunk and a final message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dspark_serve.actors.frames import Output
from dspark_serve.engine.detokenize import TextStream
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import convert


@dataclass
class LiveSequence:
    text: TextStream
    num_prompt_tokens: int
    pending: list = field(default_factory=list)  # Outputs (or an exception to raise) not taken yet
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    urgent: asyncio.Event = field(default_factory=asyncio.Event)  # set by a final or an error only
    stop_sent: bool = False
    score_only: bool = False  # max_tokens 0: the prompt's logprobs only; the engine's one token is dropped
    sent: bool = False  # its add went to the step loop
    aborted: bool = False  # an Abort came before its add went out


def take(key: str, live: LiveSequence, items: list[Output | Exception]) -> tuple[pb.GenerateResponse | None, pb.GenerateResponse | None,
                                                               bool]:
    """Every record that arrived since the stream last looked, as one chunk (a slow client gets fewer, larger
    chunks), the final message if the sequence ended, and whether a stop string just ended its text (the step loop
    must then be told to end it). An exception among the records is raised."""
    ids, text, logprobs, prompt_logprobs, final, stopped = [], [], [], None, None, False
    for item in items:
        if isinstance(item, Exception):
            raise item
        new, reason, stats = item.new_token_ids, item.finish_reason, item.stats
        if item.prompt_logprobs is not None:
            prompt_logprobs = item.prompt_logprobs
        if live.score_only:
            new = []
        if not live.text.stopped:
            kept, delta = live.text.push(new)
            ids += kept
            text.append(delta)
            if item.logprobs:  # the request asked for logprobs: one per token
                logprobs += item.logprobs[:len(kept)]
            if live.text.stopped and reason is None and not live.stop_sent:
                live.stop_sent = stopped = True
        if reason is not None:
            if not live.text.stopped:
                text.append(live.text.finish())
            reason = "length" if live.score_only else "stop" if live.text.stopped else reason
            final = convert.complete(key, live.text, reason, live.num_prompt_tokens, stats)
            break
    delta = "".join(text)
    chunk = convert.chunk(key, ids, delta, len(live.text.token_ids), logprobs, prompt_logprobs) \
        if ids or delta or prompt_logprobs else None
    return chunk, final, stopped


def aborted_final(rid: str, index: int, num_prompt_tokens: int) -> pb.GenerateResponse:
    """The final message of a sequence aborted before the step loop had it."""
    return pb.GenerateResponse(request_id=rid, index=index, complete=pb.GenerateComplete(
        finish_reason=pb.FINISH_REASON_ABORTED, num_prompt_tokens=num_prompt_tokens, stats=pb.SpecStats()))
