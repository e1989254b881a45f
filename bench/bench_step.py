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
import gc
import io
import json
import pstats
import time

import torch

from dspark_serve.kernels.config import KernelConfig
from dspark_serve.cluster.commands.demo import gpu_spec_config
from dspark_serve.engine.runner.draft_runner import DENSE_NVFP4_MIN_ROWS
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


def ms_per_step(llm: LLM, prompt: list[int], tokens: int, pauses: list[float] | None = None) -> tuple[float, int]:
    """Mean ms per step of one generation after a warm-up; `pauses` collects the garbage collector's pauses (s)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: captures every bucket the timed run meets
    if llm.target.device.type == "cuda":
        torch.cuda.synchronize()
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif pauses is not None and started:
            pauses.append(time.perf_counter() - started.pop())
    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        if llm.target.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    steps = out.stats["steps"]
    return elapsed * 1e3 / steps, steps


@torch.inference_mode()
def graph_costs(runners: dict, device: str, iters: int = 50, pad=None) -> dict[str, dict[str, float]]:
    """Per captured runner: host µs to launch it (no sync in between) and device µs per replay; `pad(key)` stages a
    step of padding for the graph first (the verify graphs read index fields that must be their own)."""
    out = {}
    for key, run in runners.items():
        if pad is not None:
            pad(key)
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


def timeline(llm: LLM, prompt: list[int], tokens: int) -> dict[str, float]:
    """Medians per step, µs: waiting for the step's accepted counts (the sync), host time from that sync to the
    next graph launch (the device idles unless work was queued ahead), from that launch to the next (the verify
    after the draft), and the step's wall time."""
    from dspark_serve.engine.core import executor as ss
    finish, replay = ss.finish, torch.cuda.CUDAGraph.replay if torch.cuda.is_available() else None
    marks: list[tuple[str, float]] = []

    def timed_finish(*a, **k):
        t = time.perf_counter()
        out = finish(*a, **k)
        marks.append(("sync", t))
        marks.append(("synced", time.perf_counter()))
        return out

    def timed_replay(self):
        marks.append(("replay", time.perf_counter()))
        return replay(self)
    ss.finish = timed_finish
    if replay is not None:
        torch.cuda.CUDAGraph.replay = timed_replay
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    finally:
        ss.finish = finish
        if replay is not None:
            torch.cuda.CUDAGraph.replay = replay
    waits, gaps, between, walls = [], [], [], []
    last_sync = synced = first = None
    for kind, t in marks:
        if kind == "sync":
            if last_sync is not None:
                walls.append(t - last_sync)
            last_sync = t
        elif kind == "synced":
            waits.append(t - last_sync)
            synced, first = t, None
        elif kind == "replay" and synced is not None:
            if first is None:
                gaps.append(t - synced)
                first = t
            else:  # the second launch after a sync: the verify after the draft
                between.append(t - first)
                synced = None
    med = lambda xs, f=0.5: sorted(xs)[int(f * (len(xs) - 1))] * 1e6 if xs else float("nan")  # noqa: E731
    return {"sync_wait_us": med(waits), "sync_to_launch_us": med(gaps), "launch_to_launch_us": med(between),
            "step_us": med(walls), "step_p90_us": med(walls, 0.9), "step_max_us": med(walls, 1.0),
            "step_mean_us": sum(walls) / max(1, len(walls)) * 1e6}


def first_steps(llm: LLM, prompt: list[int], tokens: int) -> dict[str, float | str]:
    """Host wall time of each scheduler step of one generation, ms: the first (prefill and the first token, which
    reads its token back), the next three, the median of the rest, and the whole generation; then the prefill's
    and the first decode step's wall time against their device time, kernel count and busiest host ops."""
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    cuda = llm.target.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    walls, t0 = [], time.perf_counter()
    while llm.has_unfinished():
        t = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    at = lambda i: walls[i] * 1e3 if i < len(walls) else float("nan")  # noqa: E731
    rest = sorted(walls[4:]) or [float("nan")]
    out = {"prefill_ms": at(0), "step1_ms": at(1), "step2_ms": at(2), "step3_ms": at(3),
           "rest_median_ms": rest[len(rest) // 2] * 1e3, "steps": len(walls), "generation_ms": total * 1e3}
    if cuda:  # the prefill and the first decode step again, profiled: device time, kernels, the top host ops
        from torch.profiler import ProfilerActivity, profile
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        for name in ("prefill", "step1"):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                llm.step()
                torch.cuda.synchronize()
                out[f"{name}_alone_ms"] = (time.perf_counter() - t) * 1e3
            events = [e for e in prof.key_averages() if not e.key.startswith("dspark.")]  # regions overlap kernels
            out[f"{name}_device_ms"] = sum(e.self_device_time_total for e in events) / 1e3
            out[f"{name}_kernels"] = sum(e.count for e in events if e.self_device_time_total > 0)
            top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
            out[f"{name}_host_top"] = "; ".join(f"{e.key[:40]} {e.count}x {e.self_cpu_time_total / 1e3:.2f}ms"
                                                 for e in top)
            top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
            out[f"{name}_device_top"] = "; ".join(f"{e.key[:40]} {e.count}x {e.self_device_time_total / 1e3:.2f}ms"
                                                   for e in top)
        while llm.has_unfinished():
            llm.step()
    return out


def kernel_table(llm: LLM, prompt: list[int], tokens: int, top: int) -> str:
    """The device's kernels over one run (graph replays included), by total time, with calls per step."""
    from torch.profiler import ProfilerActivity, profile
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = llm.generate([prompt], params)[0]
        torch.cuda.synchronize()
    steps = out.stats["steps"]
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    lines = [f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel"]
    for e in rows:
        lines.append(f"{e.device_time_total / steps:9.1f} {e.count / steps:10.2f} {e.device_time_total / max(1, e.count):8.2f}"
                     f"  {e.key[:110]}")
    total = sum(e.device_time_total for e in prof.key_averages())
    lines.append(f"{total / steps:9.1f} us/step of device time in all ({steps} steps)")
    return "\n".join(lines)


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
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, gpu_spec_config: "
                    "top-k 64 and the shipped token map for the shipped drafter)")
    ap.add_argument("--kernels", type=int, default=0, help="also list the top N device kernels (torch.profiler)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(DEMO_DRAFTER)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_target(args.device, dtype)
    draft = load_draft(DEMO_DRAFTER, target=target, dtype=dtype, device=args.device)
    kw = dict(device=args.device, max_num_seqs=1, num_kv_blocks=72, max_model_len=1024,
              eos_token_ids=(), enforce_eager=False,
              kernel_config=KernelConfig.from_env(args.device))  # DSPARK_<FIELD> for A/B runs
    spec_config = json.loads(args.speculative_config)
    spec_config.setdefault("enable_adaptive_verification", False)  # every step verifies the full block (see above)
    plain, spec = LLM(target, None, **kw), LLM(target, draft, spec_config, **kw)
    prompt = torch.randint(0, 151000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    "torch": torch.__version__, "tokens": args.tokens, "speculative_config": args.speculative_config,
                    "dense_min_rows": DENSE_NVFP4_MIN_ROWS}
    for name, llm in (("plain", plain), ("spec", spec)):
        llm.executor.pipeline.step_ahead = False  # the same run without launching the next step ahead, for the ratio
        ms_alone, _ = ms_per_step(llm, prompt, args.tokens)
        llm.executor.pipeline.step_ahead = args.device == "cuda"
        pauses: list[float] = []
        ms, steps = ms_per_step(llm, prompt, args.tokens, pauses)
        result[name] = {"ms_per_step": ms, "ms_per_step_without_step_ahead": ms_alone, "steps": steps,
                        "gc_pauses": len(pauses), "gc_ms": 1e3 * sum(pauses),
                        "target_graphs": graph_costs(llm.target.graphs._runners, args.device,
                                                     pad=lambda key: llm.target.graphs.stage_padding(*key[:3]))}
        result[name]["timeline"] = timeline(llm, prompt, args.tokens)
        result[name]["first_steps"] = first_steps(llm, prompt, args.tokens)
        if name == "spec":
            result[name]["draft_graphs"] = graph_costs(llm.draft.graphs._runners, args.device)
            chain = {False: [], True: []}  # the draft chained behind the verify launched ahead, off / on, alternated
            for on in (False, True, False, True):
                llm.executor.pipeline.chain_ahead = on and args.device == "cuda"
                chain[on].append(ms_per_step(llm, prompt, args.tokens)[0])
            result[name]["ms_per_step_chain_off_on"] = [chain[False], chain[True]]
        result[name]["host_profile"] = host_profile(llm, prompt, args.tokens, args.top, args.sort)
        if args.kernels and args.device == "cuda":
            result[name]["kernels"] = kernel_table(llm, prompt, args.tokens, args.kernels)
    for name in ("plain", "spec"):
        r = result[name]
        print(f"== {name}: {r['ms_per_step']:.3f} ms/step over {r['steps']} steps "
              f"({r['ms_per_step_without_step_ahead']:.3f} without launching the next step ahead)")
        print(f"   garbage collector during the timed run: {r['gc_pauses']} pauses, {r['gc_ms']:.1f} ms")
        if "ms_per_step_chain_off_on" in r:
            off, on = r["ms_per_step_chain_off_on"]
            print(f"   draft chained behind the verify: off {off[0]:.3f} / {off[1]:.3f}, on {on[0]:.3f} / {on[1]:.3f} "
                  "ms/step (alternated)")
        print("   per step: " + ", ".join(f"{k} {v:.1f}" for k, v in r["timeline"].items()))
        print("   one generation: " + ", ".join(f"{k} {v:.2f}" for k, v in r["first_steps"].items()
                                             if not isinstance(v, str)))
        for k, v in r["first_steps"].items():
            if isinstance(v, str):
                print(f"   {k}: {v}")
        for kind in ("target_graphs", "draft_graphs"):
            for key, c in r.get(kind, {}).items():
                print(f"   {kind[:-7]} graph {key}: launch {c['host_us']:.1f} us host, {c['device_us']:.1f} us device")
        print(r["host_profile"])
        if "kernels" in r:
            print(r["kernels"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
