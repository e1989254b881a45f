"""dspark.v1 messages back into OpenAI's answers and streamed chunks, as pure functions: choices (index = prompt x n +
sequence), echo, logprobs, vLLM's prompt_logprobs, usage and the speculative stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import openai_tools
from .metrics import FINISH_NAMES
from .openai_convert import Options

Piece = Callable[[int], tuple[str, list[int]]]  # token id -> (its text, its bytes)


@dataclass
class Prompt:
    """One prompt of the request, as the answer shows it."""

    text: str = ""  # echo: the prompt as text
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # per prompt token, when asked (sequence 0 brings)


@dataclass
class Sequence:
    """One choice, as it streams in."""

    prompt: Prompt
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    final: pb.GenerateComplete | None = None


def finish_reason(final: pb.GenerateComplete) -> str:
    return FINISH_NAMES.get(final.finish_reason, "stop")


def spec_stats(finals: list[pb.GenerateComplete]) -> dict:
    """The speculative stats of a request: one sequence's, or the sum over all."""
    steps = sum(f.stats.num_spec_steps for f in finals)
    drafted = sum(f.stats.num_draft_tokens for f in finals)
    accepted = sum(f.stats.num_accepted_tokens for f in finals)
    per_pos = [sum(p) for p in zip(*(f.stats.per_position_accepted for f in finals))] if finals else []
    out = {"tau": round((accepted + steps) / steps, 4) if steps else 0.0, "num_spec_steps": steps,
           "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
           "draft_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
           "per_position_accepted": per_pos}
    for name in ("draft_ms", "verify_ms", "transfer_ms", "queue_ms", "first_token_ms"):
        out[name] = round(sum(getattr(f.stats, name) for f in finals), 3)
    return out


def usage(finals: list[pb.GenerateComplete], n: int) -> dict:
    """finals in choice order; each prompt's tokens count once (its first of n choices)."""
    prompt = sum(f.num_prompt_tokens for i, f in enumerate(finals) if i % n == 0)
    cached = sum(f.stats.cached_tokens for i, f in enumerate(finals) if i % n == 0)
    completion = sum(len(f.output_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(entries: list[pb.TokenLogprob], piece: Piece) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(tid: int, lp: float) -> dict:
        text, raw = piece(tid)
        return {"token": text, "logprob": lp, "bytes": raw}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[pb.TokenLogprob], piece: Piece, offset: int = 0) -> dict:
    """tokens, token_logprobs, top_logprobs (the alternatives and the token itself) and text_offset lists; a prompt's
    first token has null for its logprob and alternatives."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text = piece(e.token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if e.HasField("logprob"):
            values.append(e.logprob)
            tops.append({**{piece(t.token_id)[0]: t.logprob for t in e.top}, text: e.logprob})
        else:
            values.append(None)
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list[pb.TokenLogprob], piece: Piece) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {"token id": {logprob, rank, decoded_token}} for
    the token and its top alternatives."""
    out: list[dict | None] = []
    for e in entries:
        if not e.HasField("logprob"):
            out.append(None)
            continue
        item = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": piece(e.token_id)[0]}}
        for rank, t in enumerate(e.top, 1):
            item.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                              "decoded_token": piece(t.token_id)[0]})
        out.append(item)
    return out


def response_json(rid: str, model: str, created: int, seqs: dict[int, Sequence], opts: Options,
                  piece: Piece) -> dict:
    """The whole answer of a request that was not streamed."""
    choices, finals = [], [seqs[i].final for i in sorted(seqs)]
    for i in sorted(seqs):
        s = seqs[i]
        choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish_reason(s.final)}
        if opts.chat:
            choice["message"], called = openai_tools.message(s.final.text, opts.tools)
            if called and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
            if opts.top_logprobs is not None and s.logprobs:
                choice["logprobs"] = chat_logprobs(s.logprobs, piece)
        else:
            choice["text"] = (s.prompt.text if opts.echo else "") + s.final.text
            entries = (list(s.prompt.logprobs) if opts.echo else []) + s.logprobs
            if opts.top_logprobs is not None and entries:
                choice["logprobs"] = completion_logprobs(entries, piece)
            if opts.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(s.prompt.logprobs, piece)
        choices.append(choice)
    out = {"id": response_id(rid, opts), "object": "chat.completion" if opts.chat else "text_completion",
           "created": created, "model": model, "choices": choices, "usage": usage(finals, opts.n),
           "dspark": spec_stats(finals)}
    if opts.chat and opts.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_json(seqs[min(seqs)].prompt.logprobs, piece)
    return out


def response_id(rid: str, opts: Options) -> str:
    return ("chatcmpl-" if opts.chat else "cmpl-") + rid


def chunk_json(rid: str, model: str, created: int, opts: Options, index: int, *, text: str | None = None,
               role: bool = False, logprobs: dict | None = None, final: pb.GenerateComplete | None = None,
               prompt_logprobs: list | None = None, tool_calls: list[dict] | None = None,
               called: bool = False) -> dict:
    """One streamed chunk of one choice: its first (chat: the role; with prompt_logprobs, vLLM's), a text delta
    and/or tool-call deltas, or its end (finish_reason, "tool_calls" when it `called` tools, and its speculative
    stats as `dspark`)."""
    choice: dict[str, Any] = {"index": index}
    if opts.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
    choice["logprobs"] = logprobs
    reason = None if final is None else finish_reason(final)
    choice["finish_reason"] = "tool_calls" if called and reason == "stop" else reason
    out = {"id": response_id(rid, opts), "object": "chat.completion.chunk" if opts.chat else "text_completion",
           "created": created, "model": model, "choices": [choice]}
    if opts.chat and prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    if final is not None:
        out["dspark"] = spec_stats([final])
    return out


def usage_chunk_json(rid: str, model: str, created: int, opts: Options, finals: list[pb.GenerateComplete]) -> dict:
    """stream_options.include_usage: the last chunk, no choices, the usage and the request's stats."""
    return {"id": response_id(rid, opts), "object": "chat.completion.chunk" if opts.chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(finals, opts.n),
            "dspark": spec_stats(finals)}
