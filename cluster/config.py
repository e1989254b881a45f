"""Configs of a deployment: the gateway's (GatewayConfig) and, from actors/pair_config.py, the draft + verifier
pair's (PairConfig) (frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_serve.actors.pair_config import PairConfig  # noqa: F401 (re-exported: the deployment's configs in one place)


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
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model may call tools (vLLM's flag)
    tool_call_parser: str | None = None  # how calls are read from the output: "hermes" (vLLM's flag)
    abort_window_s: float = 10.0  # an Abort of a request id not yet known ends that request if it comes this soon
    max_recent_aborts: int = 10000  # such ids remembered at most (the oldest are forgotten first)
    # The HTTP listener (uvicorn's and vLLM's names): a request head over this many bytes or headers gets 431
    h11_max_incomplete_event_size: int = 64 << 10
    h11_max_header_count: int = 256
    timeout_keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this long
    timeout_header_read_s: float = 10.0  # a request head not complete this long after its connection opened (or its
    # first byte, on a kept-alive connection) gets 408 and the connection is closed (slow clients hold nothing)
    timeout_body_read_s: float = 30.0  # the same for the body, from the end of the head
    limit_concurrency: int = 1024  # open HTTP connections; one more gets 503 and is closed
    api_server_count: int = 1  # gateway processes sharing the ports (vLLM's --api-server-count); each takes requests
    metrics_dir: str | None = None  # with several: where their Prometheus metrics meet (set by the service)

    def validate(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS needs both ssl_certfile and ssl_keyfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (mutual TLS) needs ssl_certfile and ssl_keyfile")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("an API key must be non-empty, without surrounding whitespace")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        if self.tool_call_parser not in (None, "hermes"):
            raise ValueError(f"tool_call_parser must be hermes, got {self.tool_call_parser!r}")
        for name in ("max_request_bytes", "max_control_request_bytes", "max_stop_strings", "max_stop_string_chars",
                     "max_stop_token_ids", "max_abort_ids", "max_queue", "max_n", "max_recent_aborts",
                     "h11_max_incomplete_event_size", "h11_max_header_count", "limit_concurrency",
                     "api_server_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("abort_window_s", "timeout_keep_alive_s", "timeout_header_read_s", "timeout_body_read_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
