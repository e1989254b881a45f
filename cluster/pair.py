"""Bring-up and teardown of a draft + verifier pair: one placement group, two actors, one step channel."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .config import PairConfig


@dataclass
class Pair:
    verifier: Any  # ray ActorHandle of actors.verifier_actor.VerifierActor
    draft: Any | None  # ActorHandle of actors.draft_actor.DraftActor
    placement_group: Any
    backend: str
    cfg: PairConfig  # as resolved: device and colocate decided
    gpus_per_actor: float = 0.0
    serve_ref: Any = None  # the draft's serve() call: it fails when the draft actor dies

    def stream_client(self):
        """A blocking request-stream client (scripts and tests that drive the pair without a gateway)."""
        import ray

        from dspark_serve.actors.request_stream import SyncStreamClient

        return SyncStreamClient(*ray.get(self.verifier.stream_address.remote(), timeout=60))

    def spawn(self, cls: type, index: int) -> Any:
        """An actor of `cls` in bundle `index` of the pair's placement group (0: verifier, 1: draft)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.cfg
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=index)
        return ray.remote(cls).options(num_cpus=c.num_cpus, num_gpus=self.gpus_per_actor, max_concurrency=16,
                                       scheduling_strategy=strategy, resources=dict(
                                           c.target_resources if index == 0 else c.draft_resources)).remote(c)

    def connect_draft(self, timeout_s: float, replacing: bool = False) -> None:
        """Join the draft and the verifier over a new step channel and start the draft's serve loop."""
        import ray

        ray.get(self.draft.info.remote(), timeout=timeout_s)  # loaded and warmed up before the channel waits
        host, port = ray.get(self.verifier.channel_address.remote(self.cfg.channel_host), timeout=timeout_s)
        join = self.verifier.attach_draft if replacing else self.verifier.connect
        ray.get([join.remote(host, port, self.backend), self.draft.connect.remote(host, port, self.backend)],
                timeout=timeout_s)
        self.serve_ref = self.draft.serve.remote()  # returns when the verifier sends STOP

    def replace_draft(self, timeout_s: float = 600.0) -> None:
        """A new draft actor in the draft's bundle, attached to the running verifier."""
        import ray

        from dspark_serve.actors.draft_actor import DraftActor

        try:
            ray.kill(self.draft)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.draft = self.spawn(DraftActor, 1)
        self.connect_draft(timeout_s, replacing=True)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.verifier.shutdown.remote(), timeout=30)
        except Exception:  # best effort: the actors are killed below anyway
            pass
        try:
            for actor in (self.verifier, self.draft):
                if actor is not None:
                    ray.kill(actor)
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - the cluster itself may already be gone
            pass


@dataclass(frozen=True)
class DevicePlan:
    device: str  # "cuda" | "cpu"
    gpus_per_actor: float
    backend: str  # the step channel: "nccl" between two GPUs, "gloo" otherwise


def plan_devices(device: str, cluster_gpus: float, has_draft: bool, num_gpus: float | None = None) -> DevicePlan:
    """One GPU per actor when there are enough; a single GPU is shared (NCCL cannot pair a device with itself,
    so the channel then uses gloo over host memory); CPU otherwise. `num_gpus`: each actor's share, as given."""
    actors = 2 if has_draft else 1
    if device == "cpu" or (device == "auto" and cluster_gpus < 1):
        return DevicePlan("cpu", 0, "gloo")
    if num_gpus is not None:
        return DevicePlan("cuda", num_gpus, "nccl" if num_gpus >= 1 else "gloo")
    if cluster_gpus >= actors or device == "cuda" and cluster_gpus == 0:
        return DevicePlan("cuda", 1, "nccl")
    return DevicePlan("cuda", 1 / actors, "gloo")


def resolve_colocate(cfg: PairConfig, plan: DevicePlan) -> bool:
    """An explicit choice stands. Otherwise co-locate when draft and verifier would share one device: a GPU each
    only splits them, and on CPUs only placement across nodes (SPREAD or custom resources) does. Sharing a
    device, separate actors just take turns on it and add the channel to every step."""
    if cfg.colocate is not None or cfg.engine.draft is None:
        return bool(cfg.colocate)
    if plan.device == "cuda":
        return plan.gpus_per_actor < 1
    return cfg.placement not in ("SPREAD", "STRICT_SPREAD") and not cfg.target_resources and not cfg.draft_resources


def create_pair(cfg: PairConfig, timeout_s: float = 600.0) -> Pair:
    """Place the verifier (bundle 0) and the draft (bundle 1), connect their channel, start the step loop."""
    import ray
    from ray.util.placement_group import placement_group

    from dspark_serve.actors.draft_actor import DraftActor
    from dspark_serve.actors.verifier_actor import VerifierActor

    cfg.validate()
    gpus = ray.cluster_resources().get("GPU", 0)
    engine = cfg.engine
    colocate = resolve_colocate(cfg, plan_devices(engine.device, gpus, engine.draft is not None, cfg.num_gpus))
    split = engine.draft is not None and not colocate  # a draft actor of its own
    plan = plan_devices(engine.device, gpus, split, cfg.num_gpus)
    cfg = replace(cfg, engine=replace(engine, device=plan.device), colocate=colocate)
    if split and engine.gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization sizes one process's caches: with separate draft and verifier "
                         "actors give --num-kv-blocks (or co-locate them)")
    gpu = {"GPU": plan.gpus_per_actor} if plan.gpus_per_actor else {}
    bundle = lambda extra: {"CPU": cfg.num_cpus, **gpu, **dict(extra)}  # noqa: E731
    bundles = [bundle(cfg.target_resources)] + ([bundle(cfg.draft_resources)] if split else [])
    pg = placement_group(bundles, strategy=cfg.placement)
    ray.get(pg.ready(), timeout=timeout_s)
    pair = Pair(None, None, pg, plan.backend, cfg, plan.gpus_per_actor)
    pair.verifier = pair.spawn(VerifierActor, 0)
    if split:
        pair.draft = pair.spawn(DraftActor, 1)
        pair.connect_draft(timeout_s)
    ray.get(pair.verifier.start.remote(), timeout=timeout_s)
    return pair
