"""CPU actors use the node's cores: Ray gives an actor OMP_NUM_THREADS = its num_cpus (1), and OpenMP keeps the
thread count per calling thread, so every thread that runs the model must set it (read back from libgomp itself:
torch.get_num_threads() in a new thread reports the global setting, not what that thread's parallel regions use)."""

import ctypes
import os
import threading

import pytest
import ray
import torch

from dspark_serve.actors.placement_env import set_cpu_threads
from dspark_serve.cluster.config import PairConfig
from dspark_serve.engine.engine_config import EngineConfig


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=1, max_concurrency=2)
class _Probe:
    def in_new_thread(self, call: bool, wanted: int) -> tuple[str | None, int]:
        """A fresh thread, as the verifier's step loop (and a threaded actor's method) is."""
        out = []

        def omp_max_threads() -> int:  # OpenMP's count for the calling thread, from the libgomp torch loaded
            path = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
            return ctypes.CDLL(path).omp_get_max_threads()

        def run():
            if call:
                set_cpu_threads(torch.device("cpu"), wanted)
            torch.ones(4) @ torch.ones(4)  # OpenMP initialised in this thread
            out.append(omp_max_threads())
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return os.environ.get("OMP_NUM_THREADS"), out[0]


def test_cpu_actor_threads_use_every_core(ray_local):
    probe = _Probe.remote()
    assert ray.get(probe.in_new_thread.remote(False, 0)) == ("1", 1)           # what Ray alone gives a thread
    cores = len(os.sched_getaffinity(0))
    assert ray.get(probe.in_new_thread.remote(True, 0))[1] == cores            # default: all of them
    assert ray.get(probe.in_new_thread.remote(True, 1))[1] == 1                # --cpu-threads 1


def test_gpu_actor_threads_unchanged():
    n = torch.get_num_threads()
    assert set_cpu_threads(torch.device("cuda", 0), 7) == n


def test_negative_cpu_threads_rejected():
    with pytest.raises(ValueError, match="cpu_threads must be >= 0"):
        PairConfig(EngineConfig(target="t"), cpu_threads=-1).validate()
