"""The served path against the in-process engine, in one run: tokens/s, TTFT p50/p99, TPOT p50, tau and the
channel's ms per step, plain and speculative, at each concurrency, for

  engine    the in-process LLM (continuous batching, the same requests)
  default   `dspark-serve serve` with default flags (one GPU: the draft inside the verifier actor)
  colocate  `dspark-serve serve --colocate`
  split     `dspark-serve serve --no-colocate` (separate draft actor and step channel)
  gateways  `dspark-serve serve --api-server-count N` (--api-server-count, default 4: N gateway processes)
  paced     `dspark-serve serve --stream-messages-per-s 2000` (fewer, larger chunk messages than the default 6000)
  serve     Ray Serve's gRPC proxy, with deploy/serve.yaml pointed at the same pair

Held-out code prompts through the target's chat template, greedy, each level c keeping c requests in flight
until --requests have run (a warm-up wave first); with --request-rates, requests also arrive as a Poisson process
at each rate (requests/s, as vLLM's serving benchmark --request-rate), with no cap on those in flight, and each
rate reports goodput: the requests per second that met TTFT <= --goodput-ttft-ms and TPOT <= --goodput-tpot-ms.
Plain = speculation disabled per request on the same server. Clients run in several processes, so that the
gateway, not the load generator, is what is measured, and each of the c clients has a connection of its own.

usage: python bench/bench_service.py [--target DIR] [--draft DIR] [--levels 1 8 32 64] [--request-rates 4 16 64]
                                     [--requests 64] [--max-tokens 128] [--layouts engine default split serve]
                                     [--rounds 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from servers import ROOT, drain, start_serve, start_server, stop
from service_clients import LOOP_TIMES, cpu_use, host_cpu, load, loop_times

BENCH = Path(__file__).resolve().parent
LAYOUT_FLAGS = {"default": [], "colocate": ["--colocate"], "split": ["--no-colocate"], "gateways": [],
                "paced": ["--stream-messages-per-s", "2000"]}


def chat_prompts(target: str, n: int, kind: str = "code") -> tuple[list[str], str]:
    """n held-out prompts of `kind` (code or prose; cycled) as the target's chat template renders them; -> (prompts,
    template)."""
    from dspark_serve.models.chat_template import ChatTemplateError, load_chat_template, render_chat
    from dspark_serve.train.data import CHAT_TEMPLATE, read_prompt_texts

    texts = read_prompt_texts(BENCH / "prompts" / f"heldout_{kind}.jsonl")
    try:
        tpl = load_chat_template(target)
        render = lambda t: render_chat(tpl, [{"role": "user", "content": t}], add_generation_prompt=True)  # noqa: E731
        name = tpl.source
    except ChatTemplateError:
        render, name = CHAT_TEMPLATE.format, "train.data.CHAT_TEMPLATE"
    return [render(texts[i % len(texts)]) for i in range(n)], name


GOODPUT = {"ttft_ms": 200.0, "tpot_ms": 20.0}  # a request meets its service level (set from the flags)


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Offsets (s) of n Poisson arrivals at `rate` requests/s (exponential gaps, seeded)."""
    import random

    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize(records: list[dict], wall_s: float) -> dict:
    """records: per request t0, t_first, t_end (seconds), tokens, steps, accepted, transfer_ms, the step loop's
    own first_token_ms and queue_ms, and served, the gateway's gateway_intake_ms and gateway_first_token_ms. A
    served TTFT splits (p50s) into: outside the gateway (the client's TTFT less the gateway's, grpc both ways),
    the gateway's intake (to its Add), the Add's wait for the step loop (the gateway's TTFT less its intake and the
    loop's) and the loop's own."""
    ok = [r for r in records if "error" not in r]
    good = [r for r in ok if 1e3 * (r["t_first"] - r["t0"]) <= GOODPUT["ttft_ms"]
            and 1e3 * (r["t_end"] - r["t_first"]) / max(r["tokens"] - 1, 1) <= GOODPUT["tpot_ms"]]
    steps = sum(r["steps"] for r in ok)
    ttft = sorted(1e3 * (r["t_first"] - r["t0"]) for r in ok)
    tpot = [1e3 * (r["t_end"] - r["t_first"]) / max(r["tokens"] - 1, 1) for r in ok]
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"requests": len(ok), "errors": len(records) - len(ok), "tokens": sum(r["tokens"] for r in ok),
            "tok_s": sum(r["tokens"] for r in ok) / wall_s, "ttft_ms_p50": pct(ttft, 0.5),
            "ttft_ms_p99": pct(ttft, 0.99), "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"),
            "tpot_ms_p99": pct(sorted(tpot), 0.99), "goodput_req_s": len(good) / wall_s,
            "goodput_frac": len(good) / max(len(ok), 1),
            "tau": (sum(r["accepted"] for r in ok) + steps) / max(steps, 1),
            "channel_ms_per_step": sum(r["transfer_ms"] for r in ok) / max(steps, 1),
            "loop_ttft_ms_p50": statistics.median(r["first_token_ms"] for r in ok) if ok else float("nan"),
            "queue_ms_p50": statistics.median(r["queue_ms"] for r in ok) if ok else float("nan"),
            "e2e_ms_p50": statistics.median(1e3 * (r["t_end"] - r["t0"]) for r in ok) if ok else float("nan"),
            "loop_e2e_ms_p50": statistics.median(r["finish_ms"] for r in ok) if ok else float("nan"),
            "loop_tpot_ms_p50": statistics.median((r["finish_ms"] - r["first_token_ms"]) / max(r["tokens"] - 1, 1)
                                                  for r in ok) if ok else float("nan"),
            **_ttft_split(ok)}


def _ttft_split(ok: list[dict]) -> dict:
    served = [r for r in ok if r.get("gateway_first_token_ms")]
    if not served:
        return {}
    med = statistics.median
    return {"outside_gateway_ms_p50": med(1e3 * (r["t_first"] - r["t0"]) - r["gateway_first_token_ms"] for r in served),
            "gateway_intake_ms_p50": med(r["gateway_intake_ms"] for r in served),
            "add_wait_ms_p50": med(r["gateway_first_token_ms"] - r["gateway_intake_ms"] - r["first_token_ms"]
                                   for r in served)}


# -- the in-process engine ---------------------------------------------------------------------------------------

def engine_run(llm, prompts: list[str], concurrency: int, max_tokens: int, plain: bool,
               loop: dict | None = None) -> tuple[list[dict], float]:
    """Keep `concurrency` requests in flight until all prompts ran; -> (records, wall seconds). `loop`: the steps and
    their seconds are added to it (the served step loop's loop_steps and loop_step_s)."""
    from dspark_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    todo, live, records = list(prompts), {}, []
    t_start = time.monotonic()
    while todo or live:
        while todo and len(live) < concurrency:
            t0 = time.monotonic()
            rid = llm.add_request(todo.pop(0), params, num_speculative_tokens=0 if plain else None)
            live[rid] = {"t0": t0, "t_first": None, "tokens": 0}
        t1 = time.perf_counter()
        outs = llm.step()
        if loop is not None:
            loop["loop_steps"] += 1
            loop["loop_step_s"] += time.perf_counter() - t1
        for out in outs:
            r = live.get(out.request_id)
            if r is None:
                continue
            now = time.monotonic()
            if out.new_token_ids and r["t_first"] is None:
                r["t_first"] = now
            if out.finished:
                s = out.stats
                records.append({**r, "t_end": now, "tokens": len(out.token_ids), "steps": s["steps"],
                                "accepted": s["accepted"], "transfer_ms": s["transfer_ms"],
                                "first_token_ms": s["first_token_ms"], "queue_ms": s["queue_ms"],
                                "finish_ms": s["finish_ms"]})
                del live[out.request_id]
    return records, time.monotonic() - t_start


def engine_poisson(llm, prompts: list[str], offsets: list[float], max_tokens: int,
                   plain: bool) -> tuple[list[dict], float]:
    """Each prompt added at its arrival offset, stepping while any runs; -> (records, wall seconds)."""
    from dspark_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    todo, live, records = list(zip(offsets, prompts)), {}, []
    t_start = time.monotonic()
    while todo or live:
        now = time.monotonic() - t_start
        while todo and todo[0][0] <= now:
            at, prompt = todo.pop(0)
            rid = llm.add_request(prompt, params, num_speculative_tokens=0 if plain else None)
            live[rid] = {"t0": t_start + at, "t_first": None, "tokens": 0}
        if not live:
            time.sleep(max(0.0, todo[0][0] - now))
            continue
        for out in llm.step():
            r = live.get(out.request_id)
            if r is None:
                continue
            t = time.monotonic()
            if out.new_token_ids and r["t_first"] is None:
                r["t_first"] = t
            if out.finished:
                s = out.stats
                records.append({**r, "t_end": t, "tokens": len(out.token_ids), "steps": s["steps"],
                                "accepted": s["accepted"], "transfer_ms": s["transfer_ms"],
                                "first_token_ms": s["first_token_ms"], "queue_ms": s["queue_ms"],
                                "finish_ms": s["finish_ms"]})
                del live[out.request_id]
    return records, time.monotonic() - t_start


def engine_rows(args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    import torch

    from dspark_serve.engine.llm import LLM

    llm = LLM(args.target, args.draft, args.speculative_config, device=args.device, max_num_seqs=max(args.levels),
              num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len, kernel_config=args.kernel_config)
    rows = []
    for c in args.levels:
        for rnd, plain in _turns(args.rounds):
            if rnd == 0:
                engine_run(llm, prompts[:c], c, args.max_tokens, plain)  # warm-up: this level's graph buckets
            before, loop = llm.num_kernel_compiles, dict.fromkeys(LOOP_TIMES, 0.0)
            c0 = host_cpu()
            records, wall = engine_run(llm, prompts, c, args.max_tokens, plain, loop)
            rows.append(_row("engine", c, plain, summarize(records, wall), rnd))
            rows[-1].update(cpu_use(c0, host_cpu(), wall))
            rows[-1].update(loop_times(loop, wall))
            rows[-1]["kernels_compiled_during"] = llm.num_kernel_compiles - before
            rows[-1]["kernels_compiled_since_start"] = llm.num_kernel_compiles
    for rate in args.request_rates:
        offsets = arrivals(len(prompts), rate)
        for plain in (True, False):
            records, wall = engine_poisson(llm, prompts, offsets, args.max_tokens, plain)
            rows.append(_row("engine", f"{rate:g}/s", plain, summarize(records, wall)))
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def served_rows(layout: str, address: str, application: str | None, args: argparse.Namespace,
                prompts: list[str]) -> list[dict]:
    from dspark_serve.cluster.grpc_client import DSparkClient

    stats = DSparkClient(address, application=application)
    rows = []
    for c in args.levels:
        for rnd, plain in _turns(args.rounds):
            if rnd == 0:
                load(address, application, prompts[:c], c, args.max_tokens, plain, args.client_procs)  # warm-up
            before = stats.server_stats()
            cpu: dict = {}
            records, wall = load(address, application, prompts, c, args.max_tokens, plain, args.client_procs,
                                 cpu=cpu)
            rows.append(_row(layout, c, plain, summarize(records, wall), rnd))
            rows[-1].update(cpu, t_first_sent=_sent(records))
            after = stats.server_stats()
            rows[-1].update(loop_times({k: getattr(after, k) - getattr(before, k) for k in LOOP_TIMES}, wall))
            rows[-1]["graphs_recorded_during"] = after.num_cuda_graphs - before.num_cuda_graphs
            rows[-1]["kernels_compiled_during"] = after.num_kernel_compiles - before.num_kernel_compiles
            rows[-1]["kernels_compiled_since_start"] = after.num_kernel_compiles
            print(_line(rows[-1]), flush=True)
    for rate in args.request_rates:
        offsets = arrivals(len(prompts), rate)
        for plain in (True, False):
            records, wall = load(address, application, prompts, 0, args.max_tokens, plain, args.client_procs,
                                 offsets)
            rows.append(_row(layout, f"{rate:g}/s", plain, summarize(records, wall), t_first_sent=_sent(records)))
            print(_line(rows[-1]), flush=True)
    stats.close()
    return rows


def _turns(rounds: int) -> list[tuple[int, bool]]:
    """(round, plain) of a level's runs: plain then speculative, `rounds` times, alternating."""
    return [(rnd, plain) for rnd in range(rounds) for plain in (True, False)]


def _row(layout: str, level: int | str, plain: bool, summary: dict, rnd: int = 0, **extra) -> dict:
    """level: a concurrency, or a request rate ("4/s")."""
    return dict(layout=layout, concurrency=level, mode="plain" if plain else "spec", round=rnd, **summary, **extra)


def _sent(records: list[dict]) -> float | None:  # when a run's first request left (the step trace's clock)
    return min((r["t0"] for r in records if "t0" in r), default=None)


def _line(r: dict) -> str:
    level = f"c={r['concurrency']}" if isinstance(r["concurrency"], int) else f"rate {r['concurrency']}"
    return (f"{r['layout']:>8} {level:<10} {r['mode']:<5} {r['tok_s']:9.1f} tok/s  TTFT p50 "
            f"{r['ttft_ms_p50']:8.2f} p99 {r['ttft_ms_p99']:8.2f} ms  TPOT p50 {r['tpot_ms_p50']:6.3f} p99 "
            f"{r['tpot_ms_p99']:6.3f} ms  goodput {r['goodput_req_s']:.2f} req/s ({r['goodput_frac']:.0%})  tau "
            f"{r['tau']:.2f}  channel {r['channel_ms_per_step']:.3f} ms/step  loop TTFT p50 {r['loop_ttft_ms_p50']:.2f} "
            f"queue {r['queue_ms_p50']:.2f} ms  e2e p50 {r['e2e_ms_p50']:.1f}, loop's {r['loop_e2e_ms_p50']:.1f} ms  loop "
            f"TPOT p50 {r['loop_tpot_ms_p50']:.3f} ms  loop ms/step: step {r.get('loop_step_ms', 0):.3f} intake "
            f"{r.get('loop_intake_ms', 0):.3f} publish {r.get('loop_publish_ms', 0):.3f} ({r.get('loop_steps', 0)} "
            f"steps, busy {r.get('loop_busy_frac', 0):.0%})  graphs +{r.get('graphs_recorded_during', 0)}  kernels "
            f"+{r.get('kernels_compiled_during', 0)} ({r.get('kernels_compiled_since_start', 0)} since start)  "
            f"errors {r['errors']}  cores busy: host {r.get('host_busy_cores', 0):.1f}"
            + "".join(f", {k[10:]} {v:.2f}" for k, v in r.items() if k.startswith("cpu_cores "))
            + (f"  TTFT split p50: outside the gateway {r['outside_gateway_ms_p50']:.2f}, intake "
               f"{r['gateway_intake_ms_p50']:.2f}, Add wait {r['add_wait_ms_p50']:.2f} ms"
               if "outside_gateway_ms_p50" in r else ""))


# -- servers -------------------------------------------------------------------------------------------------------

def serve_config(args: argparse.Namespace, folder: Path) -> Path:
    """deploy/serve.yaml, its application pointed at this pair on this machine."""
    import yaml

    cfg = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    app = cfg["applications"][0]
    app["args"].update(target=args.target, draft=args.draft, speculative_config=json.loads(args.speculative_config),
                       num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                       max_num_seqs=max(args.levels), max_queue=4 * max(args.levels), channel_host="127.0.0.1")
    app["args"].pop("target_resources", None)
    app["args"].pop("draft_resources", None)
    app["args"]["device"] = args.device or "auto"
    app["args"].pop("dtype", None)
    cfg["http_options"]["host"] = "127.0.0.1"
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# -- the report ----------------------------------------------------------------------------------------------------

def ratios(rows: list[dict]) -> list[dict]:
    """Per layout and level: spec / plain, and each layout's tok/s over the engine's (same mode)."""
    by = {(r["layout"], r["concurrency"], r["mode"], r.get("round", 0)): r for r in rows}
    out = []
    for (layout, c, mode, rnd), r in by.items():
        if mode != "spec":
            continue
        plain = by.get((layout, c, "plain", rnd))
        eng = by.get(("engine", c, "spec", rnd))
        eng_plain = by.get(("engine", c, "plain", rnd))
        out.append({"layout": layout, "concurrency": c, "round": rnd,
                    "spec_over_plain": r["tok_s"] / plain["tok_s"] if plain else None,
                    "spec_over_engine": r["tok_s"] / eng["tok_s"] if eng else None,
                    "plain_over_engine": plain["tok_s"] / eng_plain["tok_s"] if plain and eng_plain else None,
                    "ttft_added_ms_p50": r["ttft_ms_p50"] - eng["ttft_ms_p50"] if eng else None})
    return out


def print_table(rows: list[dict], summary: list[dict]) -> None:
    print(f"\n{'layout':>8} {'load':>6} {'round':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'spec/plain':>10} "
          f"{'spec/engine':>11} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'tau':>5} {'channel':>8} "
          f"{'goodput plain/spec':>19}")
    by = {(r["layout"], r["concurrency"], r["mode"], r.get("round", 0)): r for r in rows}
    for s in summary:
        key = (s["layout"], s["concurrency"])
        sp, pl = by[(*key, "spec", s["round"])], by.get((*key, "plain", s["round"]))
        f = lambda x, w, p: f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"  # noqa: E731
        good = f"{pl['goodput_req_s']:.2f} / {sp['goodput_req_s']:.2f}" if pl else "-"
        print(f"{s['layout']:>8} {s['concurrency']!s:>6} {s['round']:>5} {f(pl and pl['tok_s'], 11, 1)} "
              f"{sp['tok_s']:10.1f} {f(s['spec_over_plain'], 10, 2)} {f(s['spec_over_engine'], 11, 2)} "
              f"{sp['ttft_ms_p50']:8.2f} {sp['ttft_ms_p99']:7.1f} {sp['tpot_ms_p50']:8.3f} {sp['tau']:5.2f} "
              f"{sp['channel_ms_per_step']:8.3f} {good:>19}")


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.cluster.commands.demo import gpu_spec_config
    from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, "
                    "gpu_spec_config)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--kernel-config", help="JSON of KernelConfig fields, for the engine and the servers (A/B runs)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--request-rates", type=float, nargs="*", default=[],
                    help="also Poisson arrivals at these rates (requests/s; vLLM's --request-rate)")
    ap.add_argument("--goodput-ttft-ms", type=float, default=200.0)
    ap.add_argument("--goodput-tpot-ms", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=64, help="requests per level and mode")
    ap.add_argument("--rounds", type=int, default=1,
                    help="each level's plain and speculative runs this many times, alternating (rows name their "
                         "round)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--layouts", nargs="+", default=["engine", "default", "split", "serve"],
                    choices=["engine", "default", "colocate", "split", "gateways", "paced", "serve"])
    ap.add_argument("--api-server-count", type=int, default=4, help="gateway processes of the gateways layout")
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--client-procs", type=int, default=8, help="load-generator processes at most")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--step-trace", metavar="DIR", help="the served step loops' per-step lines into "
                    "DIR/steps_LAYOUT.jsonl (rows name when their first request left: t_first_sent)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(args.draft)
    GOODPUT.update(ttft_ms=args.goodput_ttft_ms, tpot_ms=args.goodput_tpot_ms)
    prompts, template = chat_prompts(args.target, args.requests)
    rows: list[dict] = []
    result = {"target": args.target, "draft": args.draft, "speculative_config": args.speculative_config,
              "chat_template": template, "max_tokens": args.max_tokens, "requests": args.requests, "rows": rows}
    save = lambda: Path(args.json).write_text(json.dumps(result, indent=2)) if args.json else None  # noqa: E731
    if "engine" in args.layouts:
        rows += engine_rows(args, prompts)
        for r in rows:
            print(_line(r), flush=True)
        save()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in [x for x in args.layouts if x != "engine"]:
            t0 = time.monotonic()
            trace = ["--step-trace", str(Path(args.step_trace) / f"steps_{layout}.jsonl")] if args.step_trace else []
            proc, address = start_serve(args, serve_config(args, Path(tmp))) if layout == "serve" else \
                start_server(args, LAYOUT_FLAGS[layout] + trace + (
                    ["--api-server-count", str(args.api_server_count)] if layout == "gateways" else []))
            drain(proc)
            print(f"{layout}: up in {time.monotonic() - t0:.1f} s at {address}", flush=True)
            try:
                rows += served_rows(layout, address, "dspark" if layout == "serve" else None, args, prompts)
            finally:
                stop(proc)
            save()
    result["summary"] = ratios(rows)
    print_table(rows, result["summary"])
    save()
    return result


if __name__ == "__main__":
    main()
