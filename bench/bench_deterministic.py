"""The deterministic mode's cost and what it buys, in one run: for the mode off and on, plain and speculative,
greedy and seeded, every request alone (the reference and the c = 1 speed), then all of them in waves (a third
added every two steps: changing batches) with the tokens/s and how many outputs equal the request's plain solo run.

usage: python bench/bench_deterministic.py [--target DIR --draft DIR] [--requests 24] [--waves 3]
       [--max-tokens 32] [--dtype bfloat16] [--device cpu] [--modes off on] [--kernel-config JSON] [--json OUT]
Without --target: the tiny random pair of the tests (bfloat16), in memory, random-id prompts; with it, the held-out
code prompts in the chat template. The speculative engine also runs every greedy request alone (its c = 1 speed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(args, deterministic: bool, spec: bool):
    import torch

    from dspark_serve.engine.llm import LLM
    from dspark_serve.models.random_init import tiny_pair

    kw = dict(device=args.device, block_size=16, num_kv_blocks=1024, max_num_seqs=args.requests,
              deterministic=deterministic, max_num_batched_tokens=args.batched_tokens, warmup=args.device != "cpu",
              kernel_config=args.kernel_config)
    if args.target is None:
        target, draft = tiny_pair(seed=4, dtype=getattr(torch, args.dtype), agree=0.005)
        return LLM(target, draft if spec else None, **kw)
    return LLM(args.target, args.draft if spec else None, dtype=args.dtype, **kw)


def requests(args) -> list[tuple[list[int] | str, dict]]:
    rng = random.Random(0)
    if args.target is None:
        prompts = [[rng.randrange(1, 255) for _ in range(rng.randrange(4, args.max_prompt + 1))]
                   for _ in range(args.requests)]
    else:
        from dspark_serve.train.data import CHAT_TEMPLATE, read_prompt_texts
        texts = read_prompt_texts(Path(__file__).resolve().parent / "prompts" / "heldout_code.jsonl")
        prompts = [CHAT_TEMPLATE.format(texts[i % len(texts)]) for i in range(args.requests)]
    return [(prompts[i], {"temperature": 0.0} if kind == "greedy" else {"temperature": 1.0, "seed": 1000 + i})
            for kind in ("greedy", "seeded") for i in range(args.requests)]


def run_waves(llm, reqs, waves: int) -> tuple[list[list[int]], float]:
    from dspark_serve.engine.sampling_params import SamplingParams

    ids, out = {}, {}
    size = -(-len(reqs) // waves)
    t0 = time.perf_counter()
    for w in range(waves):
        for i in range(w * size, min((w + 1) * size, len(reqs))):
            prompt, params = reqs[i]
            ids[llm.add_request(prompt, SamplingParams(max_tokens=ARGS.max_tokens, ignore_eos=True, **params))] = i
        for _ in range(2 if w < waves - 1 else 0):
            out.update({ids[o.request_id]: o.token_ids for o in llm.step() if o.finished})
    while llm.has_unfinished():
        out.update({ids[o.request_id]: o.token_ids for o in llm.step() if o.finished})
    return [out[i] for i in range(len(reqs))], time.perf_counter() - t0


def run_solo(llm, reqs) -> tuple[list[list[int]], float]:
    from dspark_serve.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    outs = [llm.generate([p], SamplingParams(max_tokens=ARGS.max_tokens, ignore_eos=True, **kw))[0].token_ids
            for p, kw in reqs]
    return outs, time.perf_counter() - t0


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="cuda: the engine's graphs recorded before anything is timed")
    p.add_argument("--requests", type=int, default=24, help="per kind (greedy, seeded)")
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=40)
    p.add_argument("--batched-tokens", type=int, default=256)
    p.add_argument("--kernel-config", help="KernelConfig fields as JSON (e.g. the invariant matmul's tiles)")
    p.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"], help="the deterministic mode")
    p.add_argument("--json")
    ARGS = args = p.parse_args()
    reqs = requests(args)
    half = len(reqs) // 2
    rows = []
    for deterministic in [m == "on" for m in args.modes]:
        solo, solo_s = run_solo(build(args, deterministic, spec=False), reqs)
        for spec in (False, True):
            llm = build(args, deterministic, spec)
            outs = {}
            for kind, part in (("greedy", reqs[:half]), ("seeded", reqs[half:])):
                got, secs = run_waves(llm, part, args.waves)
                ref = solo[:half] if kind == "greedy" else solo[half:]
                outs[kind] = got
                tokens = sum(len(t) for t in got)
                rows.append({"deterministic": deterministic, "speculative": spec, "kind": kind,
                             "waves_tok_s": round(tokens / secs, 1),
                             "equal_to_solo": sum(a == b for a, b in zip(got, ref)), "requests": len(part)})
                print(json.dumps(rows[-1]), flush=True)
            if spec:
                got, secs = run_solo(llm, reqs[:half])
                rows.append({"deterministic": deterministic, "speculative": True, "kind": "greedy alone (c = 1)",
                             "solo_tok_s": round(sum(len(t) for t in got) / secs, 1),
                             "equal_to_solo": sum(a == b for a, b in zip(got, solo[:half])), "requests": half})
                print(json.dumps(rows[-1]), flush=True)
        tokens = sum(len(t) for t in solo)
        rows.append({"deterministic": deterministic, "speculative": False, "kind": "solo (c = 1, both kinds)",
                     "solo_tok_s": round(tokens / solo_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
