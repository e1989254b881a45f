"""The draft + verifier pair's config: its engine config and where and how its two actors run (a frozen
dataclass the actors are built from)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not imported here: the gateway's modules import this one
    from dspark_serve.engine.engine_config import EngineConfig

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class PairConfig:
    engine: EngineConfig  # what both actors build their engine side from
    placement: str = "PACK"  # PACK: one node if possible; SPREAD: draft and verifier on different nodes
    colocate: bool | None = None  # the draft inside the verifier actor (no step channel, drafting ahead); None:
    # when the two would share one device (one GPU, or one node's CPUs), see pair.resolve_colocate
    channel_host: str | None = None  # address the verifier's step channel binds; None: its node IP
    channel_timeout_s: float = 120.0  # one step-channel operation that takes longer means the peer is gone
    keepalive_s: float = 20.0  # an idle split pair pings its channel this often, so idleness never times out
    num_cpus: float = 1.0  # per actor
    num_gpus: float | None = None  # per actor; None: one each, or a share of a single GPU (pair.plan_devices).
    # Below 1, several pairs (Serve replicas) share one GPU: size their caches with num_kv_blocks, since
    # gpu_memory_utilization counts the memory the others hold as used
    cpu_threads: int = 0  # torch threads of each CPU actor; 0: every CPU of its node (actors take turns in a step)
    target_resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources steering the verifier
    draft_resources: tuple[tuple[str, float], ...] = ()
    step_trace: str | None = None  # a file the step loop appends a JSON line to per step (times, shape): benchmarks

    def validate(self) -> None:
        self.engine.validate()
        if self.engine.target is None:
            raise ValueError("a pair needs the target checkpoint directory")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.num_gpus is not None and not self.num_gpus > 0:
            raise ValueError(f"num_gpus must be > 0 (GPUs per actor), got {self.num_gpus}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: all of the node's CPUs), got {self.cpu_threads}")
        if not 0 < self.keepalive_s < self.channel_timeout_s:
            raise ValueError(f"keepalive_s must be in (0, channel_timeout_s = {self.channel_timeout_s}), "
                             f"got {self.keepalive_s}")

    @classmethod
    def from_options(cls, engine: EngineConfig, options: Mapping[str, Any]) -> PairConfig:
        """The deployment's fields by name (the CLI's and the Serve app's), None for a field: its default;
        resources as a mapping or pairs. An unknown name is refused."""
        known = {f.name for f in fields(cls)} - {"engine"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown pair options {unknown}; known: {sorted(known)}")
        raw = {k: v for k, v in options.items() if v is not None}
        for name in ("target_resources", "draft_resources"):
            if name in raw:
                raw[name] = resources(raw[name])
        cfg = cls(engine, **raw)
        cfg.validate()
        return cfg


def resources(value: Mapping[str, float] | tuple | list) -> tuple[tuple[str, float], ...]:
    """Custom Ray resources as sorted (name, amount) pairs."""
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), float(v)) for k, v in items))
