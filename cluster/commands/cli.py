"""The `dspark-serve` command: one subcommand per job; heavy imports happen inside each subcommand."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _demo(args: argparse.Namespace) -> int:
    if not args.tiny:
        from .demo import run_demo

        return run_demo(args)
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.random_init import random_pair

    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = random_pair(tmp, seed=args.seed, agree=0.005, block_size=6)
        print("tiny constructed pair (random weights; the draft's Markov head is the target's bigram part), "
              "written as HF + DeepSpec checkpoints and loaded back")
        plain, spec = LLM(tdir, None, device="cpu"), LLM(tdir, ddir, device="cpu")
        prompts = [[1, 2, 3, 4], [10, 20, 30], [7] * 9]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens or 48, ignore_eos=True)
        timings = []
        for llm in (plain, spec):
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            timings.append((time.perf_counter() - t0, outs))
        (t_plain, plain_outs), (t_spec, spec_outs) = timings
        for prompt, a, b in zip(prompts, plain_outs, spec_outs):
            print(f"prompt {prompt} -> {b.token_ids}  tau {b.stats['tau']:.2f}, "
                  f"identical to plain greedy: {a.token_ids == b.token_ids}")
        tokens = sum(len(o.token_ids) for o in spec_outs)
        print(f"plain {tokens / t_plain:.1f} tok/s, speculative {tokens / t_spec:.1f} tok/s, "
              f"speedup {t_plain / t_spec:.2f}x (CPU, batch {len(prompts)})")
    return 0


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
                      keepalive_s=args.keepalive,
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
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser)
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


def _generate(args: argparse.Namespace) -> int:
    import json

    if args.server:
        return _generate_remote(args)
    if not args.target:
        raise SystemExit("dspark-serve generate: error: give --target DIR (in-process) or --server HOST:PORT")

    from dspark_serve.engine.engine_config import EngineConfig, split_options
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.config import CheckpointError

    try:
        prompt = _prompt(args)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        params.validate()
        llm = LLM.from_config(EngineConfig.from_options(split_options(vars(args))[0]))
        if args.chat:
            prompt = _chat_ids(llm.config, llm.tokenizer, prompt)
        out = llm.generate([prompt], params)[0]
    except (ValueError, CheckpointError) as e:
        raise SystemExit(f"dspark-serve generate: error: {e}") from None
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                          "stats": out.stats}))
    else:
        print(out.text if out.text else out.token_ids)
        s = out.stats
        print(f"[{out.finish_reason}] {len(out.token_ids)} tokens, {s['steps']} steps, tau {s['tau']:.2f}, "
              f"accepted {s['accepted']}/{s['drafted']}", file=sys.stderr)
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    import json

    import grpc

    from ..grpc_client import DSparkClient

    try:
        prompt = _prompt(args)
    except ValueError as e:
        raise SystemExit(f"dspark-serve generate: error: {e}") from None
    try:
        spec = json.loads(args.speculative_config) if args.speculative_config else {}
        if not isinstance(spec, dict):
            raise ValueError(f"must be a JSON object, got {type(spec).__name__}")
    except ValueError as e:
        raise SystemExit(f"dspark-serve generate: error: speculative_config is not valid JSON: {e}") from None
    client = DSparkClient(args.server, application=args.application, **_client_access(args))
    kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
              max_tokens=args.max_tokens, ignore_eos=args.ignore_eos or None,
              num_speculative_tokens=spec.get("num_speculative_tokens"),
              confidence_threshold=spec.get("dspark_confidence_threshold"))
    try:
        if args.stream and not args.json:
            for msg in client.stream(prompt, **kw):
                if msg.HasField("chunk"):
                    print(msg.chunk.text or "".join(f"{t} " for t in msg.chunk.token_ids), end="", flush=True)
            print()
            return 0
        out = client.generate(prompt, **kw)
    except grpc.RpcError as e:
        raise SystemExit(f"dspark-serve generate: error: {e.code().name}: {e.details()}") from None
    finally:
        client.close()
    out.pop("request_id", None)
    print(json.dumps(out) if args.json else (out["text"] or out["token_ids"]))
    return 0


def _client_access(args: argparse.Namespace) -> dict:
    """DSparkClient's TLS and key options from --tls, --ssl-ca-certs, --ssl-certfile / --ssl-keyfile (a client
    certificate, for mutual TLS), --api-key or DSPARK_API_KEY."""
    import os

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise SystemExit("dspark-serve: error: a client certificate needs both --ssl-certfile and --ssl-keyfile")
    roots = read(args.ssl_ca_certs)
    return {"tls": args.tls or roots is not None or args.ssl_certfile is not None, "root_certificates": roots,
            "certificate_chain": read(args.ssl_certfile), "private_key": read(args.ssl_keyfile),
            "api_key": args.api_key or os.environ.get(API_KEY_ENV) or None}


def _bench(args: argparse.Namespace) -> int:
    from .bench import main as bench

    return bench(args, _client_access(args))


def _chat_ids(cfg, tokenizer, text: str) -> list[int]:
    """--chat in-process: the prompt as one user message, rendered with the target's chat template (or
    --chat-template's); cfg: the engine's EngineConfig."""
    from dspark_serve.models.chat_template import encode_chat, load_chat_template

    if tokenizer is None:
        raise ValueError("--chat needs a tokenizer next to the target")
    return encode_chat(load_chat_template(cfg.target, cfg.chat_template), tokenizer,
                       [{"role": "user", "content": text}], add_generation_prompt=True)


def _prompt(args: argparse.Namespace) -> str | list[int] | list[dict]:
    """--prompt TEXT, --prompt-ids; with --chat (a server's) the text as one user message."""
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt or --prompt-ids")
    if args.chat and args.prompt is None:
        raise ValueError("--chat needs --prompt TEXT")
    if args.chat and args.server:
        return [{"role": "user", "content": args.prompt}]
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


API_KEY_ENV = "DSPARK_API_KEY"


def _add_client_access(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", help="connect over TLS (the system's root certificates)")
    p.add_argument("--ssl-ca-certs", help="PEM file of the root certificates that signed the server's (implies --tls)")
    p.add_argument("--ssl-certfile", help="PEM client certificate, for a server with mutual TLS (with --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    p.add_argument("--api-key", help=f"sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})")


# Subcommands that own their argument parsing: name -> (module, help). Each module has main(argv) -> int.
DELEGATED = {
    "quantize": ("dspark_serve.models.quantize", "write an NVFP4 (ModelOpt) draft checkpoint from a bf16 one"),
    "fetch": ("dspark_serve.models.fetch", "download the demo target (Qwen2.5-Coder-0.5B GGUF) and convert it"),
    "train-draft": ("dspark_serve.train.cli", "train a DSpark drafter for a target (the DeepSpec recipe)"),
    "token-map": ("dspark_serve.models.token_map", "rank a target's tokens by frequency in a corpus: an FR-Spec "
                                                   "token map for speculative_config.dspark_token_map"),
}


def _delegate(name: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(DELEGATED[name][0]).main(argv) or 0)


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})".strip()


def build_parser() -> argparse.ArgumentParser:
    from dspark_serve.engine.engine_config import add_engine_args

    parser = argparse.ArgumentParser(prog="dspark-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the demo pair (Qwen2.5-Coder-0.5B + the shipped DSpark drafter) behind the "
                                       "service: streams completions, prints tau and the speedup over plain decoding")
    demo.add_argument("--max-tokens", type=int, help="per completion (default 128; 48 with --tiny)")
    demo.add_argument("--num-prompts", type=int, default=3)
    demo.add_argument("--target", help="target directory (default: fetch the demo target into the user cache)")
    demo.add_argument("--draft", help="draft directory (default: the drafter shipped in the package)")
    demo.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    demo.add_argument("--dtype", choices=["bfloat16", "float32"],
                      help="default: bfloat16 on a GPU and on a CPU with AMX, else float32")
    demo.add_argument("--speculative-config",
                      help="JSON (vLLM names); default: top-64 drafting, plus a survival threshold of 0.3 in fp32")
    demo.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the service")
    demo.add_argument("--colocate", action=argparse.BooleanOptionalAction,
                      help="the draft inside the verifier actor, or (--no-colocate) in its own actor; default: "
                           "co-located when both share one device")
    demo.add_argument("--tiny", action="store_true",
                      help="in-process, on a tiny constructed pair (random weights; no download, seconds on CPU)")
    demo.add_argument("--seed", type=int, default=0, help="--tiny: the pair's seed")
    demo.set_defaults(func=_demo)
    g = sub.add_parser("generate", help="generate in-process (no server); without --draft it decodes plainly")
    g.add_argument("--target", help="target checkpoint directory (HF format), for in-process generation")
    g.add_argument("--server", help="HOST:PORT of a running dspark-serve (then --target/--draft are not used)")
    g.add_argument("--stream", action="store_true", help="print each verify step's text as it arrives")
    g.add_argument("--application", help="Ray Serve application name (when --server is Serve's gRPC proxy)")
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message, rendered with the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(g)  # in-process; with --server only --speculative-config's per-request fields are sent
    _add_client_access(g)
    g.set_defaults(func=_generate)
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
    s.add_argument("--target-resources", help='custom Ray resources for the verifier, JSON, e.g. {"target_gpu": 1}')
    s.add_argument("--draft-resources", help='custom Ray resources for the draft, JSON, e.g. {"draft_gpu": 1}')
    s.add_argument("--max-queue", type=int, default=256,
                   help="queued + running requests before RESOURCE_EXHAUSTED")
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
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model may call tools (vLLM\'s flag; needs '
                        "--tool-call-parser)")
    s.add_argument("--tool-call-parser", choices=["hermes"],
                   help="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call>, Qwen2.5 and "
                        "Qwen3)")
    s.add_argument("--health-port", type=int, help="also serve grpc.health.v1 alone on this port, in plaintext (for "
                                                   "Kubernetes gRPC probes, which speak no TLS)")
    s.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest Generate request (default 4 MiB)")
    s.add_argument("--max-control-request-bytes", type=int, default=64 << 10,
                   help="largest Abort, GetModelInfo or GetServerStats request (default 64 KiB)")
    s.add_argument("--max-stop-strings", type=int, default=64, help="stop strings per request (default 64)")
    s.add_argument("--max-stop-string-chars", type=int, default=1024, help="characters per stop string (default 1024)")
    s.add_argument("--max-stop-token-ids", type=int, default=256, help="stop token ids per request (default 256)")
    s.add_argument("--max-abort-ids", type=int, default=1024, help="request ids per Abort call (default 1024)")
    s.set_defaults(func=_serve)
    b = sub.add_parser("bench", help="load generator against a running server: tokens/s, TTFT, TPOT, tau")
    b.add_argument("--server", required=True)
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    b.add_argument("--num-requests", type=int, default=16)
    b.add_argument("--prompt-file", help="one prompt per line (text), or comma-separated token ids per line")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--json", help="write the results here")
    _add_client_access(b)
    b.set_defaults(func=_bench)
    for name, (_, text) in DELEGATED.items():  # listed in --help; parsed by their own modules
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
