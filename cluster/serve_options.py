"""The DSpark deployment's Serve options that follow from its engine: how many requests a replica takes at once, the
load its autoscaler aims for, and its request router. A config's `deployments:` entry overrides any of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROUTER = "dspark_serve.cluster.prefix_router.PrefixAffinityRouter"
ROUTER_ARGS = ("chunk_bytes", "imbalance_threshold", "max_keys", "seed")  # the app's `router:` mapping
QUEUE_FACTOR = 2  # a replica holds one batch running and one waiting; beyond that requests wait in Serve's router


def engine_default(name: str) -> Any:
    from dspark_serve.engine.engine_config import EngineConfig

    return EngineConfig.__dataclass_fields__[name].default


def max_ongoing_requests(max_num_seqs: int) -> int:
    """Serve sends a replica no more than this: its batch and a batch of queue, so that Serve's router and
    autoscaler see a busy replica (a replica taking everything hides every queue from them)."""
    return QUEUE_FACTOR * max_num_seqs


def target_ongoing_requests(max_num_seqs: int) -> int:
    """The autoscaler adds replicas when the mean replica has more than a full batch in flight."""
    return max_num_seqs


def deployment_options(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(DSpark.options(...) keywords, the constructor's args) from the app's args. `router` (app arg): a mapping of
    PrefixAffinityRouter's settings (ROUTER_ARGS), or "power_of_two" for Serve's default router."""
    from ray.serve.config import RequestRouterConfig

    rest = dict(args)
    router = rest.pop("router", None) or {}
    max_num_seqs = int(rest.get("max_num_seqs") or engine_default("max_num_seqs"))
    options: dict[str, Any] = {"max_ongoing_requests": max_ongoing_requests(max_num_seqs)}
    if router == "power_of_two":
        return options, rest
    if not isinstance(router, Mapping) or set(router) - set(ROUTER_ARGS):
        raise ValueError(f"router must be 'power_of_two' or a mapping of {ROUTER_ARGS}, got {router!r}")
    kwargs = {"block_size": int(rest.get("block_size") or engine_default("block_size")), **router}
    options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER, request_router_kwargs=kwargs)
    return options, rest
