"""The real demo pair (Qwen2.5-Coder-0.5B-Instruct + the shipped DSpark drafter) on held-out prompts:
tau and per-position acceptance (greedy and T = 1, code and prose), greedy agreement with plain decoding, and
batch-1 plain vs speculative tokens/s and time to first token (optionally against transformers' static-cache +
torch.compile generate), and with --concurrency plain vs speculative tokens/s with many requests at once, measured
in one run.

usage: python bench/bench_pair.py [--target DIR] [--draft DIR] [--accept-batch 32] [--max-tokens 256]
                                  [--speed-prompts 8] [--hf-baseline] [--profile] [--concurrency 1 8 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from dspark_serve.kernels.config import KernelConfig
from dspark_serve.cluster.commands.demo import gpu_spec_config
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
from dspark_serve.train.data import CHAT_TEMPLATE, read_prompt_texts

PROMPTS = Path(__file__).resolve().parent / "prompts"


def acceptance(outs: list) -> dict:
    steps = sum(o.stats["steps"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    per_pos = [sum(col) for col in zip(*(o.stats["per_position_accepted"] for o in outs))]
    return {"tau": (accepted + steps) / max(steps, 1), "steps": steps,
            "per_position": [a / max(steps, 1) for a in per_pos]}  # P(position i accepted) per step


def timed(llm: LLM, prompts: list[str], params: SamplingParams, at_once: bool = False) -> tuple[float, list]:
    """Output tokens per second: prompts one after another (batch 1), or all submitted at once."""
    if llm.target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params) if at_once else [llm.generate([p], params)[0] for p in prompts]
    if llm.target.device.type == "cuda":
        torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), outs


def first_token_ms(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Median time to first token at batch 1 (tokenizing, prefill, the first token back on the host), ms; each
    request is aborted after its first token."""
    times = []
    for p in prompts:
        if llm.target.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = llm.add_request(p, params)
        while not any(o.request_id == rid and o.token_ids for o in llm.step()):
            pass
        times.append((time.perf_counter() - t0) * 1e3)
        llm.abort(rid)
    return sorted(times)[len(times) // 2]


def concurrency_rows(plain: LLM, spec: LLM, pool: list[str], levels: list[int], max_tokens: int) -> list[dict]:
    """Plain vs speculative tok/s with c requests at once, greedy (held-out prompts, cycled when fewer)."""
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for c in levels:
        prompts = [pool[i % len(pool)] for i in range(c)]
        timed(plain, prompts, params, True), timed(spec, prompts, params, True)  # warm-up: capture the buckets
        plain_tps, _ = timed(plain, prompts, params, True)
        spec_tps, outs = timed(spec, prompts, params, True)
        rows.append({"concurrency": c, "plain_tok_s": plain_tps, "spec_tok_s": spec_tps,
                     "tau": acceptance(outs)["tau"], "speedup": spec_tps / plain_tps})
        print(f"concurrency {c:>3}: plain {plain_tps:.1f} tok/s, speculative {spec_tps:.1f} tok/s "
              f"(tau {rows[-1]['tau']:.2f}, {rows[-1]['speedup']:.2f}x)", flush=True)
    return rows


def hf_baseline(target: Path, prompts: list[str], max_tokens: int) -> float:
    """transformers' generate with a static cache (compiled by generate) at batch 1, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    kw = dict(do_sample=False, max_new_tokens=max_tokens, cache_implementation="static")
    ids = [tok(p, return_tensors="pt").input_ids.cuda() for p in prompts]
    for x in ids[:2]:  # warm-up: compiles
        model.generate(x, **kw)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    for x in ids:
        n += model.generate(x, **kw).shape[1] - x.shape[1]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def profile_one(llm: LLM, prompt: str, params: SamplingParams, trace: str | None = None) -> dict:
    """One batch-1 generation under torch.profiler -> per step: wall ms, device busy ms (all kernels), the step's
    regions (dspark.draft / .verify / .accept, host and device ms) and the 20 ops with the most self time (device
    time on CUDA). `trace`: also write the timeline as a gzipped Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.target.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        out = llm.generate([prompt], params)[0]
        if cuda:
            torch.cuda.synchronize()
    wall, steps = time.perf_counter() - t0, max(out.stats["steps"], 1)
    dev = lambda e, total=False: getattr(e, ("" if total else "self_") + "device_time_total", 0.0)  # noqa: E731
    own = (lambda e: dev(e)) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731
    events = prof.key_averages()
    per_step = lambda us: us / 1e3 / steps  # noqa: E731
    if trace:
        prof.export_chrome_trace(trace.removesuffix(".gz"))
        subprocess.run(["gzip", "-f", trace.removesuffix(".gz")], check=True)
    return {"steps": steps, "tokens": len(out.token_ids), "wall_ms_per_step": wall * 1e3 / steps,
            "device_busy_ms_per_step": per_step(sum(dev(e) for e in events)) if cuda else None,
            "regions": {e.key: {"host_ms": per_step(e.cpu_time_total), "device_ms": per_step(dev(e, True))}
                        for e in events if e.key.startswith("dspark.")},
            "top_ops": [{"op": e.key, "calls_per_step": e.count / steps, "self_ms": per_step(own(e))}
                        for e in sorted(events, key=own, reverse=True)[:20]]}


def print_profile(name: str, p: dict) -> None:
    busy = p.get("device_busy_ms_per_step")
    print(f"profile {name}: {p['steps']} steps, {p['wall_ms_per_step']:.3f} ms/step (profiled)"
          + (f", device busy {busy:.3f} ms/step" if busy is not None else ""))
    for region, t in sorted(p["regions"].items()):
        print(f"  {region:<16} host {t['host_ms']:.3f} ms  device {t['device_ms']:.3f} ms")
    for o in p["top_ops"][:12]:
        print(f"  {o['self_ms']:8.3f} ms {o['calls_per_step']:7.1f}x  {o['op'][:90]}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--sets", nargs="+", default=["code", "prose"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--accept-prompts", type=int, default=64, help="held-out prompts per set for tau (0: skip)")
    ap.add_argument("--accept-batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--speed-prompts", type=int, default=8, help="code prompts timed at batch 1 (0: skip)")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers' compiled generate")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[],
                    help="also plain vs speculative tok/s with this many code prompts at once, e.g. 1 8 32 64")
    ap.add_argument("--device")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the checkpoint's on CUDA, fp32 on CPU")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to compare)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one batch-1 code prompt, plain and speculative (per-step regions, top ops)")
    ap.add_argument("--trace", help="with --profile: write gzipped Chrome traces to TRACE.{plain,spec}.json.gz")
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, gpu_spec_config: "
                    "top-k 64 and the shipped token map for the shipped drafter)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(args.draft)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (None if cuda else torch.float32)
    seqs = max([args.accept_batch, *args.concurrency])
    kv = dict(device=args.device, dtype=dtype, max_num_seqs=seqs,
              num_kv_blocks=seqs * -(-(1200 + args.max_tokens) // 16),
              enforce_eager=args.enforce_eager or None,
              kernel_config=KernelConfig.from_env("cuda" if cuda else "cpu"))  # DSPARK_<FIELD> for A/B runs
    plain, spec = LLM(args.target, None, **kv), LLM(args.target, args.draft, args.speculative_config, **kv)
    sets = {s: [CHAT_TEMPLATE.format(t) for t in read_prompt_texts(PROMPTS / f"heldout_{s}.jsonl")]
            for s in args.sets}
    result: dict = {"device": torch.cuda.get_device_name() if spec.target.device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "max_tokens": args.max_tokens,
                    "cuda_graphs": spec.target.graphs is not None and spec.target.graphs.capture,
                    "speculative_config": args.speculative_config,
                    "acceptance": [], "speed": None}
    for name, prompts in sets.items() if args.accept_prompts > 0 else ():
        prompts = prompts[:args.accept_prompts]
        for temp in args.temperatures:
            params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=i) for i in range(len(prompts))]
            t0 = time.perf_counter()
            outs = spec.generate(prompts, params)
            row = {"set": name, "temperature": temp, "prompts": len(prompts), **acceptance(outs),
                   "seconds": time.perf_counter() - t0}
            if temp == 0:
                ref = plain.generate(prompts, params)
                row["greedy_identical"] = sum(a.token_ids == b.token_ids for a, b in zip(outs, ref)) / len(outs)
            result["acceptance"].append(row)
            print(f"{name:>5} T={temp:g}: tau {row['tau']:.2f} over {row['steps']} steps "
                  f"({row['seconds']:.1f} s) identical {row.get('greedy_identical', '-')}", flush=True)
    if args.speed_prompts:
        prompts = sets.get("code", next(iter(sets.values())))[:args.speed_prompts]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        timed(plain, prompts, params), timed(spec, prompts, params)  # warm-up: every graph bucket is captured
        plain_tps, _ = timed(plain, prompts, params)
        spec_tps, outs = timed(spec, prompts, params)
        speed = {"prompts": len(prompts), "plain_tok_s": plain_tps, "spec_tok_s": spec_tps,
                 "tau": acceptance(outs)["tau"], "speedup": spec_tps / plain_tps,
                 "plain_ttft_ms": first_token_ms(plain, prompts, params),
                 "spec_ttft_ms": first_token_ms(spec, prompts, params)}
        if args.hf_baseline:
            speed["hf_compiled_tok_s"] = hf_baseline(Path(args.target), prompts, args.max_tokens)
            speed["spec_over_hf"] = spec_tps / speed["hf_compiled_tok_s"]
            speed["plain_over_hf"] = plain_tps / speed["hf_compiled_tok_s"]
        result["speed"] = speed
    if args.concurrency:
        result["concurrency"] = concurrency_rows(plain, spec, sets.get("code", next(iter(sets.values()))),
                                                 args.concurrency, args.max_tokens)
    if args.profile:
        prompt = sets.get("code", next(iter(sets.values())))[0]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        trace = lambda name: f"{args.trace}.{name}.json.gz" if args.trace else None  # noqa: E731
        result["profile"] = {"plain": profile_one(plain, prompt, params, trace("plain")),
                             "spec": profile_one(spec, prompt, params, trace("spec"))}
        for name, p in result["profile"].items():
            print_profile(name, p)
    print(f"{'set':>5} {'T':>3} {'tau':>5}  per-position acceptance")
    for r in result["acceptance"]:
        print(f"{r['set']:>5} {r['temperature']:>3g} {r['tau']:>5.2f}  "
              + " ".join(f"{p:.2f}" for p in r["per_position"]))
    if result["speed"]:
        s = result["speed"]
        print(f"batch 1, {s['prompts']} code prompts: plain {s['plain_tok_s']:.1f} tok/s, speculative "
              f"{s['spec_tok_s']:.1f} tok/s (tau {s['tau']:.2f}, {s['speedup']:.2f}x)"
              + (f"; transformers compiled {s['hf_compiled_tok_s']:.1f} tok/s" if "hf_compiled_tok_s" in s else ""))
        print(f"time to first token (median): plain {s['plain_ttft_ms']:.2f} ms, speculative {s['spec_ttft_ms']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
