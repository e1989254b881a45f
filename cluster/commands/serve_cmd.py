"""`dspark-serve serve`: its flags (vLLM's names where vLLM has the flag) and the configs they become."""

from __future__ import annotations

import argparse

API_KEY_ENV = "DSPARK_API_KEY"


def _resources(text: str | None, flag: str) -> dict[str, float] | None:
    import json

    if not text:
        return None
    try:
        value = json.loads(text)
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, AttributeError):
        raise SystemExit(f"dspark-serve serve: error: {flag} must be a JSON object of numbers, got {text!r}") from None


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, else the environment's DSPARK_API_KEY (which keeps the key out of the process list)."""
    import os

    if args.api_key:
        return tuple(args.api_key)
    key = os.environ.get(API_KEY_ENV, "")
    return (key,) if key else ()


def _serve(args: argparse.Namespace) -> int:
    import os

    from dspark_serve.engine.engine_config import EngineConfig, split_options

    from ..config import GatewayConfig, PairConfig
    from ..standalone import run

    target = _serve_target(args)
    deployment = dict(placement=args.placement, channel_host=args.channel_host, colocate=args.colocate,
                      cpu_threads=args.cpu_threads, channel_timeout_s=args.channel_timeout,
                      keepalive_s=args.keepalive, step_trace=args.step_trace,
                      target_resources=_resources(args.target_resources, "--target-resources"),
                      draft_resources=_resources(args.draft_resources, "--draft-resources"))
    gateway = GatewayConfig(host=args.host, port=args.port, max_queue=args.max_queue,
                            drain_timeout_s=args.drain_timeout, max_prompt_chars=args.max_prompt_chars,
                            stream_messages_per_s=args.stream_messages_per_s, max_request_bytes=args.max_request_bytes,
                            max_control_request_bytes=args.max_control_request_bytes,
                            max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                            max_stop_token_ids=args.max_stop_token_ids, max_abort_ids=args.max_abort_ids,
                            api_keys=_api_keys(args), ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                            ssl_ca_certs=args.ssl_ca_certs, health_port=args.health_port,
                            http_port=args.http_port, served_model_name=args.served_model_name,
                            abort_window_s=args.abort_window,
                            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                            h11_max_header_count=args.h11_max_header_count, timeout_keep_alive_s=args.timeout_keep_alive,
                            timeout_header_read_s=args.timeout_header_read, timeout_body_read_s=args.timeout_body_read,
                            limit_concurrency=args.limit_concurrency,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser,
                            api_server_count=args.api_server_count)
    try:
        engine = EngineConfig.from_options({**split_options(vars(args))[0], "target": target})
        pair = PairConfig.from_options(engine, deployment)
        _check_context_limit(target, engine.max_model_len, 1 << 62 if engine.gpu_memory_utilization else
                             engine.kv_blocks * engine.block_size)
        gateway.validate()
        for path in (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, engine.chat_template):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"no such file: {path}")
    except ValueError as e:
        raise SystemExit(f"dspark-serve serve: error: {e}") from None
    return run(pair, gateway, args.address, args.num_cpus)


def _serve_target(args: argparse.Namespace) -> str:
    """The target from the positional MODEL or --target (the draft: --draft or speculative_config's "model")."""
    if args.model and args.target and args.model != args.target:
        raise SystemExit(f"dspark-serve serve: error: two targets given: {args.model} and --target {args.target}")
    target = args.model or args.target
    if not target:
        raise SystemExit("dspark-serve serve: error: give the target: dspark-serve serve MODEL (or --target DIR)")
    return target


def _check_context_limit(target: str, max_model_len: int | None, kv_tokens: int) -> None:
    """Refuse a --max-model-len past the target's max_position_embeddings or the KV cache before anything starts
    (the engine also keeps room for one step's drafts)."""
    import json
    from pathlib import Path

    config = Path(target) / "config.json"
    if max_model_len is None or not config.is_file():
        return
    limit = int(json.loads(config.read_text()).get("max_position_embeddings", 32768))
    if not 1 < max_model_len <= min(limit, kv_tokens):
        raise ValueError(f"--max-model-len must be in [2, {min(limit, kv_tokens)}] (the target's "
                         f"max_position_embeddings is {limit}; the KV cache holds {kv_tokens} tokens: "
                         f"--num-kv-blocks x --block-size), got {max_model_len}")


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})".strip()


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from dspark_serve.engine.engine_config import add_engine_args

    s = sub.add_parser("serve", help="start the draft+verifier pair on Ray and the gRPC gateway",
                       formatter_class=DefaultsFormatter)
    s.add_argument("model", nargs="?", help="the target checkpoint directory (as `vllm serve MODEL`; or --target)")
    s.add_argument("--target", help="the target checkpoint directory")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    s.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    s.add_argument("--address", help="join this Ray cluster (default: start Ray embedded)")
    s.add_argument("--num-cpus", type=int, help="CPUs of the embedded Ray")
    s.add_argument("--cpu-threads", type=int, default=0,
                   help="torch threads of each CPU actor (default 0: every CPU of its node; Ray alone would give 1)")
    s.add_argument("--placement", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="Ray placement strategy of the pair: PACK keeps it on one node when possible")
    s.add_argument("--channel-host", help="address the step channel binds (default: the verifier's node IP)")
    s.add_argument("--colocate", action=argparse.BooleanOptionalAction,
                   help="the draft inside the verifier actor, on its device (no step channel), or (--no-colocate) in "
                        "its own actor; default: co-located when both would share one device (one GPU, or CPUs "
                        "without SPREAD placement or custom resources), separate actors on two GPUs")
    s.add_argument("--channel-timeout", type=float, default=120.0,
                   help="seconds one step-channel operation may take before the draft counts as gone (default 120)")
    s.add_argument("--keepalive", type=float, default=20.0,
                   help="seconds between pings of an idle step channel, below --channel-timeout (default 20)")
    s.add_argument("--step-trace", metavar="FILE",
                   help="append a JSON line per engine step to FILE on the verifier's node (its time, ms in the "
                        "step, taking adds and writing outputs, the adds taken, prompt chunks, first tokens, decode "
                        "rows, drafts verified): for benchmarks, it grows with every step")
    s.add_argument("--target-resources", help='custom Ray resources for the verifier, JSON, e.g. {"target_gpu": 1}')
    s.add_argument("--draft-resources", help='custom Ray resources for the draft, JSON, e.g. {"draft_gpu": 1}')
    s.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="gateway processes (gRPC and HTTP) sharing the ports, each with its own event loop and "
                        "connection to the step loop: the kernel spreads client connections over them, so many "
                        "arriving streams are taken in in parallel (vLLM's flag; default 1)")
    s.add_argument("--max-queue", type=int, default=256,
                   help="queued + running requests before RESOURCE_EXHAUSTED (per gateway process)")
    s.add_argument("--stream-messages-per-s", type=float, default=6000.0,
                   help="chunk messages per second the gateway aims for over all streams: with many streams each "
                        "message carries several steps (default 6000)")
    s.add_argument("--max-prompt-chars", type=int,
                   help="longer text prompts are refused before tokenizing (default: 32 x --max-model-len)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM lets running requests finish before ending them")
    s.add_argument("--api-key", nargs="+", help=f"require one of these keys on every dspark.v1 call ('authorization: "
                                                 f"Bearer KEY'; default: ${API_KEY_ENV}); health and reflection stay "
                                                 "open")
    s.add_argument("--ssl-certfile", help="PEM certificate chain: serve over TLS (with --ssl-keyfile)")
    s.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    s.add_argument("--ssl-ca-certs", help="PEM CA certificates: mutual TLS, clients must present a certificate "
                                          "signed by one of them")
    s.add_argument("--http-port", type=int,
                   help="also serve the OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
                        "/v1/chat/completions, /health, /metrics) on this port, with the same keys; 0 picks a free one")
    s.add_argument("--served-model-name", help="the model name HTTP clients send (default: the target as given)")
    s.add_argument("--health-port", type=int, help="also serve grpc.health.v1 alone on this port, in plaintext (for "
                                                   "Kubernetes gRPC probes, which speak no TLS)")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest Generate request (default 4 MiB)")
    s.add_argument("--max-control-request-bytes", type=int, default=64 << 10,
                   help="largest Abort, GetModelInfo or GetServerStats request (default 64 KiB)")
    s.add_argument("--max-stop-strings", type=int, default=64, help="stop strings per request (default 64)")
    s.add_argument("--max-stop-string-chars", type=int, default=1024, help="characters per stop string (default 1024)")
    s.add_argument("--max-stop-token-ids", type=int, default=256, help="stop token ids per request (default 256)")
    s.add_argument("--max-abort-ids", type=int, default=1024, help="request ids per Abort call (default 1024)")
    s.add_argument("--abort-window", type=float, default=10.0,
                   help="seconds an Abort of a request id not yet running is remembered: the request ends as aborted "
                        "if it arrives within them (an Abort can overtake its Generate)")
    h = s.add_argument_group("HTTP connections (--http-port)")
    h.add_argument("--h11-max-incomplete-event-size", type=int, default=64 << 10,
                   help="bytes of a request's head (request line and headers); more gets 431 (default 64 KiB)")
    h.add_argument("--h11-max-header-count", type=int, default=256, help="headers per request; more gets 431")
    h.add_argument("--timeout-header-read", type=float, default=10.0,
                   help="seconds for a request's head to arrive, from the connection's opening (or the request's "
                        "first byte on a kept-alive connection); later gets 408 and the connection closed")
    h.add_argument("--timeout-body-read", type=float, default=30.0,
                   help="seconds for a request's body to arrive after its head; later gets 408 and the connection "
                        "closed")
    h.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    h.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open HTTP connections; one more gets 503 and is closed")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model may call tools (vLLM\'s flag; needs '
                        "--tool-call-parser)")
    s.add_argument("--tool-call-parser", choices=["hermes"],
                   help="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call>, Qwen2.5 and "
                        "Qwen3)")
    s.set_defaults(func=_serve)
