"""The `dspark-serve` command: one subcommand per job; heavy imports happen inside each subcommand."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _demo(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.engine.reference import greedy_generate
    from dspark_serve.models.draft_loader import load_draft
    from dspark_serve.models.random_init import random_pair
    from dspark_serve.models.target_loader import load_target

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = random_pair(tmp, seed=args.seed)
        target = load_target(tdir, dtype=torch.float32)
        draft = load_draft(ddir, target=target)
        print(f"tiny random pair: target {sum(p.numel() for p in target.parameters()):,} params "
              f"({target.config.num_layers} layers), draft {draft.config.layers.num_layers} layer(s), "
              f"block {draft.config.block_size}, markov rank {draft.config.markov_rank}")
        for prompt in ([1, 2, 3, 4], [10, 20, 30], [7] * 9):
            t0 = time.perf_counter()
            out = greedy_generate(target, prompt, args.max_tokens)
            dt = time.perf_counter() - t0
            print(f"prompt {prompt} -> {out}  ({len(out) / dt:.1f} tokens/s, plain greedy)")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from dspark_serve.models import quantize

    return quantize.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a generation on a tiny random target + DSpark draft")
    demo.add_argument("--max-tokens", type=int, default=12)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    q = sub.add_parser("quantize", help="write an NVFP4 (ModelOpt) draft checkpoint from a bf16 one", add_help=False)
    q.add_argument("rest", nargs=argparse.REMAINDER)
    q.set_defaults(func=_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
