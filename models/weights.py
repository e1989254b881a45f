"""Reading safetensors checkpoints (single file or sharded index) and strict, named assignment into a module."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from .config import CheckpointError


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    raise CheckpointError(f"{path}: no model.safetensors, model.safetensors.index.json or *.safetensors found")


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                state[name] = fh.get_tensor(name)
    return state


def assign(module: nn.Module, state: dict[str, Tensor], where: str, optional: Iterable[str] = (),
           dtype: torch.dtype | None = None) -> None:
    """Copy `state` into `module`'s parameters by name; every parameter must be covered unless `optional`.

    Raises CheckpointError listing unknown and missing tensors, or naming a tensor whose shape differs.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise CheckpointError(f"{where}: unknown tensors {unknown}")
    missing = sorted(set(params) - set(state) - set(optional))
    if missing:
        raise CheckpointError(f"{where}: missing tensors {missing}")
    for name, t in state.items():
        p = params[name]
        if tuple(p.shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.data = t.to(dtype=dtype or p.dtype).contiguous()
