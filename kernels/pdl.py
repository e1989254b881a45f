"""Programmatic dependent launch (PDL, sm_90+) for the decode step's chain of small Triton kernels.

In a CUDA graph a decode layer is ten dependent kernels, most of them a few microseconds long, and each boundary
costs the drain of one grid plus the launch and ramp of the next. Launched with PDL, a kernel's programs may become
resident while its predecessor still runs: every program first waits (`griddepcontrol.wait`: the predecessor has
finished and its writes are visible), then lets its own successor launch. Since every PDL kernel waits before it
touches memory, and a kernel finishes only after its wait returned, the order of all reads and writes is that of
the stream, transitively; only launch latency overlaps. A GEMV may also load its first weight tile before it
waits (`pdl_trigger`, then the weight loads, then `pdl_wait`): weights are constants no kernel writes, so HBM starts
streaming them while the predecessor drains.

`launch(t)` -> (the PDL constexpr, the launch options) for a kernel whose inputs live on t's device: on for CUDA
tensors of compute capability >= 9.0 when Triton has the griddepcontrol builtins and KernelConfig.pdl is set; off on
CPU (the interpreter cannot run inline PTX) and older GPUs, where the kernel compiles without the prologue.
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import active

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # Triton < 3.3: never called, `enabled` is False
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """The successor may launch (a kernel that loads constants before `pdl_wait` calls this first)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Before the first load of anything an earlier kernel wrote and before the first store: only loads of
    constants (weights) may come before it."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Call first in a kernel launched with `launch(t)`'s options, before any load or store."""
    pdl_wait(PDL)
    pdl_trigger(PDL)


@lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: Tensor) -> bool:
    return active().pdl and HAVE_GDC and t.is_cuda and _sm90(t.device.index if t.device.index is not None
                                                             else torch.cuda.current_device())


def launch(t: Tensor) -> tuple[bool, dict]:
    """-> (PDL constexpr, extra launch options) for a kernel launched on t's device."""
    on = enabled(t)
    return on, ({"launch_pdl": True} if on else {})
