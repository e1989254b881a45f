"""Adds whose grammar compiles off the step loop: a request with structured output is built (its grammar compiled,
or taken from the cache) in a worker thread, and the step loop takes it between steps, so a schema that compiles
slowly stalls no other stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

COMPILE_POLL_S = 0.002  # how often an otherwise idle step loop looks for a finished compilation


class GrammarAdds:
    def __init__(self, build: Callable[..., Any], workers: int = 2) -> None:
        """build(*args) -> the request (ValueError or TypeError: refused, with its message)."""
        self.build = build
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dspark-grammar")
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._done: list[tuple[str, Any, str | None]] = []

    def submit(self, rid: str, *args: Any) -> None:
        with self._lock:
            self._pending.add(rid)
        self._pool.submit(self._run, rid, args)

    def _run(self, rid: str, args: tuple) -> None:
        try:
            result, error = self.build(*args), None
        except (ValueError, TypeError) as e:
            result, error = None, str(e)
        except Exception as e:  # noqa: BLE001 - the request is refused; the loop goes on
            result, error = None, f"structured output failed to compile: {type(e).__name__}: {e}"
        with self._lock:
            if rid in self._pending:  # else cancelled meanwhile
                self._pending.discard(rid)
                self._done.append((rid, result, error))

    @property
    def pending(self) -> bool:
        return bool(self._pending or self._done)

    def cancel(self, rid: str) -> bool:
        """Drop a request still compiling (or compiled, not yet taken); False when it is not here."""
        with self._lock:
            if rid in self._pending:
                self._pending.discard(rid)
                return True
            kept = [d for d in self._done if d[0] != rid]
            found, self._done = len(kept) != len(self._done), kept
            return found

    def ready(self) -> list[tuple[str, Any, str | None]]:
        """(request id, the request or None, the refusal or None) of each finished compilation."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def clear(self) -> None:
        """Drop everything compiling or compiled (the gateway that sent it is gone)."""
        with self._lock:
            self._pending.clear()
            self._done = []

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
