"""The DSpark deployment's Serve request router (`request_router_config`): prefix affinity (affinity.py) inside Serve's
own handle, so no router process of ours. It runs where Serve routes: in each proxy (HTTP and gRPC) and each handle.

What it keys a request by: a gRPC Generate's prompt, read from the proto the proxy hands over (token ids: the engine's
block hashes; text or chat: hashed byte chunks of the text or of the messages, a stand-in for the chat-templated
tokens, which only the replica computes). Serve's HTTP proxy streams the body to the replica after routing, so an
HTTP request is keyed by Serve's session id (header `x-session-id`; gRPC metadata `session_id` too) when it has one
and otherwise goes to the less loaded of two, as Serve's default router sends it.
"""

from __future__ import annotations

import itertools
import pickle
import random
import time
from typing import Any

from ray.serve.request_router import (LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from .affinity import AffinityConfig, AffinityTable, chat_text, choose, session_keys, text_keys, token_keys
from .inflight import InFlight

KEYS_ATTR = "_dspark_prefix_keys"  # the keys computed when routing, kept on the pending request for on_request_routed
TOKEN_ATTR = "_dspark_inflight_token"  # the request's entry among this router's choices not yet accepted


def request_keys(pending: PendingRequest, cfg: AffinityConfig) -> list[bytes]:
    """The prompt's affinity keys, or the session's, or none."""
    meta = pending.metadata
    if meta.call_method == "Generate" and pending.args and isinstance(pending.args[0], bytes):
        try:
            proto = getattr(pickle.loads(pending.args[0]), "user_request_proto", None)
        except Exception:  # noqa: BLE001 - not a gRPC proxy's request: no prompt to read
            proto = None
        keys = prompt_keys(proto, cfg) if proto is not None else []
        if keys:
            return keys
    return session_keys(meta.session_id or "")


def prompt_keys(request: Any, cfg: AffinityConfig) -> list[bytes]:
    """A dspark.v1.GenerateRequest's keys by its input."""
    which = request.WhichOneof("input")
    if which == "token_ids":
        return token_keys(list(request.token_ids.ids), cfg)
    if which == "text":
        return text_keys(request.text, cfg)
    if which == "chat":
        return text_keys(chat_text([(m.role, m.content, m.tool_calls_json) for m in request.chat.messages]), cfg)
    return []


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes a request to the replica most likely to hold its prompt's prefix in its cache, unless that replica has
    more than `imbalance_threshold` ongoing requests beyond the mean replica; then the less loaded of two. A replica's
    load is the larger of Serve's cached count and the requests this router has sent it that have not finished.
    Keys are remembered per router (an approximate view per proxy, as SGLang's router keeps); a replica that dies or
    leaves is forgotten, so its conversations go elsewhere at once."""

    def initialize_state(self, block_size: int = 16, chunk_bytes: int = 64, imbalance_threshold: int = 2,
                         max_keys: int = 1 << 20, seed: int | None = None) -> None:
        self.affinity = AffinityConfig(block_size=block_size, chunk_bytes=chunk_bytes,
                                       imbalance_threshold=imbalance_threshold, max_keys=max_keys)
        self.table = AffinityTable(max_keys)
        self.rng = random.Random(seed)
        self.inflight = InFlight()
        self._tokens = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = self.rng.sample(candidate_replicas, min(2, len(candidate_replicas)))
        if pending_request is None:
            return [two]
        keys = getattr(pending_request, KEYS_ATTR, None)
        if keys is None:
            keys = request_keys(pending_request, self.affinity)
            setattr(pending_request, KEYS_ATTR, keys)
        if not keys:
            return [two]
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = await self._loads(candidate_replicas)
        if not loads:
            return [two]
        chosen, _ = choose(keys, loads, self.table, self.affinity, self.rng)
        self.table.insert(keys, chosen)  # at once, so the next turn finds it even before Serve reports the routing
        token = getattr(pending_request, TOKEN_ATTR, None)
        if token is None:
            token = next(self._tokens)
            setattr(pending_request, TOKEN_ATTR, token)
        self.inflight.chosen(token, chosen, time.monotonic())  # counted at once by the requests routed meanwhile
        return [[by_id[chosen]], two]  # a holder that refuses (its queue full) falls back to the two

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per replica: Serve's queue-length cache, probing those it lacks, and at least what this
        router has in flight there. A replica whose probe missed its deadline (Serve's 0.1 s at first) stays a
        candidate at the known replicas' mean load: dropping it would send every new conversation to the replicas
        that happened to answer."""
        loads, missing = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id] = n
        if missing:
            probed = await self._probe_queue_lens(missing, 0)
            for r, n in probed:
                if n is not None:
                    loads[r.replica_id] = n
            mean = round(sum(loads.values()) / len(loads)) if loads else 0
            for r, n in probed:
                if n is None and r.replica_id in self._replica_id_set:  # gone replicas left the set
                    loads[r.replica_id] = mean
        ours = self.inflight.counts(time.monotonic())  # read after the probes: choices made while they ran count
        return {replica_id: max(n, ours[replica_id]) for replica_id, n in loads.items()}

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica accepted the request: it holds the keys (when not the first choice, that replica refused),
        and the request counts there until it finishes."""
        keys = getattr(pending_request, KEYS_ATTR, None)
        if keys:
            self.table.insert(keys, replica_id)
        self.inflight.routed(getattr(pending_request, TOKEN_ATTR, None), replica_id)
        loop = self._event_loop
        result.add_done_callback(lambda _: loop.call_soon_threadsafe(self.inflight.finished, replica_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
        self.inflight.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.table.forget(replica_id)
            self.inflight.forget(replica_id)
