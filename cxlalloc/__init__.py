"""cxlalloc: a tiered PyTorch CUDA allocator (VRAM, then host/CXL NUMA memory)."""

from cxlalloc._C import (  # noqa: F401
    CaptureError,
    CudaUnavailableError,
    DriverError,
    InvalidFreeError,
    OutOfMemoryError,
    UnsupportedError,
)

__version__ = "0.1.0"
