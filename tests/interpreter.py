"""Test helper: Triton fixes interpreter mode when a kernel is decorated, so kernel tests rerun their own file in a
child process with TRITON_INTERPRET=1 when the current process was not started with it."""

import os
import subprocess
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rerun_under_interpreter(path: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
