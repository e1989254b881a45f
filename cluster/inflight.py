"""What one router has sent each replica and not yet seen finish. Serve's queue-length cache is overwritten by every
accepted request's reply, which carries the replica's count from when that request arrived: under a burst it lags
the requests already on their way, so a burst can all go to one replica. A router's own count is a floor for the
replica's load. Pure bookkeeping; prefix_router.py feeds it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

Replica = Hashable


class InFlight:
    """Choices not yet accepted (kept at most `unconfirmed_ttl_s`: a request cancelled before it was sent is never
    confirmed) and accepted requests not yet finished, per replica."""

    def __init__(self, unconfirmed_ttl_s: float = 10.0) -> None:
        if unconfirmed_ttl_s <= 0:
            raise ValueError(f"unconfirmed_ttl_s must be > 0, got {unconfirmed_ttl_s!r}")
        self.ttl = unconfirmed_ttl_s
        self._chosen: dict[int, tuple[Replica, float]] = {}  # token -> (replica, when chosen)
        self._ongoing: Counter[Replica] = Counter()

    def chosen(self, token: int, replica: Replica, now: float) -> None:
        """A routing choice; choosing again for the same token moves it."""
        self._chosen[token] = (replica, now)

    def routed(self, token: int | None, replica: Replica) -> None:
        """The replica accepted the request (token None: one this router did not choose itself)."""
        if token is not None:
            self._chosen.pop(token, None)
        self._ongoing[replica] += 1

    def finished(self, replica: Replica) -> None:
        if self._ongoing[replica] > 1:
            self._ongoing[replica] -= 1
        else:
            self._ongoing.pop(replica, None)

    def counts(self, now: float) -> Counter[Replica]:
        """Requests per replica: accepted and ongoing, plus chosen within the last ttl seconds."""
        for token in [t for t, (_, at) in self._chosen.items() if now - at > self.ttl]:
            del self._chosen[token]
        out = Counter(self._ongoing)
        out.update(replica for replica, _ in self._chosen.values())
        return out

    def forget(self, replica: Replica) -> None:
        self._ongoing.pop(replica, None)
        for token in [t for t, (r, _) in self._chosen.items() if r == replica]:
            del self._chosen[token]
