"""Keeps a pair serving without an operator. Ray reports the deaths: a draft actor's serve() call fails, a
verifier's wait_stopped() call fails or returns. A lost draft is replaced while the verifier decodes plainly; a
lost verifier (or a step loop that died) means a new pair, and the gateway reconnects to it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from .config import PairConfig
from .pair import Pair, create_pair

log = logging.getLogger(__name__)
RETRY_S = 2.0  # between attempts to place a replacement (its node may still be coming back)


class PairSupervisor:
    def __init__(self, cfg: PairConfig, pair: Pair, on_lost: Callable[[], Awaitable[None]],
                 on_new_pair: Callable[[Pair], Awaitable[None]],
                 draining: Callable[[], bool] = lambda: False) -> None:
        """`draining()` true: the service is stopping, so a lost pair is not replaced."""
        self.cfg, self.pair = cfg, pair
        self.on_lost, self.on_new_pair, self.draining = on_lost, on_new_pair, draining
        self.stopping = False
        self.restarts = {"draft": 0, "pair": 0}

    async def run(self) -> None:
        while not self.stopping:
            pair = self.pair
            watch = [asyncio.ensure_future(self._verifier_stops(pair))]
            if pair.draft is not None:
                watch.append(asyncio.ensure_future(self._keep_draft(pair)))
            await watch[0]  # the draft's watcher ends with its pair
            for task in watch[1:]:
                task.cancel()
            if self.stopping or self.draining():
                return
            await self.on_lost()
            await self._new_pair(pair)

    async def _verifier_stops(self, pair: Pair) -> None:
        try:
            error = await pair.verifier.wait_stopped.remote()
            if error:
                log.error("the step loop failed; starting a new pair:\n%s", error)
        except Exception as e:  # noqa: BLE001 - the actor died (RayActorError) or its node went away
            if not self.stopping:
                log.error("the verifier actor is gone (%s); starting a new pair", type(e).__name__)

    async def _keep_draft(self, pair: Pair) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            try:
                await pair.serve_ref
                return  # the verifier sent STOP: the pair is shutting down
            except Exception as e:  # noqa: BLE001 - the draft actor died: replace it, the verifier decodes plainly
                log.warning("the draft actor is gone (%s); replacing it", type(e).__name__)
            while not self.stopping:
                try:
                    await loop.run_in_executor(None, pair.replace_draft)
                    self.restarts["draft"] += 1
                    log.warning("a new draft actor is attached; new requests speculate again")
                    break
                except Exception as e:  # noqa: BLE001 - no room for it yet (its node may be gone): retry
                    log.warning("replacing the draft actor failed (%s); retrying", e)
                    await asyncio.sleep(RETRY_S)

    async def _new_pair(self, old: Pair) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, old.shutdown)
        while not self.stopping:
            try:
                self.pair = await loop.run_in_executor(None, create_pair, self.cfg)
                self.restarts["pair"] += 1
                await self.on_new_pair(self.pair)
                return
            except Exception as e:  # noqa: BLE001 - retry until it fits again
                log.error("starting a new pair failed (%s); retrying", e)
                await asyncio.sleep(RETRY_S)

    def stop(self) -> None:
        self.stopping = True
