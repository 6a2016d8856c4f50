"""cxlalloc inside a PyTorch process: ``cxlalloc.enable()`` and friends.

Two modes, one engine (docs/pytorch-integration.md):

**global** (``enable()`` before CUDA is initialised, or ``CXLALLOC`` set at
start-up): cxlalloc becomes torch's CUDA caching allocator for every visible
GPU, through a small C++ adapter built against the installed torch
(:mod:`cxlalloc.pytorch.adapter_build`).  Every allocation is tiered; torch's
memory APIs keep working and report the device tier.  If the adapter cannot
be built, torch's plain ``CUDAPluggableAllocator`` serves instead
("global-pluggable"), with one warning naming what that loses.

**scoped** (``enable()`` after CUDA is initialised): torch's own allocator
stays.  Allocations inside ``with cxlalloc.kv():`` go to a ``MemPool`` whose
segments cxlalloc places (VRAM, then host), and a pre-reserved host spill
pool (``MemPool(use_on_oom=True)``) catches other allocations that would
otherwise OOM, up to its reservation.  Why pre-reserved: on an outside OOM
torch only looks for an already cached free block in use-on-OOM pools; it
never asks their allocator for a new segment (docs/sources.md#torch-oom-order).

Every callback, library handle, allocator object and pool created here is
kept in the module state until the process ends (case C12).

Modules (none imports torch at import time):
    modes          enable(), mode(), is_enabled(): validation, then global or scoped mode
    global_mode    global mode: the adapter as torch's allocator, or the plain pluggable fallback
    scoped_mode    scoped mode: the KV pool and the pre-reserved host spill pool
    devices        which GPUs are served with which options; the engine that serves them
    state          the process-wide state (mode, settings, objects kept alive)
    scopes         kv() and weights(): the allocation class of a block of code
    memory         stats(), tier_of(), empty_cache()
    summary        memory_summary(): the tiers as a table
    adapter_build  building and loading the C++ adapter (csrc/torch) against the installed torch
    startup        the CXLALLOC start-up hook (imported by cxlalloc-startup.pth)
"""

from cxlalloc.pytorch.memory import empty_cache, stats, tier_of  # noqa: F401
from cxlalloc.pytorch.modes import enable, is_enabled, mode  # noqa: F401
from cxlalloc.pytorch.scopes import kv, weights  # noqa: F401
from cxlalloc.pytorch.state import CxlallocWarning  # noqa: F401
from cxlalloc.pytorch.summary import format_summary, memory_summary  # noqa: F401

__all__ = ["enable", "mode", "is_enabled", "kv", "weights", "stats", "tier_of", "empty_cache", "memory_summary",
           "format_summary", "CxlallocWarning"]
