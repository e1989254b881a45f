"""Time to first token of one fresh prompt, eager prefill against prefill CUDA graphs
(engine/runner/prompt_graphs.py), by prompt length and model shape (random weights, plain decoding, batch 1).

usage: python bench/bench_prefill.py [--models 8b 0.5b] [--lens 64 256 1024 1100 2048] [--repeat 5] [--json OUT]
A graph pads the prompt to its length bucket (up to 1.5x the tokens): for long prompts on a large target the
prefill is compute-bound and the padding can cost more than the launches the graph saves; this measures where.
Each length alternates graphs off / on, after one warm-up of each (the first graph of a bucket is captured then).
"graph ms" is what the prefill takes with prompt graphs on, so past KernelConfig.prompt_graph_work (column MAX_WORK:
the path the rule picks) it runs eagerly too; DSPARK_PROMPT_GRAPH_WORK=inf times the graphs everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dspark_serve.kernels.config import KernelConfig
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.runner.buckets import bucket as _bucket
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.qwen import QwenForCausalLM

from bench_gpu import random_module, target_config
from bench_step import random_target


def make_target(name: str, device: str, dtype: torch.dtype) -> QwenForCausalLM:
    if name == "0.5b":  # the demo target's shape, as bench_step builds it
        return random_target(device, dtype)
    return random_module(lambda: QwenForCausalLM(target_config(name, dtype)), device, dtype)


def ttft_ms(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    sync()
    return 1e3 * (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["8b", "0.5b"], choices=["8b", "0.6b", "0.5b", "tiny"])
    ap.add_argument("--lens", type=int, nargs="+", default=[64, 200, 520, 1030, 1540, 2048])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.lens) or args.repeat < 1:
        ap.error("--lens and --repeat take positive integers")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    top = max(args.lens) + 1
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "rows": []}
    for name in args.models:
        llm = LLM(make_target(name, args.device, dtype), None, device=args.device, max_num_seqs=1,
                  num_kv_blocks=-(-top // 16) + 1, max_model_len=top, eos_token_ids=(), enforce_eager=False,
                  kernel_config=KernelConfig.from_env(args.device))  # DSPARK_<FIELD> for A/B runs
        graphs = llm.target.prompts
        if graphs is None:
            raise SystemExit("prompt graphs are off (KernelConfig.prompt_graphs is off): nothing to compare")
        for n in args.lens:
            prompt = torch.randint(0, llm.target.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            times: dict[str, list[float]] = {"eager": [], "graph": []}
            for rep in range(args.repeat + 1):  # the first round warms up (and captures the bucket's graph)
                for mode in ("eager", "graph"):
                    llm.target.prompts = graphs if mode == "graph" else None
                    ms = ttft_ms(llm, prompt)
                    if rep:
                        times[mode].append(ms)
                    print(f"  {name} {n} tokens {mode}: {ms:.2f} ms{'' if rep else ' (warm-up)'}", flush=True)
            llm.target.prompts = graphs
            bucket = _bucket(n, graphs.lengths) if n <= graphs.lengths[-1] else None
            row = {"model": name, "tokens": n, "bucket": bucket, "rule": "graph" if graphs.takes([0], [n]) else "eager",
                   "eager_ms": statistics.median(times["eager"]),
                   "graph_ms": statistics.median(times["graph"]), "eager_all": times["eager"],
                   "graph_all": times["graph"]}
            result["rows"].append(row)
        del llm
        torch.cuda.empty_cache() if args.device == "cuda" else None
    print(f"\n{'model':6} {'tokens':>6} {'bucket':>6} {'eager ms':>9} {'graph ms':>9} {'graph/eager':>11} "
          f"{'MAX_WORK':>8}")
    for r in result["rows"]:
        print(f"{r['model']:6} {r['tokens']:>6} {str(r['bucket']):>6} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.2f} "
              f"{r['graph_ms'] / r['eager_ms']:>11.2f} {r['rule']:>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
