"""What an actor learns about its own process: its device, its node address, its CPU threads."""

from __future__ import annotations

import os

import torch


def actor_device(device: str) -> torch.device:
    """"auto" takes the GPU Ray assigned to this actor (it sees only that one), else the CPU."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def set_cpu_threads(device: torch.device, threads: int) -> int:
    """A CPU actor's torch threads for the calling thread: `threads`, or with 0 every CPU this process may run on.
    Ray sets OMP_NUM_THREADS to an actor's num_cpus (1), which would leave the model on one core; the draft and the
    verifier take turns within a step, so each may use them all. OpenMP keeps the count per thread (a new thread
    starts from OMP_NUM_THREADS), so every thread that runs the model calls this. -> the threads now set (GPU
    actors: unchanged)."""
    if device.type == "cpu":
        torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    return torch.get_num_threads()
