"""Load-adaptive speculation against plain decoding and every fixed draft length, in the in-process engine: the
real demo pair on held-out code prompts (chat template, greedy), c requests at once, each configuration measured
in turn and the turns alternated, so all of them see the same host.

Configurations: plain decoding; speculative with the default policy (each step verifies the drafts worth their
cost); speculative with every request pinned at k = 1, 3 and 7 drafts a step. Also reported: the step costs the
engine measured at start and, per level, how many drafts the policy verified per request per step.

A round at level c runs waves of c requests (each wave's prompts the next ones of the pool) until --min-requests
have run, so that a round at c = 1 lasts more than one request. --profile C adds a kernel table (device time per
kernel, torch.profiler; bench_gpu.profile_table) of one plain and one adaptive round at level C.

usage: python bench/bench_adaptive.py [--target DIR] [--levels 1 8 16 32 64 128] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from bench_gpu import profile_table

from dspark_serve.cluster.commands.demo import gpu_spec_config
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
from dspark_serve.train.data import CHAT_TEMPLATE, read_prompt_texts

PROMPTS = Path(__file__).resolve().parent / "prompts"
FIXED = (1, 3, 7)


def run(llm: LLM, waves: list[list[str]], params: SamplingParams, k: int | None) -> dict:
    """Each wave's prompts at once, the waves one after another (k: pinned drafts a step, 0: the speculative engine
    decoding plainly, None: the policy) -> tok/s, tau, the verified lengths and each step's wall ms with the rows
    that got tokens in it."""
    sync = torch.cuda.synchronize if llm.target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    done, walls, last, ids = {}, [], t0, []
    for prompts in waves:
        ids += [llm.add_request(p, params, num_speculative_tokens=k) for p in prompts]
        while len(done) < len(ids):
            outs = llm.step()
            done.update({o.request_id: o for o in outs if o.finished})
            now = time.perf_counter()
            walls.append((round((now - last) * 1e3, 3), sum(len(o.new_token_ids) for o in outs)))
            last = now
    sync()
    secs = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    steps = sum(o.stats["steps"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    lengths = Counter(n for o in outs for n in o.stats.get("verified_per_step", []))
    return {"tok_s": sum(len(o.token_ids) for o in outs) / secs, "tau": (accepted + steps) / max(steps, 1),
            "verified": dict(sorted(lengths.items())), "tokens": [o.token_ids for o in outs], "walls": walls}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16, help="requests a round runs at least (in waves of c)")
    ap.add_argument("--profile", type=int, metavar="C", help="a kernel table of one plain and one adaptive round at "
                    "level C (take it with DSPARK_PDL=0: under PDL a kernel is charged its wait)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, "
                    "gpu_spec_config)")
    ap.add_argument("--device")
    ap.add_argument("--configs", nargs="+", help="a subset of plain adaptive k0 k1 k3 k7 (default: all but k0, the "
                    "speculative engine with every request pinned at no drafts)")
    ap.add_argument("--trace", help="write each level's last adaptive run step by step here (JSON): each step's wall "
                    "ms and tokens, what the policy was told of each decode step and its host and rate estimates")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(args.draft)
    seqs = max(args.levels)
    kw = dict(device=args.device, max_num_seqs=seqs, max_model_len=args.max_model_len,
              num_kv_blocks=seqs * -(-(args.max_model_len + 64) // 16))
    t0 = time.perf_counter()
    plain = LLM(args.target, None, **kw)
    spec = LLM(args.target, args.draft, args.speculative_config, **kw)
    costs = spec.scheduler.policy.costs if spec.scheduler.policy is not None else None
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "speculative_config": args.speculative_config, "max_tokens": args.max_tokens,
              "build_s": time.perf_counter() - t0, "step_costs": costs.to_dict() if costs else None, "levels": []}
    print(f"engines built in {result['build_s']:.1f} s; step costs: {json.dumps(result['step_costs'])}", flush=True)
    pool = [CHAT_TEMPLATE.format(t) for t in read_prompt_texts(PROMPTS / "heldout_code.jsonl")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    configs = [("plain", plain, None), ("adaptive", spec, None), ("k0", spec, 0)] + [(f"k{k}", spec, k) for k in FIXED]
    configs = [c for c in configs if (c[0] != "k0" if args.configs is None else c[0] in args.configs)]
    policy, told, traces = spec.scheduler.policy, [], []
    if args.trace and policy is not None:
        timed = policy.timed
        policy.timed = lambda *a, **kw: (told.append([*a, *kw.values()]), timed(*a, **kw))[1]
    for c in args.levels:
        waves = [[pool[(w * c + i) % len(pool)] for i in range(c)] for w in range(-(-args.min_requests // c))]
        for _, llm, k in configs:  # warm-up: every bucket of this level recorded, the policy's estimates primed
            run(llm, waves[:1], params, k)
        rows: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        for _ in range(args.rounds):
            for name, llm, k in configs:
                told.clear()
                rows[name].append(run(llm, waves, params, k) | {"told": list(told)})
        if args.trace and policy is not None and "adaptive" in rows:
            last = rows["adaptive"][-1]
            traces.append({"concurrency": c, "walls": last["walls"], "told": last["told"],
                           "host_ms": [[*k, v] for k, v in policy._host.items()],
                           "rate": [[*k, v] for k, v in policy._rate.items()],
                           "plain_faster": sorted(policy._plain_faster())})
            Path(args.trace).write_text(json.dumps(traces))
        level = {"concurrency": c}
        for name, runs in rows.items():
            level[name] = {"tok_s": [r["tok_s"] for r in runs], "tau": runs[-1]["tau"],
                           "verified": runs[-1]["verified"]}
        if args.profile == c:
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            level["kernels"] = {name: profile_table(f"{name} at c = {c}, one round", lambda: run(llm, waves, params, k),
                                                    dev, 25, steps=1)[:25]
                                for name, llm, k in configs if name in ("plain", "adaptive")}
        ref = rows["plain"][-1]["tokens"]
        level["greedy_identical"] = {name: sum(a == b for a, b in zip(runs[-1]["tokens"], ref))
                                     for name, runs in rows.items() if name != "plain"}
        result["levels"].append(level)
        best = lambda name: max(level[name]["tok_s"]) if name in level else float("nan")  # noqa: E731
        print(f"c={c:>3}: " + ", ".join(f"{n} {best(n):.0f}" for n, _, _ in configs)
              + f" tok/s; adaptive/plain {best('adaptive') / best('plain'):.2f}, adaptive/best fixed "
              f"{best('adaptive') / max(best(f'k{k}') for k in FIXED):.2f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{'c':>4} {'plain':>7} {'adapt':>7} " + " ".join(f"{'k' + str(k):>7}" for k in FIXED)
          + f" {'a/plain':>7} {'a/best k':>8}  verified drafts per request-step (adaptive)")
    for lv in result["levels"]:
        b = {n: max(lv[n]["tok_s"]) if n in lv else float("nan") for n in ["plain", "adaptive"]
             + [f"k{k}" for k in FIXED]}
        hist = lv["adaptive"]["verified"] if "adaptive" in lv else {}
        total = sum(hist.values()) or 1
        mean = sum(k * v for k, v in hist.items()) / total
        print(f"{lv['concurrency']:>4} {b['plain']:>7.0f} {b['adaptive']:>7.0f} "
              + " ".join(f"{b[f'k{k}']:>7.0f}" for k in FIXED)
              + f" {b['adaptive'] / b['plain']:>7.2f} {b['adaptive'] / max(b[f'k{k}'] for k in FIXED):>8.2f}"
              f"  mean {mean:.2f}")
    return result


if __name__ == "__main__":
    main()
