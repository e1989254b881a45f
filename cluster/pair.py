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

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.verifier.shutdown.remote(), timeout=30)
        except Exception:  # best effort: the actors are killed below anyway
            pass
        for actor in (self.verifier, self.draft):
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.placement_group)


def _uses_gpu(cfg: PairConfig) -> bool:
    import ray

    if cfg.device == "cpu":
        return False
    return cfg.device == "cuda" or ray.cluster_resources().get("GPU", 0) >= (2 if cfg.draft else 1)


def create_pair(cfg: PairConfig, timeout_s: float = 600.0) -> Pair:
    """Place the verifier (bundle 0) and the draft (bundle 1), connect their channel, start the step loop."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dspark_serve.actors.draft_actor import DraftActor
    from dspark_serve.actors.verifier_actor import VerifierActor

    cfg.validate()
    gpu = _uses_gpu(cfg)
    device = "cuda" if gpu else "cpu"
    cfg = replace(cfg, device=device)
    bundle = lambda extra: {"CPU": cfg.num_cpus, **({"GPU": 1} if gpu else {}), **dict(extra)}  # noqa: E731
    bundles = [bundle(cfg.target_resources)] + ([bundle(cfg.draft_resources)] if cfg.draft else [])
    pg = placement_group(bundles, strategy=cfg.placement)
    ray.get(pg.ready(), timeout=timeout_s)

    def spawn(cls, index: int):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)
        return ray.remote(cls).options(num_cpus=cfg.num_cpus, num_gpus=1 if gpu else 0, max_concurrency=16,
                                       scheduling_strategy=strategy, resources=dict(
                                           cfg.target_resources if index == 0 else cfg.draft_resources)).remote(cfg)

    verifier = spawn(VerifierActor, 0)
    draft = spawn(DraftActor, 1) if cfg.draft else None
    backend = "nccl" if gpu else "gloo"
    if draft is not None:
        host, port = ray.get(verifier.channel_address.remote(cfg.channel_host), timeout=timeout_s)
        ray.get([verifier.connect.remote(host, port, backend), draft.connect.remote(host, port, backend)],
                timeout=timeout_s)
        draft.serve.remote()  # returns when the verifier sends STOP
    ray.get(verifier.start.remote(), timeout=timeout_s)
    return Pair(verifier, draft, pg, backend)
