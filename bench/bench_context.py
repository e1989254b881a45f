"""Step time by batch and context length: the demo pair's shapes (a random Qwen2.5-0.5B-shaped target and the shipped
drafter on it) in the in-process engine, plain and speculative (every slot verified: random weights accept nothing),
B distinct prompts of L tokens each, then N tokens each; ms per step, tokens/s, and the device time per step. With
--kernels, the top device kernels of the slowest configuration.

usage: python bench/bench_context.py [--batches 1 8 64] [--contexts 200 1600] [--tokens 64] [--kernels 15]
                                    [--shared-prefix 1500]   # a cached system prompt: first tokens of a wave
       python bench/bench_context.py --device cpu --batches 2 --contexts 40 --tokens 4     # a smoke test
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dspark_serve.cluster.commands.demo import gpu_spec_config
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.demo import DEMO_DRAFTER
from dspark_serve.models.draft_loader import load_draft

from bench_step import random_target


def prompts(batch: int, length: int, seed: int, shared: int = 0) -> list[list[int]]:
    """batch prompts of `length` tokens, the first `shared` of them the same in every prompt of every seed."""
    head = torch.randint(0, 151000, (shared,), generator=torch.Generator().manual_seed(12345)).tolist()
    g = torch.Generator().manual_seed(seed)
    return [head + torch.randint(0, 151000, (length - shared,), generator=g).tolist() for _ in range(batch)]


def timed(llm: LLM, batch: list[list[int]], tokens: int) -> dict:
    """One generation of the batch (the prompts' prefill included), then the decode steps alone: wall ms per step
    from the first step after every prompt has its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    cuda = llm.target.device.type == "cuda"
    for p in batch:
        llm.add_request(p, params)
    walls, firsts, t0 = [], set(), time.perf_counter()
    t_all_first = None
    while llm.has_unfinished():
        t = time.perf_counter()
        outs = llm.step()
        if cuda:
            torch.cuda.synchronize()
        walls.append((t_all_first is not None, time.perf_counter() - t))
        for o in outs:
            if o.new_token_ids:
                firsts.add(o.request_id)
        if t_all_first is None and len(firsts) == len(batch):
            t_all_first = time.perf_counter()
    total = time.perf_counter() - t0
    decode = [w for after, w in walls if after]
    return {"first_tokens_ms": (t_all_first - t0) * 1e3, "decode_steps": len(decode),
            "decode_ms_per_step": sum(decode) / max(1, len(decode)) * 1e3,
            "decode_ms_max": max(decode, default=0.0) * 1e3, "tok_s": len(batch) * tokens / total}


def kernel_table(llm: LLM, batch: list[list[int]], tokens: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(batch, params)
        torch.cuda.synchronize()
    steps = max(o.stats["steps"] for o in outs)
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    lines = [f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel"]
    for e in rows:
        lines.append(f"{e.device_time_total / steps:9.1f} {e.count / steps:10.2f} "
                     f"{e.device_time_total / max(1, e.count):8.2f}  {e.key[:100]}")
    total = sum(e.device_time_total for e in prof.key_averages())
    lines.append(f"{total / steps:9.1f} us/step of device time in all ({steps} steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1600])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, "
                    "gpu_spec_config)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the prompts share their first N tokens and the prefix cache is on (a chat's system prompt)")
    ap.add_argument("--kernels", type=int, default=0, help="top N device kernels of the largest batch and context")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(DEMO_DRAFTER)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_target(args.device, dtype)
    draft = load_draft(DEMO_DRAFTER, target=target, dtype=dtype, device=args.device)
    top = max(args.batches)
    max_len = max(args.contexts) + args.tokens + 64
    kw = dict(device=args.device, max_num_seqs=top, num_kv_blocks=top * (max_len // 16 + 4) + 64,
              max_model_len=max_len, eos_token_ids=(), enable_prefix_caching=args.shared_prefix > 0)
    spec = json.loads(args.speculative_config)
    spec["enable_adaptive_verification"] = False
    engines = {"plain": LLM(target, None, **kw), "spec": LLM(target, draft, spec, **kw)}
    rows = []
    for b in args.batches:
        for length in args.contexts:
            shared = min(args.shared_prefix, length - 1)
            for name, llm in engines.items():
                timed(llm, prompts(b, length, 1, shared), args.tokens)  # warm-up: the buckets this shape meets
                r = timed(llm, prompts(b, length, 2, shared), args.tokens)
                rows.append({"mode": name, "batch": b, "context": length, **r})
                print(f"{name:>5} b={b:<3} L={length:<5} first tokens {r['first_tokens_ms']:8.1f} ms  decode "
                      f"{r['decode_ms_per_step']:7.2f} ms/step (max {r['decode_ms_max']:7.2f}, "
                      f"{r['decode_steps']} steps)  {r['tok_s']:8.0f} tok/s", flush=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "tokens": args.tokens,
              "shared_prefix": args.shared_prefix, "rows": rows}
    if args.kernels and args.device == "cuda":
        for name, llm in engines.items():
            batch = prompts(top, max(args.contexts), 3, args.shared_prefix)
            table = kernel_table(llm, batch, args.tokens, args.kernels)
            result[f"kernels_{name}"] = table
            print(f"\n{name}, b={top}, L={max(args.contexts)}:\n{table}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
