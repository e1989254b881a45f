"""The frames of the request stream between the gateway and the step loop (actors/request_stream.py), one
definition both ends import. Named tuples: they pickle as a class reference and a tuple, and the gateway imports
no torch to read them."""

from __future__ import annotations

from typing import NamedTuple


class Add(NamedTuple):
    """Gateway -> step loop: a new sequence, its prompt already tokenized and its parameters validated."""

    request_id: str
    prompt_ids: list[int]
    params: dict  # SamplingParams' fields
    num_speculative_tokens: int | None = None  # a pin; None: the server's policy
    confidence_threshold: float | None = None


class Abort(NamedTuple):
    """Gateway -> step loop: end these sequences at the next step (their finals come as outputs)."""

    request_ids: list[str]


class Output(NamedTuple):
    """One sequence's part of one step: its new tokens; the finish reason and stats once, at the end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None
    logprobs: list[tuple] | None = None  # per new token (id, logprob, [(id, logprob), ...]), when asked
    prompt_logprobs: list[tuple] | None = None  # once, per prompt token (id, logprob, [(id, logprob)], rank)


class Step(NamedTuple):
    """Step loop -> gateway: every sequence's output of one engine step."""

    outputs: list[Output]


class Rejected(NamedTuple):
    """Step loop -> gateway: an Add the engine refused (the gateway validates first), with the reason."""

    request_id: str
    message: str


class Fatal(NamedTuple):
    """Step loop -> gateway: the loop died; every open sequence has failed."""

    message: str


Inbound = Add | Abort
Outbound = Step | Rejected | Fatal
