"""The gateway request checked and turned into the step loop's params, and the step loop's outputs as dspark.v1
messages. Pure."""

from __future__ import annotations

import ctypes

from dspark_serve.engine.detokenize import TextStream
from dspark_serve.engine.sampling_params import MAX_N, SamplingParams
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from .config import GatewayConfig
from .gateway_request import GatewayRequest, Sampling, Speculative

_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "ignore_eos", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "min_tokens", "logprobs", "include_stop_str_in_output",
           "skip_special_tokens", "n", "prompt_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORTED}
MAX_REQUEST_ID_CHARS = 256
NO_STATS = {"steps": 0, "drafted": 0, "accepted": 0, "tau": 0.0, "per_position_accepted": [], "accepted_per_step": [],
            "draft_ms": 0.0, "verify_ms": 0.0}  # the stats of a sequence the step loop did not end itself


def check_limits(req: GatewayRequest, cfg: GatewayConfig) -> None:
    """The bounds on what one request may make the gateway hold. Raises ValueError naming the field and the limit."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(req.request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    s = req.sampling
    if len(s.stop) > cfg.max_stop_strings:
        raise ValueError(f"sampling.stop has {len(s.stop)} strings; the limit is {cfg.max_stop_strings}")
    longest = max(map(len, s.stop), default=0)
    if longest > cfg.max_stop_string_chars:
        raise ValueError(f"sampling.stop has a string of {longest} characters; the limit is "
                         f"{cfg.max_stop_string_chars}")
    if len(s.stop_token_ids) > cfg.max_stop_token_ids:
        raise ValueError(f"sampling.stop_token_ids has {len(s.stop_token_ids)} ids; the limit is "
                         f"{cfg.max_stop_token_ids}")


def float32(x: float) -> float:
    """A sampling number at the precision the sampler (and dspark.v1's float fields) hold it, so a request means the
    same through either edge; past float32's range it is infinite."""
    return ctypes.c_float(x).value


def sampling_params(s: Sampling, max_tokens_limit: int, max_n: int = MAX_N, vocab_size: int | None = None) -> dict:
    """Only the fields the client set; the rest keep SamplingParams' defaults, plus "score_only": max_tokens 0 with
    prompt_logprobs (the engine then makes one token, which nobody sees). Raises ValueError naming a field."""
    kw: dict = {f: getattr(s, f) for f in _FIELDS if getattr(s, f) is not None}
    kw.update((f, float32(kw[f])) for f in _FLOATS if f in kw)
    kw["stop"] = tuple(s.stop)
    kw["stop_token_ids"] = tuple(s.stop_token_ids)
    kw["logit_bias"] = tuple(sorted((t, float32(b)) for t, b in s.logit_bias))
    if any(stop == "" for stop in kw["stop"]):
        raise ValueError("stop strings must be non-empty")
    if s.structured_outputs is not None:
        s.structured_outputs.validate("sampling.structured_outputs")
        kw["structured_outputs"] = s.structured_outputs
    score_only = kw.get("max_tokens") == 0
    if score_only:
        if kw.get("prompt_logprobs") is None:
            raise ValueError("max_tokens must be >= 1 (0 only with prompt_logprobs: the prompt is scored and nothing "
                             "is generated), got 0")
        kw["max_tokens"] = 1
    params = SamplingParams(**kw)
    params.validate(max_tokens_limit=max_tokens_limit, max_n=max_n)
    if vocab_size is not None:
        params.check_token_ids(vocab_size)
    return {**kw, "score_only": score_only}


def sequence_params(params: dict, index: int) -> dict:
    """The engine request of sequence `index` of n: a seeded request's sequence i has seed + i (wrapped to 64
    bits); an unseeded one gets a fresh seed per sequence from the engine. The prompt's logprobs come with sequence
    0 only."""
    if index == 0:
        return params
    params = {**params, "prompt_logprobs": None}
    if params.get("seed") is None:
        return params
    return {**params, "seed": (params["seed"] + index + (1 << 63)) % (1 << 64) - (1 << 63)}


def token_logprobs(logprobs: list[tuple]) -> list[pb.TokenLogprob]:
    """The engine's per-token (token_id, logprob, [(token_id, logprob), ...]) as messages."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top])
            for t, lp, top in logprobs]


def prompt_token_logprobs(entries: list[tuple]) -> list[pb.TokenLogprob]:
    """The engine's per prompt token (token_id, logprob or None, [(token_id, logprob), ...], rank or None)."""
    return [pb.TokenLogprob(token_id=t, logprob=lp, rank=rank,
                            top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in top]) for t, lp, top, rank in entries]


def prompt(given: str | tuple[int, ...] | None, vocab_size: int, max_model_len: int) -> str | list[int]:
    """A text or token-id prompt, checked."""
    if isinstance(given, str):
        if not given:
            raise ValueError("prompt is empty: text is an empty string")
        return given
    if not given:
        raise ValueError("prompt is empty: set text or token_ids")
    ids = list(given)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token_ids must be in [0, {vocab_size}), got {bad[:5]}")
    check_prompt_length(len(ids), max_model_len)
    return ids


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_tokens} tokens; the maximum is {max_model_len - 1} (max_model_len "
                         f"{max_model_len})")


def speculative(s: Speculative, max_spec: int) -> tuple[int | None, float | None]:
    """(num_speculative_tokens, confidence_threshold) overrides; disable means plain decoding."""
    if s.disable:
        return 0, None
    n = s.num_speculative_tokens
    if n is not None and not 1 <= n <= max_spec:
        raise ValueError(f"speculative.num_speculative_tokens must be in [1, {max_spec}], got {n}")
    t = None if s.confidence_threshold is None else float32(s.confidence_threshold)
    if t is not None and not 0.0 <= t <= 1.0:
        raise ValueError(f"speculative.confidence_threshold must be in [0, 1], got {t}")
    return n, t


def spec_stats(stats: dict) -> pb.SpecStats:
    drafted = stats["drafted"]
    return pb.SpecStats(
        num_spec_steps=stats["steps"], num_draft_tokens=drafted, num_accepted_tokens=stats["accepted"],
        mean_acceptance_length=stats["tau"], draft_acceptance_rate=stats["accepted"] / drafted if drafted else 0.0,
        per_position_accepted=stats["per_position_accepted"], accepted_per_step=stats["accepted_per_step"],
        draft_ms=stats["draft_ms"], verify_ms=stats["verify_ms"], transfer_ms=stats.get("transfer_ms", 0.0),
        queue_ms=stats.get("queue_ms", 0.0), first_token_ms=stats.get("first_token_ms", 0.0),
        finish_ms=stats.get("finish_ms", 0.0),
        cached_tokens=stats.get("cached_tokens", 0), verified_per_step=stats.get("verified_per_step", []))


def chunk(request_id: str, token_ids: list[int], text_delta: str, num_output_tokens: int,
          logprobs: list[tuple] | None = None, prompt_logprobs: list[tuple] | None = None) -> pb.GenerateResponse:
    """logprobs: one per token id, or None; prompt_logprobs: one per prompt token, or None."""
    return pb.GenerateResponse(request_id=request_id, chunk=pb.GenerateChunk(
        token_ids=token_ids, text=text_delta, num_output_tokens=num_output_tokens,
        logprobs=token_logprobs(logprobs) if logprobs else None,
        prompt_logprobs=prompt_token_logprobs(prompt_logprobs) if prompt_logprobs else None))


def complete(request_id: str, text: TextStream, finish_reason: str, num_prompt_tokens: int,
             stats: dict) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, complete=pb.GenerateComplete(
        output_ids=text.token_ids, text=text.text, finish_reason=FINISH[finish_reason],
        num_prompt_tokens=num_prompt_tokens, stats=spec_stats(stats)))
