"""`dspark-serve demo`: the demo pair behind the real service. Fetches the target on first use, starts the
draft and verifier actors with the gRPC gateway (`dspark-serve serve` in a child process), streams a few
completions, and times each prompt again with speculation disabled on the same server."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = (
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards, ignoring '
    'case and non-alphanumeric characters."""\n',
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    'def parse_csv_line(line, sep=","):\n    """Split one CSV line into fields, honouring double-quoted fields."""\n',
    "The Great Barrier Reef is the world's largest coral reef system.",
)
READY = re.compile(r"serving dspark.v1.Generation on (\S+:\d+)")


# A verify step over 8 tokens costs about what 1 does on a GPU, and on a CPU with bf16 matrix units (AMX): there
# the demo verifies every draft. In fp32 on a CPU it costs about its token count (3x a plain step at 8 on the dev
# machine), so only drafts the confidence head trusts are verified (0.8x of plain decoding when all 7 drafts are
# verified, 1.0x with this threshold). All draft over the top 64 base-logit candidates: held-out code, greedy,
# CPU: tau 2.78 against 2.79 over the full vocabulary, and an H200 step 3.03 ms against 4.08 ms. The shipped
# drafter also scores only the shipped token map's 32768 tokens (gpu_spec_config): its lm_head is most of its step
# at high batch (an H100 draft step at 128 requests 2.00 -> 0.98 ms) and on a CPU in fp32, for 2 % of tau.
GPU_SPEC_CONFIG = '{"dspark_draft_topk": 64}'
CPU_SPEC_CONFIG = '{"dspark_survival_threshold": 0.3, "dspark_draft_topk": 64}'


def with_demo_map(config: str, draft: Path | str) -> str:
    """`config`, plus the shipped token map when `draft` is the shipped drafter (another drafter keeps `config`)."""
    from dspark_serve.models.demo import DEMO_DRAFTER, DEMO_TOKEN_MAP

    if Path(draft).resolve() != DEMO_DRAFTER or not DEMO_TOKEN_MAP.is_file():
        return config
    return json.dumps({**json.loads(config), "dspark_token_map": str(DEMO_TOKEN_MAP)})


def gpu_spec_config(draft: Path | str) -> str:
    """The demo's (and the benchmarks') speculative_config on a GPU: GPU_SPEC_CONFIG, with the shipped map for the
    shipped drafter."""
    return with_demo_map(GPU_SPEC_CONFIG, draft)


def cpu_fp32_spec_config(draft: Path | str) -> str:
    """The same on a CPU in fp32: CPU_SPEC_CONFIG, with the shipped map for the shipped drafter."""
    return with_demo_map(CPU_SPEC_CONFIG, draft)


def cpu_dtype() -> str:
    """bfloat16 where the CPU has bf16 matrix units (AMX tiles, AVX512-BF16), else float32."""
    import torch
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return "bfloat16" if amx and bf16 else "float32"


def _start_server(target: Path, draft: Path, cuda: bool, spec_config: str | None,
                  timeout_s: float, colocate: bool | None = None,
                  dtype: str | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", str(target), "--draft", str(draft),
           "--host", "127.0.0.1", "--port", "0", "--max-model-len", "2048", "--num-kv-blocks", "1024"]
    cmd += ["--speculative-config", spec_config] if spec_config else []
    cmd += [] if colocate is None else ["--colocate" if colocate else "--no-colocate"]
    cmd += [] if cuda else ["--device", "cpu"]
    cmd += ["--dtype", dtype] if dtype else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        log.append(line)
        m = READY.search(line)
        if m:
            return proc, m.group(1)
    _stop(proc)
    raise RuntimeError("the server did not start:\n" + "".join(log[-30:]))


def _chat(text: str) -> list[dict]:
    """One user message: the server renders it with the model's chat template."""
    return [{"role": "user", "content": text}]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # drains, then stops the pair and Ray
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_demo(args: argparse.Namespace) -> int:
    import grpc
    import torch

    from dspark_serve.models.demo import DEMO_DRAFTER
    from dspark_serve.models.fetch import FetchError, fetch_demo_target

    from ..grpc_client import DSparkClient

    if not 1 <= args.num_prompts <= len(PROMPTS):
        print(f"dspark-serve demo: error: --num-prompts must be in [1, {len(PROMPTS)}]", file=sys.stderr)
        return 2
    if args.max_tokens is not None and args.max_tokens < 1:
        print("dspark-serve demo: error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        target = Path(args.target) if args.target else fetch_demo_target()
    except (FetchError, OSError) as e:
        print(f"dspark-serve demo: error: could not fetch the demo target: {e}", file=sys.stderr)
        return 1
    draft = Path(args.draft) if args.draft else DEMO_DRAFTER
    if not (draft / "config.json").is_file():
        print(f"dspark-serve demo: error: no draft checkpoint at {draft}", file=sys.stderr)
        return 1
    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    dtype = args.dtype or (None if cuda else cpu_dtype())
    cpu_fp32 = not cuda and dtype == "float32"
    spec_config = args.speculative_config or (cpu_fp32_spec_config(draft) if cpu_fp32 else gpu_spec_config(draft))
    actors = {True: "the verifier actor (with the draft inside)", False: "the verifier and draft actors",
              None: "the model pair"}[args.colocate]
    print(f"target {target}\ndraft  {draft}\ndtype {dtype or 'bfloat16 (the checkpoint)'}\n"
          f"speculative_config {spec_config}\nstarting Ray, {actors} and the gateway ...", flush=True)
    try:
        proc, address = _start_server(target, draft, cuda, spec_config, args.start_timeout, args.colocate, dtype)
    except RuntimeError as e:
        print(f"dspark-serve demo: error: {e}", file=sys.stderr)
        return 1
    client = DSparkClient(address)
    totals = {"spec_tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0, "steps": 0, "accepted": 0}
    try:
        print(f"serving on {address}; warming up ...", flush=True)
        for disable in (False, True):  # the whole path once, so that the timed runs find it warm
            client.generate(_chat(PROMPTS[-1]), max_tokens=args.max_tokens or 128, temperature=0.0,
                            disable_speculation=disable)
        for n, text in enumerate(PROMPTS[:args.num_prompts], 1):
            prompt = _chat(text)
            print(f"\n=== prompt {n}: {text.splitlines()[0][:80]}\n", flush=True)
            t0, final = time.perf_counter(), None
            for msg in client.stream(prompt, max_tokens=args.max_tokens or 128, temperature=0.0):
                if msg.HasField("chunk"):
                    print(msg.chunk.text, end="", flush=True)
                elif msg.HasField("complete"):
                    final = msg.complete
            spec_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            plain = client.generate(prompt, max_tokens=args.max_tokens or 128, temperature=0.0,
                                     disable_speculation=True)
            plain_s = time.perf_counter() - t0
            s = final.stats
            spec_n, plain_n = len(final.output_ids), len(plain["token_ids"])
            totals.update(spec_tokens=totals["spec_tokens"] + spec_n, spec_s=totals["spec_s"] + spec_s,
                          plain_tokens=totals["plain_tokens"] + plain_n, plain_s=totals["plain_s"] + plain_s,
                          steps=totals["steps"] + s.num_spec_steps, accepted=totals["accepted"] + s.num_accepted_tokens)
            same = list(final.output_ids) == plain["token_ids"]
            print(f"\n--- tau {s.mean_acceptance_length:.2f}; speculative {spec_n / spec_s:.1f} tok/s, plain "
                  f"{plain_n / plain_s:.1f} tok/s ({plain_s / spec_s * spec_n / max(plain_n, 1):.2f}x); "
                  f"identical to plain greedy: {same}", flush=True)
            if not same and dtype != "float32":
                print("    (in bf16 a verify pass over 8 rows and a decode step over 1 round differently, so a "
                      "near-tie can flip and the texts part there; --dtype float32 compares exactly)", flush=True)
        t = totals
        spec_tps, plain_tps = t["spec_tokens"] / t["spec_s"], t["plain_tokens"] / t["plain_s"]
        print(f"\nall prompts: tau {(t['steps'] + t['accepted']) / max(t['steps'], 1):.2f}, speculative "
              f"{spec_tps:.1f} tok/s vs plain {plain_tps:.1f} tok/s: speedup {spec_tps / plain_tps:.2f}x "
              f"({'GPU' if cuda else 'CPU'}, {dtype or 'bfloat16'}, batch 1, through the gRPC service)")
    except grpc.RpcError as e:
        print(f"\ndspark-serve demo: error: the server answered {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
        _stop(proc)
    return 0
