"""The step inputs of a static-shape graph: named int fields laid out in one buffer, uploaded in one copy."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class Layout:
    """Fields of a staging buffer by name, in order, each of a given length: `pack` concatenates the host values,
    `views` cuts the device buffer into the same fields."""

    def __init__(self, **lengths: int) -> None:
        self.lengths = lengths
        self.offsets: dict[str, int] = {}
        start = 0
        for name, n in lengths.items():
            self.offsets[name] = start
            start += n
        self.size = start

    def pack(self, **values: Sequence[int]) -> list[int]:
        """Every field's values (exactly its length), in the declared order -> one list for Staging.upload."""
        out: list[int] = []
        for name, n in self.lengths.items():
            v = values[name]
            if len(v) != n:
                raise ValueError(f"staging field {name} takes {n} values, got {len(v)}")
            out.extend(v)
        return out

    def views(self, buf: Tensor) -> dict[str, Tensor]:
        """name -> its slice of `buf` (a view: writes land in the buffer)."""
        return {name: buf[self.offsets[name]:self.offsets[name] + n] for name, n in self.lengths.items()}

    def view(self, buf: Tensor, name: str) -> Tensor:
        return buf[self.offsets[name]:self.offsets[name] + self.lengths[name]]


class Staging:
    """A pinned host buffer and its device twin: `upload(values)` is one non-blocking copy, and waits first until
    the previous copy has left the host buffer (so a step never overwrites data still in flight)."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.host = torch.zeros(n, dtype=dtype, pin_memory=cuda)
        self._host_np = self.host.numpy()  # the same pinned memory: a list lands there without a temporary tensor
        self.dev = torch.zeros(n, dtype=dtype, device=device)
        self._copied = torch.cuda.Event() if cuda else None
        self._stream = torch.cuda.current_stream(device) if cuda else None  # the steps' stream

    def upload(self, values: list) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        n = len(values)
        self._host_np[:n] = values
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record(self._stream)
