"""The `dspark-serve` command: one subcommand per job; heavy imports happen inside each subcommand."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _demo(args: argparse.Namespace) -> int:
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.random_init import random_pair

    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = random_pair(tmp, seed=args.seed, agree=0.005, block_size=6)
        print("tiny constructed pair (random weights; the draft's Markov head is the target's bigram part), "
              "written as HF + DeepSpec checkpoints and loaded back")
        plain, spec = LLM(tdir, None, device="cpu"), LLM(tdir, ddir, device="cpu")
        prompts = [[1, 2, 3, 4], [10, 20, 30], [7] * 9]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
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

    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.engine.spec_config import SpeculativeConfig
    from dspark_serve.models.config import CheckpointError

    try:
        prompt = _prompt(args)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        params.validate()
        spec = SpeculativeConfig.from_json(args.speculative_config)
        llm = LLM(args.target, args.draft, spec, device=args.device)
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


def _prompt(args: argparse.Namespace) -> str | list[int]:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt or --prompt-ids")
    if args.prompt is not None:
        return args.prompt
    try:
        return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


def _quantize(args: argparse.Namespace) -> int:
    from dspark_serve.models import quantize

    return quantize.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="speculative vs plain decoding on a tiny constructed pair")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    g = sub.add_parser("generate", help="generate in-process (no server); without --draft it decodes plainly")
    g.add_argument("--target", required=True, help="target checkpoint directory (HF format)")
    g.add_argument("--draft", help="draft checkpoint directory (DeepSpec, z-lab DFlash, speculators or vLLM names)")
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--speculative-config", help='JSON, e.g. {"num_speculative_tokens": 7, "dspark_draft_topk": 64}')
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=_generate)
    q = sub.add_parser("quantize", help="write an NVFP4 (ModelOpt) draft checkpoint from a bf16 one", add_help=False)
    q.add_argument("rest", nargs=argparse.REMAINDER)
    q.set_defaults(func=_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["quantize"]:  # argparse.REMAINDER drops a leading option (--help), so route directly
        from dspark_serve.models import quantize

        return int(quantize.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
