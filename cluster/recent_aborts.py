"""Request ids aborted before their request arrived (an Abort can overtake its Generate): remembered per caller for a
short window, at most `capacity` of them, so that the request ends as aborted when it comes."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentAborts:
    def __init__(self, window_s: float, capacity: int) -> None:
        self.window_s, self.capacity = window_s, capacity
        self._ids: OrderedDict[tuple[str, str], float] = OrderedDict()  # (caller, request id) -> when, oldest first

    def remember(self, caller: str, request_id: str) -> None:
        now = time.monotonic()
        self._expire(now)
        self._ids.pop((caller, request_id), None)
        self._ids[caller, request_id] = now
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def take(self, caller: str, request_id: str) -> bool:
        """Whether the caller aborted this id within the window; it is forgotten then (a later request with the id
        runs)."""
        self._expire(time.monotonic())
        return self._ids.pop((caller, request_id), None) is not None

    def __len__(self) -> int:
        return len(self._ids)

    def _expire(self, now: float) -> None:
        while self._ids and now - next(iter(self._ids.values())) > self.window_s:
            self._ids.popitem(last=False)
