"""Configs of a deployment: the draft+verifier pair (its engine config and where its actors run) and the gateway
(frozen dataclasses)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported here: the gateway's modules import this one
    from dspark_serve.engine.engine_config import EngineConfig

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class PairConfig:
    engine: EngineConfig  # what both actors build their engine side from
    placement: str = "PACK"  # PACK: one node if possible; SPREAD: draft and verifier on different nodes
    colocate: bool | None = None  # the draft inside the verifier actor (no step channel, drafting ahead); None:
    # when the two would share one device (one GPU, or one node's CPUs), see pair.resolve_colocate
    channel_host: str | None = None  # address the verifier's step channel binds; None: its node IP
    channel_timeout_s: float = 120.0  # one step-channel operation that takes longer means the peer is gone
    keepalive_s: float = 20.0  # an idle split pair pings its channel this often, so idleness never times out
    num_cpus: float = 1.0  # per actor
    cpu_threads: int = 0  # torch threads of each CPU actor; 0: every CPU of its node (actors take turns in a step)
    target_resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources steering the verifier
    draft_resources: tuple[tuple[str, float], ...] = ()

    def validate(self) -> None:
        self.engine.validate()
        if self.engine.target is None:
            raise ValueError("a pair needs the target checkpoint directory")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: all of the node's CPUs), got {self.cpu_threads}")
        if not 0 < self.keepalive_s < self.channel_timeout_s:
            raise ValueError(f"keepalive_s must be in (0, channel_timeout_s = {self.channel_timeout_s}), "
                             f"got {self.keepalive_s}")

    @classmethod
    def from_options(cls, engine: EngineConfig, options: Mapping[str, Any]) -> PairConfig:
        """The deployment's fields by name (the CLI's and the Serve app's), None for a field: its default;
        resources as a mapping or pairs. An unknown name is refused."""
        known = {f.name for f in fields(cls)} - {"engine"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown pair options {unknown}; known: {sorted(known)}")
        raw = {k: v for k, v in options.items() if v is not None}
        for name in ("target_resources", "draft_resources"):
            if name in raw:
                raw[name] = resources(raw[name])
        cfg = cls(engine, **raw)
        cfg.validate()
        return cfg


def resources(value: Mapping[str, float] | tuple | list) -> tuple[tuple[str, float], ...]:
    """Custom Ray resources as sorted (name, amount) pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), float(v)) for k, v in items))


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_queue: int = 256  # queued + running requests before RESOURCE_EXHAUSTED
    max_request_bytes: int = 4 << 20  # larger Generate requests get INVALID_ARGUMENT
    max_control_request_bytes: int = 64 << 10  # the same for Abort, GetModelInfo and GetServerStats
    max_stop_strings: int = 64  # per request
    max_stop_string_chars: int = 1024  # each
    max_stop_token_ids: int = 256  # per request
    max_abort_ids: int = 1024  # per Abort call
    max_n: int = 16  # sequences per request (sampling.n)
    max_prompt_chars: int | None = None  # a longer text prompt is refused before tokenizing; None: 32 x max_model_len
    stream_messages_per_s: float = 6000.0  # chunk messages the gateway aims to send per second over all streams:
    # with many streams each gets one every live / this seconds at most, carrying every step since its last
    drain_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # any: each dspark.v1 call needs one as a bearer key
    ssl_certfile: str | None = None  # with ssl_keyfile: TLS
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # mutual TLS: clients present a certificate signed by one of these
    health_port: int | None = None  # also serve grpc.health.v1 alone here, in plaintext (kubelet probes speak no TLS)
    http_port: int | None = None  # also serve the OpenAI-compatible HTTP API and /metrics here (0: any free port)
    served_model_name: str | None = None  # the `model` HTTP clients name; None: the target path as given

    def validate(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both ssl_certfile and ssl_keyfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (mutual TLS) needs ssl_certfile and ssl_keyfile")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("an API key must be non-empty, without surrounding whitespace")
        for name in ("max_request_bytes", "max_control_request_bytes", "max_stop_strings", "max_stop_string_chars",
                     "max_stop_token_ids", "max_abort_ids", "max_queue", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
