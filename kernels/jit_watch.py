"""Triton compiles, counted and timed. A kernel compiled while requests run stalls every stream for the compile
(hundreds of ms on a fresh host), so the engine marks the end of its warm-up and logs each compile after it: which
kernel, its constants and specialised arguments, and how long it took."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("dspark_serve.kernels")


@dataclass(frozen=True)
class Compile:
    kernel: str  # the kernel's qualified name
    signature: str  # Triton's repr: options and each argument's type / specialisation
    ms: float
    after_warm_up: bool


class JitWatch:
    """Chained into Triton's compile hooks (knobs.runtime.jit_cache_hook before, jit_post_compile_hook after); a
    no-op where Triton has no such hooks (older releases) or never compiles (TRITON_INTERPRET=1)."""

    def __init__(self) -> None:
        self.compiles: list[Compile] = []
        self.warmed = False
        self._warming = 0  # warm-ups under way (an engine built while another serves compiles on purpose)
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        if self._installed or not hasattr(rt, "jit_cache_hook") or not hasattr(rt, "jit_post_compile_hook"):
            return self._installed
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook

        def on_start(**kw):
            self._started[threading.get_ident()] = time.perf_counter()
            return before(**kw) if before is not None else None

        def on_done(**kw):
            self._record(kw["fn"], kw.get("repr", ""))
            return after(**kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_start, on_done
        self._installed = True
        return True

    def _record(self, fn, signature: str) -> None:
        ms = 1e3 * (time.perf_counter() - self._started.pop(threading.get_ident(), time.perf_counter()))
        name = getattr(fn, "name", None) or str(fn)
        c = Compile(name, signature, ms, self.warmed and not self._warming)
        with self._lock:
            self.compiles.append(c)
        if c.after_warm_up:
            log.warning("Triton compiled %s while serving (%.0f ms): %s", name, ms, signature)

    @contextmanager
    def warming(self) -> Iterator[None]:
        """An engine's warm-up: its compiles are expected. After the first one ends, a compile outside a warm-up
        stalls running requests and is logged as a warning."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1
                self.warmed = True

    @property
    def count(self) -> int:
        return len(self.compiles)

    @property
    def after_warm_up(self) -> int:
        return sum(c.after_warm_up for c in self.compiles)


WATCH = JitWatch()  # one per process: Triton's hooks are process-wide
