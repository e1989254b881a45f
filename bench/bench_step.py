"""Where a batch-1 step's time goes, without a profiler: the demo pair's shapes (a random Qwen2.5-0.5B-shaped
target and the shipped drafter on it), plain and speculative ms/step end to end, each CUDA graph's host launch
time against its device time, and the host functions of the step loop (cProfile, one run).

usage: python bench/bench_step.py [--tokens 256] [--top 25] [--json OUT]
       python bench/bench_step.py --device cpu --tokens 8     # the same code path (a CI smoke test)
Random weights accept almost nothing, so every speculative step verifies the full block: its cost per step is
the real pair's; tokens/s is bench/bench_pair.py's business.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from dspark_serve.cluster.demo import GPU_SPEC_CONFIG
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.config import ModelConfig
from dspark_serve.models.demo import DEMO_DRAFTER
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.qwen import QwenForCausalLM

QWEN25_05B = dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position=32768,
                  tie_word_embeddings=True, attention_bias=True)


def random_target(device: str, dtype: torch.dtype) -> QwenForCausalLM:
    with torch.device(device):
        model = QwenForCausalLM(ModelConfig(**QWEN25_05B, dtype=dtype)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def ms_per_step(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: captures every bucket the timed run meets
    if llm.target.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    if llm.target.device.type == "cuda":
        torch.cuda.synchronize()
    steps = out.stats["steps"]
    return (time.perf_counter() - t0) * 1e3 / steps, steps


@torch.inference_mode()
def graph_costs(runners: dict, device: str, iters: int = 50) -> dict[str, dict[str, float]]:
    """Per captured runner: host µs to launch it (no sync in between) and device µs per replay."""
    out = {}
    for key, run in runners.items():
        run(), run()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        host = (time.perf_counter() - t0) / iters * 1e6
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            dev = start.elapsed_time(end) / iters * 1e3
        else:
            dev = float("nan")
        out[str(key)] = {"host_us": host, "device_us": dev}
    return out


def host_profile(llm: LLM, prompt: list[int], tokens: int, top: int, sort: str = "tottime") -> str:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25, help="host functions listed (cProfile)")
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="cProfile order")
    ap.add_argument("--speculative-config", default=GPU_SPEC_CONFIG,
                    help=f"JSON with vLLM's names (default: the demo's, {GPU_SPEC_CONFIG})")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_target(args.device, dtype)
    draft = load_draft(DEMO_DRAFTER, target=target, dtype=dtype, device=args.device)
    kw = dict(device=args.device, max_num_seqs=1, num_kv_blocks=64, max_model_len=1024,
              eos_token_ids=(), enforce_eager=False)
    plain, spec = LLM(target, None, **kw), LLM(target, draft, args.speculative_config, **kw)
    prompt = torch.randint(0, 151000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "tokens": args.tokens, "speculative_config": args.speculative_config}
    for name, llm in (("plain", plain), ("spec", spec)):
        ms, steps = ms_per_step(llm, prompt, args.tokens)
        result[name] = {"ms_per_step": ms, "steps": steps,
                        "target_graphs": graph_costs(llm.target.graphs._runners, args.device)}
        if name == "spec":
            result[name]["draft_graphs"] = graph_costs(llm.draft.graphs._runners, args.device)
        result[name]["host_profile"] = host_profile(llm, prompt, args.tokens, args.top, args.sort)
    for name in ("plain", "spec"):
        r = result[name]
        print(f"== {name}: {r['ms_per_step']:.3f} ms/step over {r['steps']} steps")
        for kind in ("target_graphs", "draft_graphs"):
            for key, c in r.get(kind, {}).items():
                print(f"   {kind[:-7]} graph {key}: launch {c['host_us']:.1f} us host, {c['device_us']:.1f} us device")
        print(r["host_profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
