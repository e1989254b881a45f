"""Plain vs speculative decoding in the in-process engine: tokens/s and tau, measured in one run.

usage: python bench/bench_engine.py [--target DIR --draft DIR] [--batch 1 8] [--max-tokens 64] [--json OUT]
Without --target/--draft it builds the tiny constructed pair (a bigram-like target and a draft whose Markov
head is that bigram, dspark_serve.models.random_init.tiny_pair).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list]:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats["steps"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    return tokens / dt, (accepted + steps) / max(steps, 1), outs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tmp = None
    if args.target is None:
        tmp = tempfile.TemporaryDirectory()
        args.target, args.draft = map(str, random_pair(tmp.name, agree=0.005, block_size=6))
    plain = LLM(args.target, None, device=args.device)
    spec = LLM(args.target, args.draft, device=args.device)
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch:
        prompts = [torch.randint(0, 400, (int(torch.randint(4, 32, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(batch)]
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
        plain_tps, _, plain_out = run(plain, prompts, params)
        spec_tps, tau, spec_out = run(spec, prompts, params)
        same = all(a.token_ids == b.token_ids for a, b in zip(plain_out, spec_out)) if args.temperature == 0 else None
        rows.append({"batch": batch, "plain_tok_s": plain_tps, "spec_tok_s": spec_tps, "tau": tau,
                     "speedup": spec_tps / plain_tps, "greedy_identical": same})
    print(f"{'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'tau':>5} {'speedup':>8} {'identical':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} {r['tau']:>5.2f} "
              f"{r['speedup']:>7.2f}x {str(r['greedy_identical']):>9}")
    result = {"device": str(spec.target.device), "torch": torch.__version__, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
