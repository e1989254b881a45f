"""Recording a forward as a CUDA graph, on padding, with a fallback to running it eagerly."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor


def capture_on_padding(forward: Callable[[], object], pool: object, inputs: list[Tensor], pad: Callable[[], None],
                       what: str) -> tuple[Callable[[], object], object, bool]:
    """capture() while the static `inputs` hold padding only (pad() stages it), so the warm-up and captured runs
    write K/V to the trash slot alone; this step's inputs are put back after. -> (replay, pool, whether captured):
    a failed capture warns and returns forward itself, so this shape and later ones keep serving eagerly."""
    step = [t.clone() for t in inputs]
    pad()
    try:
        replay, pool = capture(forward, pool)
        ok = True
    except RuntimeError as e:
        warnings.warn(f"CUDA graph capture failed{what}, running eagerly from now on: {e}")
        replay, ok = forward, False
    for t, saved in zip(inputs, step):
        t.copy_(saved)
    return replay, pool, ok


def capture(forward: Callable[[], object], pool: object = None) -> tuple[Callable[[], object], object]:
    """Record forward() as a CUDA graph (after two warm-up runs on a side stream); -> (replay, memory pool).
    replay() returns the captured outputs, refreshed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()

    def replay() -> object:
        graph.replay()
        return out
    replay.forward = forward  # keeps alive what the graph reads and forward's closure owns (the metadata tensors)
    return replay, graph.pool()


def device_ms(fn: Callable[[], object], reps: int) -> float:
    """Milliseconds of device time of fn() (a graph replay), the best of `reps` after one warm-up run."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best
