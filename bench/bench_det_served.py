"""The deterministic mode through `dspark-serve serve`: is every output the same as the request alone on a plain
server in the same mode, at each load, and what does the mode cost? Three servers in turn:

  plain-det  `serve --deterministic` without a draft: every request alone (the references), then at each level
  spec-det   `serve --deterministic` with the draft: every level, speculative and (speculation disabled) plain
  spec       `serve` with default flags: the levels of the cost comparison, speculative

Requests: --requests held-out code prompts greedy, the same prompts seeded at temperature 1 (seed = index), and
--prose held-out prose prompts greedy, all through the target's chat template, --max-tokens each (ignore_eos). Each
row reports tokens/s and how many outputs equal their reference; the table last gives the mode's cost
(spec-det / spec tokens/s at each level of --cost-levels).

usage: RAY_AUTH_MODE=token python bench/bench_det_served.py --target DIR [--draft DIR] [--levels 1 8 32 64]
       [--requests 64] [--prose 16] [--max-tokens 256] [--kernel-config JSON] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from bench_service import chat_prompts
from servers import drain, launch, stop


async def _run(address: str, jobs: list[tuple[str, dict]], concurrency: int) -> tuple[list[list[int]], float]:
    """Jobs (prompt, sampling) kept `concurrency` in flight; -> (each job's output ids, wall seconds)."""
    import grpc

    from dspark_serve.cluster.grpc_client import DSparkClient
    from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

    outs: list[list[int] | None] = [None] * len(jobs)
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = dspark_pb2_grpc.GenerationStub(channel)
        todo = list(range(len(jobs)))

        async def worker() -> None:
            while todo:
                i = todo.pop(0)
                prompt, kw = jobs[i]
                async for msg in stub.Generate(DSparkClient.request(prompt, **kw), timeout=600):
                    if msg.HasField("complete"):
                        outs[i] = list(msg.complete.output_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outs, time.perf_counter() - t0


def run(address: str, jobs: list[tuple[str, dict]], concurrency: int) -> tuple[list[list[int]], float]:
    return asyncio.run(_run(address, jobs, concurrency))


def server(args, draft: bool, deterministic: bool):
    cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", args.target, "--host",
           "127.0.0.1", "--port", "0", "--max-num-seqs", str(max(args.levels + [args.prose])), "--max-queue", "512",
           "--max-model-len", str(args.max_model_len)]
    cmd += ["--draft", args.draft, "--speculative-config", args.speculative_config] if draft else []
    cmd += ["--deterministic"] if deterministic else []
    cmd += ["--kernel-config", args.kernel_config] if deterministic and args.kernel_config else []
    t0 = time.perf_counter()
    proc, address = launch(cmd, r"serving dspark.v1.Generation on (\S+:\d+)", args.start_timeout)
    drain(proc)
    run(address, [("warm up", dict(temperature=0.0, max_tokens=8))], 1)
    print(f"{'spec' if draft else 'plain'}{'-det' if deterministic else ''}: up in {time.perf_counter() - t0:.1f} s "
          f"at {address}", flush=True)
    return proc, address


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.cluster.commands.demo import gpu_spec_config
    from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--speculative-config", help="JSON with vLLM's names (default: the demo's, "
                    "gpu_spec_config)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--cost-levels", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prose", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--kernel-config", help="KernelConfig fields as JSON for the --deterministic servers")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.speculative_config = args.speculative_config or gpu_spec_config(args.draft)
    n, top = args.max_tokens, max(args.levels)
    greedy = dict(temperature=0.0, max_tokens=n, ignore_eos=True)
    code, prose = chat_prompts(args.target, args.requests)[0], chat_prompts(args.target, args.prose, "prose")[0]
    kinds = {"code": [(p, greedy) for p in code],
             "seeded": [(p, dict(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)) for i, p in enumerate(code)],
             "prose": [(p, greedy) for p in prose]}
    plain_kw = lambda jobs: [(p, {**kw, "disable_speculation": True}) for p, kw in jobs]  # noqa: E731
    result: dict = {"max_tokens": n, "requests": args.requests, "prose": args.prose, "rows": []}
    refs: dict[str, list] = {}

    def row(server_name: str, mode: str, kind: str, c: int, jobs: list) -> list[list[int]]:
        outs, wall = run(address, jobs, c)
        ref = refs.get(kind)
        equal = sum(a == b for a, b in zip(outs, ref)) if ref is not None else None
        r = {"server": server_name, "mode": mode, "kind": kind, "concurrency": c, "requests": len(jobs),
             "tok_s": sum(len(o) for o in outs) / wall, "equal": equal}
        result["rows"].append(r)
        print(f"{server_name:>9} {mode:>5} {kind:>6} c={c:<3} {r['tok_s']:8.1f} tok/s  equal to alone "
              f"{'-' if equal is None else equal}/{len(jobs)}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return outs

    for name, draft, det in (("plain-det", False, True), ("spec-det", True, True), ("spec", True, False)):
        proc, address = server(args, draft, det)
        try:
            if name == "plain-det":
                for kind, jobs in kinds.items():
                    refs[kind] = row(name, "plain", kind, 1, jobs)
                for c in [c for c in args.levels if c > 1]:
                    row(name, "plain", "code", c, kinds["code"])
                row(name, "plain", "seeded", top, kinds["seeded"])
            elif name == "spec-det":
                for c in args.levels:
                    row(name, "spec", "code", c, kinds["code"])
                    row(name, "plain", "code", c, plain_kw(kinds["code"]))
                row(name, "spec", "prose", 1, kinds["prose"])
                row(name, "spec", "prose", len(prose), kinds["prose"])
                row(name, "spec", "seeded", 1, kinds["seeded"])
                row(name, "spec", "seeded", top, kinds["seeded"])
            else:
                for c in args.cost_levels:
                    row(name, "spec", "code", c, kinds["code"])
        finally:
            stop(proc)
    by = {(r["server"], r["mode"], r["kind"], r["concurrency"]): r for r in result["rows"]}
    result["cost"] = {c: by[("spec-det", "spec", "code", c)]["tok_s"] / by[("spec", "spec", "code", c)]["tok_s"]
                      for c in args.cost_levels if ("spec-det", "spec", "code", c) in by}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{'server':>9} {'mode':>5} {'kind':>6} {'c':>3} {'tok/s':>9} {'equal':>7}")
    for r in result["rows"]:
        eq = "-" if r["equal"] is None else f"{r['equal']}/{r['requests']}"
        print(f"{r['server']:>9} {r['mode']:>5} {r['kind']:>6} {r['concurrency']:>3} {r['tok_s']:9.1f} {eq:>7}")
    print("deterministic / default tokens/s (speculative, code): "
          + ", ".join(f"c = {c}: {x:.2f}" for c, x in result["cost"].items()))
    return result


if __name__ == "__main__":
    main()
