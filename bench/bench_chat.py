"""Multi-turn chat through the served pair: the prefix cache on against off, and two Serve replicas routed by prompt
prefix against Serve's power of two choices. Each configuration starts its own server, runs the conversations and
stops it:

  cache         `dspark-serve serve` (prefix caching on, the default)
  nocache       `dspark-serve serve --no-enable-prefix-caching`
  serve-prefix  Ray Serve (deploy/serve.yaml, serve-cpu.yaml with --device cpu), --replicas pinned, each pair a
                1/replicas share of the one GPU (num_gpus) and --num-kv-blocks, behind the project's prefix-affinity
                request router (cluster/prefix_router.py)
  serve-pow2    the same with Serve's default router
  engine        the in-process engine (LLM, prefix caching on), the same conversations: what the served path adds

N conversations of T turns share one system prompt of about S tokens (held-out prose, sized with the target's
tokenizer); each asks its own held-out code prompts, one a turn, and turn t's prompt is the system prompt, every
earlier question with the reply the server gave, and the new question, rendered with the target's chat template
(ChatML when it has none). c conversations run at once, each turn sent when the previous reply ended; greedy,
speculative, each reply --max-tokens long (ignore_eos). Reported per configuration: TTFT p50/p99 over all turns and
over follow-ups (t >= 1), the same from the step loop's view (from its receiving a request: what the engine spends),
tokens per verify step, output tokens/s (all output tokens / wall time), requests, errors, the prefix-cache hit
rate (cached / prompt tokens, as the server reports them), the share of follow-ups with at least half of their
prompt cached, and requests per replica. --rounds alternates the configurations; --json is written after each.

usage: python bench/bench_chat.py [--target DIR] [--draft DIR] [--conversations 64] [--turns 4]
                                  [--system-tokens 1500] [--max-tokens 64] [--concurrency C]
                                  [--layouts engine cache nocache | serve-prefix serve-pow2] [--rounds 2]
                                  [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

from bench_service import BENCH
from chat_client import render, run_conversations
from servers import ROOT, drain, start_serve, start_server, stop

PREFIX_FLAGS = {"cache": ["--enable-prefix-caching"], "nocache": ["--no-enable-prefix-caching"]}
ROUTERS = {"serve-prefix": {"seed": 0}, "serve-pow2": "power_of_two"}  # the Serve app's `router` arg
# (baseline, configuration) in the ratios
COMPARED = (("nocache", "cache"), ("serve-pow2", "serve-prefix"), ("cache", "engine"))


# -- the conversations ---------------------------------------------------------------------------------------------

def system_prompt(tokenizer, tokens: int) -> str:
    """Held-out prose, cycled, until about `tokens` tokens; the same text on every run."""
    from dspark_serve.train.data import read_prompt_texts

    texts = read_prompt_texts(BENCH / "prompts" / "heldout_prose.jsonl")
    parts = ["You are a careful programming assistant. Background notes for this chat:\n"]
    n = len(tokenizer.encode(parts[0]).ids)
    while n < tokens:
        parts.append(texts[(len(parts) - 1) % len(texts)] + "\n")
        n += len(tokenizer.encode(parts[-1]).ids)
    return "".join(parts)


def conversations(n: int, turns: int) -> list[tuple[int, list[str]]]:
    """(index, its questions): held-out code prompts, each conversation its own run of them."""
    from dspark_serve.train.data import read_prompt_texts

    texts = read_prompt_texts(BENCH / "prompts" / "heldout_code.jsonl")
    return [(i, [texts[(i * turns + t) % len(texts)] for t in range(turns)]) for i in range(n)]


def chat_template(target: str):
    """(the target's template or None, its name)."""
    from dspark_serve.models.chat_template import ChatTemplateError, load_chat_template

    try:
        tpl = load_chat_template(target)
        return tpl, tpl.source
    except ChatTemplateError:
        return None, "ChatML"


def engine_conversations(llm, convs: list[tuple[int, list[str]]], concurrency: int, system: str | None, template,
                         max_tokens: int) -> list[dict]:
    """The conversations through the in-process engine, `concurrency` at once, each turn added when the previous
    reply ended; -> the records of all their turns (as the served client's)."""
    from dspark_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    todo, live, records = list(convs), {}, []

    def start(index: int, questions: list[str], turn: int, messages: list[dict]) -> None:
        messages.append({"role": "user", "content": questions[turn]})
        t0 = time.monotonic()
        rid = llm.add_request(render(template, messages), params)
        live[rid] = (index, questions, turn, messages, {"t0": t0, "t_first": None})

    while todo or live:
        while todo and len(live) < concurrency:
            index, questions = todo.pop(0)
            start(index, questions, 0, [{"role": "system", "content": system}] if system is not None else [])
        for out in llm.step():
            if out.request_id not in live:
                continue
            index, questions, turn, messages, rec = live[out.request_id]
            if out.new_token_ids and rec["t_first"] is None:
                rec["t_first"] = time.monotonic()
            if out.finished:
                del live[out.request_id]
                st = out.stats
                rec.update(t_end=time.monotonic(), tokens=len(out.token_ids), prompt_tokens=len(out.prompt_ids),
                           cached_tokens=st["cached_tokens"], replica=None, steps=st["steps"],
                           queue_ms=st["queue_ms"], engine_ttft_ms=st["first_token_ms"])
                records.append({"conversation": index, "turn": turn, **rec})
                if turn + 1 < len(questions):
                    messages.append({"role": "assistant", "content": out.text})
                    start(index, questions, turn + 1, messages)
    return records


def engine_run(args: argparse.Namespace, convs: list, system: str, template) -> tuple[list[dict], float]:
    """The engine layout: an LLM with the servers' options, warmed up as they are, then the conversations."""
    import torch

    from dspark_serve.engine.llm import LLM

    llm = LLM(args.target, args.draft, json.loads(args.speculative_config), device=args.device or "auto",
              max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len)
    warm = [(-1 - i, qs[:1]) for i, qs in conversations(args.warmup, 1)]
    engine_conversations(llm, warm, len(warm) or 1, None, template, args.max_tokens)
    records = engine_conversations(llm, convs, args.concurrency, system, template, args.max_tokens)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return records, wall_s(records)


def _client_proc(ready, out, *run_args) -> None:
    import grpc  # noqa: F401 - every client imported before they all start

    from dspark_serve.cluster.grpc_client import DSparkClient  # noqa: F401
    from dspark_serve.models.chat_template import render_chat  # noqa: F401

    try:
        ready.wait(timeout=600)
        out.put(asyncio.run(run_conversations(*run_args)))
    except Exception as e:  # noqa: BLE001 - reported as the process's error, not a hang of the others
        out.put([{"error": f"client process: {type(e).__name__}: {e}"}])


def load(address: str, application: str | None, convs: list, concurrency: int, system: str, template,
         max_tokens: int, header: str | None, procs: int) -> tuple[list[dict], float]:
    """The conversations over up to `procs` client processes, which start together (one: in this process);
    -> (records, wall s)."""
    procs = max(1, min(procs, concurrency, len(convs)))
    if procs == 1:
        records = asyncio.run(run_conversations(address, application, convs, concurrency, system, template,
                                                max_tokens, header))
        return records, wall_s(records)
    ctx = mp.get_context("spawn")
    ready, out, workers = ctx.Barrier(procs), ctx.Queue(), []
    for p in range(procs):
        share = concurrency // procs + (1 if p < concurrency % procs else 0)
        w = ctx.Process(target=_client_proc, args=(ready, out, address, application, convs[p::procs], share, system,
                                                   template, max_tokens, header))
        w.start()
        workers.append(w)
    records = [r for _ in workers for r in out.get(timeout=7200)]
    for w in workers:
        w.join()
    return records, wall_s(records)


def wall_s(records: list[dict]) -> float:
    ok = [r for r in records if "error" not in r]
    return max(r["t_end"] for r in ok) - min(r["t0"] for r in ok) if ok else float("nan")


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if "error" not in r]
    follow = [r for r in ok if r["turn"] >= 1]
    ttft = lambda rs: sorted(1e3 * ((r["t_first"] or r["t_end"]) - r["t0"]) for r in rs)  # noqa: E731
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    prompt, cached = sum(r["prompt_tokens"] for r in ok), sum(r["cached_tokens"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(ok), "errors": len(records) - len(ok), "output_tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall if ok else 0.0,
            "ttft_ms_p50": pct(ttft(ok), 0.5), "ttft_ms_p99": pct(ttft(ok), 0.99),
            "follow_up_ttft_ms_p50": pct(ttft(follow), 0.5), "follow_up_ttft_ms_p99": pct(ttft(follow), 0.99),
            # the step loop's own view: from its receiving a request to admitting it, and to its first token
            "engine_queue_ms_p50": pct(sorted(r["queue_ms"] for r in ok), 0.5),
            "engine_ttft_ms_p50": pct(sorted(r["engine_ttft_ms"] for r in ok), 0.5),
            "engine_ttft_ms_p99": pct(sorted(r["engine_ttft_ms"] for r in ok), 0.99),
            "tokens_per_step": tokens / max(1, sum(r["steps"] for r in ok)),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / max(prompt, 1),
            "follow_ups_half_cached": sum(2 * r["cached_tokens"] >= r["prompt_tokens"] for r in follow)
            / max(len(follow), 1),
            "per_replica": dict(collections.Counter(r["replica"] for r in ok if r["replica"])),
            "error_kinds": sorted({r["error"] for r in records if "error" in r})[:5]}


# -- servers -------------------------------------------------------------------------------------------------------

def serve_config(args: argparse.Namespace, layout: str, folder: Path) -> Path:
    """deploy/serve.yaml (serve-cpu.yaml on CPU) for this pair: --replicas pinned, sharing the machine's GPU, with
    the layout's request router."""
    import yaml

    cpu = args.device == "cpu"
    cfg = yaml.safe_load((ROOT / "deploy" / ("serve-cpu.yaml" if cpu else "serve.yaml")).read_text())
    app = cfg["applications"][0]
    for name in ("target_resources", "draft_resources", "dtype", "num_kv_blocks"):
        app["args"].pop(name, None)
    app["args"].update(target=args.target, draft=args.draft, speculative_config=json.loads(args.speculative_config),
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_queue=4 * args.max_num_seqs, channel_host="127.0.0.1", device=args.device or "auto",
                       router=ROUTERS[layout])
    if args.gpu_memory_utilization is not None:
        app["args"]["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        app["args"]["num_kv_blocks"] = args.num_kv_blocks
    if not cpu:
        app["args"]["num_gpus"] = 1 / args.replicas
    deployment = app["deployments"][0]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = args.replicas
    cfg["http_options"]["host"] = "127.0.0.1"
    path = folder / f"{layout}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(args: argparse.Namespace, layout: str, folder: Path):
    """The layout's server -> (process, address, Serve application or None, the replica header or None)."""
    if layout in PREFIX_FLAGS:
        proc, address = start_server(argparse.Namespace(**vars(args), levels=[args.max_num_seqs]),
                                     PREFIX_FLAGS[layout])
        return proc, address, None, None
    from dspark_serve.cluster.serve_app import REPLICA_HEADER

    proc, address = start_serve(args, serve_config(args, layout, folder))
    return proc, address, "dspark", REPLICA_HEADER


def warm_up(args: argparse.Namespace, address: str, application: str | None, template) -> None:
    """--warmup single-turn requests without the system prompt (no prefix shared with the conversations)."""
    warm = [(-1 - i, qs[:1]) for i, qs in conversations(args.warmup, 1)]
    if warm:
        asyncio.run(run_conversations(address, application, warm, len(warm), None, template, args.max_tokens))


def wait_for_replicas(address: str, header: str, replicas: int, timeout_s: float) -> set[str]:
    """Serve answers once one replica is up: one-token requests until `replicas` have answered. Their prompts are
    shorter than a block, so the prefix router has no key for them and sends each to the less loaded of two."""
    from dspark_serve.cluster.grpc_client import DSparkClient

    client, seen, end = DSparkClient(address, application="dspark"), set(), time.monotonic() + timeout_s
    try:
        while len(seen) < replicas:
            if time.monotonic() > end:
                raise RuntimeError(f"{replicas} replicas did not all answer within {timeout_s} s: {seen}")
            call = client.stub.Generate(client.request([1, 2, 3], max_tokens=1), metadata=client.metadata,
                                        timeout=60)
            for _ in call:
                pass
            seen.add(dict(call.trailing_metadata() or ()).get(header))
            seen.discard(None)
    finally:
        client.close()
    return seen


# -- the report ----------------------------------------------------------------------------------------------------

def _line(r: dict) -> str:
    return (f"{r['layout']:>12} round {r['round']}  TTFT p50 {r['ttft_ms_p50']:8.1f} p99 {r['ttft_ms_p99']:8.1f} ms  "
            f"follow-ups p50 {r['follow_up_ttft_ms_p50']:8.1f} p99 {r['follow_up_ttft_ms_p99']:8.1f} ms  "
            f"step loop TTFT p50 {r['engine_ttft_ms_p50']:8.1f} p99 {r['engine_ttft_ms_p99']:8.1f} ms  "
            f"{r['tok_s']:8.1f} tok/s  {r['tokens_per_step']:.2f} tok/step  hit rate {r['hit_rate']:6.1%}  "
            f"follow-ups >= half cached "
            f"{r['follow_ups_half_cached']:6.1%}  requests {r['requests']} errors {r['errors']}  "
            f"replicas {sorted(r['per_replica'].values(), reverse=True)}")


def ratios(rows: list[dict]) -> list[dict]:
    """Per round and compared pair: baseline / configuration TTFT p50 (all, follow-ups), configuration / baseline
    tok/s."""
    by = {(r["layout"], r["round"]): r for r in rows}
    out = []
    for base, layout in COMPARED:
        for rnd in sorted({r["round"] for r in rows}):
            a, b = by.get((base, rnd)), by.get((layout, rnd))
            if a and b and b["requests"] and a["requests"]:
                out.append({"round": rnd, "baseline": base, "layout": layout,
                            "ttft_p50": a["ttft_ms_p50"] / b["ttft_ms_p50"],
                            "follow_up_ttft_p50": a["follow_up_ttft_ms_p50"] / b["follow_up_ttft_ms_p50"],
                            "tok_s": b["tok_s"] / a["tok_s"]})
    return out


def print_table(rows: list[dict], summary: list[dict]) -> None:
    print(f"\n{'configuration':>20} {'TTFT p50':>9} {'follow-up':>9} {'tok/s':>9} {'hit rate':>8} {'>= half':>8} "
          f"{'replicas':>12}")
    for r in rows:
        reps = "/".join(str(n) for n in sorted(r["per_replica"].values(), reverse=True)) or "-"
        print(f"{r['layout'] + ' r' + str(r['round']):>20} {r['ttft_ms_p50']:9.1f} {r['follow_up_ttft_ms_p50']:9.1f} "
              f"{r['tok_s']:9.1f} {r['hit_rate']:8.1%} {r['follow_ups_half_cached']:8.1%} {reps:>12}")
    for s in summary:
        print(f"round {s['round']}: TTFT p50 {s['baseline']}/{s['layout']} {s['ttft_p50']:.2f} (follow-ups "
              f"{s['follow_up_ttft_p50']:.2f}), tok/s {s['layout']}/{s['baseline']} {s['tok_s']:.2f}")


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.cluster.commands.demo import gpu_spec_config
    from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
    from dspark_serve.models.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, "
                    "gpu_spec_config)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--kernel-config", help="JSON of KernelConfig fields, for the servers (A/B runs)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt's length, about")
    ap.add_argument("--max-tokens", type=int, default=64, help="each reply's length")
    ap.add_argument("--concurrency", type=int, help="conversations at once (default: all)")
    ap.add_argument("--layouts", nargs="+", default=["cache", "nocache"], choices=["engine", *PREFIX_FLAGS, *ROUTERS])
    ap.add_argument("--rounds", type=int, default=1, help="each layout this often, alternating")
    ap.add_argument("--replicas", type=int, default=2, help="Serve replicas, sharing the one GPU")
    ap.add_argument("--num-kv-blocks", type=int, default=16384, help="per server or replica")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="Serve replicas: size each cache by this share of the GPU instead of --num-kv-blocks (the "
                         "engine counts every process's memory on the GPU as used, the other replica's included)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, help="default: --concurrency")
    ap.add_argument("--warmup", type=int, default=8, help="single-turn requests before each measurement")
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes at most")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(args.draft)
    args.concurrency = args.concurrency or args.conversations
    args.max_num_seqs = args.max_num_seqs or args.concurrency

    tokenizer = load_tokenizer(args.target)
    system = system_prompt(tokenizer, args.system_tokens)
    template, template_name = chat_template(args.target)
    convs = conversations(args.conversations, args.turns)
    rows: list[dict] = []
    result = {"target": args.target, "draft": args.draft, "speculative_config": args.speculative_config,
              "chat_template": template_name, "system_tokens": len(tokenizer.encode(system).ids),
              "conversations": args.conversations, "turns": args.turns, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "rows": rows}
    save = lambda: Path(args.json).write_text(json.dumps(result, indent=2)) if args.json else None  # noqa: E731
    print(f"system prompt {result['system_tokens']} tokens, chat template {template_name}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for layout in args.layouts:
                if layout == "engine":
                    records, wall = engine_run(args, convs, system, template)
                    rows.append({"layout": layout, "round": rnd, **summarize(records, wall), "records": records})
                    print(_line(rows[-1]), flush=True)
                    save()
                    continue
                t0 = time.monotonic()
                proc, address, application, header = start(args, layout, Path(tmp))
                log = drain(proc)
                print(f"{layout}: up in {time.monotonic() - t0:.1f} s at {address}", flush=True)
                try:
                    if header:
                        wait_for_replicas(address, header, args.replicas, args.start_timeout)
                    warm_up(args, address, application, template)
                    records, wall = load(address, application, convs, args.concurrency, system, template,
                                         args.max_tokens, header, args.client_procs)
                finally:
                    stop(proc)
                rows.append({"layout": layout, "round": rnd, **summarize(records, wall), "records": records})
                if rows[-1]["errors"]:
                    print(f"{layout}: errors {rows[-1]['error_kinds']}; the server's last lines:\n" + "".join(log))
                print(_line(rows[-1]), flush=True)
                save()
    result["summary"] = ratios(rows)
    print_table(rows, result["summary"])
    save()
    return result


if __name__ == "__main__":
    main()
