"""The benchmarks' servers as child processes: `dspark-serve serve` (its address read from its log) and Ray Serve's
`serve run` of a config (up once its gRPC proxy answers), their logs drained, stopped as a group (SIGKILL after
60 s)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def start_server(args: argparse.Namespace, flags: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve", "--target", args.target,
           "--draft", args.draft, "--speculative-config", args.speculative_config, "--host", "127.0.0.1", "--port", "0",
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max(args.levels)), "--max-queue", str(4 * max(args.levels)), *flags]
    cmd += ["--device", args.device] if args.device else []
    cmd += ["--kernel-config", args.kernel_config] if getattr(args, "kernel_config", None) else []
    return launch(cmd, r"serving dspark.v1.Generation on (\S+:\d+)", args.start_timeout)


def launch(cmd: list[str], pattern: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """Start a server; -> (its process, the first group of the first log line matching `pattern`)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=_env())
    log, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        log.append(line)
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    stop(proc)
    raise RuntimeError("the server did not start:\n" + "".join(log[-40:]))


def start_serve(args: argparse.Namespace, config: Path) -> tuple[subprocess.Popen, str]:
    from dspark_serve.cluster.grpc_client import DSparkClient

    cmd = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=_env(), cwd=str(ROOT))
    address = f"127.0.0.1:{yaml_port(config)}"
    end = time.monotonic() + args.start_timeout
    while time.monotonic() < end and proc.poll() is None:
        c = DSparkClient(address, application="dspark")
        try:
            c.model_info()
            return proc, address
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(2.0)
        finally:
            c.close()
    stop(proc)
    raise RuntimeError("serve run did not start:\n" + (proc.stdout.read() or "")[-4000:])


def yaml_port(config: Path) -> int:
    import yaml

    return int(yaml.safe_load(config.read_text())["grpc_options"]["port"])


def drain(proc: subprocess.Popen) -> collections.deque:
    """Read the server's log on (its per-request lines would fill the pipe and stall it); the last lines kept."""
    tail = collections.deque(maxlen=100)
    threading.Thread(target=tail.extend, args=(proc.stdout,), daemon=True).start()
    return tail


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT if "serve.scripts" in " ".join(proc.args) else signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
