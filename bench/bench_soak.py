"""Soak: `dspark-serve serve` on a tiny pair under c concurrent streams for a long time. Every greedy output must
equal the same request's solo run (a seeded sampled one too when speculation verifies every draft,
--all-drafts: with the default policy how many drafts a step verifies depends on the batch, and with it which
tokens a sampled request draws), no request may fail, and the server's memory (the gateway and its actors, summed)
may not grow. Prints a line per minute; writes a JSON summary.

usage: python bench/bench_soak.py [--minutes 30] [--concurrency 64] [--max-tokens 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def requests(n: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    """n requests: token prompts of 1-40 tokens, greedy or seeded sampling, a few with stop token ids."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 41))]
        params = {"temperature": 0.0} if i % 3 else {"temperature": 1.0, "seed": i, "top_p": 0.9}
        if i % 7 == 0:
            params["stop_token_ids"] = [rng.randrange(1, 500) for _ in range(3)]
        out.append((prompt, params))
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its whole session (the server started Ray and its actors in it)."""
    sid = os.getsid(pid)
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != sid:
                continue
            total += int(re.search(r"VmRSS:\s+(\d+)", (d / "status").read_text()).group(1))
        except (OSError, AttributeError, ProcessLookupError):
            continue
    return total / 1024


async def one(stub, prompt: list[int], params: dict, max_tokens: int) -> tuple[list[int], str | None]:
    import grpc

    from dspark_serve.cluster.grpc_client import DSparkClient

    req = DSparkClient.request(prompt, max_tokens=max_tokens, **params)
    try:
        async for msg in stub.Generate(req, timeout=120):
            if msg.HasField("complete"):
                return list(msg.complete.output_ids), None
    except grpc.aio.AioRpcError as e:
        return [], e.code().name
    return [], "no final message"


async def soak(address: str, pid: int, args: argparse.Namespace) -> dict:
    import grpc

    from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

    reqs = requests(args.distinct)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = dspark_pb2_grpc.GenerationStub(channel)
        solo = []
        for prompt, params in reqs:  # one at a time: the reference
            ids, err = await one(stub, prompt, params, args.max_tokens)
            assert err is None, err
            solo.append(ids)
        counts = {"requests": 0, "errors": 0, "mismatches": 0, "sampled_unlike_solo": 0, "tokens": 0}
        rss, start = [tree_rss_mb(pid)], time.monotonic()
        end = start + 60 * args.minutes
        next_report = start + 60

        async def worker(w: int) -> None:
            i = w
            while time.monotonic() < end:
                prompt, params = reqs[i % len(reqs)]
                ids, err = await one(stub, prompt, params, args.max_tokens)
                counts["requests"] += 1
                counts["tokens"] += len(ids)
                counts["errors"] += err is not None
                unlike = err is None and ids != solo[i % len(reqs)]
                if params["temperature"] == 0.0 or args.all_drafts:
                    counts["mismatches"] += unlike
                else:
                    counts["sampled_unlike_solo"] += unlike
                i += args.concurrency

        async def monitor() -> None:
            nonlocal next_report
            while time.monotonic() < end:
                await asyncio.sleep(5)
                if time.monotonic() >= next_report:
                    rss.append(tree_rss_mb(pid))
                    m = (time.monotonic() - start) / 60
                    print(f"{m:5.1f} min: {counts['requests']} requests, {counts['tokens'] / (m * 60):.0f} tok/s, "
                          f"{counts['errors']} errors, {counts['mismatches']} mismatches, RSS {rss[-1]:.0f} MB",
                          flush=True)
                    next_report += 60

        await asyncio.gather(monitor(), *(worker(w) for w in range(args.concurrency)))
        rss.append(tree_rss_mb(pid))
    base = rss[1] if len(rss) > 3 else rss[0]  # after the first minute's warm-up, when there was one
    return {**counts, "minutes": args.minutes, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "rss_mb": rss, "rss_growth": rss[-1] / base - 1}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--distinct", type=int, default=96, help="distinct requests, cycled")
    ap.add_argument("--all-drafts", action="store_true",
                    help="speculation verifies every draft (the policy off): seeded sampled outputs must match too")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from dspark_serve.models.random_init import random_pair

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = random_pair(tmp, agree=0.005, block_size=6)
        cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", str(target), "--draft",
               str(draft), "--device", "cpu", "--host", "127.0.0.1", "--port", "0", "--block-size", "8",
               "--num-kv-blocks", "4096", "--max-num-seqs", str(args.concurrency),
               "--max-queue", str(2 * args.concurrency)]
        if args.all_drafts:
            cmd += ["--speculative-config", json.dumps({"enable_adaptive_verification": False})]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)
        address = None
        while address is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the server did not start")
            m = re.search(r"serving dspark.v1.Generation on (\S+:\d+)", line)
            address = m.group(1) if m else None
        try:
            result = asyncio.run(soak(address, proc.pid, args))
        finally:
            proc.send_signal(signal.SIGTERM)  # the server drains and stops its pair and Ray itself
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"{result['requests']} requests over {result['minutes']:g} min at c = {result['concurrency']}: "
          f"{result['errors']} errors, {result['mismatches']} outputs unlike their solo run, RSS growth "
          f"{100 * result['rss_growth']:.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
