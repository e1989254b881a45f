"""The `dspark-serve` command: one subcommand per job; heavy imports happen inside each subcommand."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from .serve_cmd import API_KEY_ENV, add_serve_parser


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

    return bench(args, {**_client_access(args), "application": args.application})


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
    add_serve_parser(sub)
    b = sub.add_parser("bench", help="load generator against a running server: tokens/s, TTFT, TPOT, tau")
    b.add_argument("--server", required=True)
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    b.add_argument("--num-requests", type=int, default=16)
    b.add_argument("--prompt-file", help="one prompt per line (text), or comma-separated token ids per line")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--json", help="write the results here")
    b.add_argument("--application", help="Ray Serve application name (when --server is Serve's gRPC proxy)")
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
