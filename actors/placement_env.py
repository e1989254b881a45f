"""What an actor learns about its own process: its device, the torch dtype asked for, its node address."""

from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def actor_device(device: str) -> torch.device:
    """"auto" takes the GPU Ray assigned to this actor (it sees only that one), else the CPU."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def torch_dtype(name: str | None) -> torch.dtype | None:
    return _DTYPES[name] if name else None


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
