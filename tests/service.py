"""Test helper: the real `dspark-serve serve` in its own process session, on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServerProcess:
    def __init__(self, target: Path | None, draft: Path | None, *extra: str, timeout_s: float = 180.0,
                 check_blocks: bool = True) -> None:
        """check_blocks: after each test the block invariant is checked on this server (plaintext; with the first
        --api-key when it has keys)."""
        import block_invariant

        self.checked = check_blocks and not any(a.startswith("--ssl") for a in extra)
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        self.address = self.http_address = None
        block_invariant.SERVERS.add(self)
        cmd = [sys.executable, "-m", "dspark_serve.cluster.commands", "serve",
               *(["--target", str(target)] if target else []), "--port", "0",
               "--host", "127.0.0.1", "--num-cpus", "4", "--block-size", "8", "--num-kv-blocks", "1024", *extra]
        if draft is not None:
            cmd += ["--draft", str(draft)]
        if not any(a == "--step-costs" for a in extra):  # pinned, as in-process engines' are (tests/conftest.py)
            import json

            from engine_pairs import cheap_draft_costs
            cmd += ["--step-costs", json.dumps(cheap_draft_costs().to_dict())]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.address is None:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.log.append(line)
            m = re.search(r"serving the OpenAI-compatible HTTP API on (127\.0\.0\.1:\d+)", line)
            if m:
                self.http_address = m.group(1)
            m = re.search(r"serving dspark.v1.Generation on (127\.0\.0\.1:\d+)", line)
            if m:
                self.address = m.group(1)
        if self.address is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        # The server logs a line per request: read on, or a full pipe would block it.
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def terminate(self) -> None:
        """SIGTERM to the server process only (not its Ray workers): it drains and stops the pair itself."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
