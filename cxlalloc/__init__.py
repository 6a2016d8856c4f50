"""cxlalloc: a tiered PyTorch CUDA allocator.

VRAM first, then host memory on a chosen NUMA node (where CXL memory
expanders appear in Linux), with a KV-cache-aware spill policy.

Entry points:
    cxlalloc.Allocator(...)     the tiered allocator of one GPU, used directly
    cxlalloc.enable(...)        make it torch's CUDA allocator (docs/pytorch-integration.md)
    with cxlalloc.kv(): ...     allocations inside are KV cache (spilled first)
    cxlalloc.stats()            per-tier statistics of the process's engine
    cxlalloc.hf.wrap(model)     HuggingFace generate() with a tiered KV cache
    CXLALLOC=1 python ...       enable with no code change
"""

from cxlalloc._C import (  # noqa: F401
    CaptureError,
    CudaUnavailableError,
    DriverError,
    InvalidFreeError,
    OutOfMemoryError,
    UnsupportedError,
)
from cxlalloc.allocator import Allocator, Extent  # noqa: F401
from cxlalloc.config import Config, format_bytes, make_config, parse_size  # noqa: F401

# torch integration (imports torch only when called)
from cxlalloc.pytorch import (  # noqa: F401
    CxlallocWarning,
    empty_cache,
    enable,
    is_enabled,
    kv,
    memory_summary,
    mode,
    stats,
    tier_of,
    weights,
)

__version__ = "0.1.0"
